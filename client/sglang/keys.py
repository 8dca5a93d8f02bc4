"""sglang page keys -> dflash2 content keys, namespaced so that only compatible pages are shared.

sglang names a page by a string: a chained hash of the page's tokens and its whole prefix
(`get_hash_str`). The same string names *different bytes* in different processes when they hold a
different shard or format of the KV, so the dflash2 key hashes the string together with a namespace:

- the model: its served name, and its identity (identity.py: the server arguments and files that
  decide its numbers; the served name alone let `--quantization fp8`, or a new checkpoint under the
  old name, read the other's pages);
- the shard: TP rank and size for standard attention (each rank holds its own KV heads), none for
  MLA (the latent is replicated on every TP rank, so every rank may read the writer's page);
  pipeline stage (its rank, and its first layer), attention context-parallel and decode
  context-parallel ranks where used;
- the page format: the host pool's memory layout (page_first, layer_first, ...), its storage
  format tag, and the page geometry (dtype, layers, heads, tokens per page);
- the server's key space, once it has cleared (`DFlash2Storage.clear`: after an in-place weight
  update pages written before are not this server's KV any more): its launch token and clear epoch
  (clears.py).

Invariant: a TP rank never reads another rank's shard, and a page is only ever read into a host
pool whose byte format is the one it was written from. Key 0 is "no key" on the wire and is never
produced.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

NO_KEY = 0


@dataclasses.dataclass(frozen=True)
class Shard:
    """Which slice of a model's KV one sglang process (rank) holds; the fields of sglang's
    `HiCacheStorageConfig` that decide it."""

    model: str
    tp_rank: int = 0
    tp_size: int = 1
    is_mla: bool = False
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    # The first layer of the stage's slice (the host pool's `start_layer`), where pp_size > 1: with
    # SGLANG_PP_LAYER_PARTITION two servers of one model hold other layers at one pp rank (10,10,12
    # and 12,10,10: stage 1 holds layers 10-19 and 12-21), and with the rank and the layer count
    # alone they read each other's pages, KV of other layers, as hits (a review).
    pp_start_layer: int | None = None

    @classmethod
    def from_storage_config(cls, cfg) -> "Shard":
        return cls(model=cfg.model_name or "", tp_rank=cfg.tp_rank, tp_size=cfg.tp_size, is_mla=bool(cfg.is_mla_model),
                   pp_rank=cfg.pp_rank, pp_size=cfg.pp_size, attn_cp_rank=cfg.attn_cp_rank,
                   attn_cp_size=cfg.attn_cp_size, dcp_rank=getattr(cfg, "dcp_rank", 0),
                   dcp_size=getattr(cfg, "dcp_size", 1))

    def tag(self) -> str:
        """The shard part of the namespace. MLA pages are the same on every TP rank: no TP rank."""
        parts = [f"model={self.model}"]
        parts.append("mla" if self.is_mla else f"tp={self.tp_rank}/{self.tp_size}")
        if self.pp_size > 1:
            parts.append(f"pp={self.pp_rank}/{self.pp_size}" +
                         ("" if self.pp_start_layer is None else f"@layer{self.pp_start_layer}"))
        if self.attn_cp_size > 1:
            parts.append(f"cp={self.attn_cp_rank}/{self.attn_cp_size}")
        if self.dcp_size > 1:
            parts.append(f"dcp={self.dcp_rank}/{self.dcp_size}")
        return ",".join(parts)


def namespace(shard: Shard, page_format: str, model_id: str | None = None, clear: str = "") -> str:
    """The full namespace: shard + the model's identity (`identity.model_id`; None: unknown, the
    served name alone) + page byte format (see the module docstring) + the server's key space where
    it has cleared (`clears.KeySpace.tag`, `<launch>.<epoch>`; "" where it never cleared, so it
    shares its pages with every server of its identity, as before)."""
    model = "" if model_id is None else f"|id={model_id}"
    cleared = f"|clear={clear}" if clear else ""
    return f"sglang|{shard.tag()}{model}|{page_format}{cleared}"


def _seed(ns: str) -> bytes:
    return hashlib.blake2b(ns.encode("utf-8"), digest_size=16, person=b"dflash2-sglang").digest()


class KeyMapper:
    """Maps sglang page keys to dflash2 content keys within one namespace (cached per string)."""

    def __init__(self, ns: str):
        self.namespace = ns
        self._salt = _seed(ns)

    def key(self, page_key: str) -> int:
        digest = hashlib.blake2b(page_key.encode("utf-8"), digest_size=8, key=self._salt).digest()
        return int.from_bytes(digest, "little") or 1  # 0 is "no key"

    def keys(self, page_keys: Sequence[str]) -> np.ndarray:
        return np.fromiter((self.key(k) for k in page_keys), dtype=np.uint64, count=len(page_keys))
