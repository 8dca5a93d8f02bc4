"""`dflash2 status --watch [--interval S] [--count N]`: a live terminal view for someone on the node.

Every S seconds it asks the daemon for its `stats` (as `dflash2 status` does, dflash2/status.py),
redraws that view, and adds what changed since the previous frame: the HBM hit ratio of the blocks
acquired in between, swap bandwidth per direction and requests per second. A daemon that goes
away is reported on the frame and asked again on the next one; Ctrl-C ends the view.
"""

from __future__ import annotations

import argparse
import sys
import time

from dflash2 import status
from dflash2.argtypes import non_negative_int, seconds
from dflash2.history import change, rates, sample_of

CLEAR = "\x1b[H\x1b[2J"


def configure(parser: argparse.ArgumentParser) -> None:
    status.configure(parser)
    parser.add_argument("--watch", action="store_true", help="redraw the view every --interval seconds (Ctrl-C ends)")
    parser.add_argument("--interval", type=seconds, default=None, metavar="S", help="with --watch: seconds between frames (default 1)")
    parser.add_argument("--count", type=non_negative_int, default=None, metavar="N", help="with --watch: stop after N frames (0 = never)")


def handler(args: argparse.Namespace) -> int:
    if not args.watch:
        given = [o for o, v in (("--interval", args.interval), ("--count", args.count)) if v is not None]
        if given:  # not silently ignored: the user meant a live view
            print(f"dflash2 status: error: {' and '.join(given)} only {'go' if len(given) > 1 else 'goes'} with "
                  "--watch", file=sys.stderr)
            return status.EXIT_USAGE
        return status.handler(args)
    if args.json:  # (not silently ignored either: the frames are for a person)
        print("dflash2 status: error: --json does not go with --watch (for a series of figures as JSON: "
              "dflash2 history --json)", file=sys.stderr)
        return status.EXIT_USAGE
    if sys.stdout is None:
        # Closed (`>&-`): its isatty() ended in a traceback, exit 1 (a review). Frames nobody sees are
        # not drawn, for ever with no --count: the daemon is asked once, as by `dflash2 status`, whose
        # exit code and stderr line say whether it answered.
        return status.handler(args)
    from dflash2.client.where import resolve_endpoint, resolve_key_file
    from dflash2.errors import ConfigError, EndpointNotSocket

    try:
        endpoint = resolve_endpoint(args.endpoint, args.config)
        key_file = resolve_key_file(args.endpoint, args.config)
    except (ConfigError, OSError) as e:
        print(status.no_endpoint(e), file=sys.stderr)
        return status.EXIT_USAGE
    try:
        answered = watch(endpoint, 1.0 if args.interval is None else args.interval, args.count or 0, args.timeout,
                         clear=sys.stdout.isatty(), key_file=key_file)
    except KeyboardInterrupt:
        return status.EXIT_OK
    except EndpointNotSocket as e:  # (no daemon will answer there: not a frame to ask again)
        print(f"dflash2 status: error: {e}", file=sys.stderr)
        return status.EXIT_USAGE
    # A view with a frame count is a probe too: like `dflash2 status`, exit 1 when no frame got an answer.
    return status.EXIT_OK if answered else status.EXIT_UNAVAILABLE


def watch(endpoint: str, interval_s: float, count: int = 0, timeout_s: float = status.TIMEOUT_S,
          clear: bool = True, key_file=None) -> bool:
    """Frames until `count` (0: until Ctrl-C); whether any frame got the daemon's answer."""
    prev = None
    frame = 0
    answered = False
    while True:
        stats, error = _ask(endpoint, timeout_s, key_file)
        last = bool(count) and frame + 1 >= count
        now = time.time()
        out = [CLEAR] if clear else []
        out.append(time.strftime("%H:%M:%S", time.localtime(now)) + f"  every {interval_s:g}s  (Ctrl-C ends)")
        if stats is None:
            # The last answered frame stays what the next one is compared with: a daemon restarted
            # while frames went unanswered is said so then (its pid, or its counters going down),
            # not taken for a first frame.
            out.append(f"daemon unavailable at {endpoint}: {error}" + ("" if last else "; asking again"))
        else:
            answered = True
            stats["endpoint"] = endpoint
            out.append(status.render(stats))
            # Frames timed by the monotonic clock: by the wall clock, a step back between two frames
            # (NTP, a resumed VM) was said to be a restart, and a step forward divided a frame's
            # counts by the whole step (a review).
            cur = sample_of(stats, time.monotonic())
            out.append(changes(prev, cur))
            prev = cur
        print("\n".join(out), flush=True)
        frame += 1
        if last:
            return answered
        time.sleep(interval_s)


def changes(prev: dict | None, cur: dict) -> str:
    """One line: what changed between two frames."""
    if prev is None:
        return "\nsince last frame: (first frame)"
    r = rates([prev, cur])
    if not r:
        return ("\nsince last frame: (the daemon restarted)" if change(prev, cur) is None else
                "\nsince last frame: (no time passed between the frames)")
    r = r[0]
    hit = "-" if r["hbm_hit_ratio"] is None else f"{100 * r['hbm_hit_ratio']:.1f}%"
    swaps = ", ".join(f"{d} {bps / 1e6:.1f} MB/s" for d, bps in r["swap_bps"].items() if bps) or "none"
    req = (cur["requests"] - prev["requests"]) / r["dt"]
    return f"\nsince last frame: hbm hit {hit} of {r['reads']} blocks read; swaps {swaps}; {req:.0f} requests/s"


def _ask(endpoint: str, timeout_s: float, key_file=None) -> tuple[dict | None, str]:
    from dflash2.client.endpoint_check import check_endpoint
    from dflash2.client.transport import Transport
    from dflash2.errors import DaemonError, DaemonUnavailable, EndpointNotSocket, VersionMismatch
    from dflash2.protocol import Op

    try:
        check_endpoint(endpoint)
        transport = Transport(endpoint, timeout_s, key_file=key_file)
        try:
            return transport.call(Op.STATS).result, ""
        finally:
            transport.close()
    except EndpointNotSocket:
        raise
    except (DaemonUnavailable, DaemonError, VersionMismatch) as e:
        return None, str(e)
