"""GPU nodes with clients in other processes: one pool per GPU, and GPUs found by UUID whatever
each process numbers them (run on a GPU machine; the two-GPU test on a two-GPU one)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from gpu_helpers import GPU, daemon_on, fill, two_gpus

pytestmark = GPU


@pytest.mark.skipif(not two_gpus(), reason="needs two GPUs (run on nvidia-h200-x2)")
def test_one_daemon_keeps_one_pool_per_gpu(tmp_path):
    """A daemon on two GPUs: each client's blocks live in the pool of the GPU it serves, views map
    that GPU's arena, and a move never crosses GPUs."""
    import torch
    from dflash2.client import Client
    from dflash2.layout import Layout
    cfg = {"enable": True, "device": {"kind": "cuda", "gpu_ids": [0, 1]},
           "memory": {"hbm_reserve_mb": 0, "hbm_capacity_mb": 64, "dram_capacity_mb": 64, "nvme_capacity_mb": 128,
                      "nvme_path": "nvme.cache", "staging_buffer_size_mb": 8, "page_kb": 256},
           "kv_block": {"block_size": 16, "prefetch_window": 2}, "policy": {"swap_batch_size": 64},
           "daemon": {"endpoint": f"ipc://{tmp_path}/d.sock"}, "logging": {"format": "text"}}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    with daemon_on(path) as line:
        assert "2 GPUs" in line
        layout = Layout("bf16", 4, 2, 64, "bf16", 16)
        with Client.connect(config=str(path), name="g0", layouts=[layout], device=0) as c0, \
                Client.connect(config=str(path), name="g1", layouts=[layout], device=1) as c1:
            assert c0.gpu == 0 and c1.gpu == 1
            places = c1.allocate(c1.layout_ids[0], 4)
            for p in places:
                t = c1.view(p)
                assert t.is_cuda and t.device.index == 1
                t.fill_(1.5)
            torch.cuda.synchronize(1)
            c1.commit(places["vid"], keys=[21, 22, 23, 24])
            assert len(c1.lookup([21, 22, 23, 24])) == 4
            assert len(c0.lookup([21, 22, 23, 24])) == 0, "GPU 0's pool does not hold GPU 1's blocks"
            st = c0.stats()
            assert set(st["devices"]) == {"0", "1"}
            assert st["devices"]["1"]["tiers"]["hbm"]["blocks"] == 4
            assert st["devices"]["0"]["tiers"]["hbm"]["blocks"] == 0
            c1.check()
            # A process that sees only the daemon's GPU 1 calls it device 0: it gets GPU 1's pool.
            out = client_in("1", str(path), 0, "print('POOL', c.gpu, len(c.lookup([21, 22, 23, 24])))")
            assert out.returncode == 0 and "POOL 1 4" in out.stdout, out.stdout + out.stderr


@pytest.mark.skipif(not two_gpus(), reason="needs two GPUs (run on nvidia-h200-x2)")
def test_moves_on_two_gpus_at_once_stay_on_their_gpu_bit_exact(cuda_config):
    """Each GPU's pool moves its own blocks through DRAM and NVMe (its own share of each) while the
    other GPU's pool moves at the same time, by the copy kernel and the copy engines: every byte
    comes back, on the GPU it left from."""
    import threading

    from dflash2.assemble import build_managers
    from dflash2.config import load_config
    from dflash2.tiers import Tier
    one = Path(cuda_config())
    cfg = json.loads(one.read_text())
    cfg["device"]["gpu_ids"] = [0, 1]
    two = one.with_name("two.json")
    two.write_text(json.dumps(cfg))
    managers = build_managers(load_config(str(two)), instance=f"dflash2-two-{uuid.uuid4().hex[:8]}")
    try:
        assert sorted(managers) == [0, 1]
        hbm = {d: m.arenas[Tier.HBM] for d, m in managers.items()}
        assert {d: a.device for d, a in hbm.items()} == {0: 0, 1: 1}
        assert managers[0].arenas[Tier.NVME].path != managers[1].arenas[Tier.NVME].path
        failures: list[str] = []

        # Each pool's moves start from a thread current on the other GPU, as the daemon's loop thread
        # is (left on GPU 0 by start-up) for GPU 1's pool: only the backend's own device switch
        # (`on_device`) puts them on theirs (started on their own GPU, a backend without it passed).
        threads = [threading.Thread(target=churn, args=(managers[d], d, failures, 1 - d)) for d in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads), "a GPU's moves did not finish in 5 minutes"
        assert not failures, failures
        for d, m in managers.items():
            churned(m, d)
    finally:
        for m in managers.values():
            m.close()


