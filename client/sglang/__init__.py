"""dflash2 for sglang: `--dflash2-config FILE` keeps sglang's hierarchical KV cache (its L3 storage)
in the node's dflash2 daemon, shared and deduplicated by every sglang process on the node.

    plugin.py   the `sglang.srt.plugins` entry point: adds the flag, rewrites it into sglang's
                hierarchical cache with the `dynamic` storage backend, or falls back
    backend.py  DFlash2Storage, the HiCacheStorage subclass sglang creates (imports sglang)
    pages.py    one host page <-> one dflash2 block: layout and copies (torch, no sglang import)
    chains.py   a batch's cached prefix, and the chain tips kept until the next batch links to
                them (no torch, no sglang)
    keys.py     sglang page keys -> namespaced dflash2 content keys (no torch, no sglang)
    clears.py   the key spaces a server's clears move it to (launch token, epoch); no torch, no sglang
    identity.py the model's identity that the namespace covers: server arguments (the plugin's)
                and the model's files (read by the backend); no torch, no sglang

Layers import only downward: backend -> chains, pages, keys, clears, identity, plugin (for the fallback
line); plugin -> clears, identity; nothing here is imported by the rest of dflash2.
"""
