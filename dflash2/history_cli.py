"""`dflash2 history`: read the daemon's history and print it, as JSON lines, or as a plot.

    dflash2 history [--config F | --endpoint E | --file STATE_DIR/history.jsonl]
                    [--since 30m] [--json] [--rows N] [--plot FILE.png]

The plot (matplotlib, `pip install 'dflash2[plot]'`) has three panels over time: tier use, the HBM
hit ratio per interval, and swap bandwidth per direction.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import errno
import io
import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import Optional


from dflash2 import protocol as P
from dflash2.history import FILE_NAME, change, decode, rates, read_file, regular_file, span_seconds
from dflash2.argtypes import endpoint, positive_int, seconds
from dflash2.files import same_file
from dflash2.tiers import fill

EXIT_OK = 0
EXIT_FAIL = 1
# A plot that could not be written for want of room (not a path the user can fix): exit 1, not 2.
_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EIO)
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class HistoryError(Exception):
    """Something the user can fix (history off, bad duration, a file that is not history)."""


class DaemonNotAnswering(HistoryError):
    """No daemon answers at the endpoint: exit 1, as `dflash2 status` (not a usage error)."""


MAX_SINCE_S = 100 * 365 * 86400  # a century: anything longer asks for everything kept anyway


def parse_duration(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 90s, 30m, 6h or 1d")
    value = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    if value <= 0:  # (0 gave "no samples yet" from a daemon that had some, and the newest alone from a file)
        raise argparse.ArgumentTypeError(f"{text!r} is no time: give a duration above 0, or leave --since out for all")
    if value > MAX_SINCE_S:
        raise argparse.ArgumentTypeError(f"{text!r} is longer than {MAX_SINCE_S // 86400}d")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--config", metavar="FILE", help="the daemon's config (default: dflash2_config.json if present, else the default endpoint)")
    src.add_argument("--endpoint", metavar="E", type=endpoint, help="the daemon's control endpoint (ipc://... or tcp://...)")
    src.add_argument("--file", metavar="PATH", type=_history_file, help="read a history file offline (STATE_DIR/history.jsonl)")
    parser.add_argument("--since", type=parse_duration, default=None, metavar="DUR",
                        help="only the last DUR (e.g. 30m, 6h); default: all that is kept")
    parser.add_argument("--json", action="store_true", help="print every sample as one JSON line")
    parser.add_argument("--rows", type=positive_int, default=30, metavar="N", help="text table rows at most (default 30)")
    parser.add_argument("--plot", metavar="FILE.png", type=_plot_file,
                        help="draw tier use, hit ratio and swap bandwidth to a file")
    parser.add_argument("--timeout", type=seconds, default=5.0, metavar="S", help="seconds to wait for the daemon (default %(default)g)")


def handler(args: argparse.Namespace) -> int:
    from dflash2.cli import UsageError

    try:
        samples = load(args)
    except DaemonNotAnswering as e:
        print(f"dflash2 history: {e}", file=sys.stderr)
        return EXIT_FAIL
    except HistoryError as e:
        raise UsageError(str(e)) from None
    path = None
    if args.plot is not None:
        # Drawn before anything is printed: a plot refused (no matplotlib, a format it cannot write,
        # a folder it cannot write to) ends the command with its error alone, not after the table
        # as if the command had worked (a review). The file's kind from its extension, PNG without
        # one (matplotlib wrote NAME.png and it was reported as NAME); one matplotlib cannot write
        # is refused by name (it raised a traceback).
        path = args.plot if os.path.splitext(args.plot)[1] not in ("", ".") else f"{args.plot.rstrip('.')}.png"
        try:
            plot(samples, path)
        except ModuleNotFoundError:
            raise UsageError("--plot needs matplotlib: pip install 'dflash2[plot]'") from None
        except OSError as e:
            if e.errno in _FULL:  # output that cannot be written: exit 1, as the table's (README)
                print(f"dflash2 history: --plot: cannot write {path}: {e.strerror or e}; a file there is left as "
                      "it was", file=sys.stderr)
                return EXIT_FAIL
            raise UsageError(f"--plot: cannot write {path}: {e.strerror or e}") from None
        except (ValueError, RuntimeError) as e:  # (matplotlib: "Format 'xyz' is not supported ...";
            raise UsageError(f"--plot {args.plot}: {e}") from None  # pgf without xelatex: RuntimeError)
    if sys.stdout is None:  # (closed, `>&-`: said, as by dflash2d --check; what was read is in the exit code)
        plotted = "" if path is None else f"; the plot is written to {path}"
        print(f"dflash2 history: stdout is closed: the history read ({len(samples)} samples) is not printed"
              f"{plotted}",
              file=sys.stderr)
        return EXIT_OK
    if args.json:
        for s in samples:
            print(json.dumps(s, separators=(",", ":")))
    elif samples or args.since is None or args.file is not None:
        print(render(samples, args.rows))
    else:  # (a daemon counts --since back from now: one shorter than its interval may hold none of its samples)
        print(f"no samples in the last {args.since:g}s (the daemon samples once a second; a longer --since, or "
              "none, shows those it keeps)")
    if path is not None and not args.json:
        print(f"plot written to {path}")
    return EXIT_OK


# -- reading -------------------------------------------------------------------------------------
def load(args: argparse.Namespace) -> list[dict]:
    if args.file is not None:
        path = Path(args.file)
        try:
            if not regular_file(path):  # (FileNotFoundError; in a folder this user may not enter,
                # PermissionError: a traceback, when exists() was asked before the try)
                raise HistoryError(f"{path} is not a regular file (a daemon's history is STATE_DIR/{FILE_NAME})")
            with open(path, "rb") as f:
                has_lines = bool(f.read(1))
        except FileNotFoundError:
            raise HistoryError(f"no history file at {path}") from None
        except OSError as e:
            raise HistoryError(f"cannot read the history file {path}: {e.strerror or e}") from None
        samples = read_file(path, since_s=args.since)
        if has_lines and not samples:
            raise HistoryError(f"{path} holds no dflash2 history samples (a daemon's is STATE_DIR/{FILE_NAME})")
        if args.since is not None and samples:
            # (read_file cut at its newest sample's time, read from the file's tail; where no sample
            # lies there, it kept them all, and this cuts them)
            cutoff = samples[-1]["t"] - args.since
            samples = [s for s in samples if s["t"] >= cutoff]
        return samples
    endpoint, key_file = resolve_endpoint(args)
    return fetch(endpoint, args.since, args.timeout, key_file)


def resolve_endpoint(args: argparse.Namespace) -> tuple[str, Optional[Path]]:
    """The endpoint to ask, and its key file when the config names it (a tcp endpoint's: tcpkeys.py;
    None: the transport's default)."""
    from dflash2.config import load_config
    from dflash2.endpoints import connectable, default_endpoint
    from dflash2.errors import ConfigError

    if args.endpoint:
        return connectable(args.endpoint), None
    path = args.config if args.config is not None else ("dflash2_config.json" if os.path.exists("dflash2_config.json") else None)
    if path is None:
        return default_endpoint(os.environ), None
    try:
        cfg = load_config(path)
        return cfg.client_endpoint(), cfg.resolved_tcp_key_file()
    except ConfigError as e:
        raise HistoryError(str(e)) from None


def fetch(endpoint: str, since_s: float | None, timeout_s: float = 5.0, key_file=None) -> list[dict]:
    """The daemon's samples over the control protocol (needs no attached client)."""
    from dflash2.client.endpoint_check import check_endpoint
    from dflash2.client.transport import Transport
    from dflash2.errors import (AccessDenied, DaemonError, DaemonUnavailable, EndpointNotSocket, UnreadableReply,
                                VersionMismatch)

    args = {} if since_s is None else {"since_s": since_s}
    try:
        check_endpoint(endpoint)  # no socket file: say so at once (it asks whether the daemon runs)
    except EndpointNotSocket as e:  # (a folder, a regular file: the endpoint is wrong, exit 2 as in status)
        raise HistoryError(str(e)) from None
    except DaemonUnavailable as e:
        raise DaemonNotAnswering(str(e)) from None
    try:
        transport = Transport(endpoint, timeout_s, key_file=key_file)
        try:
            reply = transport.call(P.Op.HISTORY, None, args)
        finally:
            transport.close()
    except AccessDenied as e:  # (it runs: it refused this process)
        raise DaemonNotAnswering(str(e)) from None
    except DaemonUnavailable as e:  # (it says how: gone or stuck, or the pid holding the endpoint, as status's)
        raise DaemonNotAnswering(str(e)) from None
    # A daemon of another version (not one this command can ask), or what answered is not dflash2d
    # (or its reply is unreadable).
    except (VersionMismatch, UnreadableReply) as e:
        raise DaemonNotAnswering(str(e)) from None
    except DaemonError as e:  # it answered: the question was at fault (or the daemon names its own problem)
        raise HistoryError(f"dflash2d at {endpoint} refused the history call: {e}") from None
    if not reply.result.get("enabled"):
        raise HistoryError("the daemon keeps no history: set history_enabled: true in its config and restart it")
    return decode(reply.arrays[0]) if reply.arrays else []


# -- text ----------------------------------------------------------------------------------------
def render(samples: list[dict], max_rows: int = 30) -> str:
    if not samples:
        return "no samples yet"
    tiers = list(samples[-1]["tiers"])
    head = ["time"] + [f"{t} use" for t in tiers] + ["hbm hit", "swap out MB/s", "swap in MB/s", "clients", "deferred"]
    # max_rows samples (all, when there are fewer) evenly spread from the first to the last: every
    # step-th sample and then the last one appended gave max_rows + 1 rows.
    k = min(len(samples), max_rows)
    picked = sorted({round(j * (len(samples) - 1) / (k - 1)) for j in range(k)}) if k > 1 else [len(samples) - 1]
    rows = []
    for a, i in zip([None, *picked], picked):
        b = samples[i]
        # A tier the daemon had not before a restart (nvme_capacity_mb raised) shows as "-" there.
        rows.append([_clock(b["t"])] + [_pct(b["tiers"].get(t)) for t in tiers]
                    + _interval(None if a is None else samples[a:i + 1])
                    + [str(b["clients"]), str(b["reservations"]["deferred"])])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [head, *rows]]
    span = span_seconds(samples)  # (a clock set back between two: none; it printed "over -2941s")
    lines.append(f"{len(samples)} samples over {span:.0f}s; hit ratio and bandwidth are per row's interval")
    return "\n".join(lines)


