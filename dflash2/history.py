"""The daemon's history: a bounded time series of its key figures, to read back after an incident.

With `history_enabled: true` the daemon's owner thread samples once per `interval_s` (1 s) from the
same snapshot the metrics use, keeps the last `max_samples` (3 hours) in memory, and appends each
sample as one JSON line to `STATE_DIR/history.jsonl` (rotated to `history.jsonl.1` past 64 MiB).
In memory each sample is kept as that line, not as the nested dicts it is built from: those took
4.4 KB a sample on a loaded three-tier node (5.5 KB reloaded; 48-60 MB for 3 hours, by which the
daemon's resident memory grew through its first three hours after every start), and a third to a
quarter of that as lines (an idle three-tier pool's 3 hours: 18.9 MB as dicts, 5.7 MB as lines);
readers get the dicts back (`since`), the `history` op the lines as they are (`encoded`).
On start it reloads the newest `max_samples` lines that file still holds, so a restarted daemon
still has the night before; a line that is not a sample (torn by a crash, or foreign) is skipped and
the count logged.

A sample holds gauges as they were and counters as running totals since the daemon started (a
restart shows as a counter going down; `rates` skips that interval):

    {"t": unix seconds, "tiers": {tier: {used_bytes, capacity_bytes, full_bytes, blocks}},
     "reads": {tier: blocks acquired from it}, "hbm_hit_ratio": since start or null,
     "lookup_misses": n, "swaps": {"hbm->dram": {blocks, bytes, seconds, failed_blocks}, ...},
     "reservations": {granted, deferred, reserved_blocks}, "clients": n, "requests": n, "errors": n,
     "pid": the daemon's pid}

Read it over the control protocol (op `history`, samples as JSON lines in one binary frame) or with
`dflash2 history [--since 30m] [--json] [--plot FILE.png]`, which also reads the file offline.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import itertools
import json
import logging
import math
import os
import re
import stat
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from dflash2.endpoints import _bare_host
from dflash2.files import make_private_folders, owner_text
from dflash2.history_sample import change, is_sample, rates, sample_of  # noqa: F401 (re-exported: callers import them here)
from dflash2.historylock import lock_again, lock_moved

log = logging.getLogger("dflash2.history")

FILE_NAME = "history.jsonl"
LOCK_NAME = "history.lock"  # held by the daemon that writes FILE_NAME
DEFAULT_INTERVAL_S = 1.0
DEFAULT_MAX_SAMPLES = 3 * 3600
DEFAULT_MAX_FILE_BYTES = 64 << 20
CATCH_UP_BYTES = 1 << 20  # of waiting samples written a sample once writes work again (hundreds of samples)


class History:
    def __init__(self, *, interval_s: float = DEFAULT_INTERVAL_S, max_samples: int = DEFAULT_MAX_SAMPLES,
                 path: Path | None = None, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                 clock: Callable[[], float] = time.time):
        if interval_s <= 0 or max_samples <= 0:
            raise ValueError("history needs a positive interval and room for at least one sample")
        self.interval_s = interval_s
        # (t, the sample as one compact JSON line with its newline): a quarter of the dict's memory
        self.samples: collections.deque[tuple[float, str]] = collections.deque(maxlen=max_samples)
        self.path = path
        self.max_file_bytes = max_file_bytes
        self.clock = clock
        self.lock_fd = -1  # the state folder's history lock, when this daemon holds it (make_history)
        self._next = -float("inf")
        self._due_at: float | None = None  # when `due` last said a sample was due, for `record`
        self._taken = -float("inf")  # when the last sample was taken (its question's time): `due`'s set back
        self._torn_tail = False  # the file ends in a line a crash cut short: the next write starts a new line
        self._mode_said = False  # made owner-only, said once (a filesystem that ignores chmod: every sample)
        # Samples not in the file yet: a write failed (a full disk). Each sample tries again, these
        # first, so that the file catches up once there is room (at most as many as are kept).
        self._unwritten: collections.deque[str] = collections.deque(maxlen=max_samples)
        self._failing = False  # the last write failed: the next tries the oldest waiting line alone
        self._waited: int | None = None  # since a streak of failures began, how many have been written
        # The lock's names, unwritten (a start on a full disk): written before the next samples.
        self._lock_text: bytes | None = None
        if path is not None:
            self.samples.extend((s["t"], _line(s)) for s in read_file(path, max_samples, links=False))
            self._torn_tail = _ends_torn(path)
            if self.samples:
                log.info("history: %d samples read back from %s", len(self.samples), path)

    def close(self) -> None:
        """Write the samples still waiting, whole (a stop during a catch-up dropped them without a
        word, those taken since the disk came back among them: a review), or say how many are lost;
        then give the state folder's history lock back (the file stays)."""
        if self.path is not None and self._unwritten:
            self._write_waiting(math.inf)
            if self._unwritten:
                log.warning("history: %d samples were not written to %s as the daemon stops (its last write "
                            "failed); they are lost", len(self._unwritten), self.path)
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1

    def due(self) -> bool:
        """Whether a sample is due: on a grid of `interval_s` steps, within a tenth of one (a caller
        asking about once an interval may ask a little early)."""
        now = self.clock()
        # A wall clock set back (an NTP step, a resumed VM) must not stop sampling until it catches up:
        # a time before the grid step behind `_next`, and before the last sample's own. (The grid step
        # alone took every question in the tenth after a sample taken early for a set back: a second
        # sample some milliseconds after it, the grid moved, about 1 in 40 samples of a daemon, a review.)
        due = now >= self._next - self.interval_s / 10 or now < min(self._taken, self._next - self.interval_s)
        if due:
            self._due_at = now
        return due

    def record(self, stats: dict) -> dict:
        """Append a sample of `stats` now (and to the file)."""
        now = self.clock()
        at = now if self._due_at is None else self._due_at
        self._due_at = None
        # The next one a step of the grid later, whenever within the tenth this one was taken. Counted
        # from `record`'s clock, after the stats were built, a loop asking once a second found every
        # other sample not yet due (one in 2 s); from the question's time with the tenth's leeway, a
        # loop asking every 100 ms took one every 0.9 s (reviews). Off the grid by more than a step
        # (a pause, a clock set back), from now.
        step = self._next + self.interval_s
        self._next = step if abs(at - self._next) < self.interval_s else at + self.interval_s
        self._taken = at
        s = sample_of(stats, now)
        line = _line(s)
        self.samples.append((s["t"], line))
        if self.path is not None:
            self._persist(line)
        return s

    def _lines(self, seconds: float | None) -> list[str]:
        if seconds is None:
            return [line for _, line in self.samples]
        n = span_count((t for t, _ in reversed(self.samples)), seconds, self.clock())
        return [line for _, line in itertools.islice(self.samples, len(self.samples) - n, None)]

    def since(self, seconds: float | None = None) -> list[dict]:
        return [json.loads(line) for line in self._lines(seconds)]

    def encoded(self, seconds: float | None = None) -> tuple[int, bytes]:
        """(how many samples, those samples as JSON lines): `encode(since(seconds))`, without
        decoding and encoding them again."""
        lines = self._lines(seconds)
        return len(lines), "".join(lines).encode()

    @staticmethod
    def encode(samples: Iterable[dict]) -> bytes:
        return "".join(_line(s) for s in samples).encode()

    def _persist(self, line: str) -> None:
        """Write `line` after the samples still waiting, in order. While writes fail, each sample
        tries the oldest waiting line alone; once that is written, the rest follow in pieces, at
        most `CATCH_UP_BYTES` a sample, each dropped from the wait once written. Before, each sample
        of a full disk joined, encoded and handed over every waiting sample again (3 hours of them:
        11 MB, 42 ms of the loop thread, every second; a review)."""
        self._unwritten.append(line)
        self._write_waiting(CATCH_UP_BYTES)

    def _write_waiting(self, budget: float) -> None:
        """The waiting samples, in order, up to `budget` bytes (`_persist`)."""
        while self._unwritten and budget > 0:
            n = size = 0
            for waiting in itertools.islice(self._unwritten, 1 if self._failing else None):
                if n and size + len(waiting) > budget:
                    break
                n, size = n + 1, size + len(waiting)
            lines = "".join(itertools.islice(self._unwritten, n))
            try:
                if self.lock_fd >= 0 and not self._locked():
                    return  # (another daemon's file now: this one's history is kept in memory only, said)
                if self._lock_text is not None:  # (make_history: held, its names not written for want of room)
                    os.pwrite(self.lock_fd, self._lock_text, 0)
                    self._lock_text = None
                if self.path.exists() and self.path.stat().st_size > self.max_file_bytes:
                    os.replace(self.path, self.path.with_name(self.path.name + ".1"))
                # Appended to a torn line, these samples would be unreadable too.
                self._append(("\n" + lines if self._torn_tail else lines).encode())
                self._torn_tail = False
            except OSError as e:  # a full disk must not stop the daemon: keep the in-memory series
                if self._waited is None:  # the first failure of a streak: said once, not per sample
                    self._waited = 0
                    log.warning("history: cannot write %s (%s); keeping samples in memory and trying again with "
                                "each one", self.path, e)
                self._failing = True
                return
            for _ in range(n):
                self._unwritten.popleft()
            self._failing, budget = False, budget - size
            if self._waited is not None:
                self._waited += n
        if self._waited and not self._unwritten:
            log.info("history: %s written again (%d samples that had waited)", self.path, self._waited)
            self._waited = None

    def _locked(self) -> bool:
        """Whether this daemon still holds the lock of the folder it writes to, taken again where the
        folder was made again under it (historylock.py); False, said, and the file given up where
        another daemon took it meanwhile or the folder is another daemon's. OSError where it cannot be
        had (the folder still gone)."""
        lock_path = self.path.with_name(LOCK_NAME)
        if not lock_moved(self.lock_fd, lock_path):
            return True
        fd, how = lock_again(self.lock_fd, lock_path, [self.path, self.path.with_name(FILE_NAME + ".1")],
                             _lock_names)
        os.close(self.lock_fd)
        self.lock_fd = fd
        if fd >= 0:
            log.info("history: %s was made again: its lock taken again", lock_path)
            _own_folder(lock_path.parent)  # (as at a start, once taken: made owner-only; before, every sample)
            return True
        log.warning("history: %s was made again, %s; this one keeps its history in memory only from now (%d "
                    "samples not written)", lock_path.parent, how, len(self._unwritten))
        self.path = None
        self._unwritten.clear()
        return False

    def _append(self, data: bytes) -> None:
        """Append `data` to the file, all of it or none: a write that fails part way (a full disk) is
        cut back to where the file ended, so that the samples tried again next time are in it once.
        Before, each retry appended every waiting sample again after those that a failed append had
        written whole: a disk that filled up and then freed a little room held samples twice, and
        time went back in `dflash2 history` (a review's script). OSError when it fails; the file may
        then end in part of a line only when the cut failed too (`_torn_tail`)."""
        # Owner-only, never through a link: made 0666, a umask of 000 left it writable by every user,
        # and a link another user put in its place had each sample appended to the file it named
        # (the daemon's user's: root's in a container; a review).
        # Not blocking: a FIFO put in its place held the loop thread in open() for good.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise OSError(f"{self.path} is not a regular file of this user's ({owner_text(st)})")
            if st.st_mode & 0o077:  # (one an earlier release made under umask 000, or 0644)
                os.fchmod(fd, 0o600)
                if not self._mode_said:
                    self._mode_said = True
                    log.warning("history: %s was open to other users (mode %o): made owner-only (0600)", self.path,
                                stat.S_IMODE(st.st_mode))
            os.set_blocking(fd, True)
            end = st.st_size
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(fd, view):]
            except OSError:
                try:
                    os.ftruncate(fd, end)
                except OSError:
                    self._torn_tail = True  # the next append starts on a line of its own
                raise
        finally:
            os.close(fd)


