"""A call or background step that fails part way (a bug; numpy's MemoryError under an address-space
limit) may leave the block table half changed: a review injected MemoryError at each allocation of 19
calls and found, after some, a slot handed out twice, blocks moving for good, keys lost, a block
leaked, while the daemon replied InternalError and served on. The tables are checked after each such
failure; one that fails the check stops the daemon (daemon/failing.py): every later call refused, exit 6."""

from __future__ import annotations

import glob
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest
from conftest import SMALL, write_config
from observe_helpers import call_ok

from dflash2 import protocol as P
from dflash2.daemon.service import Service
from dflash2.tiers import Tier


def fail_once_in(monkeypatch, function: str, numpy_function: str = "full", times: int = 1,
                 error=MemoryError) -> list:
    """np.full (or `numpy_function`) raises MemoryError `times`, where `function` calls it (the
    review's injection: by default the second half of a move, table.py `end_move`, after the source
    slots were freed)."""
    real, fired = getattr(np, numpy_function), []

    def failing(*args, **kwargs):
        if len(fired) < times and sys._getframe(1).f_code.co_name == function:
            fired.append(function)
            raise error("Unable to allocate 128. KiB (injected)")
        return real(*args, **kwargs)
    monkeypatch.setattr(np, numpy_function, failing)
    return fired


