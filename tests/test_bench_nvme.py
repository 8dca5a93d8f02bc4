"""`dflash2 bench nvme` runs end to end on a small size: the tier's bytes read back equal, both raw
memory kinds, and the rounds that run the tier first."""

import argparse

import pytest

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