def _line(sample: dict) -> str:
    """A sample as one compact JSON line, its newline included (ASCII: one byte a character in memory)."""
    return json.dumps(sample, separators=(",", ":")) + "\n"


def decode(raw: bytes) -> list[dict]:
    return [json.loads(line) for line in raw.decode().splitlines() if line.strip()]


_T_PREFIX = re.compile(rb'\{"t":([-+0-9.eE]+)[,}]')  # how `_line` begins a sample
TAIL_BYTES = 1 << 16  # read from a file's end for its newest sample's time (a sample is about 1-3 KB)


def _time_of(line: bytes) -> float | None:
    """A line's sample time from its first bytes, as the daemon writes it; None when not so written."""
    m = _T_PREFIX.match(line)
    try:
        return None if m is None else float(m.group(1))
    except ValueError:
        return None


def last_time(path: Path) -> float | None:
    """The newest sample's time in a history file pair, from the end of the current file (else of the
    rotated one); None when neither ends in a sample."""
    for p in (path, path.with_name(path.name + ".1")):
        try:
            if not regular_file(p):
                continue
            with open(p, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - TAIL_BYTES))
                tail = f.read()
        except OSError:
            continue
        for line in reversed(tail.splitlines()):
            try:
                sample = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if is_sample(sample):
                return float(sample["t"])
    return None


