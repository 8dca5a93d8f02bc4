"""A host-only client of a GPU daemon (`Client.connect(host_only=True)`, as sglang's storage backend
attaches an MLA model's ranks to one pool whatever GPU each serves): it maps no GPU arena, uses the
host tiers, and is refused a view of a block in HBM by name (run on a GPU machine)."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import GPU, daemon_on

pytestmark = GPU


def test_a_host_only_client_maps_no_gpu_arena_and_uses_dram(cuda_config):
    from dflash2.client import Client
    from dflash2.errors import ArenaError
    from dflash2.layout import Layout
    from dflash2.tiers import Tier

    path = cuda_config()
    layout = Layout("bf16", 4, 2, 64, "bf16", 16)
    with daemon_on(path):
        with Client.connect(config=path, name="host", layouts=[layout], host_only=True) as c:
            assert any(a["kind"] == "cuda" for a in c.arena_info)  # (the pool has HBM ...)
            assert int(Tier.HBM) not in c._arenas.arenas  # (... which this client did not map)
            lid = c.layouts[0]
            placed = c.allocate(lid, 2, tier="dram")
            c.view_bytes(placed[0])[:] = 5
            (vid,) = c.commit(placed["vid"][:1], keys=[77])
            c.free(c.commit(placed["vid"][1:]))
            c.free([vid])
            held = c.acquire(c.lookup([77], tier="dram")["vid"], tier="dram")
            assert (np.asarray(c.view_bytes(held[0])) == 5).all()
            c.release(held["vid"])
            in_hbm = c.allocate(lid, 1)
            with pytest.raises(ArenaError, match="host_only client maps no GPU arena"):
                c.view_bytes(in_hbm[0])
            c.free(in_hbm["vid"])
            c.check()
