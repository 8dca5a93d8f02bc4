"""`dflash2 bench ...` with bad options and bad traces: exit 2 with one error line naming what is
wrong (no traceback, no silently empty or wrong run); and the figures' JSON stays JSON."""

import json
import math
import sys
import time
import tracemalloc
import types
from pathlib import Path

import pytest

from dflash2 import cli
from dflash2.bench import BenchFailed
from dflash2.bench import policy as policy_bench
from dflash2.bench import table as table_bench
from dflash2.cuda import cuda_available

TRACE = str(Path(__file__).resolve().parent.parent / "traces" / "synthetic_trace.jsonl")  # shipped


def usage_error(capsys, *argv: str) -> str:
    """Run `dflash2 bench ...`; it must exit 2 printing nothing on stdout. Returns the error line."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", *argv])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    line = err.strip().splitlines()[-1]
    assert "error:" in line
    return line


def write_trace(tmp_path, lines) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return str(path)


@pytest.fixture
def trace(tmp_path):
    return write_trace(tmp_path, [{"timestamp": i * 10, "hash_ids": [0, 1 + i % 3]} for i in range(12)])


# ---- bench policy: options ----------------------------------------------------------------------

@pytest.mark.parametrize("option, value", [
    ("--hbm-blocks", "0"), ("--hbm-blocks", "-5"), ("--dram-blocks", "-1"), ("--nvme-blocks", "-1"),
    ("--chunk", "0"), ("--prefetch-window", "-1"), ("--limit", "0"),
    # past numpy's int64 and past any machine (a review: TypeError and ValueError tracebacks, exit 1)
    ("--hbm-blocks", "99999999999999999999"), ("--dram-blocks", "9223372036854775808"),
    ("--nvme-blocks", str((1 << 40) + 1)), ("--prefetch-window", "65537"),
])
def test_policy_counts_out_of_range_are_usage_errors(capsys, trace, option, value):
    argv = ["policy", "--trace", trace, "--hbm-blocks", "4", "--policies", "lru", option, value]
    assert f"argument {option}: must be" in usage_error(capsys, *argv)


@pytest.fixture
def replayed(monkeypatch) -> list[str]:
    """Names of the policies `bench policy` replays in the test (the real replay still runs)."""
    names: list[str] = []
    real = policy_bench.replay
    monkeypatch.setattr(policy_bench, "replay", lambda reqs, name, *a: names.append(name) or real(reqs, name, *a))
    return names


@pytest.mark.parametrize("policies, message", [
    ("lru,nope", "unknown 'nope'; valid: belady, heat, lfu, lru"),
    (" , ", "names no policy"),
    ("lru,heat,lru", "'lru' more than once"),
])
def test_policy_names_are_checked_before_any_replay(capsys, replayed, trace, policies, message):
    assert message in usage_error(capsys, "policy", "--trace", trace, "--hbm-blocks", "4", "--policies", policies)
    assert replayed == []


@pytest.mark.parametrize("weights, message", [
    ("rec=2", "unknown heat weights"),
    ("recency=inf", "'recency=inf' is not NAME=NUMBER"),
    ("recency=1,recency=2", "names 'recency' twice"),
])
def test_policy_weights_are_checked_before_any_replay(capsys, replayed, trace, weights, message):
    argv = ["policy", "--trace", trace, "--hbm-blocks", "4", "--policies", "lru,heat", "--weights", weights]
    assert message in usage_error(capsys, *argv)
    assert replayed == []


@pytest.mark.parametrize("options, message", [
    (["--duel-sample", "16"], "--duel-sample applies to the heat policy, which --policies does not list"),
    (["--decay-half-life-s", "5"], "--decay-half-life-s applies to the heat policy"),
    (["--decay-half-life-s", "0", "--weights", "recency=2"], "--weights, --decay-half-life-s apply to the heat"),
])
def test_heat_options_without_heat_are_refused(capsys, replayed, trace, options, message):
    """(--duel-sample and --decay-half-life-s were ignored without a word, a review; --weights was refused.)"""
    assert message in usage_error(capsys, "policy", "--trace", trace, "--hbm-blocks", "4", "--policies", "lru,lfu",
                                  *options)
    assert replayed == []


# ---- bench policy: traces -----------------------------------------------------------------------

def ok(i, ids):
    return {"timestamp": i, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids}


@pytest.mark.parametrize("lines, message", [
    ([], "holds no requests"),
    (["", "  "], "holds no requests"),
    ([ok(0, [0]), "not json"], "line 2: not JSON"),
    (["[1, 2]"], "line 1: not a JSON object"),
    ([{"timestamp": 0}], "line 1: the request has no 'hash_ids'"),
    ([{"hash_ids": [1]}], "line 1: the request has no 'timestamp'"),
    ([{"timestamp": "x", "hash_ids": [1]}], "line 1: timestamp 'x' is not a number"),
    ([{"timestamp": 0, "hash_ids": 5}], "line 1: hash_ids 5 is not a list"),
    ([ok(0, ["a"])], "line 1: hash id 'a' is not an integer"),
    ([ok(0, [1.7])], "line 1: hash id 1.7 is not an integer"),  # was truncated to 1 silently
    ([ok(0, [-1])], "line 1: hash id -1 is not an integer"),  # was content key 0
    ([ok(0, [True])], "line 1: hash id True is not an integer"),
    ([ok(0, [2 ** 64 - 1])], "is not an integer in 0..2**64-2"),
    ([ok(10, [1]), ok(5, [2])], "line 2: timestamp 5 is earlier than the line before's (10)"),
    # (printed to 6 digits, a real trace's times said "1.02203e+06 is earlier than ... (1.02203e+06)", a review)
    ([ok(1022026, [1]), ok(1022025, [2])], "line 2: timestamp 1022025 is earlier than the line before's (1022026)"),
    ([ok(0.1, [1]), ok(0.07, [2])], "line 2: timestamp 0.07 is earlier than the line before's (0.1)"),
    # (to 15 digits, 16-digit times a millisecond apart were both said "1.73358000012346e+15", a review)
    ([ok(1733580000123456, [1]), ok(1733580000123455, [2])],
     "line 2: timestamp 1733580000123455 is earlier than the line before's (1733580000123456)"),
    ([ok(1733580000123.457, [1]), ok(1733580000123.456, [2])],
     "line 2: timestamp 1733580000123.456 is earlier than the line before's (1733580000123.457)"),
    ([ok(0, [1]), ok(1, [1, 2, 1])], "line 2: hash ids [1] occur twice in one request"),
    (['{"timestamp": NaN, "hash_ids": [1]}'], "line 1: timestamp nan is not a number"),
    ([{"timestamp": 10 ** 400, "hash_ids": [1]}], "line 1: timestamp 1000"),  # (an OverflowError's traceback)
    (['{"timestamp": 0, "hash_ids": [1, 2], "hash_ids": []}'], "line 1: 'hash_ids' is named twice"),  # (lost the blocks)
])
def test_bad_traces_are_named_with_their_line(capsys, tmp_path, lines, message):
    path = write_trace(tmp_path, lines)
    line = usage_error(capsys, "policy", "--trace", path, "--hbm-blocks", "4", "--policies", "lru")
    assert message in line and path in line


@pytest.mark.parametrize("name", ["missing.jsonl", ".", "binary.jsonl"])
def test_unreadable_trace_files_are_usage_errors(capsys, tmp_path, name):
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00garbage\n")
    line = usage_error(capsys, "policy", "--trace", str(tmp_path / name), "--hbm-blocks", "4", "--policies", "lru")
    assert "--trace" in line


def test_the_shipped_mooncake_trace_passes_the_checks():
    requests = policy_bench.load_trace(TRACE)
    assert len(requests) == 3993 and sum(len(r.keys) for r in requests) == 121877


# ---- bench nvme ---------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--block-kb", "0"], "argument --block-kb: must be a positive integer"),
    (["--batch", "0"], "argument --batch: must be a positive integer"),
    (["--staging-mb", "0"], "argument --staging-mb: must be a positive integer"),
    (["--repeat", "0"], "argument --repeat: must be a positive integer"),  # ran one round, said 0
    (["--raw-buffer-mb", "-1"], "argument --raw-buffer-mb: must be an integer >= 0"),
    (["--size-mb", "-1"], "argument --size-mb: must be a positive integer"),
])
def test_nvme_bad_counts(capsys, tmp_path, argv, message):
    assert message in usage_error(capsys, "nvme", "--size-mb", "4", "--block-kb", "256", "--dir", str(tmp_path), *argv)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["missing", "a_file"])
def test_nvme_dir_that_cannot_hold_the_files(capsys, tmp_path, where):
    (tmp_path / "a_file").write_text("x")
    line = usage_error(capsys, "nvme", "--size-mb", "4", "--block-kb", "256", "--dir", str(tmp_path / where))
    assert f"--dir {tmp_path / where}: cannot make a scratch folder there" in line


def test_nvme_dir_too_small_names_the_unit_it_needs(capsys, tmp_path, monkeypatch):
    """The room the bench needs is in MiB, as the room free (it printed a bare number)."""
    import collections
    import shutil

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda where: usage(1 << 30, 0, 3 << 20))
    line = usage_error(capsys, "nvme", "--size-mb", "4", "--block-kb", "256", "--dir", str(tmp_path))
    assert f"--dir {tmp_path}: 3 MiB free, the bench needs 8 MiB (two files of --size-mb)" in line
    assert list(tmp_path.iterdir()) == []


# ---- GPU benches on a machine without a GPU -----------------------------------------------------

no_gpu = pytest.mark.skipif(cuda_available(), reason="a GPU is visible: the benches would run")


@no_gpu
def test_transfer_without_a_gpu_says_so(capsys):
    assert "bench transfer runs on a GPU" in usage_error(capsys, "transfer", "--sizes-kib", "16")


@pytest.mark.parametrize("argv, message", [
    (["--sizes-kib", "16,x"], "--sizes-kib: 'x' is not a number"),
    (["--sizes-kib", "0"], "--sizes-kib: 0 is not a positive size"),
    (["--sizes-kib", "16+x"], "--sizes-kib: 'x' is not a number"),
    (["--sizes-kib", "16,,64"], "--sizes-kib: '' is not a number"),
    (["--sizes-kib", "64,16,64"], "--sizes-kib: 64 is given twice"),
    (["--sizes-kib", "16+16+64,64+16+16"], "--sizes-kib: 64+16+16 is given twice"),
    (["--sizes-kib", "16+64,64+16"], "--sizes-kib: 64+16 is given twice"),
    (["--sizes-kib", "16,16+16"], "--sizes-kib: 16+16 mixes one size only: write 16"),
    (["--sizes-kib", "16+256", "--run-blocks", "2"], "--run-blocks > 1 needs one block size per batch"),
    (["--repeat", "0"], "argument --repeat: must be a positive integer"),
    (["--inflight", "0"], "argument --inflight: must be a positive integer"),
    (["--device", "-1"], "argument --device: must be an integer >= 0"),
])
def test_transfer_options_are_checked_before_the_gpu(capsys, argv, message):
    assert message in usage_error(capsys, "transfer", *argv)


def test_a_transfer_mix_may_give_a_size_twice_for_its_proportions():
    """16+16+64: two thirds of the batch's blocks of 16 KiB (refused as "16 is given twice" once
    --sizes-kib refused a size given twice, a review)."""
    from dflash2.bench.transfer import size_mixes
    assert size_mixes("16+16+64,64") == [(16 * 1024, 16 * 1024, 64 * 1024), (64 * 1024,)]


@no_gpu
def test_swap_on_cuda_without_a_gpu_says_so(capsys):
    line = usage_error(capsys, "swap", "--device", "cuda", "--sizes-kib", "64", "--mb", "8", "--repeat", "1")
    assert "bench swap runs on a GPU" in line


def test_swap_gpu_index_must_not_be_negative(capsys):
    line = usage_error(capsys, "swap", "--gpu", "-1", "--sizes-kib", "64", "--mb", "8", "--repeat", "1")
    assert "argument --gpu: must be an integer >= 0" in line


@pytest.mark.parametrize("mb, message", [
    (4 << 20, "hbm tier needs"),  # 4 TiB a promotion: refused by the arena's room check, nothing mapped
    (10 << 20, "memory.hbm_capacity_mb"),  # beyond what the config allows a tier
])
def test_swap_larger_than_the_machine_is_a_usage_error(capsys, mb, message):
    line = usage_error(capsys, "swap", "--device", "host", "--sizes-kib", "2048", "--mb", str(mb), "--repeat", "1")
    assert f"--mb {mb} --repeat 1: " in line and message in line


# ---- bench control ------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--iterations", "0"], "argument --iterations: must be a positive integer"),
    (["--batch-iterations", "0"], "argument --batch-iterations: must be a positive integer"),
    (["--seconds", "0"], "argument --seconds: must be a positive number"),
    (["--seconds", "nan"], "argument --seconds: must be a positive number"),
    (["--processes", "0"], "argument --processes: must be a positive integer"),
])
def test_control_bad_counts(capsys, argv, message):
    assert message in usage_error(capsys, "control", *argv)


def test_control_with_one_process_measures_one_client_once(capsys, monkeypatch):
    from dflash2.bench import control

    runs = []
    real = control._throughput
    monkeypatch.setattr(control, "_throughput", lambda ep, keys, n, s: runs.append(n) or real(ep, keys, n, s))
    argv = ["bench", "control", "--iterations", "20", "--batch-iterations", "5", "--seconds", "0.2",
            "--processes", "1", "--json"]
    assert cli.main(argv) == 0
    assert runs == [1]
    assert list(json.loads(capsys.readouterr().out)["ops_per_s"]) == ["1"]


def test_control_samples_its_floor_between_the_ops_rounds(capsys, monkeypatch):
    """The echo floor is sampled once before each round of the ops, not all before them: on a shared
    machine a floor measured apart drifted from the ops (and kept both processes awake between its
    round trips, where the ops' calls find the daemon idle). Back-to-back figures come apart
    (hot_*), alternating in blocks."""
    from dflash2.bench import control
    from dflash2.client import Client

    calls = []
    once, lookup = control.Echo.once, Client.lookup
    monkeypatch.setattr(control.Echo, "once", lambda self: calls.append("echo") or once(self))
    monkeypatch.setattr(Client, "lookup", lambda self, keys, *a, **kw: calls.append(len(keys)) or lookup(self, keys, *a, **kw))
    argv = ["bench", "control", "--iterations", "200", "--batch-iterations", "2", "--seconds", "0.2",
            "--processes", "1", "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    rounds = calls[200:200 + 2 * 200 + 1]  # after the echo's warm-up: one-key lookup (its vid), then the rounds
    assert rounds[0] == 1 and rounds[1:] == ["echo", 1] * 200
    hot = calls[201 + 400:201 + 400 + 400]
    assert hot == ["echo"] * 100 + [1] * 100 + ["echo"] * 100 + [1] * 100
    for key in ("floor_p50_us", "hot_floor_p50_us", "hot_lookup_p50_us", "ratio_hot", "ratio_single_vs_floor"):
        assert out[key] > 0, key


def test_control_judges_its_targets_on_unrounded_figures():
    """The ratio was rounded to two decimals first: 1.504x the floor read 1.5, and the target met."""
    from dflash2.bench.control import targets_met

    assert targets_met(150.4, 100.0, 400.0) == {"single_le_1.5x_floor": False, "batch1000_le_4x_single": True}
    assert targets_met(150.0, 100.0, 600.1) == {"single_le_1.5x_floor": True, "batch1000_le_4x_single": False}


# ---- bench drain --------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--dram-mb", "0"], "argument --dram-mb: must be a positive integer"),
    (["--gap-ms", "0"], "argument --gap-ms: must be a positive number"),
    (["--seconds", "inf"], "argument --seconds: must be a positive number"),
    (["--block-kib", "48"], "argument --block-kib: must be a power of two from 16 to 4096, not 48"),
    (["--block-kib", "8192"], "argument --block-kib: must be a power of two from 16 to 4096, not 8192"),
    (["--nvme-mb", "0"], "argument --nvme-mb: must be a positive integer"),
    # (whole blocks could not fill it past the watermark: an IndexError, or no drain measured)
    (["--dram-mb", "4", "--block-kib", "4096"], "--dram-mb 4 holds too few blocks of 4096 KiB to fill it past"),
    (["--dram-mb", "8", "--block-kib", "1024"], "--dram-mb 8 holds too few blocks of 1024 KiB to fill it past"),
])
def test_drain_bad_options(capsys, argv, message):
    assert message in usage_error(capsys, "drain", *argv)


def test_drain_times_lookups_back_to_back_and_at_random_times_while_dram_drains(capsys):
    """Two phases, each filling DRAM over its high watermark and timing lookups until it is down to
    its low one: a line each, with the drain seen through (a drain that never ended would say
    drained false and the phase would last its --seconds)."""
    argv = ["bench", "drain", "--dram-mb", "64", "--seconds", "60", "--json"]
    assert cli.main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["phase"] for r in rows] == ["back_to_back", "random_times", "allocate_back_to_back"]
    for r in rows:
        assert r["drained"] and r["dram_end"] <= 0.51 and r["n"] > 0, r
        assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"] <= r["max_ms"], r
        # DRAM of 64 MB from 0.97 down to 0.5: about 30 MB went to NVMe, in batches
        assert 25 <= r["moved_mb"] <= 35 and r["batches"] > 0 and r["step_late_max_ms"] >= 0, r
        assert (r["dram_mb"], r["nvme_mb"], r["block_kib"]) == (64, 128, 64), r


def test_drain_of_a_small_tier_drains_and_ends_when_it_has(capsys):
    """A tier of 9 MB: the fill was rounded down to whole MB (8 of 9, 0.89, under the high watermark)
    and no drain began. And a phase ended only at a look at DRAM's fill, once every 200 calls: at 50
    ms between lookups no phase could end before 10 s, whatever the drain took."""
    argv = ["bench", "drain", "--dram-mb", "9", "--gap-ms", "50", "--seconds", "30", "--json"]
    assert cli.main(argv) == 0
    rows = {r["phase"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    for r in rows.values():
        assert r["drained"] and r["moved_mb"] > 0 and r["batches"] > 0, r
    assert rows["random_times"]["n"] < 200, rows["random_times"]  # (calls counted: no timed bound in a test)


def test_drain_at_random_times_ends_at_its_seconds_whatever_the_gap(capsys):
    """A lookup due past the phase's --seconds ends it (it slept until then: 10.7 s of a 1 s phase
    at a 10 s gap, and for ever at a gap of 1e9 ms, a review's runs)."""
    argv = ["bench", "drain", "--dram-mb", "16", "--seconds", "1", "--gap-ms", "1e9", "--json"]
    assert cli.main(argv) == 0
    rows = {r["phase"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    row = rows["random_times"]
    assert row["n"] == 0 and row["p50_ms"] is None and row["drain_s"] <= 1.0, row


class _DrainingDaemon:
    """A client of a daemon whose DRAM is drained `drain_s` after the phase starts, on a fake clock
    (the drain bench's `time`): no timing in a test."""

    def __init__(self, drain_s: float):
        self.now, self.drain_s, self.lookups = 0.0, drain_s, 0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.now += seconds

    def stats(self) -> dict:
        used = 10 if self.now >= self.drain_s else 95
        return {"tiers": {"dram": {"used_bytes": used, "capacity_bytes": 100}},
                "moves": {}, "daemon": {"background": {"late_max_s": None}}}

    def lookup(self, keys):
        self.lookups += 1
        self.now += 0.001


def test_drain_at_random_times_says_how_long_the_drain_took_whatever_the_gap(monkeypatch):
    """At --gap-ms 3000 the phase slept until its first lookup was due before it looked at DRAM
    again: a drain of 0.2 s read as that due time (3.22 s), against 0.2 s back to back. It looks at
    the fill every 20 ms while it waits, and counts no lookup due after the drain."""
    from dflash2.bench import drain

    args = types.SimpleNamespace(seconds=8.0, gap_ms=3000.0)
    for phase in ("random_times", "back_to_back"):
        daemon = _DrainingDaemon(drain_s=0.2)
        monkeypatch.setattr(drain, "time", daemon)
        row = drain._lookups(daemon, [1], phase, args)
        assert row["drained"] and 0.2 <= row["drain_s"] <= 0.2 + drain.CHECK_EVERY_S, (phase, row)
        if phase == "random_times":
            assert row["n"] == daemon.lookups == 0 and row["p50_ms"] is None, row


def test_a_bench_whose_daemon_cannot_start_says_why_in_one_line(capsys):
    """Options that make a daemon that cannot start (tiers past the config's bounds or the machine's
    memory): the daemon's own error line, exit 2 (a RuntimeError's traceback before, exit 1)."""
    line = usage_error(capsys, "churn", "--hbm-mb", "100000000")
    assert "the bench's daemon did not start (exit 2): dflash2d: error: memory.hbm_capacity_mb" in line


# ---- bench churn --------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--clients", "0"], "argument --clients: must be a positive integer"),
    (["--seconds", "0"], "argument --seconds: must be a positive number"),
    (["--warmup", "-1"], "argument --warmup: must be an integer >= 0"),
    (["--nvme-mb", "-5"], "argument --nvme-mb: must be an integer >= 0"),
    (["--policy", "belady"], "--policy: 'belady' is not a policy the daemon runs; valid: heat, lfu, lru"),
    (["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
])
def test_churn_bad_options(capsys, argv, message):
    assert message in usage_error(capsys, "churn", *argv)


def test_churn_measures_the_daemons_cpu_per_request_while_two_clients_churn_a_full_cache(capsys):
    """Tiers of a few hundred blocks: the warm-up fills them, and in the window the calls promote,
    demote and evict; every block read is checked, and the daemon's CPU is counted over the window."""
    argv = ["bench", "churn", "--clients", "2", "--warmup", "3", "--seconds", "3", "--docs", "400",
            "--hbm-mb", "1", "--dram-mb", "2", "--nvme-mb", "4", "--json"]
    assert cli.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["requests"] > 0 and r["calls"] >= 3 * r["requests"], r
    assert r["wrong_blocks"] == 0 and r["blocks_checked"] > 0 and 0 < r["hit_ratio"] < 1, r
    assert r["moves"].get("hbm->dram", 0) > 0 and r["moves"].get("dram->nvme", 0) > 0, r  # the cache churned
    assert r["daemon_cpu_ms_per_request"] > 0 and 0 < r["daemon_cpu_share"] <= 1.5, r
    assert r["daemon_cpu_ms_per_call"] < r["daemon_cpu_ms_per_request"], r
    # At the default `info`: a line per direction every 10 s at most, not one a batch (swaplog.py;
    # one a batch wrote 33-41 KB a second in the default churn).
    assert r["log_level"] == "info" and 0 <= r["log_bytes_per_s"] < 1500, r
    assert set(r["p50_ms"]) == {"lookup", "acquire", "allocate", "commit", "free", "release"}
    assert all(0 < r["p50_ms"][op] <= r["p99_ms"][op] for op in r["p50_ms"]), r
    assert r["duel_served"] >= 0 and r["duel_dropped"] >= 0, r
    # (policy.duel_sample 8; finer where 1/8 of this 1 MB HBM holds too few blocks, coarser once the loop fell behind)
    assert r["duel_sample"] >= 2 and r["duel_state"] in ("warming up", "judging", "off"), r
    assert 0 <= r["duel_turned_over"] <= 1, r
    assert r["duel_state"] == "off" or (r["duel_turned_over"] == 1) == (r["duel_state"] == "judging"), r


# ---- bench calls --------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--blocks", "0"], "argument --blocks: must be a positive integer"),
    (["--blocks", "65537"], "--blocks: 65537 is more than a call may name (65536)"),
    (["--block-kib", "12"], "argument --block-kib: must be a power of two from 16 to 4096, not 12"),
    (["--rounds", "0"], "argument --rounds: must be a positive integer"),
    (["--hbm-chains", "0"], "argument --hbm-chains: must be a positive integer"),
    (["--policy", "belady"], "--policy: 'belady' is not a policy the daemon runs; valid: heat, lfu, lru"),
    (["--gpu", "-1"], "argument --gpu: must be an integer >= 0"),
    # (a chain smaller than HBM's slack: every acquire found its chain in HBM, promoted_per_acquire 0)
    (["--blocks", "4", "--block-kib", "16"], "--blocks 4 of 16 KiB: HBM, sized in whole MB"),
])
def test_calls_bad_options(capsys, argv, message):
    assert message in usage_error(capsys, "calls", "--device", "host", *argv)


@pytest.mark.skipif(cuda_available(), reason="a GPU is visible: --device cuda would run")
def test_calls_on_cuda_without_a_gpu_says_so(capsys):
    assert "bench calls --device cuda runs on a GPU" in usage_error(capsys, "calls", "--device", "cuda")


def test_calls_times_each_call_of_a_request_whose_prefix_lies_in_dram(capsys):
    """Every acquire promotes the whole chain into a full HBM; each call's round trip and the
    daemon's own time of it are figures, the daemon's no longer than the round trip's median."""
    argv = ["bench", "calls", "--device", "host", "--blocks", "96", "--block-kib", "16", "--rounds", "5",
            "--hbm-chains", "2", "--dram-chains", "3", "--json"]
    assert cli.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["device"], r["blocks"], r["block_kib"], r["rounds"]) == ("host", 96, 16, 5), r
    assert r["promoted_per_acquire"] == 96, r  # the whole prefix came up from DRAM
    ops = {"lookup", "acquire", "release", "allocate", "commit", "free"}
    assert set(r["p50_ms"]) == set(r["p90_ms"]) == set(r["daemon_ms"]) == ops, r
    assert all(0 < r["p50_ms"][op] <= r["p90_ms"][op] for op in ops), r
    assert all(0 < r["daemon_ms"][op] <= r["p90_ms"][op] for op in ops), r


