"""`dflash2 bench nvme`'s errors name its own options (--staging-mb, --size-mb, --batch and --block-kb),
not the daemon's config keys, and only the option at fault: a staging buffer past the machine's memory,
a tier file that cannot be made, a file size limit (ulimit -f) below the tier's file or the bench's
own buffers. Moved from test_audit_bench.py (past 600 lines)."""

from test_audit_bench import usage_error


def test_a_staging_buffer_past_the_machines_memory_is_refused_in_one_line(capsys, tmp_path):
    line = usage_error(capsys, "nvme", "--size-mb", "4", "--block-kb", "256", "--staging-mb", "100000000",
                       "--dir", str(tmp_path))
    assert "staging buffer needs" in line and "available" in line
    assert "error: --staging-mb 100000000: " in line, line  # (it named memory.staging_buffer_size_mb alone, a review)
    assert "memory.staging_buffer_size_mb" not in line, line  # (the daemon's key, named beside the option: a review)


def test_a_tier_file_that_cannot_be_made_is_not_blamed_on_the_staging_buffer(capsys, tmp_path, monkeypatch):
    """The tier's file refused (a file-size limit, a full disk): said as the arena says it, not as the
    --staging-mb option's fault (every CapacityError of the arena was put on --staging-mb, a review)."""
    from dflash2.bench import nvme
    from dflash2.errors import CapacityError

    def refused(path, size, staging_bytes):
        raise CapacityError(f"NVMe tier needs {size} bytes at {path}, preallocation failed: [Errno 27] File too large")
    monkeypatch.setattr(nvme, "NvmeArena", refused)
    line = usage_error(capsys, "nvme", "--size-mb", "4", "--block-kb", "256", "--dir", str(tmp_path))
    assert "error: NVMe tier needs " in line and "File too large" in line, line
    assert "--staging-mb" not in line, line


def test_a_file_size_limit_below_the_tier_file_names_the_bench_option(capsys, tmp_path):
    """Under a file size limit (ulimit -f) below the tier's file, the arena's refusal told the bench's user
    to lower memory.nvme_capacity_mb, the daemon's key (a review): the option is --size-mb."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, hard))
    try:
        line = usage_error(capsys, "nvme", "--size-mb", "4", "--block-kb", "256", "--dir", str(tmp_path))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert "error: --size-mb 4: NVMe tier needs " in line and "RLIMIT_FSIZE" in line, line
    assert line.endswith("raise the limit or lower --size-mb"), line
    assert "memory.nvme_capacity_mb" not in line, line


def test_a_file_size_limit_below_the_benchs_own_buffers_names_its_options(capsys, tmp_path):
    """The tier's sources and destinations are a shared-memory segment, a file in /dev/shm: under a file
    size limit below it the bench said "dram tier could not take ... File too large", naming no option
    and no limit (a review)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (6 << 20, hard))
    try:
        line = usage_error(capsys, "nvme", "--size-mb", "4", "--block-kb", "256", "--batch", "16", "--dir", str(tmp_path))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert "error: --batch 16 of --block-kb 256 (a batch of sources and one of destinations): " in line, line
    assert f"segment of {8 << 20} bytes" in line and "RLIMIT_FSIZE" in line, line