def span_count(newest_first: Iterable[float], seconds: float, now: float | None = None) -> int:
    """How many of the samples at these times (newest first) lie within the last `seconds`, counted
    back from the newest (from `now` when that is later) as the sum of the intervals between them:
    one in which the clock went back counts as none. Cut at a time instead (`t >= now - seconds`),
    after a wall clock set back an hour (an NTP step, a resumed VM) every sample stamped before the
    step was "within" any span, and `history --since 5m` gave all 660 of 11 minutes (a review)."""
    n, later, elapsed = 0, None, 0.0
    for t in newest_first:
        elapsed += max(0.0, (now if now is not None else t) - t) if later is None else max(0.0, later - t)
        if elapsed > seconds:
            break
        n, later = n + 1, t
    return n


def span_seconds(samples: list[dict]) -> float:
    """The seconds these samples (oldest first) span: their intervals, one in which the clock went
    back counted as none (`span_count`)."""
    return sum(max(0.0, b["t"] - a["t"]) for a, b in zip(samples, samples[1:]))


def read_file(path: Path, max_samples: int | None = None, since_s: float | None = None,
              links: bool = True) -> list[dict]:
    """The samples among the newest `max_samples` lines of a history file (and its rotated
    predecessor), oldest first; with `since_s`, only those of the last `since_s` seconds before the
    newest sample (`span_count`: the clock set back between two counts no time). Lines are streamed and only the kept ones parsed: a full file pair is 128 MiB
    (`dflash2 history --file --since 30m` parsed all of it: 1.2 GB of memory and 6 s for 30 minutes'
    rows). A line that is not a sample (torn, foreign) is skipped and the count logged; an
    unreadable file is skipped and logged; with `links` False (the daemon's own), so is a link."""
    lines: collections.deque[bytes] = collections.deque(maxlen=max_samples)
    newest = None if since_s is None else last_time(path)
    cutoff = None if newest is None else newest - since_s
    for p in (path.with_name(path.name + ".1"), path):
        try:
            if not regular_file(p, follow=links):
                log.warning("history file %s is not a regular file: skipped", p)
                continue
            with open(p, "rb") as f:
                if cutoff is None:
                    lines.extend(f)
                else:  # (a line whose time cannot be read so is parsed, and judged, below)
                    for line in f:
                        if (t := _time_of(line)) is None or t >= cutoff:
                            lines.append(line)
                        elif lines:
                            # Past the span, and so is everything before it (span_count); kept, the
                            # samples before a clock set back (stamped later) came back (a review).
                            # Only a sample cuts: a line that merely begins as one (foreign, torn)
                            # cut every good sample before it (a review). Parsed only where there
                            # is something to cut: a file's lines before its span are not.
                            if is_sample(_parsed(line)):
                                lines.clear()
                            else:
                                lines.append(line)
        except FileNotFoundError:
            continue
        except OSError as e:  # unreadable: start without it, and say so
            log.warning("history file %s cannot be read (%s): skipped", p, e)
    out, skipped = [], 0
    for line in lines:
        if not line.strip():
            continue
        sample = _parsed(line)
        if is_sample(sample):
            if cutoff is None or sample["t"] >= cutoff:
                out.append(sample)
            else:  # (as above, for a line not laid out as the daemon writes it: kept, the samples before
                out.clear()  # a clock set back came back between those after it, a review)
        else:
            skipped += 1
    if skipped:
        log.warning("history file %s: %d lines are not samples (torn by a crash, or not history): skipped",
                    path, skipped)
    if since_s is not None:  # (those at or past the cutoff are all that can be: span_count <= t's)
        out = out[len(out) - span_count((s["t"] for s in reversed(out)), since_s):]
    return out