def served(make_manager, clock):
    """A service over 4 HBM and 8 DRAM blocks (a lookup's prefetch window 2), a client attached, a
    chain of 4 filling HBM."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=8, prefetch_window=2)
    svc = Service(mgr, lease_timeout_s=60, heartbeat_interval_s=10, clock=clock, pid_alive=lambda pid: True)
    client = call_ok(svc, P.Op.ATTACH, args={"name": "t", "pid": 0, "layouts": [SMALL.to_dict()]}).result["client"]
    mgr.free(client, mgr.commit(client, mgr.allocate(client, 0, 4), keys=[1, 2, 3, 4]))
    return svc, mgr, client


def call(svc, op, client=None, args=None, keys=None) -> P.Reply:
    token = svc.sessions[client].token if client in svc.sessions else None
    arrays = None if keys is None else [np.asarray(keys, dtype=P.KEYS_DTYPE).tobytes()]
    return svc.handle(P.decode_request(P.encode_request(op, 1, client, args, arrays, token=token)))


def free_a_held_slot(mgr) -> None:
    """Break the table: free the slot of a block that still lies in HBM."""
    row = int(np.flatnonzero(mgr.table.cols.tier == int(Tier.HBM))[0])
    mgr.table.allocators[Tier.HBM].free(SMALL.block_bytes, np.array([mgr.table.cols.offset[row]]))


def run_daemon(path) -> int:
    """`dflash2d` in this process (startup.run) on `path` until it ends: its exit code. SIGTERM after
    30 s (a daemon that serves on then stops, 0); the signal handlers it installed are put back."""
    import dflash2.daemon.startup as srv
    from dflash2.config import load_config

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    stop = threading.Timer(30, os.kill, (os.getpid(), signal.SIGTERM))
    stop.start()
    try:
        return srv.run(load_config(path))
    finally:
        stop.cancel()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def test_a_table_left_half_moved_stops_the_daemon_and_every_later_call_is_refused(make_manager, clock, monkeypatch):
    svc, mgr, client = served(make_manager, clock)
    fired = fail_once_in(monkeypatch, "end_move")
    failed = call(svc, P.Op.ALLOCATE, client, {"layout": 0, "n": 2})  # (room made: two of the chain go down)
    assert fired and not failed.ok and failed.error_type == "InternalError", failed
    assert "MemoryError: Unable to allocate 128. KiB (injected)" in failed.error_message
    assert svc.broken.startswith("the block table of pool 0 fails its check after allocate failed part way "
                                 "(MemoryError: Unable to allocate 128. KiB (injected)): InvariantViolation: ")
    assert svc.fatal() == svc.broken
    # Before, the next allocate handed the slots the chain's blocks still named to new blocks.
    for op, args, who in ((P.Op.ALLOCATE, {"layout": 0, "n": 2}, client), (P.Op.PING, {}, None),
                          (P.Op.STATS, {}, None)):
        refused = call(svc, op, who, args)
        assert not refused.ok and refused.error_type == "DaemonUnavailable", refused
        assert refused.error_message == f"dflash2d is stopping: {svc.broken}"


@pytest.mark.parametrize("error", [KeyError, ValueError, TypeError])
def test_an_expected_error_type_raised_part_way_is_checked_too(make_manager, clock, monkeypatch, error):
    """A bug that raises KeyError (ValueError, TypeError: the types validation raises) part way
    through a move was answered as a refusal, unchecked, and the next allocate served from a slot
    held twice (a review). What the call moved (slots, rows, keys, copies) makes it checked."""
    svc, mgr, client = served(make_manager, clock)
    fired = fail_once_in(monkeypatch, "end_move", error=error)
    failed = call(svc, P.Op.ALLOCATE, client, {"layout": 0, "n": 2})
    assert fired and failed.error_type == error.__name__, failed
    assert svc.broken.startswith(f"the block table of pool 0 fails its check after allocate (refused) failed part "
                                 f"way ({error.__name__}: ")
    assert call(svc, P.Op.ALLOCATE, client, {"layout": 0, "n": 2}).error_type == "DaemonUnavailable"


def test_refusals_are_checked_within_a_share_of_the_daemons_time(make_manager, clock, monkeypatch, caplog):
    """Bad arguments change nothing, nearly always; but no cheap counter tells a refusal raised part
    way through a change (a KeyError in the key index's insertion, a review) from one raised before.
    Refusals are checked, at most REFUSAL_CHECK_SHARE of the time: one at once, the others together
    once as long again past, divided by the share, as the last check took."""
    import dflash2.daemon.failing as failing

    svc, mgr, client = served(make_manager, clock)
    checks = []

    def check():  # (a table of a million rows: 0.2-0.35 s of the thread's time)
        checks.append(time.monotonic())
        began = time.thread_time()
        while time.thread_time() - began < 0.02:
            pass
    monkeypatch.setattr(mgr, "check_invariants", check)
    monkeypatch.setattr(failing, "REFUSAL_CHECK_SHARE", 0.002)  # (the next after 10 s: no race on a slow machine)
    with caplog.at_level("INFO", logger="dflash2.daemon"):
        for _ in range(9):  # (a ValueError: what validation raises, and a bug anywhere)
            refused = call(svc, P.Op.SET_WEIGHTS, client, {"weights": {"no_such_weight": 1.0}})
            assert refused.error_type == "ValueError", refused
    assert len(checks) == 1 and svc.broken is None  # (the first at once; 8 wait)
    assert "the block tables are whole" not in caplog.text  # (a refusal that changed nothing: not said at INFO)
    assert svc._refusal_check_at - time.monotonic() > 5  # (0.02 s / 0.002)
    assert svc.fatal() is None and len(checks) == 1 and svc._refused == 8 and len(svc._refusals) == 4
    svc._refusal_check_at = 0.0  # (as long past)
    assert svc.fatal() is None and len(checks) == 2  # (the loop's next turn: the 8 together)
    assert svc.fatal() is None and len(checks) == 2 and not svc._refused and not svc._refusals


def test_a_refusal_raised_on_purpose_is_not_checked(make_manager, clock, monkeypatch, caplog):
    """A DFlash2Error other than ArenaError is raised on purpose before anything changes: checked
    after each, a lapsed client's calls (UnknownClient) logged 70-90 checks a second, and sglang's
    commit under an evicted parent (UnknownBlock) ran one in its ordinary work (a review)."""
    svc, mgr, client = served(make_manager, clock)
    checks = []
    monkeypatch.setattr(mgr, "check_invariants", lambda: checks.append(1))
    assert call(svc, P.Op.ALLOCATE, client, {"layout": 9, "n": 2}).error_type == "UnknownLayout"
    stale = svc.handle(P.decode_request(P.encode_request(P.Op.ALLOCATE, 1, 12345, {"layout": 0, "n": 2}, None,
                                                         token="0" * P.TOKEN_CHARS)))
    assert stale.error_type == "UnknownClient", stale
    assert not checks


def test_an_invariant_violation_refusal_is_said_and_checked(make_manager, clock, monkeypatch, caplog):
    """InvariantViolation is a DFlash2Error but a bug, raised part way (heat's recount, after a commit's
    blocks were published): it went unsaid and unchecked (a review)."""
    from dflash2.invariants import InvariantViolation

    svc, mgr, client = served(make_manager, clock)
    checks = []
    monkeypatch.setattr(mgr, "check_invariants", lambda: checks.append(1))

    def recount(*args, **kwargs):
        raise InvariantViolation("a row uncounted twice (injected)")
    monkeypatch.setattr(mgr, "allocate", recount)
    with caplog.at_level("ERROR", logger="dflash2.daemon"):
        refused = call(svc, P.Op.ALLOCATE, client, {"layout": 0, "n": 2})
    assert refused.error_type == "InvariantViolation" and checks == [1]
    assert "internal error handling allocate: a row uncounted twice (injected)" in caplog.text


def test_the_wait_after_a_check_counts_its_cpu_time_within_a_bound_and_a_stop_checks_the_rest(
        make_manager, clock, monkeypatch):
    """A stall of the process during a check (SIGSTOP, swap) counted as check time: 2 s made the next
    check wait 40 s, and a refusal that broke the table meanwhile was served from; and refusals still
    waiting at a stop were never checked (a review)."""
    import dflash2.daemon.failing as failing

    svc, mgr, client = served(make_manager, clock)
    checks = []

    def stalled():  # (no CPU: the process stopped)
        checks.append(1)
        time.sleep(0.2)
    monkeypatch.setattr(mgr, "check_invariants", stalled)
    weights = {"weights": {"no_such_weight": 1.0}}
    assert call(svc, P.Op.SET_WEIGHTS, client, weights).error_type == "ValueError"
    assert len(checks) == 1 and svc._refusal_check_at - time.monotonic() < 1.0  # (wall-clock: 4 s)
    monkeypatch.setattr(failing, "REFUSAL_CHECK_SHARE", 1e-9)
    svc._refusal_check_at = 0.0
    call(svc, P.Op.SET_WEIGHTS, client, weights)
    assert len(checks) == 2 and svc._refusal_check_at - time.monotonic() <= failing.REFUSAL_CHECK_MAX_S
    call(svc, P.Op.SET_WEIGHTS, client, weights)  # (waits for the budget ...)
    assert len(checks) == 2
    svc.shutdown()  # (... and is checked at the stop)
    assert len(checks) == 3


def test_a_prefetch_that_fails_part_way_is_checked_too(make_manager, clock, monkeypatch):
    """A lookup's prefetch runs after the lookup's own work, and its failure is logged, not the
    call's (manager `_follow_up`): no check ran, and the next allocate handed a slot out twice (a
    review). The failure is noted, and checked before the next call."""
    svc, mgr, client = served(make_manager, clock)
    mgr.free(client, mgr.commit(client, mgr.allocate(client, 0, 4), keys=[11, 12, 13, 14]))  # [1..4] to DRAM
    first = mgr.table.rows(mgr.table.vids(np.flatnonzero(mgr.table.cols.key != 0)))[:4]
    assert (mgr.table.cols.tier[first] == int(Tier.DRAM)).all()
    fired = fail_once_in(monkeypatch, "end_move")
    looked = call(svc, P.Op.LOOKUP, client, {"layout": 0}, keys=[1, 2, 3, 4])
    assert fired and looked.ok  # (the lookup's own answer stands)
    refused = call(svc, P.Op.ALLOCATE, client, {"layout": 0, "n": 2})
    assert refused.error_type == "DaemonUnavailable", refused
    assert svc.broken.startswith("the block table of pool 0 fails its check after the prefetch of a lookup "
                                 "failed part way (MemoryError: Unable to allocate 128. KiB (injected)): ")


def test_a_drain_pieces_end_that_fails_is_checked_at_the_loops_next_turn(make_manager, clock):
    """The end of a drain piece's copies (rebalance `settle`) is logged where it fails, the others
    still ended: noted too, and the server's loop checks the tables at its next turn (`fatal`)."""
    svc, mgr, _ = served(make_manager, clock)

    class Done:
        def done(self):
            return True

    def end():  # breaks the table, then runs out of memory
        free_a_held_slot(mgr)
        raise MemoryError("Unable to allocate (injected)")
    mgr.placement._in_flight.append((Done(), end))
    mgr.placement.settle()
    assert svc.broken is None and svc.fatal().startswith(
        "the block table of pool 0 fails its check after ending a drain piece's copies failed part way "
        "(MemoryError: Unable to allocate (injected)): ")


