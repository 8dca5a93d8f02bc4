"""Client processes of the benches that drive a daemon from several at once (churn, control): each
one's answer, or an error naming the one that ended without it.

A `multiprocessing.Pool` hid that: a worker killed mid-run (by hand, by the OOM killer) was replaced
in silence and its task never answered, so the bench waited for ever, and a stop signal then often
hung in the pool's own shutdown (a review). Here each worker answers over a pipe of its own; a pipe
that closes without an answer is a worker gone, named with how it ended, and so is one that has not
answered by the bench's deadline.
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing import resource_tracker
from multiprocessing.connection import wait

from dflash2 import stopsignals
from dflash2.bench import BenchFailed
from dflash2.errors import DFlash2Error

ANSWER_MARGIN_S = 30.0  # past the run's end: a client's last call (its timeout, 5 s) and its exit
JOIN_S = 5.0  # how long a worker told to stop (SIGTERM) is waited for before it is killed


class WorkerFailed(BenchFailed):
    """A bench's client process ended without its figures, or failed: the bench has none to print."""


def _answer(conn, target: Callable, args: tuple) -> None:
    """In the worker: `target(*args)`'s result, or its exception as text, sent up the pipe. An
    error dflash2 raises on purpose (the daemon gone) or a stop signal ends the worker quietly: the
    bench names it (a review: each client printed a traceback as well); any other is a bug, and its
    traceback goes to the worker's stderr too."""
    try:
        # Started with SIGINT blocked (`Workers`): a terminal's Ctrl-C reaches the whole group, and one
        # that came while the interpreter was still starting (spawn_main's imports) printed its
        # traceback (a CI run). Unblocked here, it is a KeyboardInterrupt like any other, quiet.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        result = target(*args)
    except BaseException as exc:
        if not isinstance(exc, (DFlash2Error, KeyboardInterrupt, SystemExit)):
            traceback.print_exc()  # (before the bench hears of it: it stops the workers then)
            sys.stderr.flush()
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    conn.send(("done", result))


def how_it_ended(code: int | None) -> str:
    """A process's return code in words (negative: the signal that killed it)."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Workers:
    """`target(*args)` in a spawned process for each of `arg_lists`, started at once; `results`
    waits for them. Used as a context manager: on the way out, workers still running are stopped."""

    def __init__(self, target: Callable, arg_lists: Sequence[tuple], name: str):
        ctx = multiprocessing.get_context("spawn")
        # Started now, not in the first worker's start: its start unblocks SIGINT, which the workers
        # are started with blocked (below), and the first worker started with it open.
        resource_tracker.ensure_running()
        self.name = name
        self._procs: list = []
        self._conns: list = []
        try:
            for i, args in enumerate(arg_lists):
                recv, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_answer, args=(send, target, tuple(args)), name=f"{name}-{i}", daemon=True)
                self._procs.append(proc)
                self._conns.append(recv)
                old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # (the child starts with it)
                try:
                    proc.start()
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, old)
                send.close()  # (the worker holds the only write end: its death closes the pipe)
        except BaseException:  # (a start that failed, or a stop signal meanwhile: those started are stopped)
            self.__exit__()
            raise
        self._out: list = [None] * len(self._procs)
        self._waiting = dict(zip(self._conns, range(len(self._procs))))  # pipe -> worker, not yet answered

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc) -> None:
        with stopsignals.uninterrupted():  # (cut short, workers ran on with the bench gone)
            for proc in self._procs:
                if proc.is_alive():
                    proc.terminate()
            for proc in self._procs:
                if proc.pid is None:  # (never started: its start failed)
                    continue
                proc.join(JOIN_S)
                if proc.is_alive():
                    proc.kill()
                    proc.join(JOIN_S)
            for conn in self._conns:
                conn.close()

    def sleep_until(self, t: float) -> None:
        """Sleep until time.time() reaches `t`, but raise WorkerFailed as soon as a worker fails or
        ends without its answer (a churn client killed in the warm-up was named only once the
        measured window had been slept through as well, a review). An answer that comes early is
        kept for `results`."""
        while (left := t - time.time()) > 0:
            if not self._waiting:
                time.sleep(left)
                return
            for conn in wait(list(self._waiting), timeout=left):
                self._take(conn)

    def results(self, deadline: float) -> list:
        """Each worker's result, in order, once all have answered; WorkerFailed naming the first
        that failed or ended without answering, or those that had not answered by `deadline`
        (time.time())."""
        while self._waiting:
            left = deadline - time.time()
            if left <= 0:
                late = ", ".join(f"{i} (pid {self._procs[i].pid})" for i in sorted(self._waiting.values()))
                raise WorkerFailed(f"{self.name}: client process(es) {late} had not answered by the end of the run "
                                   "and its margin: no figures")
            for conn in wait(list(self._waiting), timeout=min(left, 1.0)):
                self._take(conn)
        return self._out

    def _take(self, conn) -> None:
        """A worker's pipe that is ready: its answer kept, or WorkerFailed naming how it failed."""
        i = self._waiting.pop(conn)
        proc = self._procs[i]
        try:
            status, value = conn.recv()
        except EOFError:  # its pipe closed with no answer: the process is gone
            proc.join(JOIN_S)
            raise WorkerFailed(f"{self.name}: client process {i} (pid {proc.pid}) ended without its figures "
                               f"({how_it_ended(proc.exitcode)}): no figures") from None
        if status == "failed":
            raise WorkerFailed(f"{self.name}: client process {i} (pid {proc.pid}) failed: {value}")
        self._out[i] = value
