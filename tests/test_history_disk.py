"""The history file on a disk that refuses writes: each sample tries one line, then the backlog goes out in
pieces, and a clean stop writes what still waits or says how many are lost (dflash2/history.py).
Split from test_history_units.py."""

from __future__ import annotations

import logging

import pytest
from observe_helpers import service  # noqa: F401  (a fixture)

from dflash2.history import History, read_file


def test_a_full_disk_costs_a_sample_one_line_and_the_file_catches_up_in_pieces(service, tmp_path, clock, monkeypatch,
                                                                              caplog):
    # README: a write that fails (a full disk) "is logged once, and the samples wait in memory". Each
    # sample of such a streak joined, encoded and handed over every waiting sample again, once a
    # second on the loop thread (3 hours waiting: 11 MB a sample; a review's script). Now it tries
    # the oldest waiting line alone, and once that is written the rest follow, at most
    # CATCH_UP_BYTES a sample, each piece written once: the file gets every sample, in order.
    import errno

    from dflash2 import history as H

    monkeypatch.setattr(H, "CATCH_UP_BYTES", 16 << 10, raising=False)  # (pieces of a few dozen samples)
    path = tmp_path / "history.jsonl"
    h = History(path=path, clock=clock)
    real, tried, full = h._append, [], [True]

    def append(data: bytes) -> None:
        tried.append(len(data))
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(data)
    monkeypatch.setattr(h, "_append", append)
    with caplog.at_level(logging.INFO, logger="dflash2.history"):
        for _ in range(300):
            h.record(service.stats())
            clock.advance(1)
        longest = max(len(line) for _, line in h.samples)
        assert len(tried) == 300 and max(tried) <= longest, (len(tried), max(tried), longest)
        assert not path.exists() or not path.read_text()
        full[0], tried[:] = False, []
        for n in range(1, 300):
            h.record(service.stats())
            clock.advance(1)
            if len(read_file(path)) == 300 + n:
                break
    assert n > 1 and max(tried) <= 16 << 10, (n, tried)  # (the probe, then pieces, a sample at a time)
    assert [s["t"] for s in read_file(path)] == [s["t"] for s in h.since()]  # (all 300 + n, each once)
    assert caplog.text.count("cannot write") == 1, caplog.text
    assert f"written again ({300 + n} samples that had waited)" in caplog.text, caplog.text


@pytest.mark.parametrize("still_full", [False, True])
def test_a_stop_during_a_catch_up_writes_the_waiting_samples_or_says_they_are_lost(service, tmp_path, clock,
                                                                                  monkeypatch, caplog, still_full):
    # A review: a stop while the file caught up in pieces (after a full disk) dropped the samples still
    # waiting, those taken since the disk came back among them, without a word. Now close() writes them
    # whole; where that fails too, it says how many are lost.
    import errno

    from dflash2 import history as H

    monkeypatch.setattr(H, "CATCH_UP_BYTES", 16 << 10, raising=False)
    path = tmp_path / "history.jsonl"
    h = History(path=path, clock=clock)
    real, full = h._append, [True]

    def append(data: bytes) -> None:
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(data)
    monkeypatch.setattr(h, "_append", append)
    for _ in range(300):
        h.record(service.stats())
        clock.advance(1)
    full[0] = still_full
    h.record(service.stats())  # (the disk back: the probe line and a first piece, no more)
    assert 0 < len(h._unwritten) < 301 or still_full
    with caplog.at_level(logging.WARNING, logger="dflash2.history"):
        h.close()
    written = [s["t"] for s in read_file(path)] if path.exists() else []
    if still_full:
        assert not written and "301 samples were not written" in caplog.text and "they are lost" in caplog.text
    else:
        assert written == [s["t"] for s in h.since()] and len(written) == 301 and "lost" not in caplog.text
