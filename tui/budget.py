"""The memory budget the panel's bar is drawn against: what this machine can give MLX.

Called on the MLX worker thread (it may ask MLX for the device's limits on macOS).
"""

from __future__ import annotations

import sys
from pathlib import Path


def _linux_budget() -> int | None:
    total = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
    except OSError:
        pass
    # A container's cgroup limit is the real ceiling when it is lower.
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < (total or 1 << 62):
            total = int(raw)
    return total


def memory_budget() -> int | None:
    """Bytes of memory MLX may use here, or None if unknown."""
    if sys.platform == "darwin":
        try:
            import mlx.core as mx

            info = mx.device_info()
            return int(info.get("max_recommended_working_set_size") or info["memory_size"])
        except Exception:  # an older MLX without device_info: no bar limit
            return None
    return _linux_budget()
