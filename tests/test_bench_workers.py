"""The benches' client processes (dflash2/bench/workers.py): a worker that dies, fails or never
answers is named, the bench ends. Under a multiprocessing.Pool a worker killed mid-run was replaced
in silence and `bench churn` waited for ever (a review)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from dflash2.bench.workers import Workers, WorkerFailed


def _double(i: int) -> int:
    return 2 * i


def _dies(i: int) -> int:
    if i == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return i


def _fails(i: int) -> int:
    if i == 2:
        raise ValueError(f"worker {i} cannot")
    return i


def _daemon_gone(i: int) -> int:
    from dflash2.errors import DaemonUnavailable
    raise DaemonUnavailable(f"lookup: the daemon of worker {i} ended")


def _sleeps(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def test_each_workers_result_in_order():
    with Workers(_double, [(i,) for i in range(3)], "bench test") as workers:
        assert workers.results(deadline=time.time() + 60) == [0, 2, 4]


def test_a_worker_killed_mid_run_is_named_at_once():
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed, match=r"bench test: client process 1 \(pid \d+\) ended without its figures "
                                           r"\(killed by SIGKILL\): no figures"):
        with Workers(_dies, [(i,) for i in range(3)], "bench test") as workers:
            workers.results(deadline=time.time() + 60)
    assert time.monotonic() - t0 < 30  # (not the deadline: the pipe closed)


def test_a_worker_that_raises_is_named_with_its_error(capfd):
    with pytest.raises(WorkerFailed, match=r"client process 2 \(pid \d+\) failed: ValueError: worker 2 cannot"):
        with Workers(_fails, [(i,) for i in range(3)], "bench test") as workers:
            workers.results(deadline=time.time() + 60)
    assert "Traceback" in capfd.readouterr().err  # (an error not raised on purpose: a bug, its traceback kept)


def test_a_worker_whose_daemon_is_gone_is_named_without_a_traceback(capfd):
    """A review: with the bench's daemon killed, every client printed a traceback beside the bench's
    one error line."""
    with pytest.raises(WorkerFailed, match=r"client process 0 \(pid \d+\) failed: DaemonUnavailable: lookup: the "
                                           "daemon of worker 0 ended"):
        with Workers(_daemon_gone, [(0,)], "bench test") as workers:
            workers.results(deadline=time.time() + 60)
    assert "Traceback" not in capfd.readouterr().err


def test_a_worker_past_the_deadline_is_named_and_stopped():
    with pytest.raises(WorkerFailed, match=r"client process\(es\) 1 \(pid \d+\) had not answered"):
        with Workers(_sleeps, [(0.0,), (600.0,)], "bench test") as workers:
            try:
                workers.results(deadline=time.time() + 5)
            finally:
                procs = list(workers._procs)
    assert not any(p.is_alive() for p in procs)


def test_a_start_that_fails_stops_the_workers_started_before_it(monkeypatch):
    """Workers started, then one whose start fails: those before it are stopped, not left running."""
    import multiprocessing.context

    started: list = []
    real = multiprocessing.context.SpawnProcess.start

    def start(self):
        if started:
            raise OSError("no more processes")
        real(self)
        started.append(self)
    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", start)
    with pytest.raises(OSError, match="no more processes"):
        Workers(_sleeps, [(600.0,), (600.0,)], "bench test")
    assert started and not started[0].is_alive()


def test_every_bench_module_imports():
    """A name one bench module takes from another that is not there broke five benches at once (a
    review: control, churn, drain, calls and sglang ended in an ImportError)."""
    import importlib
    import pkgutil

    import dflash2.bench

    for info in pkgutil.iter_modules(dflash2.bench.__path__):
        try:
            importlib.import_module(f"dflash2.bench.{info.name}")
        except ModuleNotFoundError as exc:  # (an optional dependency: torch, sglang, cupy)
            assert exc.name.split(".")[0] in ("torch", "sglang", "cupy"), (info.name, exc)


def test_a_worker_killed_while_the_bench_sleeps_is_named_at_once():
    # `bench churn` slept through its warm-up and its window before it looked: a client killed in
    # the warm-up was named only at the run's end (a review). Answers that come early are kept.
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed, match=r"client process 1 \(pid \d+\) ended without its figures \(killed by SIGKILL\)"):
        with Workers(_dies, [(i,) for i in range(3)], "bench test") as workers:
            workers.sleep_until(time.time() + 120)
    assert time.monotonic() - t0 < 60
    with Workers(_double, [(i,) for i in range(3)], "bench test") as workers:
        workers.sleep_until(time.time() + 3)  # (all answer within it)
        assert workers.results(deadline=time.time()) == [0, 2, 4]
    t0 = time.monotonic()
    with Workers(_sleeps, [(0.1,)], "bench test") as workers:
        workers.sleep_until(time.time() + 2)  # (still sleeps to its time when every worker has answered)
        assert time.monotonic() - t0 >= 1.9


SIGINT_WHILE_STARTING = """
import os, signal, sys, time
sys.path.insert(0, {tests!r})
from dflash2.bench.workers import Workers, WorkerFailed
from test_bench_workers import _sleeps
signal.signal(signal.SIGINT, lambda *a: None)  # (the bench: its own handler, which its children do not inherit)
with Workers(_sleeps, [(5.0,)] * 2, "starting") as w:
    for p in w._procs:
        os.kill(p.pid, signal.SIGINT)  # (a terminal's Ctrl-C reaches the whole group: here, at once)
    try:
        w.results(time.time() + 30)
    except WorkerFailed as e:
        print("failed:", e)
"""


def test_a_ctrl_c_while_a_worker_starts_prints_no_traceback():
    """A terminal's Ctrl-C reaches the bench's workers too; one that came while a worker's interpreter
    was still starting (multiprocessing's spawn_main, importing) printed a KeyboardInterrupt traceback
    (a CI run of test_bench_signals). Workers start with SIGINT blocked and unblock it in `_answer`,
    where it ends them quietly."""
    import subprocess
    import sys
    tests = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", SIGINT_WHILE_STARTING.format(tests=tests)], capture_output=True,
                          text=True, timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "KeyboardInterrupt" in proc.stdout, (proc.stdout, proc.stderr[-2000:])
