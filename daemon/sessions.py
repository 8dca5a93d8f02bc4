"""A client's session in the daemon: its lease, its token, the calls it may still `forget`; and
whether the process behind a session still runs (a pid seen through this pid namespace)."""

from __future__ import annotations

import dataclasses
import hmac
import os
from collections import OrderedDict


@dataclasses.dataclass
class Session:
    client: int
    name: str
    pid: int
    last_seen: float
    attached_at: float
    same_pid_namespace: bool  # only then does the pid name the client's process here
    device: int = 0  # which GPU's block pool the client uses
    token: str = ""  # the credential attach returned; every call of this client carries it
    # How to give back what each of the client's last UNDOABLE calls handed out (call id -> undo,
    # the last KEEP_CALLS), the ids of calls it gave up on before they arrived, and of calls whose
    # `forget` was carried out (undone, or refused on arrival): the forget of a call is sent again on
    # each new socket, and its repeats change nothing (the last KEEP_FORGOTTEN of each).
    undo: OrderedDict = dataclasses.field(default_factory=OrderedDict)  # call -> (op, undo, block ids it holds)
    undo_ids: int = 0  # block ids the undos hold together (KEEP_UNDO_IDS)
    forgotten: OrderedDict = dataclasses.field(default_factory=OrderedDict)
    # Calls that ran and whose undo was pushed out of `undo` since (call -> op, the last
    # KEEP_FORGOTTEN): their `forget` can give nothing back, and says so. Taken for calls that never
    # arrived, each was noted to be refused, "will not run" logged of a call that had run, and what
    # it handed out stayed held with no word (a review).
    expired: OrderedDict = dataclasses.field(default_factory=OrderedDict)
    settled: OrderedDict = dataclasses.field(default_factory=OrderedDict)
    # The ids of its last KEEP_RAN releases and frees that ran, and of the last KEEP_FORGOTTEN that a
    # `retry` ran (one the client timed out on comes again so): whichever of a call and its retry
    # arrives second is not run (forgetting.py `_once`).
    ran: OrderedDict = dataclasses.field(default_factory=OrderedDict)
    retried: OrderedDict = dataclasses.field(default_factory=OrderedDict)
    pid_ns: int | None = None  # the client's pid namespace (inode) as it said at attach; None: unknown
    detach_failures: int = 0  # detaches of it that failed part way (Service._drop_session: DETACH_TRIES)
    freeing_failures: int = 0  # ... and, set aside, frees of its blocks that failed (Service.expire_leases)
    # When it was last heard from: `last_seen` without the daemon's stalls credited (Leases.resumed moves
    # that on), which tells a later session of its process attached after it from one beside it
    # (Leases._carry_into_later: compared with last_seen, a stall made the replacement one beside it).
    heard_at: float | None = None

    def __post_init__(self) -> None:
        if self.heard_at is None:
            self.heard_at = self.last_seen


# A client's calls in flight are not one at a time: each that timed out stays queued (on a stopped or
# slow daemon) while the client goes on, and threads share a client. With 8 of each kept, the 9th
# call that timed out left what it handed out held (its undo, or its forget, was pushed out first:
# blocks leaked until detach, a review's scripts). An undo holds the call's block ids (8 bytes
# each); a forgotten or settled call id a few bytes.
KEEP_CALLS = 64
# ... and their undos hold no more than 2^20 block ids together (8 MiB a client; a call's ids are
# at most protocol.MAX_BATCH, 65,536): 16 calls of the largest batches, 64 of up to 16,384 ids.
KEEP_UNDO_IDS = 1 << 20
KEEP_FORGOTTEN = 1024
# Every release and free is noted (a few bytes each, for as long as the client lives): the client
# sends one it timed out on again ahead of any later call, so its retry meets the call's note unless
# it comes more than this many of the client's releases and frees after it.
KEEP_RAN = 256


def pid_namespace() -> int | None:
    """Inode of this process's pid namespace: equal in two processes iff their pids are comparable."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def same_token(session: Session, token: str | None) -> bool:
    """Constant-time comparison, of bytes: any string from the wire compares without raising."""
    return hmac.compare_digest(session.token.encode(), (token or "").encode("utf-8", "surrogatepass"))


PID_MAX = 1 << 22  # the kernel's largest pid (pid_max can be at most this)


def _own_procfs() -> bool:
    """Whether /proc is this process's pid namespace's (not one mounted from another: its pids
    would name other processes)."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


