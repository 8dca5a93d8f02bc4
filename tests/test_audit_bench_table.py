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