def test_a_detach_that_fails_part_way_is_finished_by_the_next(make_manager, clock, monkeypatch):
    """A detach that failed after dropping the client's pins left its references: the session was
    dropped with the failure, and no detach or lease could reach them again (a review)."""
    svc, mgr, client = served(make_manager, clock)
    held = mgr.commit(client, mgr.allocate(client, 0, 2), keys=[21, 22])  # references kept
    fired = fail_once_in(monkeypatch, "_drop_all_refs", "fromiter")
    failed = call(svc, P.Op.DETACH, client)
    assert fired and failed.error_type == "InternalError" and svc.broken is None
    assert client in svc.sessions and (mgr.table.cols.refs[mgr.table.rows(held)] > 0).all()
    assert call(svc, P.Op.DETACH, client).ok and client not in svc.sessions
    assert (mgr.table.cols.refs[mgr.table.rows(held)] == 0).all()
    mgr.check_invariants()


def test_a_detach_that_always_fails_is_given_up_after_three(make_manager, clock, monkeypatch, caplog):
    from dflash2.daemon.leases import DETACH_TRIES

    svc, mgr, client = served(make_manager, clock)
    mgr.commit(client, mgr.allocate(client, 0, 2), keys=[21, 22])
    fail_once_in(monkeypatch, "_drop_all_refs", "fromiter", times=DETACH_TRIES)
    for attempt in range(DETACH_TRIES):
        assert client in svc.sessions
        assert call(svc, P.Op.DETACH, client).error_type == "InternalError"
    assert client not in svc.sessions and svc.broken is None
    assert f"client {client}: its detach failed {DETACH_TRIES} times; what it still holds stays held" in caplog.text


