"""The machine's free memory kept above a floor, for a server that runs beside other programs.

The memory budget (``--memory``) is fixed when a server starts; what the machine has free is
not: a browser, an editor or a build takes memory from the same pool (on a Mac the GPU's
too). Every ``READ_EVERY`` seconds the scheduler reads the machine's free memory
(:class:`mlxkv.memory.system.SystemGauge`). When that falls under the floor it gives back
what it holds only for later, until the shortfall is covered: first MLX's freed buffers,
then kept prefixes, to the prefix cache's disk tier, least recently used first (the running
requests' caches are never touched). A waiting request starts beside running ones only if
the KV that its reservation and theirs have yet to allocate fits in the free memory above
the floor (a turn-boundary copy is kept only if it fits there too); a request starts alone
whatever the floor, so none waits forever. So memory stops growing where the machine has
none to give.

exo evicts its prompt cache above 70-85% of RAM in use; this rule keeps a floor of free
memory instead (``default_floor``), which the machine's other programs share.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from mlxkv.memory.budget import human_bytes as size
from mlxkv.memory.system import MemoryGauge

READ_EVERY = 1.0  # seconds between readings of the machine's free memory
FLOOR_SHARE = 0.10  # of the machine's memory, kept free by default
FLOOR_MIN, FLOOR_MAX = 2**30, 8 * 2**30


def default_floor(total: int | None) -> int:
    """The floor when none is given: a tenth of the machine's memory, 1 to 8 GiB (a
    quarter of a machine of less than 4 GiB)."""
    if not total:
        return FLOOR_MIN
    return min(max(int(total * FLOOR_SHARE), min(FLOOR_MIN, total // 4)), FLOOR_MAX)


class MemoryFloor:
    """The last reading of the machine's free memory against ``floor`` bytes, and what was
    given back to keep it there."""

    def __init__(
        self,
        gauge: MemoryGauge,
        floor: int,
        log: Callable[[str], None] = lambda line: None,
        every: float = READ_EVERY,
    ):
        self.gauge = gauge
        self.floor = floor
        self.log = log
        self.every = every
        self.free: int | None = None  # bytes free at the last reading
        self._read_at = -math.inf
        self._since_reading = 0  # bytes given back since the last reading (not seen in it)
        self.under = False  # the last reading was under the floor
        self.times_under = 0  # times the free memory fell under the floor
        self.given_back = 0  # bytes given back under the floor, since the start
        self._episode = 0  # bytes given back in this time under the floor

    def read(self) -> bool:
        """Read the gauge if the last reading is ``every`` seconds old; True if it did."""
        now = time.monotonic()
        if now - self._read_at < self.every:
            return False
        self._read_at = now
        reading = self.gauge.free()
        self.free = None if reading is None else reading.available
        self._since_reading = 0
        return True

    def room(self) -> int | None:
        """Bytes free above the floor now (negative: under it by that much), counting what
        was given back since the reading; None where the gauge cannot read."""
        if self.free is None:
            return None
        return self.free - self.floor + self._since_reading

    def gave_back(self, nbytes: int) -> None:
        self._since_reading += nbytes
        self.given_back += nbytes
        self._episode += nbytes

    def note(self, what: str = "") -> None:
        """After a reading: log the way under the floor (``what``: what was given back) and
        the way out, once each."""
        if self.free is None:
            return
        under = self.free < self.floor
        if under and not self.under:
            self.times_under += 1
            self._episode = self._since_reading  # given back on the way in
            self.log(
                f"the machine has {size(self.free)} free, {size(self.floor - self.free)} under "
                f"the floor of {size(self.floor)} (--memory-floor): {what}; a new request "
                "starts beside running ones only where its KV fits above the floor"
            )
        elif self.under and not under:
            self.log(
                f"the machine has {size(self.free)} free again, above the floor of "
                f"{size(self.floor)}; {size(self._episode)} given back meanwhile"
            )
        self.under = under

    def status(self) -> dict:
        return {
            "free_bytes": self.free,
            "floor_bytes": self.floor,
            "under_floor": self.under,
            "times_under": self.times_under,
            "given_back_bytes": self.given_back,
        }