def _interval(span: list[dict] | None) -> list[str]:
    """A row's hit ratio and bandwidths over the consecutive samples it spans (each interval
    between them counted: the row's two ends alone skipped a restart between them, and mixed or
    dropped two daemons' figures), "(restart)" beside them when the daemon restarted within it."""
    if span is None:
        return ["-", "-", "-"]
    seconds, reads, in_hbm, out_bytes, in_bytes, restart = 0.0, 0, 0, 0, 0, ""
    for a, b in zip(span, span[1:]):
        moves = change(a, b)
        if moves is None:
            restart = " (restart)"
        elif b["t"] > a["t"]:
            seconds += b["t"] - a["t"]
            reads += sum(moves[0].values())
            in_hbm += moves[0].get("hbm", 0)
            out_bytes += sum(v for d, v in moves[1].items() if _rank(d) > 0)
            in_bytes += sum(v for d, v in moves[1].items() if _rank(d) < 0)
    if not seconds:
        return [restart.strip() or "-", "-", "-"]
    hit = "-" if not reads else f"{100 * in_hbm / reads:.1f}%"
    return [hit + restart, f"{out_bytes / seconds / 1e6:.1f}", f"{in_bytes / seconds / 1e6:.1f}"]


def _rank(d: str) -> int:
    """>0 for a move to a slower tier (out of the fast ones), <0 for a move to a faster one."""
    order = {"hbm": 0, "dram": 1, "nvme": 2}
    src, dst = d.split("->")
    return order[dst] - order[src]


