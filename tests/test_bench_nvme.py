"""`dflash2 bench nvme` runs end to end on a small size: the tier's bytes read back equal, both raw
memory kinds, and the rounds that run the tier first."""

import argparse
import subprocess
import sys

import numpy as np
import pytest

from dflash2.arena.nvme import NvmeArena
from dflash2.bench import nvme


@pytest.mark.parametrize("raw_memory", ["shm", "anon"])
def test_bench_nvme_small_run(tmp_path, raw_memory):
    parser = argparse.ArgumentParser()
    nvme.add_arguments(parser)
    args = parser.parse_args(["--size-mb", "8", "--block-kb", "256", "--batch", "4", "--staging-mb", "2",
                              "--repeat", "2", "--dir", str(tmp_path), "--raw-memory", raw_memory])
    out = nvme.run(args)
    assert out["verified"] and out["tier_read_misses"] == 0
    assert out["raw_memory"] == raw_memory and out["repeat"] == 2
    for key in ("tier_write_gbps", "raw_write_gbps", "tier_read_gbps", "raw_read_gbps"):
        assert out[key] > 0
    assert list(tmp_path.iterdir()) == []  # the scratch folder is removed


def test_bench_nvme_is_not_verified_when_later_reads_deliver_nothing(tmp_path, monkeypatch):
    """Every batch reads the same bytes into the same views: once the first batch had read back, reads
    that copied nothing still said "verified": true (a review). The last round's batches are each
    checked against views zeroed before the read."""
    real, calls = NvmeArena.read_blocks, []

    def read_blocks(self, offsets, dests):  # the first batch reads; the rest say "read", copy nothing
        calls.append(len(offsets))
        return real(self, offsets, dests) if len(calls) == 1 else np.ones(len(offsets), dtype=bool)

    out = _run_with(monkeypatch, read_blocks, tmp_path, repeat=2)
    assert len(calls) == 8 and out["tier_read_misses"] == 0
    assert out["verified"] is False


def test_bench_nvme_is_not_verified_when_reads_come_from_another_batchs_blocks(tmp_path, monkeypatch):
    """Every batch wrote the same sources, so block k on disk equalled block k % batch: a read_blocks
    that returned the first batch's blocks for every batch still said "verified": true (a review).
    Each block's first 8 bytes now hold its index."""
    real, calls = NvmeArena.read_blocks, []

    def read_blocks(self, offsets, dests):  # every batch reads the first batch's blocks (a wrong offset)
        calls.append(int(offsets[0]))
        return real(self, offsets - offsets[0], dests)

    out = _run_with(monkeypatch, read_blocks, tmp_path, repeat=1)
    assert len(calls) == 4 and out["tier_read_misses"] == 0
    assert out["verified"] is False


def _run_with(monkeypatch, read_blocks, tmp_path, repeat: int) -> dict:
    """The bench over 4 MiB in 16 blocks of 256 KiB, batches of 4, with the tier's reads by `read_blocks`."""
    monkeypatch.setattr(NvmeArena, "read_blocks", read_blocks)
    parser = argparse.ArgumentParser()
    nvme.add_arguments(parser)
    return nvme.run(parser.parse_args(["--size-mb", "4", "--block-kb", "256", "--batch", "4", "--staging-mb", "2",
                                       "--repeat", str(repeat), "--dir", str(tmp_path)]))


def test_bench_nvme_rejects_a_block_larger_than_the_size(tmp_path):
    parser = argparse.ArgumentParser()
    nvme.add_arguments(parser)
    with pytest.raises(ValueError, match="--block-kb"):
        nvme.run(parser.parse_args(["--size-mb", "1", "--block-kb", "2048", "--dir", str(tmp_path)]))


def test_bench_nvme_takes_no_larger_batch_than_the_run_moves(tmp_path):
    """--batch 100,000 on 16 MiB of 64 KiB blocks took 20 GB of /dev/shm for its buffers (a review:
    the OOM killer ended the run and they were left there): a batch is at most the blocks moved."""
    parser = argparse.ArgumentParser()
    nvme.add_arguments(parser)
    out = nvme.run(parser.parse_args(["--size-mb", "8", "--block-kb", "256", "--batch", "100000", "--staging-mb", "2",
                                      "--repeat", "1", "--dir", str(tmp_path)]))
    assert out["batch"] == 32 and out["verified"] and out["raw_buffer_mb"] == 8.0


def _raw_too_large(tmp_path, memory):
    return subprocess.run([sys.executable, "-m", "dflash2.cli", "bench", "nvme", "--size-mb", "8",
                           "--repeat", "1", "--dir", str(tmp_path), "--raw-memory", memory,
                           "--raw-buffer-mb", "1000000000"], capture_output=True, text=True, timeout=120)


def test_a_raw_buffer_too_large_is_a_usage_error_in_either_memory(tmp_path):
    """--raw-memory anon: mmap's ENOMEM was a traceback (exit 1), shm's an option error (a review)."""
    shm = _raw_too_large(tmp_path, "shm")
    assert shm.returncode == 2, shm.stderr[-1000:]
    # The option named (it said "dram tier needs ... bytes of shared memory", no option: a review).
    assert "error: --raw-buffer-mb: " in shm.stderr, shm.stderr[-600:]
    anon = _raw_too_large(tmp_path, "anon")
    assert anon.returncode == 2 and "Traceback" not in anon.stderr, (anon.returncode, anon.stderr[-600:])
