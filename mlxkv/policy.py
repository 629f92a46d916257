"""The KV cache policy: one description shared by the caches, the memory model and the CLI.

A policy says what every layer whose cache grows with the sequence keeps:

* ``window=None``            full cache (every token kept)
* ``window=W, sinks=0``      sliding window of the last W tokens
* ``window=W, sinks=S``      S attention-sink tokens + the last W tokens (S + W kept)
* ``bits=b``                 keys/values quantized to b bits, per ``group_size`` along head_dim

Layers that already have a shorter window, SSM and linear-attention states are left alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mlxkv.errors import UserError

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
DEFAULT_SINKS = 4


class PolicyError(UserError, ValueError):
    """A policy that cannot be built; the message is one line meant for the user."""


@dataclass(frozen=True)
class KVPolicy:
    window: int | None = None
    sinks: int = 0
    bits: int | None = None
    group_size: int = 64

    def __post_init__(self):
        if self.window is not None and self.window < 1:
            raise PolicyError(f"--kv-window must be a positive number of tokens, got {self.window}")
        if self.sinks < 0:
            raise PolicyError(f"--kv-sinks must be 0 or more, got {self.sinks}")
        if self.window is None and self.sinks:
            raise PolicyError("--kv-sinks needs a window: add --kv-window W")
        if self.window is not None and self.sinks and self.window <= self.sinks:
            raise PolicyError(
                f"--kv-window ({self.window}) must be larger than --kv-sinks ({self.sinks})"
            )
        if self.bits is not None and self.bits not in SUPPORTED_BITS:
            raise PolicyError(
                f"--kv-bits {self.bits} is not supported by MLX; use one of "
                + ", ".join(map(str, SUPPORTED_BITS))
            )
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise PolicyError(
                f"--kv-group-size {self.group_size} is not supported; use one of "
                + ", ".join(map(str, SUPPORTED_GROUP_SIZES))
            )

    @classmethod
    def from_flags(
        cls,
        window: int | None = None,
        sinks: int | None = None,
        bits: int | None = None,
        group_size: int | None = None,
        max_kv_size: int | None = None,
    ) -> KVPolicy:
        """Build a policy from CLI flags. Sinks default to 4 when a window is set.

        ``--kv-window W`` keeps the sinks plus the last W tokens; ``--max-kv-size M`` keeps
        M tokens in total, sinks included, as mlx-lm's ``RotatingKVCache(M, keep=4)`` does
        (so the window is M minus the sinks)."""
        if sinks is None:
            sinks = DEFAULT_SINKS if window is not None or max_kv_size is not None else 0
        if max_kv_size is not None:
            if max_kv_size <= sinks:
                raise PolicyError(
                    f"--max-kv-size ({max_kv_size}) counts the {sinks} sink tokens too; "
                    f"give more than {sinks} (or fewer --kv-sinks)"
                )
            if window is not None and window + sinks != max_kv_size:
                raise PolicyError(
                    f"--max-kv-size {max_kv_size} keeps {max_kv_size} tokens in total but "
                    f"--kv-window {window} + {sinks} sinks keep {window + sinks}; give only one"
                )
            window = max_kv_size - sinks
        return cls(window=window, sinks=sinks, bits=bits, group_size=group_size or 64)

    @property
    def kept_tokens(self) -> int | None:
        """Tokens a growing layer keeps at most (None: unbounded)."""
        return None if self.window is None else self.window + self.sinks

    def describe(self) -> str:
        parts = []
        if self.window is None:
            parts.append("full")
        elif self.sinks:
            parts.append(f"sink {self.sinks} + window {self.window}")
        else:
            parts.append(f"window {self.window}")
        if self.bits is not None:
            parts.append(f"{self.bits}-bit (group {self.group_size})")
        return ", ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)