def _pct(t: dict | None) -> str:
    return f"{100 * fill(t):.1f}%" if t and t["capacity_bytes"] else "-"


def _clock(t: float) -> str:
    return _dt.datetime.fromtimestamp(t).strftime("%H:%M:%S")


# -- plot ----------------------------------------------------------------------------------------
def plot(samples: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_use, ax_hit, ax_bw) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    times = [_dt.datetime.fromtimestamp(s["t"]) for s in samples]
    for tier in (samples[-1]["tiers"] if samples else []):
        ax_use.plot(times, [100 * fill(s["tiers"][tier]) if tier in s["tiers"] else float("nan")  # (fill: 1 of no capacity)
                            for s in samples], label=tier)
    ax_use.set_ylabel("tier use (%)")
    ax_use.set_ylim(0, 105)
    r = rates(samples)
    rt = [_dt.datetime.fromtimestamp(x["t"]) for x in r]
    # Dots as well as lines: an interval with reads between two without (reads come in bursts) has no
    # finite neighbour to draw a line to, and the series showed nothing at all (a review).
    ax_hit.plot(rt, [float("nan") if x["hbm_hit_ratio"] is None else x["hbm_hit_ratio"] for x in r],
                label="per interval", marker="o", markersize=3)
    ax_hit.plot(times, [float("nan") if s["hbm_hit_ratio"] is None else s["hbm_hit_ratio"] for s in samples],
                label="since start", linestyle="--")
    ax_hit.axhline(0.95, color="red", linewidth=0.8, label="alert (0.95)")
    ax_hit.set_ylabel("HBM hit ratio")
    ax_hit.set_ylim(0, 1.05)
    for d in sorted({d for x in r for d in x["swap_bps"]}):
        ax_bw.plot(rt, [x["swap_bps"].get(d, 0) / 1e6 for x in r], label=d)
    ax_bw.set_ylabel("swap MB/s")
    for ax in (ax_use, ax_hit, ax_bw):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", fontsize="small")
    fig.suptitle("dflash2 history")
    fig.tight_layout()
    try:
        # Drawn in memory, then written over the file only once the disk has given it the room: in
        # place, a full disk left an earlier plot at that path truncated to a partial PNG (a review).
        # Not drawn beside it and moved onto it: that replaced a link instead of the file it names,
        # failed in a folder the user cannot write though the file is theirs, and on a long name.
        drawn = io.BytesIO()
        fig.savefig(drawn, format=os.path.splitext(path)[1][1:].lower(), dpi=100)
    finally:
        plt.close(fig)
    _write_whole(path, drawn.getvalue())