def test_a_failure_that_left_the_table_whole_serves_on(make_manager, clock, monkeypatch, caplog):
    svc, mgr, client = served(make_manager, clock)

    def out_of_memory(*args, **kwargs):  # (before anything changed)
        raise MemoryError("Unable to allocate 1.00 MiB (injected)")
    with monkeypatch.context() as patched:
        patched.setattr(mgr, "allocate", out_of_memory)
        with caplog.at_level("INFO", logger="dflash2.daemon"):
            failed = call(svc, P.Op.ALLOCATE, client, {"layout": 0, "n": 2})
    assert failed.error_type == "InternalError" and svc.broken is None and svc.fatal() is None
    assert "the block tables are whole after allocate failed (MemoryError); serving on" in caplog.text
    assert call(svc, P.Op.ALLOCATE, client, {"layout": 0, "n": 2}).ok
    mgr.check_invariants()


def test_a_read_only_call_that_fails_is_not_followed_by_a_check(make_manager, clock, monkeypatch):
    svc, mgr, _ = served(make_manager, clock)
    checks = []
    monkeypatch.setattr(mgr, "check_invariants", lambda: checks.append(1))

    def out_of_memory():
        raise MemoryError("Unable to allocate (injected)")
    monkeypatch.setattr(svc, "stats", out_of_memory)
    assert call(svc, P.Op.STATS).error_type == "InternalError"
    assert not checks and svc.broken is None


def test_a_memory_error_under_an_address_space_limit_says_so(make_manager, clock, monkeypatch):
    import dflash2.arena.shm as shm

    svc, mgr, client = served(make_manager, clock)
    monkeypatch.setattr(shm, "address_space", lambda: (700 << 20, 690 << 20))

    def out_of_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 1.00 MiB (injected)")
    monkeypatch.setattr(mgr, "allocate", out_of_memory)
    failed = call(svc, P.Op.ALLOCATE, client, {"layout": 0, "n": 2})
    assert failed.error_message.startswith("MemoryError: Unable to allocate 1.00 MiB (injected) (the daemon's "
                                           f"address space is limited to {700 << 20} bytes, {690 << 20} in use")


