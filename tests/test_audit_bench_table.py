"""`dflash2 bench table` with bad options, and its figures: what a policy takes when it is made,
and the timed choice of 1% as victims, which must take all it asks for (a review). Split from
test_audit_bench.py."""

import json

import pytest
from test_audit_bench import usage_error

from dflash2 import cli

# ---- bench table --------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--blocks", "0"], "argument --blocks: must be a positive integer"),
    # (numpy's "Maximum allowed dimension exceeded": a traceback, exit 1)
    (["--blocks", "1" + "0" * 30], "argument --blocks: must be at most 1099511627776 (2^40) blocks"),
    # (past the machine's memory: numpy mapped the columns and ran on, over 120 s without a word, a review)
    (["--blocks", str(10 ** 11)], f"--blocks {10 ** 11}: the table does not fit in this machine's memory (at least "
                                  "100 bytes a block"),
    (["--blocks", "1000", "--batch", "0"], "argument --batch: must be a positive integer"),
    (["--blocks", "1000", "--repeat", "0"], "argument --repeat: must be a positive integer"),  # was NaN
    (["--blocks", "1000", "--policy", "nope"], "--policy: unknown 'nope'; valid: heat, lfu, lru"),
    (["--blocks", "1000", "--batch", "6000"], "--batch 6000 is more than --blocks 1000"),  # (a TypeError)
])
def test_table_bad_options(capsys, argv, message):
    assert message in usage_error(capsys, "table", *argv)


def test_table_counts_what_a_policy_takes_when_it_is_made(capsys):
    """Heat's hit-density ghosts (2^20 entries of 17 bytes) are made with the policy, whatever the
    table's size: bytes_per_block and policy_bytes_per_block, traced from the empty table on, left
    them out (a daemon's memory grew more per block than the figures said)."""
    from dflash2 import cli

    figures = {}
    for policy in ("heat", "lru"):
        assert cli.main(["bench", "table", "--blocks", "2000", "--policy", policy, "--repeat", "1", "--json"]) == 0
        out = json.loads(capsys.readouterr().out.splitlines()[-1])
        figures[policy] = out["policy_fixed_bytes"]
        # The calls that doubled the table (1,024 -> 2,048 rows) and its key index (2,048 -> 4,096 slots).
        assert out["table_doubled_to"] == 2048 and out["key_index_doubled_to"] == 4096, out
        assert out["table_doubling_ms"] > 0 and out["key_index_doubling_ms"] > 0, out
    assert figures["heat"] >= 17 << 20 and figures["lru"] < 1 << 20, figures


@pytest.mark.parametrize("policy", ["heat", "lru", "lfu"])
def test_table_times_the_choice_of_one_percent(capsys, monkeypatch, policy):
    """rescore_ms and select_ms are said to time the choice of 1% of the blocks as victims; with
    random ages per block a child was as often hotter than its parent, and the choice, which lets
    only leaves and wholly cold subtrees go, took 6 of the 10,000 asked at a million blocks (a
    review): a round of make_room, not 1%."""
    from dflash2.placement import Placement

    chosen = []  # every choice the bench makes, counted here as well as in its figures
    select = Placement.select
    def counted(self, *args, **kwargs):
        victims = select(self, *args, **kwargs)
        chosen.append(len(victims))
        return victims
    monkeypatch.setattr(Placement, "select", counted)
    assert cli.main(["bench", "table", "--blocks", "20000", "--policy", policy, "--repeat", "1", "--json"]) == 0
    assert len(chosen) == 3 and min(chosen) >= 200, chosen  # rescore_ms's, select_ms's, chain_select_ms's
    captured = capsys.readouterr()
    out = json.loads(captured.out.splitlines()[-1])
    assert out["select_asked"] == 200 and out["select_victims"] >= 200, out
    assert out["select_short"] is False and "victims asked for" not in captured.err, (out, captured.err)
    assert out["chain_select_victims"] >= 200, out


