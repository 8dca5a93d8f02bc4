"""The `dflash2_swap` log lines: a direction's batch moves summed, a line every SWAP_LOG_EVERY_S at most,
none left unsaid (dflash2/swaplog.py)."""

from __future__ import annotations

import logging

import numpy as np

from dflash2.layout import Layout
from dflash2.swaplog import SWAP_LOG_EVERY_S, SwapLog
from dflash2.tiers import Tier

LAYOUT = Layout("t", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bf16", tokens_per_block=16)  # 16 KiB


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def events(self, name: str) -> list[logging.LogRecord]:
        return [r for r in self.records if getattr(r, "event", None) == name]


def _logger(name: str, level: int) -> tuple[logging.Logger, Lines]:
    logger = logging.getLogger(name)
    logger.setLevel(level)
    logger.propagate = False
    lines = Lines()
    logger.handlers = [lines]
    return logger, lines


def test_a_quiet_directions_first_batch_is_said_at_once_and_the_rest_summed_into_the_next_line():
    now = [100.0]
    logger, lines = _logger("test.swaplog.a", logging.INFO)
    swaps = SwapLog(logger, clock=lambda: now[0])
    swaps.batch("hbm->dram", 64, 0, 64 << 14, 0.002)
    assert [(r.direction, r.batches, r.blocks) for r in lines.events("dflash2_swap")] == [("hbm->dram", 1, 64)]
    for _ in range(200):  # churn: 200 batches in 2 s, and one of the other direction
        now[0] += 0.01
        swaps.batch("hbm->dram", 8, 1, 8 << 14, 0.001)
    swaps.batch("dram->hbm", 4, 0, 4 << 14, 0.0005)
    said = lines.events("dflash2_swap")
    assert [(r.direction, r.batches) for r in said] == [("hbm->dram", 1), ("dram->hbm", 1)]
    now[0] = 100.0 + SWAP_LOG_EVERY_S
    swaps.batch("hbm->dram", 8, 0, 8 << 14, 0.001)
    line = lines.events("dflash2_swap")[-1]
    assert (line.direction, line.batches, line.blocks, line.failed) == ("hbm->dram", 201, 201 * 8, 200)
    assert line.bytes == 201 * 8 << 14 and line.seconds == round(201 * 0.001, 6)
    assert line.over_s == round(SWAP_LOG_EVERY_S - 0.01, 3)
    assert not lines.events("dflash2_swap_batch")  # (debug: off at info)


def test_flush_says_what_is_pending_and_debug_says_each_batch():
    now = [0.0]
    logger, lines = _logger("test.swaplog.b", logging.DEBUG)
    swaps = SwapLog(logger, clock=lambda: now[0])
    for k in range(5):
        now[0] += 1.0
        swaps.batch("dram->nvme", k + 1, 0, (k + 1) << 14, 0.01)
    swaps.flush()
    swaps.flush()  # (nothing left: no line)
    said = lines.events("dflash2_swap")
    assert [(r.batches, r.blocks) for r in said] == [(1, 1), (4, 2 + 3 + 4 + 5)]
    assert [r.blocks for r in lines.events("dflash2_swap_batch")] == [1, 2, 3, 4, 5]
    assert all(r.levelno == logging.DEBUG for r in lines.events("dflash2_swap_batch"))


def test_the_step_says_a_bursts_batches_once_their_time_is_up_without_another_batch():
    now = [0.0]
    logger, lines = _logger("test.swaplog.c", logging.INFO)
    swaps = SwapLog(logger, clock=lambda: now[0])
    for _ in range(5):  # a burst: the first said at once, four kept
        swaps.batch("hbm->dram", 2, 0, 2 << 14, 0.001)
        now[0] += 0.1
    swaps.due()
    assert [r.batches for r in lines.events("dflash2_swap")] == [1]  # (not yet 10 s)
    now[0] = SWAP_LOG_EVERY_S
    swaps.due()  # the step, with no batch since the burst
    assert [(r.batches, r.blocks) for r in lines.events("dflash2_swap")] == [(1, 2), (4, 8)]
    now[0] = 3600.0  # an hour's quiet, then one batch: said at once, alone
    swaps.due()
    swaps.batch("hbm->dram", 2, 0, 2 << 14, 0.001)
    last = lines.events("dflash2_swap")[-1]
    assert (last.batches, last.over_s) == (1, 0.0)


def _eight_cached(m) -> np.ndarray:
    """Eight blocks committed under keys 1-8 and let go of (cached, idle, in HBM)."""
    a = m.attach("writer")
    vids = m.commit(a, m.allocate(a, m.register_layout(LAYOUT), 8), keys=list(range(1, 9)))
    m.free(a, vids)
    return vids


def _lines_of(logger_name: str) -> tuple[Lines, object]:
    logger = logging.getLogger(logger_name)
    lines = Lines()
    saved = logger.level, logger.handlers[:]
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)

    def restore():
        logger.setLevel(saved[0])
        logger.handlers = saved[1]
    return lines, restore


