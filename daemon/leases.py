"""Leases and sessions that end: a client that sends nothing for `lease_timeout_s`, or whose process
is gone, is detached (`expire_leases`); one whose process may still run keeps its private blocks set
aside a while (sessions.SetAside), counted against the share of the process's later sessions
(`_carry_into_later`). Time the daemon did not run counts against no lease, no reservation's TTL and
no set-aside (`resumed`), and a call parked on copies keeps its client heard from (`waiting`).

A mixin of `Service` (service.py), which owns the sessions, the managers and the clock.
"""

from __future__ import annotations

import logging

from dflash2.daemon.parking import Parked
from dflash2.daemon.sessions import Session
from dflash2.errors import CopiesRunning, UnknownClient

log = logging.getLogger("dflash2.daemon")

DETACH_TRIES = 3  # a client's detach that fails part way is tried again this many times in all (_drop_session)


class Leases:
    def expire_leases(self, behind_s: float | None = None, longest_call_s: float | None = None) -> list[int]:
        """Detach clients whose lease lapsed or whose process is gone. Returns their ids.
        `behind_s`: how long ago the request queue was last empty; `longest_call_s`: the longest
        busy stretch since (`busy`: a call, the work after its reply, the background step); both
        default to what the server last reported (`queue_empty`).
        Every message sent before the queue was last empty has been answered, so a lease is judged
        as of then: a heartbeat still queued behind a busy loop never lapses a live client's lease
        (the queue's backlog delays expiry instead)."""
        if behind_s is None:
            behind_s = self.queue_behind_s()
        if longest_call_s is None:
            longest_call_s = self._longest_call_s
        # The credit is at most one lease past the longest busy stretch: a backlog that never empties
        # (a client pipelining calls) delays expiry by a lease at most instead of stopping it, and a
        # call longer than the lease (a large NVMe promotion), which held every heartbeat, lapses nobody.
        credit = min(max(0.0, behind_s), self.lease_timeout_s + max(0.0, longest_call_s))
        now = self.clock() - credit
        gone = [s for s in self.sessions.values()
                if now - s.last_seen > self.lease_timeout_s
                or (s.same_pid_namespace and not self.pid_alive(s.pid))]
        for s in gone:
            # A process that may still run keeps its private blocks a while (sessions.SetAside).
            try:
                released = self._drop_session(s.client, set_aside=self.set_aside.hold_s > 0
                                              and (not s.same_pid_namespace or self.pid_alive(s.pid)))
            except Exception as e:  # (the others go on: one held them behind it for its three tries, a review)
                log.exception("client %d (%s, pid %d): its detach after its lease failed", s.client, s.name, s.pid)
                self.verify_after(e, "a lapsed client's detach")
                continue
            self.counters["leases_expired"] += 1  # (a lease that lapsed, or a process seen gone)
            log.warning("client %d (%s, pid %d) %s: released %s", s.client, s.name, s.pid, "lease lapsed" if now
                        - s.last_seen > self.lease_timeout_s else "process is gone", released)
        for s in self.set_aside.due():
            try:  # (each on its own, as above: the due ones had all left the set, a review)
                log.info("client %d (%s, pid %d): its set-aside blocks are freed: %s", s.client, s.name, s.pid,
                         self.managers[s.device].detach(s.client))
            except Exception as e:
                s.freeing_failures += 1
                log.exception("client %d: freeing its set-aside blocks failed (%d of %d tries)", s.client,
                              s.freeing_failures, DETACH_TRIES)
                if s.freeing_failures < DETACH_TRIES:
                    self.set_aside.again(s)
                else:
                    log.error("client %d: freeing its set-aside blocks failed %d times; they stay held until the "
                              "daemon restarts", s.client, s.freeing_failures)
                self.verify_after(e, "a set-aside client's detach")
        return [s.client for s in gone]

    def waiting(self, parked: list[Parked]) -> None:
        """These calls wait parked (the server, before leases are judged: `Server._judge_leases`): their clients are
        heard from, as a client whose call runs is (`handle`), so that none lapses for a call the
        daemon has not answered yet (a client without heartbeats, a disk slower than a lease)."""
        now = self.clock()
        for p in parked:
            session = self.sessions.get(p.client)
            if session is not None:
                session.last_seen = session.heard_at = now

    def resumed(self, stalled_s: float) -> None:
        """The daemon did not run for `stalled_s` (server.py, stalls.py): that time counts neither
        against a lease, nor against a reservation's TTL (records.credit_stall), nor against a lapsed
        client's set-aside (SetAside.credit_stall), and each client has a heartbeat interval more to
        reach it again, once a lease at most (given at every stall, short stalls that kept coming, a
        swap storm's, credited more than the time passing: a dead client in another pid namespace was
        never let go, a review)."""
        if stalled_s <= 0:
            return
        now, more = self.clock(), 0.0
        if now - self._stall_grace_at >= self.lease_timeout_s:
            more, self._stall_grace_at = self.heartbeat_interval_s, now
        for s in self.sessions.values():
            s.last_seen = min(now, s.last_seen + stalled_s + more)
        self.set_aside.credit_stall(stalled_s)
        for m in self.managers.values():
            m.admission.credit_stall(stalled_s)

    def _drop_session(self, client: int, set_aside: bool = False) -> dict:
        session = self.sessions.get(client)
        if session is None:
            return {}
        try:
            released = self.managers[session.device].detach(client, set_aside=set_aside)
        except UnknownClient:
            released = None
        except CopiesRunning:
            raise  # a detach parked until copies end changed nothing: the session stays for its run
        except BaseException:
            # Kept for the next detach (the client's retry, the lease's next judging) to finish what
            # this one left (a review: dropped, no detach could reach its references again), but
            # DETACH_TRIES times at most: one that always fails would fail every step.
            session.detach_failures += 1
            if session.detach_failures >= DETACH_TRIES:
                del self.sessions[client]
                log.error("client %d: its detach failed %d times; what it still holds stays held until the "
                          "daemon restarts", client, session.detach_failures)
            raise
        del self.sessions[client]
        if released is None:
            return {}
        if set_aside:
            self.set_aside.add(session)
            self._carry_into_later(session)
        return released

    def _carry_into_later(self, session: Session) -> None:
        """A session set aside after its process attached again (a Client dropped, a new one connected
        before the old lease lapsed): its blocks count against the share of the process's sessions
        attached since it was last heard from, as they do against a session attached after the lapse
        (shares.py). Only those were carried: the process held its set-aside blocks and a whole share on
        top (a review). A session attached while it was still heard from (two engines of one process)
        is another's, not its replacement: it carries nothing."""
        shares = self.managers[session.device].admission.shares
        if session.pid_ns is None or not shares.limited:  # (a pid alone may name another process:
            return  # SetAside.of_process; under a whole share nothing is carried, `ClientShares.carry`)
        later = [s.client for s in self.sessions.values()
                 if s.client > session.client and s.attached_at >= session.heard_at and s.pid == session.pid
                 and s.pid_ns == session.pid_ns and s.device == session.device]
        for client in later:
            shares.carry(client, [session.client])
        if later:  # (one line: a line per later session, a process that attached a session per request and
            # dropped each wrote a line per pair of them, 740,000 lines and 128 MB of log in 50 s, a review)
            log.info("client %d (pid %d): its set-aside blocks count against the share of its process's %d later "
                     "session(s) %s", session.client, session.pid, len(later), some_ids(later))


def some_ids(clients: list[int], most: int = 8) -> str:
    """Client ids for a log line: the first `most` of them, and how many more."""
    return str(clients) if len(clients) <= most else f"{str(clients[:most])[:-1]}, ... {len(clients) - most} more]"
