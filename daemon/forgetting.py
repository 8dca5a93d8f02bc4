"""`forget`: a client that timed out on a call that hands it something (protocol.UNDOABLE) tells
the daemon to give back what the call handed out if it ran, or to refuse it when it arrives if it
has not; a commit's blocks being written, which its `forget` names, are freed then, since it may
never arrive. `retry`: one that timed out on a release or free (protocol.RETRIED) sends it again,
and the daemon runs it once, whichever of the two comes first (the Service's share of it, as a
mixin over its sessions, counters and pools)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import numpy as np

from dflash2 import protocol as P
from dflash2.daemon.sessions import KEEP_CALLS, KEEP_FORGOTTEN, KEEP_RAN, KEEP_UNDO_IDS, Session
from dflash2.errors import CallForgotten, CopiesRunning, DFlash2Error, ProtocolError
from dflash2.protocol import Op, Reply, Request, arg

log = logging.getLogger("dflash2.daemon")


class Forgetting:
    """Needs `sessions` (client -> Session), `counters` and `_mgr(req)` of the Service. Also its
    replies' encoding (`_encoded`): a reply that cannot be sent gives back what its call handed out."""

    def _undoable(self, req: Request, give_back: Callable[..., object], *args) -> None:
        """Remember how to give back what this call handed out, should its client forget it:
        `give_back(client, *args)`. Its block ids are kept as an array of their own: a view of the
        request's frame (as the lambdas that were here held, with the whole request) kept each
        call's frames alive, commit's keys too, up to 64 calls a client (a soak: 30-37 MB a client
        of 65,536-id calls). The last KEEP_CALLS calls are kept, holding KEEP_UNDO_IDS ids at most
        together (the last call's always)."""
        args = tuple(np.array(a, dtype=np.int64) if isinstance(a, np.ndarray) else a for a in args)
        ids = sum(len(a) for a in args if isinstance(a, np.ndarray))
        session = self.sessions[req.client]
        kept = session.undo
        old = kept.pop(req.call_id, None)  # (a call id used again: its earlier undo is replaced)
        session.expired.pop(req.call_id, None)  # (... or its earlier call's expiry)
        session.undo_ids += ids - (0 if old is None else old[2])
        kept[req.call_id] = (req.op.value, functools.partial(give_back, req.client, *args), ids)
        while len(kept) > KEEP_CALLS or (session.undo_ids > KEEP_UNDO_IDS and len(kept) > 1):
            call, (op, _, held) = kept.popitem(last=False)
            session.undo_ids -= held
            _keep(session.expired, call, note=op)  # ran, and can no longer be undone: its forget says so
        self._handed = req  # (the call being answered handed something out: `reply_dropped`)

    def _refuse_forgotten(self, req: Request, session: Session) -> None:
        """CallForgotten when the client gave up on this call before it arrived (a refused commit
        frees the blocks it names that the writer was still writing)."""
        if req.call_id not in session.forgotten:
            return
        if req.op == Op.COMMIT:
            try:
                vids = req.array(0, P.VIDS_DTYPE, "block ids")
            except DFlash2Error:
                vids = None  # a malformed commit: nothing of it is the writer's to free
            if vids is not None:  # (first: parked on copies in flight, CopiesRunning, it stays forgotten)
                self._drop_writes(req, req.call_id, vids)
        elif req.op == Op.ACQUIRE:
            # The parked call run again: its record of what it waited for is dropped (it stayed, and was
            # taken for the client's next acquire's, a review). The record is the call's own (client,
            # call id): a forgotten call that came late, first seen now, leaves another parked one's alone.
            self._mgr(req).end_call(req.client, req.call_id)
        del session.forgotten[req.call_id]
        _keep(session.settled, req.call_id)
        self.counters["calls_refused_forgotten"] += 1
        raise CallForgotten(f"{req.op.value}: call {req.call_id} of client {req.client} arrived after its client "
                            "gave up on it: not run")

    def _drop_writes(self, req: Request, call: int, vids: np.ndarray) -> None:
        """A commit (`call`) whose writer (`req`'s client) gave up on it is not run: the blocks it names
        that are still that writer's, being written, are freed (it no longer knows whether they were
        committed; a free it sent after the forget may be lost on a socket the daemon never read)."""
        try:
            freed = self._mgr(req).drop_writes(req.client, vids)
        except DFlash2Error as e:
            log.warning("client %d gave up on its commit (call %d); freeing its blocks being written failed: %s",
                        req.client, call, e)
            return
        if freed:
            log.info("client %d gave up on its commit (call %d), which was not run: its %d blocks being written "
                     "are freed", req.client, call, freed)

    def _forget(self, req):
        """The client gave up waiting on its call `call`: give back what it handed out if it ran;
        refuse it when it arrives if it has not. One that ran and is too old to undo is answered
        `expired` (`_forget_expired`); any other call was not UNDOABLE, or had not arrived.
        A commit's `forget` names the blocks it named (an array frame; none from a client before
        it): when the commit has not run, those still being written are freed at once, as they are
        when it arrives (`_refuse_forgotten`), since it may never (it was lost with its socket)."""
        call = arg(req, "call", int, lo=1, hi=P.INT64_MAX)  # (at most one array frame: protocol.ARRAYS)
        written = req.array(0, P.VIDS_DTYPE, "block ids") if req.arrays else None
        session = self.sessions[req.client]
        if call in session.settled or call in session.forgotten:
            return {"undone": False}, []  # a repeat (sent again on a new socket): carried out already
        kept = session.undo.get(call)
        if kept is None and call in session.expired:
            return self._forget_expired(req, call, session.expired[call])
        if kept is None:
            if written is not None:  # (first: parked on copies in flight, CopiesRunning, nothing is noted)
                self._drop_writes(req, call, written)
            _keep(session.forgotten, call)
            log.info("client %d gave up on call %d before it ran (it had not arrived, or waited parked for "
                     "copies to end): it will not run", req.client, call)
            return {"undone": False}, []
        op, undo, _ = kept
        try:
            undo()  # (a `forget` parked until copies end, CopiesRunning, keeps the call to undo)
        except DFlash2Error as e:  # the client changed what the call handed out since (it cannot know it)
            undone = False
            log.warning("client %d gave up on its %s (call %d); giving back what it handed out failed: %s",
                        req.client, op, call, e)
        else:
            undone = True
            self.counters["calls_undone"] += 1
            log.warning("client %d gave up waiting on its %s (call %d): what it handed out is given back",
                        req.client, op, call)
        session.undo_ids -= session.undo.pop(call)[2]
        _keep(session.settled, call)
        return {"undone": undone}, []

    def _forget_expired(self, req: Request, call: int, op: str):
        """The client gave up on its call `call`, which ran, but more undoable calls of its have run
        since than the daemon keeps the undo of: what it handed out stays held, said to the client and
        logged (not noted as forgotten: it will not arrive again)."""
        log.warning("client %d gave up on its %s (call %d), which ran and is too old to undo (past the client's "
                    "last %d undoable calls, or %d block ids of theirs): what it handed out stays held until the "
                    "client releases or frees it, or detaches", req.client, op, call, KEEP_CALLS, KEEP_UNDO_IDS)
        return {"undone": False, "expired": True}, []

    def _once(self, req: Request, call: int, run: Callable[[], object], retry: bool = False) -> tuple[bool, object]:
        """Run a release or free of `req`'s client, its call `call` (`run`; `retry`: as its `retry`
        asks), unless the other of the two ran it: both may arrive, in either order (the call came
        late on a socket the client had given up on). Pins and references are counted per client, so
        a second run would drop another thread's. A call is checked only against the calls retries
        ran (a client that uses a call id twice, and never retries, runs both). Noted once it has
        run, refused too (NotOwner: its client held no pin then; run again, it would give up one that
        another thread has taken since); one parked on copies in flight (CopiesRunning) changed
        nothing and is not noted: it runs when it comes again. Returns whether it ran now, and what
        `run` returned."""
        session = self.sessions[req.client]
        if call in session.retried:
            return False, None
        if retry and call in session.ran:
            # Noted as retried too: `ran` keeps only the last KEEP_RAN, and the same retry comes again
            # on every new socket until its answer arrives (one dropped, it ran a second time once 256
            # releases had passed, giving up another thread's pin: a review's script).
            _keep(session.retried, call, KEEP_FORGOTTEN)
            return False, None
        noted, most = (session.retried, KEEP_FORGOTTEN) if retry else (session.ran, KEEP_RAN)
        try:
            out = run()
        except CopiesRunning:
            raise  # parked: not noted
        except Exception:
            _keep(noted, call, most)  # refused: answered, as run
            raise
        _keep(noted, call, most)
        return True, out

    def _retry(self, req):
        """The client timed out on its release or free `call` and sends it again (its block ids):
        run it unless it ran (`_once`)."""
        call = arg(req, "call", int, lo=1, hi=P.INT64_MAX)
        name = arg(req, "op", str)
        op = next((o for o in P.RETRIED if o.value == name), None)
        if op is None:
            raise ProtocolError(f"retry: argument 'op' must be one of {sorted(o.value for o in P.RETRIED)}, got {name!r}")
        if not req.arrays:  # (more than one: refused by protocol.ARRAYS)
            raise ProtocolError("retry: one array frame (the block ids of the call), got 0")
        m, vids = self._mgr(req), req.array(0, P.VIDS_DTYPE, "block ids")
        give_back = m.release if op == Op.RELEASE else m.free
        ran, out = self._once(req, call, lambda: give_back(req.client, vids), retry=True)
        log.info("client %d timed out on its %s of %d blocks (call %d) and sent it again: %s", req.client, op.value,
                 len(vids), call, "run now" if ran else "it had run")
        return ({"ran": ran, "freed": out or 0} if op == Op.FREE else {"ran": ran}), []

    def _encoded(self, req: Request, reply: Reply) -> list[bytes]:
        """The reply's frames; a reply that cannot be encoded (a bug) becomes an InternalError, and what
        the call handed out is given back (`_reply_lost`): its client would never learn of it."""
        try:
            return P.encode_reply(reply)
        except Exception as e:
            self.counters["errors"] += 1
            log.exception("internal error encoding the reply to %s", req.op.value)
            undone = self._reply_lost(req) if reply.ok else False
            return P.encode_reply(Reply(req.call_id, False, {}, "InternalError",
                                        f"the reply could not be encoded ({type(e).__name__}: {e})"
                                        + ("; what the call handed out was given back" if undone else "")))

    def reply_dropped(self) -> bool:
        """The reply to the call just handled was not sent (its connection gone, or REPLIES_QUEUED_PER_PEER
        replies queued unread on it): what it handed out is given back, as for a reply that cannot be
        encoded (`_reply_lost`): its client never learns of it (before, 2,000 one-block allocations sent unread
        left the 1,600 whose replies were dropped held until detach, under ids no one knew: HBM full, a review).
        Whether something was given back."""
        req, self._handed = self._handed, None
        if req is None or not self._reply_lost(req):
            return False
        log.debug("the reply to client %d's %s (call %d) was not sent: what the call handed out is given back",
                  req.client, req.op.value, req.call_id)  # (counted: the server's line a minute says how many)
        return True

    def _reply_lost(self, req: Request) -> bool:
        """The reply to `req` cannot be sent (it failed to encode: a bug), so its client never learns
        what the call handed out: that is given back now, as its `forget` would (before, it stayed
        held until detach: the client sends `forget` only after a timeout, not after an error
        reply). Whether something was given back."""
        session = self.sessions.get(req.client)
        kept = None if session is None else session.undo.pop(req.call_id, None)
        if kept is None:
            return False
        session.undo_ids -= kept[2]
        _keep(session.settled, req.call_id)
        op, undo, _ = kept
        try:
            undo()
        except DFlash2Error as e:
            log.warning("the reply to client %d's %s (call %d) was lost; giving back what it handed out failed: %s",
                        req.client, op, req.call_id, e)
            return False
        self.counters["calls_undone"] += 1
        return True


def _keep(calls, call: int, most: int = KEEP_FORGOTTEN, note: object = True) -> None:
    """Note `call` among the last `most` of a session's forgotten, settled, ran or expired calls."""
    calls[call] = note
    while len(calls) > most:
        calls.popitem(last=False)