def test_table_says_when_the_choice_took_fewer_than_asked(capsys, monkeypatch):
    """Should the choice take fewer victims than the 1% asked for again, the figures say so, and a
    line on stderr: rescore_ms and select_ms then time less than they claim (a review)."""
    from dflash2.placement import Placement

    select = Placement.select
    monkeypatch.setattr(Placement, "select", lambda self, *a, **k: select(self, *a, **k)[:5])
    assert cli.main(["bench", "table", "--blocks", "2000", "--repeat", "1", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.splitlines()[-1])
    assert out["select_victims"] == 5 and out["select_asked"] == 20 and out["select_short"] is True, out
    assert "the timed choice took 5 of the 20 victims asked for" in captured.err


def test_table_says_when_the_chain_choice_took_fewer_than_asked(capsys, monkeypatch):
    """select_short looked at the first choice only: one over whole chains (chain_select_ms) that took
    fewer than asked went unsaid (a review). Only the chains' choice is cut short here: the reads that
    make the chains the coldest come at times from 2.0 on."""
    from dflash2.placement import Placement
    from dflash2.table import BlockTable

    select, touch, chains = Placement.select, BlockTable.touch, []

    def touched(self, rows, *a, now=None, **k):
        chains.append(now is not None and now >= 2.0)
        return touch(self, rows, *a, now=now, **k)
    monkeypatch.setattr(BlockTable, "touch", touched)
    monkeypatch.setattr(Placement, "select", lambda self, *a, **k: select(self, *a, **k)[:5 if any(chains) else None])
    assert cli.main(["bench", "table", "--blocks", "2000", "--repeat", "1", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.splitlines()[-1])
    assert out["select_victims"] == 20 and out["chain_select_victims"] == 5 and out["select_short"] is True, out
    assert "5 of the 20 victims asked for (blocks held back by hotter descendants): chain_select_ms" in captured.err


def _count_passes_per_timing(monkeypatch, passes: list) -> list:
    """(name of each function the bench times, scoring passes it ran), as the bench times them."""
    from dflash2.bench import table as table_bench

    timed = []
    median = table_bench._median_ms

    def counted(fn, repeat):
        before = len(passes)
        out = median(fn, repeat)
        timed.append((fn.__name__, len(passes) - before))
        return out

    monkeypatch.setattr(table_bench, "_median_ms", counted)
    return timed


def test_bench_tables_timed_choices_take_no_scoring_pass_of_their_own(monkeypatch):
    """select_ms and chain_select_ms are the choice alone from the policy's current scores, and
    rescore_ms one pass plus the choice; but heat's scores expire rescore_interval_s (0.1 s) of wall
    clock after its last pass, and the timed choices ran a full pass of their own once a repeat took
    that long: at --blocks 4000000 four of select_ms's five and two of chain_select_ms's (a review)."""
    import argparse
    import itertools

    from dflash2.bench import table as table_bench
    from dflash2.policy.heat import HeatPolicy

    passes = []
    rescore = HeatPolicy.rescore
    monkeypatch.setattr(HeatPolicy, "rescore", lambda self, table, now: passes.append(1) or rescore(self, table, now))
    empty = table_bench._empty

    def slow(n, policy):  # each reading of the table's clock a second after the last: every pass out of date
        made = empty(n, policy)
        ticks = itertools.count()
        made[0].table.clock = lambda: 1000.0 + next(ticks)
        return made

    monkeypatch.setattr(table_bench, "_empty", slow)
    timed = _count_passes_per_timing(monkeypatch, passes)
    table_bench.run(argparse.Namespace(blocks=4096, policy="heat", batch=32, repeat=3))
    assert timed == [("full_pass", 3), ("choose", 0), ("choose", 0), ("<lambda>", 0)]


def test_bench_tables_rescore_ms_times_one_scoring_pass_with_a_policy_that_caches_no_scores(monkeypatch):
    """rescore_ms is one full scoring pass plus the choice of 1%; with LFU, whose rescore is its
    scores_all and caches nothing, the bench's pass was thrown away and the choice ran its own: two
    passes timed (at a million blocks 31.2 ms against select_ms's 19.1, a review)."""
    import argparse

    from dflash2.bench import table as table_bench
    from dflash2.policy import lfu

    passes = []
    score = lfu.lfu_score
    monkeypatch.setattr(lfu, "lfu_score", lambda *a: passes.append(1) or score(*a))
    timed = _count_passes_per_timing(monkeypatch, passes)
    table_bench.run(argparse.Namespace(blocks=4096, policy="lfu", batch=32, repeat=3))
    assert timed == [("full_pass", 3), ("choose", 3), ("choose", 3), ("<lambda>", 0)]