def _write_whole(path: str, data: bytes) -> None:
    """`data` as the file at `path` (through a link, keeping its mode and owner), or the file as it
    was: the room is taken first (posix_fallocate), so a full disk refuses before a byte changes. A
    file this made (a link's target too) and could not fill is removed again. Not all or nothing
    where the process dies mid-write (a plot of a few MB: milliseconds)."""
    made = False  # whether this call makes the file (a link's target too): removed where it cannot fill it
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # (a FIFO without a reader said "no such device")
            raise OSError(errno.EINVAL, "not a regular file")
    except FileNotFoundError:
        made = True
    # The kernel's lookup, not realpath's (which made x.png of missing/../x.png, a review); exclusive
    # where the path is no link, so a file made meanwhile by another is never removed as this one's.
    # Not blocking: a FIFO put there since is refused (ENXIO), not waited on for good.
    flags = os.O_CREAT | (0 if os.path.islink(path) else os.O_EXCL) if made else 0
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | flags, 0o666)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        os.posix_fallocate(fd, 0, max(1, len(data)))
        view = memoryview(data)
        while view:
            view = view[os.pwrite(fd, view, len(data) - len(view)):]
        os.ftruncate(fd, len(data))
    except BaseException:
        if made:
            with contextlib.suppress(OSError):
                where = os.path.realpath(path)  # (the file exists now: the lookup's own)
                if same_file(fd, where):
                    os.remove(where)
        raise
    finally:
        os.close(fd)


def _plot_file(value: str) -> str:
    """`--plot`'s file: a name, not a folder (`out/` drew `out/.png.png` and said `out/.png`; an
    empty name drew nothing and said nothing, a review)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("names no file")
    name = os.path.basename(value)
    if value.endswith(os.sep) or os.path.isdir(value) or name in (".", "..") or (name.startswith(".") and "." not in name[1:]):
        raise argparse.ArgumentTypeError(f"{value!r} is a folder or names no file in it: give a file's name, "
                                         "such as history.png")
    return value


def _history_file(value: str) -> str:
    """`--file`'s path: an empty one (`--file "$F"` with F unset) read as no --file, and the command
    asked the daemon of the config here, or of the default endpoint, instead (a review)."""
    if not value.strip():
        raise argparse.ArgumentTypeError(f"names no file (it was given {value!r})")  # (as --config's)
    return value
