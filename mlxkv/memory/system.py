"""How much memory this machine can give MLX, and ``--memory SIZE`` parsing.

macOS: Metal's ``max_recommended_working_set_size`` (what the GPU may wire; MLX asks for
it as its wired limit) next to ``memory_size`` and the ``iogpu.wired_limit_mb`` sysctl.
Linux: /proc/meminfo MemAvailable, capped by the cgroup (v2 or v1) limit minus its usage.
CUDA: the GPU's own memory, as MLX reports it (``mx.device_info()``: ``free_memory`` and
``total_memory``, read by MLX through NVML, or ``memory_size`` in builds that give only
the total); host RAM is not what the weights and KV live in there.

``SystemGauge`` reads, at any moment, the memory the machine has free for anything (what
other programs leave): a server that runs for days checks it against a floor
(:mod:`mlxkv.engine.pressure`). macOS: the kernel's ``kern.memorystatus_level`` (the percent
of memory free, what ``memory_pressure`` prints) of ``hw.memsize``; Linux and CUDA: as above.
"""

from __future__ import annotations

import ctypes
import functools
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from mlxkv.memory.config import BadInput

_UNITS = {
    "": 1,
    "B": 1,
    "K": 10**3,
    "KB": 10**3,
    "M": 10**6,
    "MB": 10**6,
    "G": 10**9,
    "GB": 10**9,
    "T": 10**12,
    "TB": 10**12,
    "KI": 2**10,
    "KIB": 2**10,
    "MI": 2**20,
    "MIB": 2**20,
    "GI": 2**30,
    "GIB": 2**30,
    "TI": 2**40,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_UNLIMITED = 1 << 60  # cgroup v1 spells "no limit" as a huge number


@dataclass(frozen=True)
class SystemMemory:
    available: int  # bytes the plan compares against
    total: int | None  # physical (or cgroup) total, for display
    source: str  # how ``available`` was found


def parse_size(text: str) -> int:
    """'16GB' (10^9), '16GiB' (2^30), '512M', '1.5G', '1073741824' -> bytes."""
    m = _SIZE.match(str(text))
    unit = m.group(2).upper() if m else None
    if not m or unit not in _UNITS:
        raise BadInput(f"--memory must be a size like 16GB, 16GiB or 512M, got '{text}'")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise BadInput(f"--memory must be positive, got '{text}'")
    return value


def mac_ram(text: str) -> int:
    """A Mac's RAM as Apple sells it: '16GB' is 16 GiB (units 1000-based are read 1024-based)."""
    size = parse_size(text)
    unit = text.strip().lstrip("0123456789. ").upper().removesuffix("B")
    scale = {"K": 2**10 / 10**3, "M": 2**20 / 10**6, "G": 2**30 / 10**9, "T": 2**40 / 10**12}
    ram = round(size * scale.get(unit, 1))  # "GI" (GiB) is already binary
    if ram < 2**30:
        raise BadInput(f"--memory {text} is smaller than any Mac; give the Mac's RAM, e.g. 16GB")
    return ram


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _meminfo() -> dict[str, int]:
    out = {}
    for line in (_read("/proc/meminfo") or "").splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * 1024
    return out


def cgroup_room() -> tuple[int, int] | None:
    """(limit, room left) of this process's memory cgroup, or None when unlimited."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        raw = _read(limit_file)
        if raw is None or not raw.isdigit() or int(raw) >= _UNLIMITED:
            continue
        limit = int(raw)
        usage = _read(usage_file)
        used = int(usage) if usage and usage.isdigit() else 0
        return limit, max(0, limit - used)
    return None


def _linux() -> SystemMemory:
    info = _meminfo()
    avail = info.get("MemAvailable") or info.get("MemFree")
    total = info.get("MemTotal")
    source = "/proc/meminfo MemAvailable"
    room = cgroup_room()
    if room is not None:
        limit, left = room
        total = min(total, limit) if total else limit
        if avail is None or left < avail:
            avail, source = left, "cgroup memory limit minus usage"
    if avail is None:
        raise BadInput("cannot read available memory (/proc/meminfo); pass --memory SIZE")
    return SystemMemory(avail, total, source)


def _macos() -> SystemMemory:
    import mlx.core as mx

    info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    total = info.get("memory_size")
    rec = info.get("max_recommended_working_set_size")
    wired = _wired_limit()
    if wired:  # an admin raised (or lowered) the GPU wired limit with sysctl
        return SystemMemory(wired, total, "sysctl iogpu.wired_limit_mb")
    if rec:
        return SystemMemory(int(rec), total, "Metal max_recommended_working_set_size")
    if total:
        return SystemMemory(int(total), total, "Metal memory_size")
    raise BadInput("cannot read the GPU memory size; pass --memory SIZE")


def _cuda() -> SystemMemory:
    import mlx.core as mx

    try:
        info = mx.device_info()
    except (RuntimeError, ValueError):
        info = {}
    total = info.get("total_memory") or info.get("memory_size")
    free = info.get("free_memory")
    if free:
        return SystemMemory(int(free), int(total) if total else None, "CUDA free device memory")
    if total:
        return SystemMemory(int(total), int(total), "CUDA device memory")
    raise BadInput("--backend cuda: cannot read the GPU's memory here; pass --memory SIZE")


def _wired_limit() -> int | None:
    try:
        out = subprocess.run(
            ["sysctl", "-n", "iogpu.wired_limit_mb"], capture_output=True, text=True, timeout=2
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return int(out) * 2**20 if out.isdigit() and int(out) > 0 else None


@functools.cache
def _sysctlbyname():
    """macOS's ``sysctlbyname`` from the C library (None where it has none)."""
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c")).sysctlbyname
    except (OSError, AttributeError, TypeError):
        return None


def _sysctl_int(name: str) -> int | None:
    """An integer sysctl of macOS (no process started, as ``sysctl`` would), None elsewhere."""
    call = _sysctlbyname()
    if call is None:
        return None
    value = ctypes.c_uint64(0)  # a 4-byte int fills its low bytes (both Mac CPUs are little-endian)
    size = ctypes.c_size_t(ctypes.sizeof(value))
    if call(name.encode(), ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0)):
        return None
    return int(value.value)