def endpoint_id(endpoint: str | None) -> str | None:
    """The daemon a history belongs to, as its lock names it: "default" for the default socket's
    usual paths (`daemon.endpoint` null, or either path written out: it follows XDG_RUNTIME_DIR,
    which a login shell sets and a systemd unit does not: the same daemon, a review), a tcp
    endpoint's host in one spelling, an ipc one's resolved path; None where no endpoint is given."""
    if endpoint is None or endpoint == "default":
        return endpoint
    if endpoint.startswith("ipc://") and _resolved(endpoint) in {_resolved(e) for e in _default_endpoints()}:
        return "default"  # (a default socket's path written out, in any environment: that daemon, a review)
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        host = _bare_host(host)
        # One address each: a loopback name and its address, and every address (`*` binds `[::]`
        # where IPv6 is on, as the daemon's socket asks, a review).
        host = {"localhost": "127.0.0.1", "ip6-localhost": "::1", "0.0.0.0": "*", "::": "*"}.get(host, host)
        return f"tcp://{f'[{host}]' if ':' in host else host}:{port}"
    if endpoint.startswith("ipc://"):
        return _resolved(endpoint)
    return endpoint


def _resolved(endpoint: str) -> str:
    """An ipc endpoint with its folder resolved (the socket itself may not be there yet)."""
    folder, name = os.path.split(endpoint[len("ipc://"):])
    return f"ipc://{os.path.join(os.path.realpath(folder), name)}"