# ---- the command's JSON -------------------------------------------------------------------------

def test_a_figure_that_is_not_a_number_is_never_printed_as_json(monkeypatch, capsys):
    module = types.ModuleType("dflash2.bench.table")
    module.add_arguments = lambda parser: None
    module.run = lambda args: {"ratio": math.nan}
    monkeypatch.setitem(sys.modules, "dflash2.bench.table", module)
    with pytest.raises(ValueError, match="not JSON compliant"):
        cli.main(["bench", "table", "--json"])
    assert "NaN" not in capsys.readouterr().out


def test_a_reader_that_went_away_ends_the_command_quietly(tmp_path):
    """`dflash2 bench ... --json | head -1`: the pipe's reader is gone when the figures are printed."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will read: the first write fails with EPIPE
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "hash_ids": [1, 2]}\n{"timestamp": 1, "hash_ids": [1, 2, 3]}\n')
    try:
        proc = subprocess.run([sys.executable, "-m", "dflash2.cli", "bench", "policy", "--trace", str(trace),
                               "--hbm-blocks", "4", "--policies", "lru", "--json"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 141, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr



@pytest.mark.parametrize("argv", [["bench", "policy", "--trace", "TRACE", "--hbm-blocks", "4", "--policies", "lru",
                                   "--json"],
                                  ["status", "--endpoint", "ipc://TMP/none.sock", "--watch", "--count", "1"]])
def test_output_that_cannot_be_written_is_one_error_line(tmp_path, argv):
    """`dflash2 ... > out.json` on a full disk (/dev/full): one line naming it, exit 1, where `status`,
    `history` and the benches ended in a traceback (a review)."""
    import subprocess
    import sys

    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "hash_ids": [1, 2]}\n{"timestamp": 1, "hash_ids": [1, 2, 3]}\n')
    argv = [a.replace("TRACE", str(trace)).replace("TMP", str(tmp_path)) for a in argv]
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "dflash2.cli", *argv], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("dflash2: error: cannot write the output to stdout: No space "
                                                    "left on device")


N = 2000


def _policy_kept_per_block(n: int) -> float:
    """The same traced build as the bench's, with the policy's mappings counted before the fill too."""
    mgr, lid, client = table_bench._empty(n, "heat")
    tracemalloc.start()
    try:
        def mapped():
            return mgr.table.cols.mapped_bytes + mgr.table.keys.mapped_bytes + mgr.policy.mapped_bytes()
        before = tracemalloc.get_traced_memory()[0] + mapped()
        table_bench._fill(mgr, lid, client, n)
        table = tracemalloc.get_traced_memory()[0] + mapped() - before
        mgr.policy.rescore(mgr.table, mgr.table.clock())
        after = tracemalloc.get_traced_memory()[0] + mapped()
        kept = after - before - table
    finally:
        tracemalloc.stop()
    mgr.close()
    return kept / n


def test_policy_bytes_per_block_leaves_out_what_the_policy_mapped_when_made():
    """Heat's sketch (1 MiB, mapped when the policy is made, in policy_fixed_bytes) was counted per
    block too: 625.6 bytes a block at 2,000 blocks where 100.4 is right (a review)."""
    mgr, _, _ = table_bench._empty(N, "heat")
    at_creation = mgr.policy.mapped_bytes()
    mgr.close()
    assert at_creation > 0  # heat's sketch, mapped when the policy is made ...
    assert table_bench._policy_fixed_bytes("heat") >= at_creation  # ... and counted in policy_fixed_bytes
    _, per_block = table_bench._traced_bytes(N, "heat")
    truth = _policy_kept_per_block(N)
    # counted again per block: 1 MiB / 2000 blocks = 524 bytes a block too many
    assert per_block <= truth * 1.1 + 5, (per_block, truth, at_creation / N)


def test_the_benches_daemon_start_up_timeout_holds_for_a_child_that_prints_nothing(tmp_path, monkeypatch):
    """A readline waited as long as the child ran, whatever the deadline (a review: 8 s, timeout 1 s)."""
    from dflash2.bench import control

    monkeypatch.setattr(control, "STARTUP_TIMEOUT_S", 1.0)
    t = time.monotonic()
    # (a named failure, one line: a RuntimeError's traceback before, a review)
    with pytest.raises(BenchFailed, match=r"the bench's helper process \(pid \d+\) was not ready within 1 s \(it did "
                                          "not print 'DFlash2: enabled'\\); stopped"):
        control._start(["-c", "import time; time.sleep(8)"], "DFlash2: enabled", tmp_path / "d.log")
    took = time.monotonic() - t
    assert took < 4.0, f"_start took {took:.1f}s with a 1 s start-up timeout"


def test_the_start_up_timeout_grows_with_the_daemons_tiers(tmp_path, monkeypatch):
    """A daemon takes its tiers' memory as it starts: 22 GB of DRAM (`bench calls --rounds 300`) took
    longer than the 30 s the wait had (a review)."""
    from dflash2.bench import control

    monkeypatch.setattr(control, "STARTUP_TIMEOUT_S", 1.0)
    monkeypatch.setattr(control, "STARTUP_S_PER_GB", 1.0)
    with pytest.raises(BenchFailed, match="was not ready within 3 s"):
        control._start(["-c", "import time; time.sleep(8)"], "DFlash2: enabled", tmp_path / "d.log", tiers_mb=2048)
