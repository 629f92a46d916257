"""The KV cache policy: one description shared by the caches, the memory model and the CLI.

A policy says what every layer whose cache grows with the sequence keeps:

* ``window=None``            full cache (every token kept)
* ``window=W, sinks=0``      sliding window of the last W tokens
* ``window=W, sinks=S``      S attention-sink tokens + the last W tokens (S + W kept)
* ``bits=b``                 keys and values quantized to b bits (shorthand for both widths)
* ``key_bits`` / ``value_bits``  separate widths (``None``: that tensor stays unquantized);
  keys in groups of ``group_size``, values in groups of ``value_group_size`` (default: the same)
* ``key_scheme``             how keys are quantized: ``kivi`` (default: per channel, in groups
  of ``group_size`` consecutive tokens, the newest incomplete group in full precision; see
  ``mlxkv.caches.kivi``), ``rotated`` (minus a per-channel offset, then a Hadamard rotation of
  head_dim, then per-token groups; see ``mlxkv.caches.storage``) or
  ``plain`` (per-token groups of the raw keys, like mlx-lm)

Layers that already have a shorter window, SSM and linear-attention states are left alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mlxkv.errors import UserError

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
DEFAULT_SINKS = 4
KEY_SCHEMES = ("kivi", "rotated", "plain")
DEFAULT_KEY_SCHEME = "kivi"
MAX_TOKENS = 2**30  # positions MLX indexes with int32; no model's context comes near


class PolicyError(UserError, ValueError):
    """A policy that cannot be built; the message is one line meant for the user."""


@dataclass(frozen=True)
class KVPolicy:
    window: int | None = None
    sinks: int = 0
    bits: int | None = None
    group_size: int = 64
    key_bits: int | None = None
    value_bits: int | None = None
    value_group_size: int | None = None
    key_scheme: str = DEFAULT_KEY_SCHEME

    def __post_init__(self):
        # ``bits`` sets both widths; afterwards it is the widest one (None: unquantized), so
        # ``policy.bits is not None`` still means "quantized" and equal policies compare equal.
        kb = self.key_bits if self.key_bits is not None else self.bits
        vb = self.value_bits if self.value_bits is not None else self.bits
        widths = [b for b in (kb, vb) if b is not None]
        kflag = "--kv-key-bits" if self.key_bits is not None else "--kv-bits"
        vflag = "--kv-value-bits" if self.value_bits is not None else "--kv-bits"
        for flag, b in ((kflag, kb), (vflag, vb)):
            if b is not None and b not in SUPPORTED_BITS:
                raise PolicyError(
                    f"{flag} {b} is not supported by MLX; use one of "
                    + ", ".join(map(str, SUPPORTED_BITS))
                )
        object.__setattr__(self, "key_bits", kb)
        object.__setattr__(self, "value_bits", vb)
        object.__setattr__(self, "bits", max(widths) if widths else None)
        if self.value_group_size is None:
            object.__setattr__(self, "value_group_size", self.group_size)
        for flag, g in (
            ("--kv-group-size", self.group_size),
            ("--kv-value-group-size", self.value_group_size),
        ):
            if g not in SUPPORTED_GROUP_SIZES:
                raise PolicyError(
                    f"{flag} {g} is not supported; use one of "
                    + ", ".join(map(str, SUPPORTED_GROUP_SIZES))
                )
        if self.key_scheme not in KEY_SCHEMES:
            raise PolicyError(
                f"key scheme {self.key_scheme!r} is unknown; use one of " + ", ".join(KEY_SCHEMES)
            )
        if self.window is not None and self.window < 1:
            raise PolicyError(f"--kv-window must be a positive number of tokens, got {self.window}")
        if self.window is not None and self.window > MAX_TOKENS:
            raise PolicyError(
                f"--kv-window {self.window} is past any model's context; use at most "
                f"{MAX_TOKENS} (or no window, for the full cache)"
            )
        if self.sinks < 0:
            raise PolicyError(f"--kv-sinks must be 0 or more, got {self.sinks}")
        if self.sinks > MAX_TOKENS:
            raise PolicyError(f"--kv-sinks {self.sinks} is too many; use at most {MAX_TOKENS}")
        if self.window is None and self.sinks:
            raise PolicyError("--kv-sinks needs a window: add --kv-window W")
        if self.window is not None and self.sinks and self.window <= self.sinks:
            raise PolicyError(
                f"--kv-window ({self.window}) must be larger than --kv-sinks ({self.sinks})"
            )

    @classmethod
    def from_flags(
        cls,
        window: int | None = None,
        sinks: int | None = None,
        bits: int | None = None,
        group_size: int | None = None,
        max_kv_size: int | None = None,
        key_bits: int | None = None,
        value_bits: int | None = None,
        value_group_size: int | None = None,
        key_scheme: str | None = None,
    ) -> KVPolicy:
        """Build a policy from CLI flags. Sinks default to 4 when a window is set;
        ``--kv-key-bits`` / ``--kv-value-bits`` override ``--kv-bits`` for one tensor.

        ``--kv-window W`` keeps the sinks plus the last W tokens; ``--max-kv-size M`` keeps
        M tokens in total, sinks included, as mlx-lm's ``RotatingKVCache(M, keep=4)`` does
        (so the window is M minus the sinks). The window must stay larger than the sinks:
        below M = 9 the default sinks shrink to ``(M - 1) // 2`` (mlx-lm keeps 4 and a
        window of ``M - 4``)."""
        quantized = bits is not None or key_bits is not None or value_bits is not None
        for flag, given in (
            ("--kv-group-size", group_size),
            ("--kv-value-group-size", value_group_size),
        ):
            if given is not None and not quantized:  # taken, and nothing would use it
                raise PolicyError(f"{flag} applies to a quantized cache; add --kv-bits B")
        if max_kv_size is not None and max_kv_size < 1:
            raise PolicyError(
                f"--max-kv-size must be a positive number of tokens, got {max_kv_size}"
            )
        if sinks is None and max_kv_size is not None and window is None:
            # as many of the default sinks as leave a window larger than them
            sinks = min(DEFAULT_SINKS, (max_kv_size - 1) // 2)
        if sinks is None:
            sinks = DEFAULT_SINKS if window is not None or max_kv_size is not None else 0
        if max_kv_size is not None:
            if window is not None and window + sinks != max_kv_size:
                raise PolicyError(
                    f"--max-kv-size {max_kv_size} keeps {max_kv_size} tokens in total but "
                    f"--kv-window {window} + {sinks} sinks keep {window + sinks}; give only one"
                )
            if sinks and max_kv_size - sinks <= sinks:
                left = max_kv_size - sinks
                raise PolicyError(
                    f"--max-kv-size {max_kv_size} with {sinks} sink tokens leaves "
                    f"{f'a window of {left}' if left > 0 else 'no window'}, which must be "
                    "larger than the sinks; give "
                    f"--max-kv-size {2 * sinks + 1} or more, or fewer --kv-sinks"
                )
            window = max_kv_size - sinks
        return cls(
            window=window,
            sinks=sinks,
            bits=bits,
            group_size=64 if group_size is None else group_size,
            key_bits=key_bits,
            value_bits=value_bits,
            value_group_size=value_group_size,
            key_scheme=key_scheme or DEFAULT_KEY_SCHEME,
        )

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
            parts.append(self.quantization())
        return ", ".join(parts)

    def quantization(self) -> str | None:
        """The KV quantization scheme in words (None when nothing is quantized)."""
        if self.bits is None:
            return None
        kb, vb, g, vg = self.key_bits, self.value_bits, self.group_size, self.value_group_size
        keys = f"{self.key_scheme} keys" if kb is not None else "float keys"
        if kb == vb and g == vg:
            return f"{kb}-bit (group {g}), {keys}"
        k = f"keys {kb}-bit (group {g})" if kb is not None else "keys unquantized"
        v = f"values {vb}-bit (group {vg})" if vb is not None else "values unquantized"
        return f"{k}, {v}, {keys}"

    def to_dict(self) -> dict:
        return asdict(self)


def uses_kivi(policy: KVPolicy) -> bool:
    """Whether keys are stored per channel along tokens (KIVI) under ``policy``."""
    return policy.key_bits is not None and policy.key_scheme == "kivi"


def check_layers(
    name: str,
    policy: KVPolicy,
    *,
    growing: bool,
    composite: bool = False,
    mla: bool = False,
    learned_sinks: bool = False,
    head_dims: tuple[int, ...] = (),
) -> None:
    """The refusals that depend only on what the model's growing attention layers are: one
    rule for the engine (read off the loaded model) and the plan (read off config.json).

    ``growing``: whether any layer's cache grows with the sequence; ``composite``: whether
    the model's attention caches sit in CacheLists; ``head_dims``: the key and value head
    dimensions of the growing layers."""
    if policy.window is None and policy.bits is None:
        return
    if not growing:
        why = (
            "its attention caches are composite (CacheList) and must stay aligned"
            if composite
            else "it has no attention layer whose cache grows with the sequence"
        )
        raise PolicyError(f"{name}: --kv-window/--kv-bits do not apply: {why}")
    if policy.bits is not None:
        if mla:
            raise PolicyError(
                f"{name}: --kv-bits is not supported for MLA latent caches "
                "(the decoupled RoPE key is read unquantized); drop --kv-bits"
            )
        if learned_sinks:
            raise PolicyError(
                f"{name}: --kv-bits is not supported: its attention uses learned sink "
                "logits, which mlx-lm's quantized attention does not support"
            )
        groups = []
        if policy.key_bits is not None and not uses_kivi(policy):  # KIVI groups run along tokens
            groups.append(("--kv-group-size", policy.group_size))
        if policy.value_bits is not None:
            same = policy.value_group_size == policy.group_size
            vflag = "--kv-group-size" if same else "--kv-value-group-size"
            groups.append((vflag, policy.value_group_size))
        for flag, g in groups:
            bad = [d for d in head_dims if d % g]
            if bad:
                raise PolicyError(
                    f"{name}: {flag} {g} does not divide the head "
                    f"dimension {bad[0]}; use a group size that divides it"
                )
    if policy.sinks and mla:
        raise PolicyError(
            f"{name}: --kv-sinks needs re-positioning keys, but MLA stores the RoPE "
            "key apart from the latent; use --kv-sinks 0 for a plain window"
        )