def _default_endpoints() -> list[str]:
    """The default socket's usual paths, whatever this environment: with XDG_RUNTIME_DIR as
    systemd-logind sets it (a login shell's, /run/user/UID) and without (a systemd unit's, cron's).
    (This environment's own default is not among them where XDG_RUNTIME_DIR is elsewhere: the same
    config then named two owners by where it was started, a review.)"""
    from dflash2.endpoints import usual_default_endpoints

    return list(usual_default_endpoints())


def _lock_names(fd: int) -> list[str]:
    """The names of the daemon a history lock holds for (the lines after its pid: its endpoint, and
    the default endpoint's paths where that is its endpoint), the latest start's first; none in an
    earlier release's lock (the pid alone)."""
    lines = os.pread(fd, 4096, 0).decode(errors="replace").split("\n")[1:]
    # (a NUL names no path: it raised ValueError out of the start, and of every sample, a review)
    return list(dict.fromkeys(endpoint_id(line.strip()) for line in lines if line.strip() and "\0" not in line))


def _parsed(line: bytes):
    """A line's JSON value, None when it is not JSON."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


def regular_file(path: Path, follow: bool = True) -> bool:
    """Whether `path` is a regular file (FileNotFoundError when there is none); not `follow`ing, a
    link is not one. Opened, a FIFO in its place blocked the daemon's start-up and `dflash2 history
    --file` for ever (a review's script)."""
    return stat.S_ISREG((os.stat if follow else os.lstat)(path).st_mode)


def _ends_torn(path: Path) -> bool:
    """Whether the file ends in a line without its newline (a write a crash or a full disk cut short)."""
    try:
        if not regular_file(path):
            return False
        with open(path, "rb") as f:
            if f.seek(0, os.SEEK_END) == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except OSError:
        return False


OWN_NAMES = (FILE_NAME, FILE_NAME + ".1", LOCK_NAME)  # what the history keeps in its state folder


def _own_folder(folder: Path) -> None:
    """A state folder of this user's that others may write (an earlier release's, made under umask
    000), and that holds the history's files alone, is made theirs no more, and its rotated file
    owner-only, said: anyone could put a FIFO or a link in the history file's place, or forge
    samples. A folder that holds anything else, or is sticky (`/tmp`), is only said: stripping its
    bits locked every other user out of a shared folder named as `daemon.state_dir` (a review)."""
    st = folder.stat()
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid():
        return
    if mode & 0o022:
        if mode & stat.S_ISVTX or not set(os.listdir(folder)) <= set(OWN_NAMES):
            log.warning("history: %s is writable by other users (mode %o), who could change the history: give the "
                        "daemon a daemon.state_dir of its own", folder, mode)
        else:
            folder.chmod(mode & ~0o022)
            log.warning("history: %s was writable by other users (mode %o): no longer", folder, mode)
    rotated = folder / OWN_NAMES[1]
    try:
        fd = os.open(rotated, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return  # (none; or not one to touch: a link, another user's)
    try:
        rst = os.fstat(fd)
        if stat.S_ISREG(rst.st_mode) and rst.st_uid == os.geteuid() and rst.st_mode & 0o077:
            os.fchmod(fd, 0o600)
            log.warning("history: %s was open to other users (mode %o): made owner-only (0600)", rotated,
                        stat.S_IMODE(rst.st_mode))
    finally:
        os.close(fd)


def _not_writable(path: Path) -> tuple[Path, str, str] | None:
    """(the file, what it is, what to do) where the history file, or its rotated one, is one the daemon
    never writes: a link or not a regular file (the rotated file's link is only skipped as it is read),
    or another user's (one `sudo dflash2d` left). Each was read back as this daemon's history, then
    every write refused it (O_NOFOLLOW: "too many levels of symbolic links"; "not a regular file of
    this user's") while the log said it kept trying, and the samples since the start were lost at
    the next restart (reviews)."""
    for p in (path, path.with_name(path.name + ".1")):
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid != os.geteuid():
            return p, f"another user's file ({owner_text(st)})", f"remove it, or chown it to uid {os.geteuid()}"
        if p == path and not stat.S_ISREG(st.st_mode):
            return p, ("a link, which the daemon never writes through" if stat.S_ISLNK(st.st_mode)
                       else "not a regular file"), "remove it"
    return None


def make_history(cfg, state_dir: Path, endpoint: str | None = None, also: str | None = None,
                 **kw) -> History | None:
    """The daemon's history per the config (None when off); the file lives in the state folder.
    One daemon writes a state folder's file: it holds a lock beside it (`LOCK_NAME`) while it runs,
    and a second daemon given the same folder keeps its history in memory only, and says so
    (two daemons appending to one file would interleave their samples). The lock names the
    `endpoint` of the daemon whose file it is (and `also`, a second name: the default endpoint's
    path where it serves the default endpoint): one that shares no name with it keeps its history
    in memory too, and says so (two models' daemons on the default state folder, one after the
    other, took each other's samples for their own past, a review)."""
    if not cfg.history_enabled:
        return None
    path, lock_fd, text = None, -1, None
    try:
        make_private_folders(state_dir)  # (the folders it makes: owner-only)
        _own_folder(state_dir)
        lock_fd = os.open(state_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(lock_fd, 32).decode(errors="replace").split("\n")[0].strip() or "unknown"
            os.close(lock_fd)
            lock_fd = -1
            log.warning("history: %s is written by another daemon (pid %s); this one keeps its history in memory "
                        "only (give it a daemon.state_dir of its own)", state_dir / FILE_NAME, holder)
        else:
            earlier = _lock_names(lock_fd)
            owner, names = set(earlier), {endpoint_id(e) for e in (endpoint, also) if e is not None}
            held = [state_dir / name for name in (FILE_NAME, FILE_NAME + ".1") if (state_dir / name).exists()]
            endpoint = endpoint_id(endpoint)
            if names and owner and not owner & names and held:
                owner = " or ".join(sorted(owner))
                os.close(lock_fd)
                lock_fd = -1
                log.warning("history: %s is the history of the daemon serving %s, not of this one (%s); this one keeps "
                            "its history in memory only (give each daemon a daemon.state_dir of its own, or remove "
                            "%s to let this one take the folder)", state_dir / FILE_NAME, owner, endpoint,
                            " and ".join(map(str, held)))
                return History(path=None, **kw)
            if names and not owner and held:  # (an earlier release's lock: the pid alone)
                log.info("history: %s names no daemon's endpoint (an earlier release's): taken as the history of this "
                         "one (%s)", state_dir / LOCK_NAME, endpoint)
            os.ftruncate(lock_fd, 0)
            # Its names, then those the lock held for it, latest first: a later start elsewhere must
            # not forget how an earlier one was reached (a review); 8 at most, this start's kept.
            keep = sorted(names) + ([n for n in earlier if n not in names] if owner & names else [])
            keep = keep[:max(8, len(names))]
            text = "".join(f"{line}\n" for line in (os.getpid(), *keep)).encode()
            try:
                os.pwrite(lock_fd, text, 0)
                text = None
            except OSError as e:
                # A full disk at the start: the lock is held all the same, and its names are written
                # before the next samples, once there is room. Before, the lock was let go and the
                # history kept in memory for the daemon's whole life, its file never written (a review).
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                full = e
            path = state_dir / FILE_NAME
            if (why := _not_writable(path)) is not None:
                log.warning("history: %s is %s; this daemon keeps its history in memory only and does not read it "
                            "(%s, or give the daemon another daemon.state_dir)", *why)
                path = None
            elif text is not None:
                log.warning("history: cannot write %s (%s); this daemon holds it, keeps its samples in memory and "
                            "writes it and %s once there is room", state_dir / LOCK_NAME, full, path)
    except OSError as e:
        # (an error of a write to the open lock names no file: the lock is what it could not write)
        what = f"write {state_dir / LOCK_NAME}" if lock_fd >= 0 and e.filename is None else f"create {state_dir}"
        if lock_fd >= 0:
            os.close(lock_fd)
            lock_fd = -1
        log.warning("history: cannot %s (%s); keeping it in memory only", what, e)
    history = History(path=path, **kw)
    history.lock_fd = lock_fd
    if path is not None and lock_fd >= 0 and text is not None:  # (the disk full: warned once, above)
        history._lock_text, history._waited = text, 0
    return history