def mac_free(level: int | None, total: int | None) -> SystemMemory | None:
    """macOS: ``kern.memorystatus_level`` percent of ``hw.memsize`` bytes free."""
    if level is None or total is None or not 0 <= level <= 100 or total <= 0:
        return None
    return SystemMemory(total * level // 100, total, "kern.memorystatus_level")


class MemoryGauge(Protocol):
    """What reads the machine's free memory now (``SystemGauge``; tests give their own)."""

    def free(self) -> SystemMemory | None: ...


@dataclass(frozen=True)
class SystemGauge:
    """This machine's free memory now, on backend ``on``; None where it cannot be read."""

    on: str = "cpu"

    def free(self) -> SystemMemory | None:
        try:
            if self.on == "cuda":
                return _cuda()
            if sys.platform == "darwin":
                return mac_free(_sysctl_int("kern.memorystatus_level"), _sysctl_int("hw.memsize"))
            return _linux()
        except BadInput:
            return None


def system_memory(override: str | None = None, on: str = "cpu") -> SystemMemory:
    """Memory the plan may use: ``--memory`` if given, else what this machine reports.

    On the Metal backend ``--memory`` is the Mac's RAM and the plan gets Metal's
    recommended working set for it (``mlxkv.memory.working_set``), not the RAM."""
    from mlxkv.memory.working_set import working_set, working_set_rule

    if on == "metal":
        if override is not None:
            ram = mac_ram(override)
            return SystemMemory(working_set(ram), ram, working_set_rule(ram))
        if sys.platform != "darwin":
            raise BadInput(
                "--backend metal on this machine needs --memory SIZE: the Mac's RAM, e.g. 16GB"
            )
        return _macos()
    if override is not None:
        return SystemMemory(parse_size(override), None, "--memory")
    if on == "cuda":
        return _cuda()
    if sys.platform == "darwin":
        return _macos()
    return _linux()