PROCFS = _own_procfs()


def _signal_says_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        pass
    return True


def pid_alive(pid: int) -> bool:
    """False only when the process certainly does not run: it does not exist, or it has exited
    and waits for its parent to reap it (a zombie with no thread left: its memory and sockets are
    gone). pid 0 = unknown: assume alive. Asked of every client in the daemon's pid namespace at
    every step: one read of /proc/PID/stat, 8 us (a signal 0 and all of /proc/PID/status parsed
    took 26-46 us, a quarter of the loop with 1,000 clients; a scale review). A process /proc does
    not show (mounted with hidepid=2, a process that is not dumpable) is asked by a signal: it
    was taken for gone, and its client detached while it ran (a review's script)."""
    if pid <= 0:
        return True
    if not PROCFS:
        return _signal_says_alive(pid)
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return _signal_says_alive(pid)
    except OSError:
        return True
    # After "(comm)", whose name may hold spaces or parentheses: the state (field 3), ..., the
    # threads (field 20). A zombie whose threads are all gone (1: the leader's exit status alone);
    # a leader that exited while other threads run on (a client in a worker thread) shows Z too: alive.
    fields = stat[stat.rindex(b")") + 2:].split(b" ", 18)
    return not (fields[0] == b"Z" and fields[17] == b"1")


class SetAside:
    """Clients whose lease lapsed while their process may still run (alive, or in another pid
    namespace, where the daemon cannot tell): their private blocks are kept out of reuse
    (BlockManager.detach with set_aside), because a process that stopped answering (a long GC or swap storm,
    SIGSTOP, a frozen cgroup) may resume the writes it was making into them, and a reused slot then
    held another block's bytes, read as a hit by every client. `due` names those whose process is
    gone, or that were set aside `leases` leases ago (`daemon.set_aside_leases`; 0: none is held): a
    process stalled longer than that which then resumes its writes is not protected."""

    def __init__(self, lease_timeout_s: float, leases: int, pid_alive, clock):
        self.hold_s = leases * lease_timeout_s
        self.pid_alive = pid_alive
        self.clock = clock
        self.sessions: dict[int, tuple[Session, float]] = {}  # client -> (its session, set aside until)

    def add(self, session: Session) -> None:
        self.sessions[session.client] = (session, self.clock() + self.hold_s)

    def due(self) -> list[Session]:
        """The set-aside sessions whose blocks may be freed now, removed from the set."""
        now = self.clock()
        out = [s for s, until in self.sessions.values()
               if now >= until or (s.same_pid_namespace and not self.pid_alive(s.pid))]
        for s in out:
            del self.sessions[s.client]
        return out

    def credit_stall(self, stalled_s: float) -> None:
        """The daemon did not run for `stalled_s` (Service.resumed): that time does not count against a
        set-aside, as it does not against a lease. Counted, a lapsed client whose process was still
        stopped had its blocks freed and its pins let go at once when the daemon ran again, its
        set-aside spent while nothing could reach the daemon (a review: 0.6 s of a 6 s set-aside run)."""
        for client, (session, until) in self.sessions.items():
            self.sessions[client] = (session, until + stalled_s)

    def again(self, session: Session) -> None:
        """Back in the set, due at once: its detach failed part way, and the next judging tries again."""
        self.sessions[session.client] = (session, self.clock())

    def of_process(self, pid: int, pid_ns: int | None, device: int) -> list[int]:
        """The set-aside clients of the process `pid` in pid namespace `pid_ns` (in `device`'s pool):
        its earlier sessions, whose blocks count against a new session's share (shares.py). None
        when the namespace is unknown (a pid alone may name another process)."""
        if pid_ns is None:
            return []
        return [s.client for s, _ in self.sessions.values() if s.pid == pid and s.pid_ns == pid_ns and s.device == device]

    def take_all(self) -> list[Session]:
        """Every set-aside session, removed from the set (shutdown: nothing writes any more)."""
        out = [s for s, _ in self.sessions.values()]
        self.sessions.clear()
        return out