@pytest.mark.parametrize("where", ["step", "piece"])
def test_a_background_step_or_drain_piece_that_breaks_the_table_stops_the_daemon(make_manager, clock, tmp_path,
                                                                                 monkeypatch, where):
    from dflash2.daemon.server import Server

    svc, mgr, _ = served(make_manager, clock)
    srv = Server(svc, f"ipc://{tmp_path}/d.sock", tick_interval_s=30.0)

    def breaks(*args):  # breaks the table, then runs out of memory
        free_a_held_slot(mgr)
        raise MemoryError("Unable to allocate (injected)")
    try:
        if where == "step":
            srv._run_steps([("BlockManager.tick (pool 0)", breaks), ("the next", lambda: None)])
        else:  # (a rebalance piece run between requests: the server's `_drain_slice`)
            monkeypatch.setattr(mgr, "draining", lambda: True)
            monkeypatch.setattr(mgr, "drain_slice", breaks)
            srv._drain_slice(wait=True)
    finally:
        srv.close()
    what = "the background step BlockManager.tick (pool 0)" if where == "step" else "a rebalance piece"
    assert svc.broken.startswith(f"the block table of pool 0 fails its check after {what} failed part way "
                                 "(MemoryError: Unable to allocate (injected)): InvariantViolation: "), svc.broken


def test_the_daemon_exits_6_and_cleans_up(tmp_path, monkeypatch, capsys):
    """End to end: a client's write that makes room fails in the move's second half; the client is
    answered InternalError, then refused; the daemon exits 6 with one line, its shared memory gone."""
    from dflash2.assemble import instance_name
    from dflash2.client import Client
    from dflash2.errors import DaemonError

    path = write_config(tmp_path, memory={"hbm_capacity_mb": 1})  # (64 blocks of 16 KiB)
    segments = f"/dev/shm/{instance_name(os.getpid())}-*"
    seen: dict = {}

    def client():
        deadline = time.monotonic() + 30
        while not os.path.exists(tmp_path / "d.sock") and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["segments"] = glob.glob(segments)
        c = Client.connect(config=path, name="writer", layouts=[SMALL])
        for chain in range(4):
            try:
                vids = c.allocate(0, 32)["vid"]
                c.commit(vids, keys=[chain * 100 + i + 1 for i in range(32)])
                c.free(vids)
            except DaemonError as e:
                seen.setdefault("errors", []).append(f"{type(e).__name__}: {e}")
                break
        try:
            c.close()  # (the daemon is gone: its detach may fail)
        except DaemonError:
            pass
    fired = fail_once_in(monkeypatch, "end_move")
    writer = threading.Thread(target=client, daemon=True)
    writer.start()
    assert run_daemon(path) == 6
    writer.join(30)
    assert fired and seen["segments"] and not glob.glob(segments)
    assert "InternalError: MemoryError: Unable to allocate 128. KiB (injected)" in seen["errors"][0], seen
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("dflash2d: error: ")]
    assert len(lines) == 1 and "the block table of pool 0 fails its check after" in lines[0], err
    assert lines[0].endswith("exiting (code 6) so that the supervisor restarts the daemon; clients fall back to "
                             "their own cache, then attach again")
    assert not os.path.exists(tmp_path / "d.sock.lock")


def test_a_slab_claim_that_runs_out_of_memory_claims_nothing(make_manager, monkeypatch):
    """Pages were marked taken before the slab's arrays were made: a MemoryError between left pages
    neither free nor held, which the check did not see, lost until a restart (a review)."""
    mgr = make_manager(hbm_blocks=8)
    client, lid = mgr.attach("t"), mgr.register_layout(SMALL)
    allocator = mgr.table.allocators[Tier.HBM]
    before = allocator.stats()
    fired = fail_once_in(monkeypatch, "_claim_slabs", "repeat")
    with pytest.raises(MemoryError):
        mgr.allocate(client, lid, 4)
    assert fired and allocator.stats() == before
    assert len(mgr.allocate(client, lid, 8)) == 8  # every slot still to be had
    mgr.check_invariants()


def test_a_lapsed_clients_failing_detach_holds_no_other_behind_it(make_manager, clock, monkeypatch):
    """Its failure ended the judging: every other lapsed client waited behind it for its three tries
    (a review). The others go at once; it stays for the next judging to finish."""
    svc, mgr, first = served(make_manager, clock)
    second = call_ok(svc, P.Op.ATTACH, args={"name": "u", "pid": 0, "layouts": [SMALL.to_dict()]}).result["client"]
    for client in (first, second):
        mgr.commit(client, mgr.allocate(client, 0, 1), keys=[900 + client % 1000])  # (a reference each)
    clock.advance(120)  # (both leases lapse)
    fired = fail_once_in(monkeypatch, "_drop_all_refs", "fromiter")
    gone = svc.expire_leases()
    assert fired and gone == [first, second] and first in svc.sessions and second not in svc.sessions
    assert svc.broken is None
    svc.expire_leases()
    assert first not in svc.sessions
    mgr.check_invariants()


