"""History's sampling grid and clock: one sample an interval whatever the asking loop's rhythm, none
taken twice, and a wall clock set back. Moved from test_history_units.py (past 600 lines)."""

from __future__ import annotations

import json

from dflash2 import cli
from dflash2.history import History, read_file, sample_of
from observe_helpers import service  # noqa: F401  (a fixture)


def test_a_loop_asking_once_an_interval_gets_a_sample_each_time_though_stats_take_time(service):
    """The daemon's loop asks every SAMPLE_INTERVAL_S (1 s, a little late each time); the stats take a
    few ms to build. The next sample was counted from after them, and every other one was not yet
    due: one sample in 2 s (a review). A question a little early still gets its sample."""
    from dflash2.daemon.observe import Observers

    wall = [1000.0]
    h = History(clock=lambda: wall[0])
    real = service.stats

    def slow_stats():
        wall[0] += 0.004
        return real()
    service.stats = slow_stats
    obs = Observers(service, None, h)
    for k in range(1, 21):
        wall[0] = 1000.0 + k * 1.0005 - (0.02 if k % 3 == 0 else 0.0)
        obs.sample()
    assert len(h.samples) == 20, [t for t, _ in h.samples]


def test_a_loop_asking_every_step_of_100_ms_gets_one_sample_a_second(monkeypatch):
    """The daemon asks after each background step (100 ms by default): a sample due a tenth early
    and counted from the question took one every 0.9 s (11% more, 2.7 h kept where 3 are said, a
    review). On a grid: one a second, whatever the asking."""
    from dflash2 import history as hmod

    monkeypatch.setattr(hmod, "sample_of", lambda stats, now: {"t": now})
    t = [0.0]
    h = History(clock=lambda: t[0], max_samples=10_000)
    for _ in range(36_000):  # an hour of steps, each 0.3 ms late
        if h.due():
            h.record({})
        t[0] += 0.1003
    assert 3600 <= len(h.samples) <= 3615, len(h.samples)


def test_a_sample_taken_a_little_early_is_not_taken_again_before_its_grid_point(monkeypatch):
    """A sample taken within the tenth before its grid point moved the next one a step on; a question
    before that grid point (the next background step, or the loop's sample timer) was then taken for
    a wall clock set back, and a second sample came milliseconds after the first (7 of 756 samples of
    a host daemon's history.jsonl came 1-84 ms after the one before, a review). A clock set back
    still gets its sample at once."""
    from dflash2 import history as hmod

    monkeypatch.setattr(hmod, "sample_of", lambda stats, now: {"t": now})
    t = [0.0]
    h = History(clock=lambda: t[0], max_samples=10_000)

    def ask(now):
        t[0] = now
        if h.due():
            h.record({})
            return True
        return False
    assert [now for now in (0.0, 0.95, 0.97, 0.99, 1.0, 1.5, 1.95) if ask(now)] == [0.0, 0.95, 1.95]
    assert ask(1.2)  # the clock set back past the last sample: sampled at once
    # The daemon's two askers for an hour: a step every 100 ms (a little late) and the 1 s timer.
    h.samples.clear()
    asks = sorted([1000 + k * 0.1003 + (k * 7919 % 20) / 1000 for k in range(36_000)]
                  + [1000.05 + k * 1.0004 for k in range(3600)])
    taken = [now for now in asks if ask(now)]
    gaps = [b - a for a, b in zip(taken, taken[1:])]
    assert min(gaps) > 0.5, sum(g <= 0.5 for g in gaps)
    assert 3600 <= len(taken) <= 3615, len(taken)


def test_since_counts_no_time_for_a_clock_set_back(service, tmp_path):
    """Ten minutes of samples, the wall clock set back an hour, one more minute: `--since 5m` (the
    history op, and `history --file`) gave all 660 samples, every one stamped before the step being
    "within" any span, and the table said "over -2941s" (a review)."""
    from dflash2.history_cli import render

    now = [10_000.0]
    path = tmp_path / "history.jsonl"
    h = History(interval_s=1.0, path=path, clock=lambda: now[0])
    for step in (600, -3600, 60):
        if step < 0:
            now[0] += step
            continue
        for _ in range(step):
            if h.due():
                h.record(service.stats())
            now[0] += 1
    assert len(h.samples) == 660
    # Counted back from now (a second after the newest), and in the file from its newest sample.
    for last, n in ((h.since(300), 301), (read_file(path, since_s=300), 302)):
        assert len(last) == n  # the 60 after the step and those before it: 300 s of intervals
        assert [s["t"] for s in last[-60:]] == [7000.0 + i for i in range(60)]
        assert f"{n} samples over {n - 2}s" in render(last)
    # 30 s after the step: none of before it (the file's counted from its newest sample).
    assert len(h.since(30)) == 30 and [s["t"] for s in read_file(path, since_s=30)] == [7029.0 + i for i in range(31)]


def test_since_after_a_clock_set_back_in_lines_not_laid_out_as_the_daemon_writes_them(service, tmp_path):
    """A review: a history file re-written with JSON's spacing (`{"t": 1000.0, ...}`), whose times the
    streaming step cannot read, kept a sample from before a clock set back between those after it."""
    path = tmp_path / "history.jsonl"
    sample = service.stats()
    with open(path, "w") as f:
        for t in (1000, 1010, 1020, 1030, 500, 510, 520):  # the clock set back after 1030
            f.write(json.dumps(sample_of(sample, float(t)), separators=(", ", ": ")) + "\n")
    assert [s["t"] for s in read_file(path, since_s=15)] == [510.0, 520.0]


def test_a_line_that_only_begins_as_a_sample_does_not_cut_since(service, tmp_path, clock, capsys):
    # A review: a line of JSON that is not a sample but begins as one ({"t":0,...}, foreign or torn)
    # in the middle of the file made `--since` drop every good sample before it.
    path = tmp_path / "history.jsonl"
    h = History(path=path, clock=clock)
    for _ in range(10):
        h.record(service.stats())
        clock.advance(1)
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:5] + ['{"t":0,"note":"not a sample"}', '{"t":1,"cut'] + lines[5:]) + "\n")
    assert len(read_file(path)) == 10
    assert len(read_file(path, since_s=100)) == 10
    assert len(read_file(path, since_s=4.5)) == 5  # (a real sample past the cutoff still cuts)
    assert cli.main(["history", "--file", str(path), "--since", "100s"]) == 0
    assert "10 samples" in capsys.readouterr().out