def test_the_churn_on_one_gpu(cuda_config):
    """What the two-GPU test runs on each GPU, here on one (so that a one-GPU machine checks it)."""
    from dflash2.assemble import build_manager
    from dflash2.config import load_config
    mgr = build_manager(load_config(cuda_config()), instance=f"dflash2-one-{uuid.uuid4().hex[:8]}")
    try:
        failures: list[str] = []
        churn(mgr, 0, failures)
        assert not failures, failures
        churned(mgr, 0)
    finally:
        mgr.close()


def churned(mgr, device: int) -> None:
    """After `churn`: every block is back in HBM, and both mechanisms moved some."""
    assert mgr.stats()["tiers"]["hbm"]["blocks"] == 96, device
    batches = mgr.stats()["copy_batches"]  # what dflash2_copy_batches_total exports
    assert set(batches) == {"hbm->dram", "dram->hbm"}, batches
    mechanisms = {m for per in batches.values() for m in per}
    assert mechanisms == {"kernel", "engines"} or not mgr.backend.engines.available, (device, batches)


def churn(mgr, device: int, failures: list[str], moves_from: int | None = None) -> None:
    """Fill blocks of three layouts on `device` and move them through every tier five times, by the
    copy kernel and the copy engines, checking every byte each round (`failures` says what broke).
    `moves_from`: the moves start from a thread whose current device is that one (else `device`)."""
    import cupy as cp
    from dflash2.layout import Layout
    from dflash2.tiers import Tier
    try:
        with cp.cuda.Device(device):
            a = mgr.attach(f"gpu{device}")
            bf16 = mgr.register_layout(Layout("bf16", 4, 2, 64, "bf16", 16))
            fp8 = mgr.register_layout(Layout("fp8", 4, 2, 64, "fp8_e4m3", 16))
            # 256 KiB blocks: the copy engines move them (the others go by the copy kernel)
            big = mgr.register_layout(Layout("big", 4, 4, 128, "bf16", 16))
            vids, data, groups = [], {}, []
            for lids, seed, count in (((bf16, fp8), 1, 40), ((big,), 3, 16)):
                group = []
                for lid in lids:
                    got = mgr.allocate(a, lid, count)
                    for i, v in enumerate(got.tolist()):
                        view = mgr.view(v)
                        assert view.device.id == device, f"GPU {device}'s block {v} is on GPU {view.device.id}"
                        data[v] = fill(view, device * 10_000 + seed * 100 + lid * 1000 + i)
                    group += mgr.commit(a, got).tolist()
                vids += group
                # Shuffled, so that neighbouring blocks do not coalesce into large copies (which
                # the engines would take); the large blocks move in batches of their own.
                groups.append(mgr.table.rows(np.random.default_rng(device).permutation(group)))
            for round_ in range(5):
                with cp.cuda.Device(device if moves_from is None else moves_from):
                    for tier in (Tier.DRAM, Tier.NVME, Tier.HBM, Tier.NVME, Tier.DRAM, Tier.HBM):
                        for rows in groups:
                            if not mgr.mover.move(rows, tier).all():
                                failures.append(f"GPU {device}: a move to {tier.name} failed in round {round_}")
                                return
                for v in vids:
                    view = mgr.view(v)
                    if view.device.id != device or not (cp.asnumpy(view) == data[v]).all():
                        failures.append(f"GPU {device}: block {v} changed in round {round_}")
                        return
            mgr.check_invariants()
    except Exception as e:  # reported by the test's thread
        failures.append(f"GPU {device}: {type(e).__name__}: {e}")


