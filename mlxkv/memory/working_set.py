"""How much of a Mac's unified memory MLX may use on Metal, and what mlxkv wires at load.

Metal caps what the GPU keeps resident at ``MTLDevice.recommendedMaxWorkingSetSize``. MLX
reports it as ``mx.device_info()["max_recommended_working_set_size"]``
(mlx/backend/metal/device_info.cpp), refuses a wired limit above it
(``set_wired_limit`` in mlx/backend/metal/allocator.cpp: "Setting a wired limit larger than
the maximum working set size is not allowed") and sizes its own limits from it (memory
limit ``min(1.5 x it, 0.95 x RAM)``, cache collection at ``0.95 x it``; same file, MLX
commit 846d176). A plan that exceeds it pages or fails mid-prefill, so it is the budget.

The default for a RAM size, as Metal reports it on real Macs (macOS 13-15):

* RAM up to 36 GiB: 2/3 of RAM. 8 GB: 5,461.34 MiB (SceneWorks#1552: "~5.3 GB"); 16 GB:
  10,922.67 MiB (llama-cpp-python#687, exo#1672: 10.67 GB on an M4, macOS 15.6);
  32 GB: 21,845.34 MiB (ollama#434, llama.cpp#2011).
* Above 36 GiB: 3/4 of RAM. 64 GB: 49,152 MiB (llama.cpp#1870); gpustack#1375: "75% of
  total RAM". 36 and 48 GB Macs follow the same two rules here, unmeasured.

macOS 26 reports more on large Macs (128 GiB: 107.52 GiB, antirez/ds4#893); the plan keeps
the older, smaller default, so a plan that fits fits on either.

``sudo sysctl iogpu.wired_limit_mb=N`` replaces the default, and Metal then reports N MiB
(llmfit#754 measured 12,000 and 14,000 on a 16 GB M3; ds4#893 114,688 on 128 GiB). The
plan proposes it only when the request then fits and macOS keeps ``MACOS_HEADROOM``.

At load time mlx-lm's ``wired_limit`` wires the whole working set; exo did the same and
froze 16 GB Macs (exo#1672), then capped it at model + 4 GB. mlxkv wires
``min(working set, weights + WIRE_MARGIN)``: the weights stay resident, the KV cache and
activations above that are still usable, just not pinned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GiB = 2**30
MiB = 2**20
SMALL_MAC = 36 * GiB  # up to here Metal recommends 2/3 of RAM, above it 3/4
MACOS_HEADROOM = 4 * GiB  # never propose a wired limit leaving macOS less than this
WIRE_MARGIN = 2 * GiB  # wired at load on top of the weights
WIRED_STEP_MB = 256  # proposed iogpu.wired_limit_mb values are multiples of this


def working_set(ram: int) -> int:
    """Metal's default recommended working set (bytes) for a Mac with ``ram`` bytes."""
    if ram <= SMALL_MAC:
        return ram * 2 // 3
    return ram * 3 // 4


def working_set_rule(ram: int) -> str:
    """The rule applied, for the user."""
    share = "2/3" if ram <= SMALL_MAC else "3/4"
    size = f"{ram / GiB:g}"
    article = "an" if size.startswith(("8", "11", "18")) else "a"
    return f"Metal's recommended working set of {article} {size} GB Mac ({share} of RAM)"


@dataclass(frozen=True)
class WiredAdvice:
    limit_mb: int  # the value for iogpu.wired_limit_mb
    headroom: int  # bytes left to macOS and other programs

    @property
    def command(self) -> str:
        return f"sudo sysctl iogpu.wired_limit_mb={self.limit_mb}"


def wired_advice(needed: int, ram: int, available: int) -> WiredAdvice | None:
    """The sysctl that makes ``needed`` bytes fit on a Mac with ``ram``, if one is safe."""
    if needed <= available:
        return None
    mb = math.ceil(needed / MiB / WIRED_STEP_MB) * WIRED_STEP_MB
    headroom = ram - mb * MiB
    if headroom < MACOS_HEADROOM:
        return None
    return WiredAdvice(mb, headroom)


def load_wired_limit(weights_bytes: int, recommended: int) -> int:
    """Bytes mlxkv wires when it loads a model: the weights plus a margin, at most Metal's
    recommended working set (MLX refuses more)."""
    return min(recommended, weights_bytes + WIRE_MARGIN)


def wire_for_load(weights_bytes: int) -> int | None:
    """On Metal, wire what ``load_wired_limit`` says (instead of mlx-lm's whole working set);
    returns the bytes wired, None where there is no Metal device."""
    import mlx.core as mx

    if not mx.metal.is_available():
        return None
    recommended = int(mx.device_info()["max_recommended_working_set_size"])
    limit = load_wired_limit(weights_bytes, recommended)
    mx.set_wired_limit(limit)
    return limit
