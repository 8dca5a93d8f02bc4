"""`dflash2 bench churn`'s client loop (`churn._client`) on a fake daemon and clock: what it counts."""

import numpy as np

from dflash2.bench import churn

class _FakeChurnClient:
    """A daemon that keeps every committed block (and, on demand, hands back one block's bytes
    wrong): for `churn._client` alone, on a fake clock, no daemon."""

    DTYPE = [("vid", "i8")]

    def __init__(self, clock, wrong_at=None):
        self.clock, self.wrong_at = clock, wrong_at
        self.layouts, self.by_key, self.bytes, self.next_vid, self.reads = [1], {}, {}, 1, 0
        self.held: set[int] = set()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def _places(self, vids):
        return np.array([(v,) for v in vids], dtype=self.DTYPE)

    def lookup(self, keys):
        found = []
        for key in keys:
            if key not in self.by_key:
                break
            found.append(self.by_key[key])
        return self._places(found)

    def acquire(self, vids):
        self.held.update(int(v) for v in vids)
        return self._places(vids)

    def allocate(self, lid, n):
        vids = list(range(self.next_vid, self.next_vid + n))
        self.next_vid += n
        for v in vids:
            self.bytes[v] = np.zeros(churn.LAYOUT.block_bytes, dtype=np.uint8)
        return self._places(vids)

    def commit(self, vids, keys, parent=None):
        for v, key in zip(vids, keys):
            self.by_key[key] = int(v)
        return vids

    def free(self, vids):
        pass

    def release(self, vids):
        self.held.difference_update(int(v) for v in vids)

    def view_bytes(self, place):
        data = self.bytes[int(place["vid"])]
        if int(place["vid"]) not in self.held:
            return data  # (a block being written)
        self.reads += 1
        if self.reads == self.wrong_at:
            assert self.clock.now < 1.0  # (in the warm-up)
            return np.zeros_like(data)
        return data


class _ChurnClock:
    """Each request reads the clock once: 20 requests of warm-up, then 20 in the window (1 s, 2 s)."""

    def __init__(self):
        self.now = 0.0

    def time(self):
        self.now += 0.05
        return self.now

    def sleep(self, seconds):
        pass

    def perf_counter(self):
        return self.now


def test_churn_counts_the_blocks_it_checked_in_the_window_as_its_other_figures(monkeypatch):
    """`blocks_checked` counted the warm-up's reads too while `requests`, `hit_ratio` and the rest
    cover the timed window: in the window it is every block found and acquired (every one is
    byte-checked). A wrong block read in the warm-up still counts in `wrong_blocks`."""
    import dflash2.client

    clock = _ChurnClock()
    fake = _FakeChurnClient(clock, wrong_at=1)
    monkeypatch.setattr(churn, "time", clock)
    monkeypatch.setattr(dflash2.client.Client, "connect", staticmethod(lambda *a, **kw: fake))
    counts = churn._client("ipc://unused", 0, docs=4, start_at=0.0, window=(1.0, 2.0))["counts"]
    assert counts["requests"] > 0 and counts["found"] > 0, counts
    assert counts["checked"] == counts["found"], counts  # (the warm-up's reads were counted too: 185 against 118)
    assert counts["wrong"] == 1, counts


def test_a_churn_client_that_began_after_the_window_opened_gives_no_figures(monkeypatch, capsys):
    """A client process whose start took past the timed window's opening (a loaded node, a short
    --warmup) served part of it or none: the bench printed `requests: 0`, `requests_per_s: 0.0`,
    exit 0 (a review, `--warmup 0 --seconds 1` on a busy VM). Now one error line, exit 1."""
    from dflash2 import cli

    monkeypatch.setattr(churn, "START_DELAY_S", -3.0)  # the window opens 2.7 s before the client is started
    rc = cli.main(["bench", "churn", "--clients", "1", "--warmup", "0", "--seconds", "1", "--docs", "20", "--json"])
    out, err = capsys.readouterr()
    assert rc == 1 and out == "", (rc, out)
    assert "client process(es) 0 (" in err and "began serving after the timed window opened" in err, err


def test_churn_times_its_window_from_its_opening_not_from_the_stats_reply(monkeypatch, capsys):
    """The window's seconds were timed from the reply to the stats call made as it opened: a daemon
    slow to answer that call shortened the divisor of requests_per_s and calls_per_s, but not the
    window the clients counted their requests in (6-7% too high on a loaded 2-core VM)."""
    import json
    import time

    import dflash2.client
    from dflash2 import cli

    stats = dflash2.client.Client.stats
    slow = []

    def slow_stats(self, *a, **kw):  # the first call (as the window opens) answered 0.5 s late
        if not slow:
            slow.append(1)
            time.sleep(0.5)
        return stats(self, *a, **kw)

    monkeypatch.setattr(dflash2.client.Client, "stats", slow_stats)
    rc = cli.main(["bench", "churn", "--clients", "1", "--warmup", "3", "--seconds", "1", "--docs", "20", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    fig = json.loads(out)
    assert slow and fig["requests"] > 0, fig
    # (requests over the 1 s window; it said twice as many, over the 0.5 s left after the reply)
    assert fig["requests_per_s"] <= 1.15 * fig["requests"], fig
