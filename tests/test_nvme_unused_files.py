"""An earlier daemon's NVMe cache files that no pool of this start uses (made for another number of
GPUs: `nvme_path` with one pool, `nvme_path.gpuN` with several): start-up removes them, logged, and
`--check` says it will and counts their room as free. A two-GPU daemon's two files left a one-pool
restart on the same disk refused for room (exit 4, the message naming bytes only, a review)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re

from conftest import gpu_node, write_config

from dflash2.arena.nvme import NvmeArena
from dflash2.assemble import build_managers
from dflash2.config import load_config, parse_config
from dflash2.daemon import main as dmain
from dflash2.plan import resolve_plan

MB = 1 << 20


def test_start_up_removes_an_earlier_daemons_files_that_no_pool_uses(tmp_path, caplog):
    config = write_config(tmp_path)  # one pool: its file is tmp_path / nvme.cache
    for name in ("gpu0", "gpu1", "gpu0.orig", "gpus-notes"):  # the last two: an operator's copies, left
        NvmeArena(tmp_path / f"nvme.cache.{name}", 4 * MB, staging_bytes=1 * MB).close()
    (tmp_path / "nvme.cache.gpu7").write_bytes(b"someone else's file")  # not dflash2's: left alone
    held = NvmeArena(tmp_path / "nvme.cache.gpu2", 1 * MB, staging_bytes=1 * MB)  # a running daemon's
    try:
        with caplog.at_level("WARNING", logger="dflash2.arena"):
            managers = build_managers(load_config(config))
        for m in managers.values():
            m.close()
    finally:
        held.close()
    names = sorted(p.name for p in tmp_path.glob("nvme.cache*"))
    assert names == ["nvme.cache", "nvme.cache.gpu0.orig", "nvme.cache.gpu2", "nvme.cache.gpu7",
                     "nvme.cache.gpus-notes"], names
    for gpu in (0, 1):
        assert re.search(rf"removed an earlier daemon's cache file {tmp_path}/nvme.cache.gpu{gpu} \(\d+ bytes on disk\)",
                         caplog.text), caplog.text
    assert "gpu2" not in caplog.text and "gpu7" not in caplog.text


def test_check_says_start_up_removes_them_and_counts_their_room(tmp_path, monkeypatch):
    NvmeArena(tmp_path / "nvme.cache", 64 * MB, staging_bytes=1 * MB).close()  # a one-pool daemon's file
    raw = gpu_node(tmp_path, monkeypatch, 2)
    plan = resolve_plan(parse_config(raw))
    st = os.statvfs(tmp_path)
    free_before = st.f_bavail * st.f_frsize
    held = os.stat(tmp_path / "nvme.cache").st_blocks * 512
    lines = dmain.room_now(plan)
    assert any(line == (f"{tmp_path}/nvme.cache is an earlier daemon's NVMe cache file ({held} bytes on disk) that "
                        "no pool of this config uses (made for another number of GPUs): start-up removes it")
               for line in lines), lines
    free = int(re.search(r"; (\d+) are free there", lines[-1]).group(1))
    assert free >= free_before + held // 2, (free, free_before, held)  # (others may write to the disk meanwhile)
    # The files this config uses are never among them.
    NvmeArena(tmp_path / "nvme.cache.gpu0", 1 * MB, staging_bytes=1 * MB).close()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        (tmp_path / "c.json").write_text(json.dumps(raw))
        assert dmain.main(["--config", str(tmp_path / "c.json"), "--check"]) == 0
    assert "nvme.cache.gpu0 is an earlier daemon's" not in out.getvalue()
    assert f"{tmp_path}/nvme.cache is an earlier daemon's" in out.getvalue()


def test_a_symlinked_file_of_an_earlier_daemon_is_named_and_left(tmp_path, caplog):
    """A link per GPU onto a disk each is the operator's layout: removing the link freed nothing (its
    target kept the room) and lost the layout (a review)."""
    disks, cfg = tmp_path / "disks", tmp_path / "cfg"
    disks.mkdir()
    cfg.mkdir()
    for gpu in (0, 1):
        NvmeArena(disks / f"f{gpu}", 4 * MB, staging_bytes=1 * MB).close()
        (cfg / f"nvme.cache.gpu{gpu}").symlink_to(disks / f"f{gpu}")
    config = write_config(cfg)  # one pool: cfg / nvme.cache
    lines = dmain.room_now(resolve_plan(load_config(config)))
    assert any(f"{cfg}/nvme.cache.gpu0 leads to an earlier daemon's NVMe cache file {disks}/f0" in line
               and "start-up leaves the link as it is" in line for line in lines), lines
    with caplog.at_level("WARNING", logger="dflash2.arena"):
        for m in build_managers(load_config(config)).values():
            m.close()
    for gpu in (0, 1):
        assert (cfg / f"nvme.cache.gpu{gpu}").is_symlink() and (disks / f"f{gpu}").is_file()
        assert f"{cfg}/nvme.cache.gpu{gpu} leads to an earlier daemon's cache file {disks}/f{gpu}" in caplog.text
    assert "removed" not in caplog.text