def test_failures_noted_together_are_checked_once(make_manager, clock, monkeypatch):
    svc, mgr, _ = served(make_manager, clock)
    checks = []
    monkeypatch.setattr(mgr, "check_invariants", lambda: checks.append(1))
    mgr.failures.extend([("MemoryError: a", "the prefetch of a lookup"),
                         ("KeyError: b", "ending a drain piece's copies")])
    assert svc.fatal() is None and len(checks) == 1 and not mgr.failures


def test_a_set_aside_clients_failing_detach_is_tried_again_and_holds_no_other(make_manager, clock, monkeypatch):
    """The due set-aside sessions all left the set before any was detached: one that failed ended the
    judging, the others' blocks held until a restart (a review). Each goes on its own; the failed one
    is due again at the next judging."""
    svc, mgr, first = served(make_manager, clock)
    clients = [first] + [call_ok(svc, P.Op.ATTACH, args={"name": n, "pid": 0, "layouts": [SMALL.to_dict()]})
                         .result["client"] for n in "uv"]
    for client in clients:
        mgr.allocate(client, 0, 1)  # (a block each, being written)
    clock.advance(120)
    svc.expire_leases()  # (their processes may live: set aside)
    assert sorted(svc.set_aside.sessions) == sorted(clients)
    clock.advance(svc.set_aside.hold_s + 1)
    fired = fail_once_in(monkeypatch, "_drop_all_refs", "fromiter")
    svc.expire_leases()
    assert fired and list(svc.set_aside.sessions) == [first] and svc.broken is None
    kept = svc.set_aside.sessions[first][0]
    assert (kept.freeing_failures, kept.detach_failures) == (1, 0)  # (its own tries: not its lease's detach's)
    svc.expire_leases()
    assert not svc.set_aside.sessions
    assert mgr.table.cols.live == 4  # (the cached chain alone: the three blocks freed)
    mgr.check_invariants()


def test_a_lapsed_clients_detach_that_breaks_the_table_stops_the_daemon(make_manager, clock, monkeypatch):
    svc, mgr, client = served(make_manager, clock)

    def breaks(*args, **kwargs):  # breaks the table, then runs out of memory
        free_a_held_slot(mgr)
        raise MemoryError("Unable to allocate (injected)")
    monkeypatch.setattr(mgr, "detach", breaks)
    clock.advance(120)
    svc.expire_leases()
    assert svc.broken.startswith("the block table of pool 0 fails its check after a lapsed client's detach "
                                 "failed part way (MemoryError: Unable to allocate (injected)): ")


def test_a_broken_table_found_by_the_stops_check_exits_6(tmp_path, monkeypatch, capsys):
    """A refusal that broke the table, waiting for the budget when SIGTERM came: the stop's check finds
    it and the daemon exits 6 with one line (it exited 0 after logging it: a review)."""
    from dflash2.client import Client
    from dflash2.daemon.failing import Failing
    from dflash2.daemon.service import Service
    from dflash2.errors import DaemonError

    monkeypatch.setattr(Failing, "_refusal_check_at", float("inf"))  # (every refusal waits for the budget)

    def breaks(self, req):  # breaks the table, then refuses
        free_a_held_slot(self.manager)
        raise ValueError("a weight out of range (injected)")
    monkeypatch.setattr(Service, "_set_weights", breaks)
    path = write_config(tmp_path)
    seen: dict = {}

    def client():
        deadline = time.monotonic() + 30
        while not os.path.exists(tmp_path / "d.sock") and time.monotonic() < deadline:
            time.sleep(0.01)
        c = Client.connect(config=path, name="writer", layouts=[SMALL])
        vids = c.allocate(0, 2)["vid"]
        c.commit(vids, keys=[1, 2])
        try:
            c.set_weights({"recency": 1.0})
        except DaemonError as e:
            seen["refused"] = str(e)
        c.close()
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=client, daemon=True).start()
    assert run_daemon(path) == 6
    assert "a weight out of range (injected)" in seen["refused"]
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dflash2d: error: ")]
    assert len(lines) == 1 and lines[0].startswith("dflash2d: error: the block table of pool 0 fails its check after "
                                                   "set_weights (refused) failed part way (ValueError: "), lines
    assert lines[0].endswith("exiting (code 6) so that the supervisor restarts the daemon")