def test_a_batch_whose_blocks_fail_counts_them_as_the_metrics_do(small_nvme_manager):
    """`blocks` and `bytes` are those that arrived, `failed` the others: summed, the metrics' totals."""
    m = small_nvme_manager
    lines, restore = _lines_of("dflash2.swap")
    try:
        vids = _eight_cached(m)
        start = m.backend.start

        def half_failing(batch):
            job = start(batch)
            wait = job.wait

            def failing_wait():
                ok = wait().copy()
                ok[::2] = False
                return ok
            job.wait = failing_wait
            return job
        m.backend.start = half_failing
        ok = m.mover.move(m.table.rows([int(v) for v in vids]), Tier.DRAM)
        assert ok.sum() == 4
        m.close()
    finally:
        restore()
    (line,) = lines.events("dflash2_swap")
    st = m.mover.stats[(Tier.HBM, Tier.DRAM)]
    assert (line.blocks, line.failed, line.bytes) == (st.blocks, st.failed_blocks, st.bytes) == (4, 4, 4 * 16384)


def test_a_drains_copies_in_flight_at_shutdown_are_said_before_the_shutdown_line(small_nvme_manager):
    """SIGTERM while a drain piece's copies run and no client is left: the service's shutdown ends
    them and says their batches (the daemon's `dflash2_shutdown` line comes right after it)."""
    from dflash2.daemon.service import Service

    m = small_nvme_manager
    lines, restore = _lines_of("dflash2.swap")
    try:
        a = m.attach("writer")
        lid = m.register_layout(LAYOUT)
        vids = m.commit(a, m.allocate(a, lid, 62), keys=list(range(1, 63)))  # HBM of 64 over its high watermark
        m.free(a, vids)
        m.detach(a)
        m.tick(drain=False)
        m.drain_slice(0.0)
        assert m.placement.in_flight, "no drain piece in flight: the test proves nothing"
        Service({0: m}, lease_timeout_s=30, heartbeat_interval_s=5).shutdown()
        said = sum(r.batches for r in lines.events("dflash2_swap"))
        assert said == sum(st.batches for st in m.mover.stats.values()) > 0
        m.close()
        assert sum(r.batches for r in lines.events("dflash2_swap")) == said  # nothing left for after
    finally:
        restore()


def test_a_managers_moves_under_churn_are_a_line_a_direction_and_sum_to_its_stats(small_nvme_manager):
    """Through a real host manager's copies: batches back and forth between HBM and DRAM, many a
    second, make one line per direction until SWAP_LOG_EVERY_S has passed (one a batch before), and
    the lines, with the one its close says, add up to every block moved."""
    m = small_nvme_manager
    lines, restore = _lines_of("dflash2.swap")
    try:
        vids = _eight_cached(m)
        rows = m.table.rows([int(v) for v in vids])
        for _ in range(10):
            assert m.mover.move(rows, Tier.DRAM).all()
            assert m.mover.move(rows, Tier.HBM).all()
        said = lines.events("dflash2_swap")
        assert sorted(r.direction for r in said) == ["dram->hbm", "hbm->dram"]
        assert all(r.batches == 1 and r.blocks == 8 for r in said)
        m.close()  # says the rest
    finally:
        restore()
    said = lines.events("dflash2_swap")
    moved = {f"{src.label}->{dst.label}": st.blocks for (src, dst), st in m.mover.stats.items()}
    for direction, blocks in moved.items():
        assert sum(r.blocks for r in said if r.direction == direction) == blocks
    batches = {f"{src.label}->{dst.label}": st.batches for (src, dst), st in m.mover.stats.items()}
    assert {d: sum(r.batches for r in said if r.direction == d) for d in batches} == batches
    assert moved["hbm->dram"] == 80 and moved["dram->hbm"] == 80
    assert all(r.failed == 0 for r in said)
