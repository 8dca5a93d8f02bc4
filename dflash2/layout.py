"""KV layouts: the geometry an engine registers when it attaches; block bytes follow from it exactly."""

from __future__ import annotations

import dataclasses
import functools
import numbers
from fractions import Fraction

from dflash2.errors import LayoutError

# A block's bytes, and its slot's (rounded up to a tier's alignment), must fit the daemon's int64
# columns: a block within one alignment of 2^63 had a slot of 2^63 bytes, and the table's array of
# slot sizes then failed every client's allocate, reserve and check until a restart (a review).
MAX_BLOCK_BYTES = 1 << 62
MAX_LAYOUT_NAME_CHARS = 512  # (sglang's names hold the model's path)

# Bits per element. 4-bit values are packed two to a byte.
DTYPE_BITS: dict[str, int] = {
    "fp32": 32,
    "fp16": 16,
    "bf16": 16,
    "fp8_e4m3": 8,
    "fp8_e5m2": 8,
    "int8": 8,
    "int4": 4,
    "fp4": 4,
}


@dataclasses.dataclass(frozen=True)
class Layout:
    """KV geometry of one model at one precision.

    A block holds `tokens_per_block` tokens of KV for every layer. Standard attention stores K and V
    (`num_kv_heads * head_dim` each) per token per layer; MLA stores one latent vector of
    `mla_latent_dim` (+ `mla_rope_dim`) per token per layer and ignores heads.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tokens_per_block: int
    mla_latent_dim: int = 0
    mla_rope_dim: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise LayoutError(f"layout name must be a non-empty string, got {self.name!r}")
        if len(self.name) > MAX_LAYOUT_NAME_CHARS:
            # (the daemon keeps every layout registered for its life: a client's megabyte names
            # held a megabyte each)
            raise LayoutError(f"layout name {self.name[:40]!r}... has {len(self.name)} characters, more than "
                              f"{MAX_LAYOUT_NAME_CHARS}")
        from dflash2.protocol import unprintable  # (printed by `dflash2 status` and the log, as client names)

        why = unprintable(self.name)
        if why is not None:
            raise LayoutError(f"layout name {self.name[:40]!r} {why}")
        for field in ("num_layers", "num_kv_heads", "head_dim", "tokens_per_block", "mla_latent_dim", "mla_rope_dim"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise LayoutError(f"layout {self.name!r}: {field} must be an integer, got {value!r}")
            object.__setattr__(self, field, int(value))  # (a numpy integer is sent as JSON: a Python int)
        if self.dtype not in DTYPE_BITS:
            raise LayoutError(f"layout {self.name!r}: dtype {self.dtype!r} is not one of {sorted(DTYPE_BITS)}")
        for field in ("num_layers", "tokens_per_block"):
            if getattr(self, field) <= 0:
                raise LayoutError(f"layout {self.name!r}: {field} must be > 0, got {getattr(self, field)}")
        # Checked whatever the kind: a negative latent size would otherwise pass as "not MLA".
        if self.mla_latent_dim < 0 or self.mla_rope_dim < 0:
            raise LayoutError(f"layout {self.name!r}: MLA dims must be >= 0")
        if self.mla_rope_dim and not self.is_mla:
            raise LayoutError(f"layout {self.name!r}: mla_rope_dim is set but mla_latent_dim is not "
                              "(the rope part is stored next to an MLA latent; it would be ignored)")
        if not self.is_mla:
            if self.num_kv_heads <= 0 or self.head_dim <= 0:
                raise LayoutError(
                    f"layout {self.name!r}: num_kv_heads and head_dim must be > 0 (or set mla_latent_dim for MLA)"
                )
        if Fraction(self.elements_per_block * DTYPE_BITS[self.dtype], 8).denominator != 1:
            raise LayoutError(f"layout {self.name!r}: a block of {self.dtype} is not a whole number of bytes")

    @property
    def is_mla(self) -> bool:
        return self.mla_latent_dim > 0

    @property
    def elements_per_token_layer(self) -> int:
        if self.is_mla:
            return self.mla_latent_dim + self.mla_rope_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def elements_per_block(self) -> int:
        return self.num_layers * self.tokens_per_block * self.elements_per_token_layer

    @functools.cached_property  # (asked for every block a reply places)
    def block_bytes(self) -> int:
        """Exact bytes of one block: no padding here; arenas round up and measure the waste."""
        return self.elements_per_block * DTYPE_BITS[self.dtype] // 8

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape of a block's tensor view: (layers, K/V or latent, tokens, heads, head_dim)."""
        if self.is_mla:
            return (self.num_layers, self.tokens_per_block, self.elements_per_token_layer)
        return (self.num_layers, 2, self.tokens_per_block, self.num_kv_heads, self.head_dim)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Layout":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise LayoutError(f"unknown layout field(s) {unknown}; valid: {sorted(known)}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING and f.name not in data)
        if missing:
            raise LayoutError(f"layout is missing field(s) {missing}")
        # A layout from the wire is checked field by field before any arithmetic: a bool, float or
        # string where a count belongs, or a name that is not a string, is named here (never coerced).
        for f in dataclasses.fields(cls):
            if f.name not in data:
                continue
            value, want = data[f.name], (str if f.type == "str" else int)
            if isinstance(value, bool) or not isinstance(value, want):
                raise LayoutError(f"layout field {f.name!r} must be {want.__name__}, got {type(value).__name__}")
        layout = cls(**data)
        # Every number the daemon stores is 64-bit (its columns and the place records): a block of
        # more bytes than that would break every client's batch calls, not only this one's.
        if layout.block_bytes > MAX_BLOCK_BYTES:
            raise LayoutError(f"layout {layout.name!r}: a block of {layout.block_bytes} bytes (num_layers, "
                              f"tokens_per_block, heads, dims) exceeds {MAX_BLOCK_BYTES}")
        return layout