def client_in(env_gpus: str, config: str, device, code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh process that sees only `env_gpus` (CUDA_VISIBLE_DEVICES), after it
    attached as `c` (ArenaError's text is printed as ERROR: ...)."""
    import os
    script = f"""
from dflash2.client import Client
from dflash2.errors import ArenaError
from dflash2.layout import Layout
try:
    c = Client.connect(config={config!r}, name="sub", layouts=[Layout("bf16", 4, 2, 64, "bf16", 16)],
                       device={device!r})
except ArenaError as e:
    print("ERROR:", e)
    raise SystemExit(0)
{code}
c.close()
"""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": env_gpus}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)


def test_a_client_finds_the_daemons_gpu_by_uuid_whatever_its_numbering(cuda_config):
    """A client names the GPU it serves by its own device number; the daemon may number its GPUs
    differently (CUDA_VISIBLE_DEVICES), so the GPU goes by UUID both ways. A client that cannot see
    the daemon's GPU is refused with a named error (mapping it through another GPU would work, slowly,
    with tensors on the wrong device)."""
    import cupy as cp
    from dflash2.client import Client
    from dflash2.errors import ArenaError
    from dflash2.cuda import gpu_uuid
    from dflash2.layout import Layout
    path = cuda_config()
    # (from the driver: CuPy's device properties cut the UUID's bytes at a zero byte, which this
    # H200's UUID holds: "a GPU UUID has 16 bytes, got 10")
    uuid = gpu_uuid(0)
    with daemon_on(path):
        with Client.connect(config=path, name="here", layouts=[Layout("bf16", 4, 2, 64, "bf16", 16)], device=0) as c:
            assert c.gpu == 0 and c.gpu_uuid == uuid
            assert [a["uuid"] for a in c.arena_info if a["kind"] == "cuda"] == [uuid]
            assert c.stats()["daemon"]["gpus"] == {"0": uuid}
        seen = cp.cuda.runtime.getDeviceCount()
        with pytest.raises(ArenaError, match=f"this process sees {seen} GPU"):
            Client.connect(config=path, name="past", device=seen)
        # Seen by UUID in a process whose only GPU is that one: its device 0.
        out = client_in(uuid, path, 0, "p = c.allocate(c.layout_ids[0], 1)[0]\n"
                                         "t = c.view(p)\nprint('OK', c.gpu, t.device)")
        assert out.returncode == 0 and "OK 0 cuda:0" in out.stdout, out.stdout + out.stderr
        # A process that sees no GPU: refused, naming the GPU it would need (with or without a device).
        for device in (None, 0):
            out = client_in("", path, device, "print('MAPPED')")
            assert out.returncode == 0, out.stderr
            assert f"ERROR: the daemon's HBM arena lies on GPU {uuid}" in out.stdout, out.stdout + out.stderr


def test_every_visible_gpus_uuid_is_nvidia_smis_whole():
    """The UUIDs the daemon and its clients name GPUs by are the driver's, all 16 bytes, as
    nvidia-smi lists them. CuPy's device properties end them at their first zero byte: on an H200
    whose UUID held one, every client's attach was refused ("a GPU UUID has 16 bytes, got 13")."""
    import subprocess

    from dflash2.cuda import gpu_uuid, visible_uuids

    listed = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True,
                            text=True, check=True).stdout.split()
    seen = visible_uuids()
    assert seen and len(set(seen)) == len(seen), seen
    assert all(u in listed for u in seen), (seen, listed)
    assert [gpu_uuid(d) for d in range(len(seen))] == seen
