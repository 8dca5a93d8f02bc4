"""One sglang host page <-> one dflash2 block: the layout registered from the page geometry, and the
copies between sglang's host KV pool and daemon-owned blocks.

A block holds exactly the bytes of the host pool's *flat data page* (`get_data_page(i, flat=True)`:
the same bytes sglang's own file backend writes), so a page is one block with no padding. The copies
use only the host pool's public page calls, each one strided copy with no staging buffer:

- store: `block.copy_(pool.get_data_page(i, flat=False))` - the page's view, straight into the block;
- load:  `pool.set_from_flat_data_page(i, block)` - the block, straight into the pool.

On a host-only node a block is shared memory (a numpy view, wrapped by torch without a copy); on a
GPU node it is a CUDA tensor and the same calls move the bytes across PCIe.
"""

from __future__ import annotations

import hashlib

import numpy as np

from dflash2.layout import Layout

# The most characters of the model a layout's name holds (the rest of the name, its geometry, takes
# under 100 of the daemon's 512).
MODEL_CHARS = 300

# torch dtype name -> dflash2 layout dtype. Packed or scaled formats travel as their raw bytes
# (an int8 layout of the same byte count), which is all a block needs to hold.
LAYOUT_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "fp8_e4m3",
                 "float8_e5m2": "fp8_e5m2", "int8": "int8", "uint8": "int8"}


class PageFormatError(ValueError):
    """The host pool's pages cannot be stored as dflash2 blocks (the message says why)."""


def _dtype_name(torch_dtype) -> str:
    return str(torch_dtype).removeprefix("torch.")


def page_elements(pool) -> int:
    """Elements of one flat data page (a view of page 0: nothing is allocated). PageFormatError when
    the pool has no flat pages: sglang's asymmetric-head MHA and MXFP8 pools raise
    NotImplementedError there, an MLA pool of layout page_first_kv_split ValueError."""
    try:
        return int(pool.get_data_page(0, flat=False).numel())
    except (NotImplementedError, ValueError, TypeError, AttributeError) as e:
        raise PageFormatError(f"{type(pool).__name__} (layout {getattr(pool, 'layout', '?')}) has no flat data "
                              f"pages ({type(e).__name__}: {e})") from e


def layout_model(model: str) -> str:
    """The model as a layout's name holds it: as given up to MODEL_CHARS, else its tail (a local
    snapshot's path differs at its end) and a digest of the whole, MODEL_CHARS + 1 characters in all,
    so that no two models share a name (a cut one is longer than any uncut). A model path over about
    470 characters made the name longer than the daemon takes, and every scheduler fell back (a
    review); the model's whole name is in the key namespace, so pages are shared as before."""
    if len(model) <= MODEL_CHARS:
        return model
    digest = hashlib.blake2b(model.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()
    tail = MODEL_CHARS + 1 - len("...#") - len(digest)
    return f"...{model[-tail:]}#{digest}"


def page_layout(pool, model: str) -> Layout:
    """The dflash2 layout of one page of `pool` (an sglang HostKVCache), named after the model and
    the geometry, so that every process with the same geometry registers the same layout."""
    dtype_name = _dtype_name(pool.dtype)
    itemsize = int(pool.dtype.itemsize)
    if dtype_name not in LAYOUT_DTYPES:
        raise PageFormatError(f"host KV dtype {dtype_name} has no dflash2 layout dtype")
    elems, tokens = page_elements(pool), int(pool.page_size)
    dtype = LAYOUT_DTYPES[dtype_name]
    if dtype == "int8" and itemsize != 1:
        raise PageFormatError(f"host KV dtype {dtype_name}: {itemsize}-byte elements")
    layers, model = int(getattr(pool, "layer_num", 0) or 0), layout_model(model)
    heads, head_dim = int(getattr(pool, "head_num", 0) or 0), int(getattr(pool, "head_dim", 0) or 0)
    v_dim = int(getattr(pool, "v_head_dim", head_dim) or 0)
    if layers and heads and head_dim == v_dim and elems == 2 * layers * tokens * heads * head_dim:
        name = f"sglang:{model}:mha-l{layers}-h{heads}-d{head_dim}-{dtype}-p{tokens}"
        return Layout(name, num_layers=layers, num_kv_heads=heads, head_dim=head_dim, dtype=dtype,
                      tokens_per_block=tokens)
    if elems % tokens:
        raise PageFormatError(f"a page of {elems} elements does not split into {tokens} tokens")
    # MLA latents, asymmetric K/V and other formats: one flat row of elements per token.
    per_token = elems // tokens
    name = f"sglang:{model}:flat-{per_token}-{dtype}-p{tokens}"
    return Layout(name, num_layers=1, num_kv_heads=0, head_dim=0, dtype=dtype, tokens_per_block=tokens,
                  mla_latent_dim=per_token)


def page_format(pool) -> str:
    """The byte format of a pool's pages, for the key namespace (keys.namespace)."""
    tag = getattr(pool, "storage_format_tag", None)
    return f"{type(pool).__name__}/{pool.layout}" + (f"/{tag}" if tag else "")


def logical_kv_dtype(pool, extra: dict) -> str | None:
    """For a pool that stores its KV as bytes (every fp8 format, and other quantized ones, are
    uint8 to the host pool): the server's `--kv-cache-dtype`, which the namespace must carry
    (fp8_e4m3 and fp8_e5m2 pages of one model hold the same bytes for different values). None
    for a pool whose dtype is the KV's own. PageFormatError when it is not known (a backend set
    up without `--dflash2-config`, which passes it, nor `dflash2_kv_cache_dtype` in `extra`)."""
    if getattr(getattr(pool, "dtype", None), "itemsize", 2) != 1:
        return None
    kv = extra.get("dflash2_kv_cache_dtype")
    if not isinstance(kv, str) or not kv:
        raise PageFormatError(f"the host pool stores its KV as {pool.dtype}, and the KV's own dtype is not known: "
                              "pages of different fp8 formats would share keys (start sglang with "
                              "--dflash2-config, or give dflash2_kv_cache_dtype in the extra config)")
    return kv


def block_tensor(raw, torch_dtype):
    """A flat torch tensor of `torch_dtype` over a block's bytes (numpy or CuPy view), no copy."""
    import torch

    flat = torch.frombuffer(raw, dtype=torch.uint8) if isinstance(raw, np.ndarray) else torch.from_dlpack(raw)
    return flat.view(torch_dtype)


def store_page(pool, page_index: int, raw) -> None:
    """Copy host page `page_index` (a token index, as sglang's host indices) into a block."""
    src = pool.get_data_page(page_index, flat=False)
    block_tensor(raw, src.dtype).view(src.shape).copy_(src)


def load_page(pool, page_index: int, raw) -> None:
    """Copy a block into host page `page_index`."""
    pool.set_from_flat_data_page(page_index, block_tensor(raw, pool.dtype))


def flat_bytes(t):
    """A flat uint8 view of a contiguous torch tensor (a copy only when it is not contiguous)."""
    import torch

    return t.contiguous().view(-1).view(torch.uint8)
