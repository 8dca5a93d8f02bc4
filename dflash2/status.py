"""`dflash2 status [--config FILE | --endpoint E] [--json]`: what a running daemon holds.

Tiers (capacity, used, blocks), hit rates, moves, the heat policy's split and admission gate, clients
and reservations: a table for people, or the daemon's `stats` reply as JSON for scripts. Status does not attach (it is not a client of the
cache); it sends one `stats` request. No daemon → exit 1 with one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

from dflash2.argtypes import endpoint, seconds
from dflash2.duel import NOT_REPLAYED
from dflash2.errors import ConfigError, DaemonError, DaemonUnavailable, EndpointNotSocket, VersionMismatch
from dflash2.policy.heat import INNER_LISTS
from dflash2.policy.split import LISTS
from dflash2.readcost import read_paths
from dflash2.tiers import fill

EXIT_OK = 0
EXIT_UNAVAILABLE = 1
EXIT_USAGE = 2
TIMEOUT_S = 3.0


def configure(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--config", metavar="FILE", default=None,
                       help="config whose daemon.endpoint to ask (default: dflash2_config.json here)")
    where.add_argument("--endpoint", metavar="E", default=None, type=endpoint, help="ask this endpoint (ipc://PATH or tcp://HOST:PORT)")
    parser.add_argument("--json", action="store_true", help="print the daemon's stats as JSON")
    parser.add_argument("--timeout", type=seconds, default=TIMEOUT_S, metavar="S", help="seconds to wait for the daemon (default %(default)g)")


def no_endpoint(e: Exception) -> str:
    """The line for a config that names no endpoint here; run outside the config's folder, it named
    the missing file and not what to give instead (a review)."""
    return (f"dflash2 status: error: cannot find the daemon's endpoint: {e} (give --config FILE, the "
            "daemon's config, or --endpoint E)")


def handler(args: argparse.Namespace) -> int:
    from dflash2.client.where import resolve_endpoint, resolve_key_file
    from dflash2.client.endpoint_check import check_endpoint
    from dflash2.client.transport import Transport
    from dflash2.protocol import Op

    try:
        endpoint = resolve_endpoint(args.endpoint, args.config)
        key_file = resolve_key_file(args.endpoint, args.config)
    except (ConfigError, OSError) as e:
        print(no_endpoint(e), file=sys.stderr)
        return EXIT_USAGE
    try:
        check_endpoint(endpoint)
        transport = Transport(endpoint, args.timeout, key_file=key_file)
        try:
            stats = transport.call(Op.STATS).result
        finally:
            transport.close()
    except EndpointNotSocket as e:  # (a folder: "a daemon that was killed left it", exit 1, a review)
        print(f"dflash2 status: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (DaemonUnavailable, DaemonError, VersionMismatch) as e:
        print(f"dflash2 status: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    stats["endpoint"] = endpoint
    if sys.stdout is None:  # (closed, `>&-`): as dflash2d --check's plan, the answer is in the exit code
        print(f"dflash2 status: stdout is closed: the view is not printed (dflash2d at {endpoint} answered)",
              file=sys.stderr)
        return EXIT_OK
    print(json.dumps(stats, indent=2) if args.json else render(stats))
    return EXIT_OK


def render(st: dict) -> str:
    d = st.get("daemon", {})
    lines = [f"dflash2d pid {d.get('pid')} at {st.get('endpoint', '?')} (device: {d.get('device')}, "
             f"policy: {st.get('policy', {}).get('name')}); requests {d.get('requests', 0)}, "
             f"errors {d.get('errors', 0)}, leases expired {d.get('leases_expired', 0)}, "
             f"calls parked {d.get('calls_parked', 0)}", ""]
    # Answered "no room now" (README, Observability); an acquire whose copy failed is no want of room
    # (HBM may be empty), said on its own line: summed in here, it sent an operator to capacity (a review).
    causes = st.get("refused", {})
    refused = {op: sum(n for cause, n in by.items() if cause != "copy_failed") for op, by in causes.items()}
    if any(refused.values()):
        lines[-1:-1] = ["refused (no room now): " + ", ".join(f"{op} {n}" for op, n in refused.items())]
    copy_failed = {op: by.get("copy_failed", 0) for op, by in causes.items() if by.get("copy_failed")}
    if copy_failed:
        lines[-1:-1] = ["refused (their copy up failed): " + ", ".join(f"{op} {n}" for op, n in copy_failed.items())]
    if d.get("gpus"):  # pools by the daemon's GPU number; clients find them by UUID
        lines[-1:-1] = ["GPUs: " + ", ".join(f"{n} {u}" for n, u in d["gpus"].items())]
    rows = [("tier", "capacity", "used", "full %", "blocks")]  # (full: what the watermarks weigh, `fill`)
    # A node of several GPUs: each pool's tiers too (each fills on its own: one full GPU beside an
    # empty one read as half full in the node's totals, the only rows before).
    pools = st.get("devices") or {}
    for gpu, pool in [(None, st), *(pools.items() if len(pools) > 1 else [])]:
        for name, t in pool.get("tiers", {}).items():
            cap, used = t.get("capacity_bytes", 0), t.get("used_bytes", 0)
            rows.append((name if gpu is None else f"  GPU {gpu} {name}", _size(cap), _size(used),
                         f"{100 * fill(t):.1f}" if cap else "-", str(t.get("blocks", 0))))
    lines += _table(rows)
    aside = {name: t["quarantined_bytes"] for name, t in st.get("tiers", {}).items() if t.get("quarantined_bytes")}
    if aside:  # out of the capacity above: slots whose writes or whose blocks' reads failed
        lines.append("slots set aside after failed writes or reads (re-tested, given back once sound): "
                     + ", ".join(f"{name} {_size(n)}" for name, n in aside.items()))
    for gpu, pool in (pools.items() if len(pools) > 1 else [(None, st)]):  # (nvmegone.py: each GPU's file)
        for name, t in pool.get("tiers", {}).items():  # its file removed and no new one to be had
            if t.get("no_file"):
                where = name if gpu is None else f"GPU {gpu} {name}"
                lines.append(f"{where} tier has no file (writes refused, reads miss): {t['no_file']}")
    ratio = st.get("hbm_hit_ratio")
    reads = ", ".join(f"{k} {v}" for k, v in st.get("reads", {}).items()) or "none"
    lines += ["", f"hbm hit ratio: {'-' if ratio is None else f'{100 * ratio:.1f}%'} (block reads: {reads}); "
                  f"lookups {st.get('lookups', 0)}"]
    host = st.get("host_reads", {})
    if host:  # host-side readers (tier dram): read where blocks lie, not in the HBM ratio
        lines.append("host-side reads: " + ", ".join(f"{k} {v}" for k, v in host.items()))
    moves = st.get("moves", {})
    lines.append("moves: " + ("; ".join(f"{k} {_brief(v)}" for k, v in moves.items()) if moves else "none"))
    batches = st.get("copy_batches", {})
    if batches:  # a GPU node: how its HBM<->DRAM batches were moved
        lines.append("GPU copy batches: " + "; ".join(f"{d} {_brief(per)}" for d, per in batches.items()))
    placement = st.get("placement", {})
    if placement:
        lines.append("placement: " + _brief(placement))
    for gpu, pool in (st.get("devices") or {None: st}).items():
        pre = pool.get("prefetch") or {}
        if pre.get("window"):  # (0: prefetch off)
            lines.append(f"prefetch{'' if gpu is None else f' (GPU {gpu})'}: window {pre['window']} blocks; "
                         f"useful {pre.get('useful', 0)}, wasted {pre.get('wasted', 0)}, pending {pre.get('pending', 0)}")
    lines += _policy_lines(st)
    # Measured per GPU pool (a node of several keeps them under `devices`).
    measured = {gpu: read_paths(pool.get("read_cost", {}).get("bytes_per_s", {}))
                for gpu, pool in (st.get("devices") or {None: st}).items()}
    if any(measured.values()) or st.get("lookup_withheld"):
        paths = "; ".join(("" if gpu is None else f"GPU {gpu} ") + f"{k} {'unmeasured' if v is None else _size(v) + '/s'}"
                          for gpu, per in measured.items() for k, v in per.items())
        # (Both causes in one count, as `dflash2_lookup_withheld_blocks_total`: named "slower to load than
        # to recompute" alone, a failing disk's back-off read as a cost figure with no prefill rate given.)
        lines.append(f"read back: {paths or 'unmeasured'}; lookup blocks withheld (slower to load than to "
                     f"recompute, or on an NVMe disk backing off after failed reads) {st.get('lookup_withheld', 0)}")
    late = d.get("background") or {}
    if late.get("late_s") is not None:
        lines.append(f"background step: started {1000 * late['late_s']:.1f} ms late the last time, at most "
                     f"{1000 * late['late_max_s']:.1f} ms over its last 64 runs; request queue "
                     f"{1000 * late['queue_behind_s']:.1f} ms behind (leases are judged as of then)")
    res = st.get("reservations", {})
    lines.append(f"reservations: granted {res.get('granted', 0)}, deferred {res.get('deferred', 0)}, "
                 f"reserved blocks {res.get('reserved_blocks', 0)}; totals: "
                 + _brief({k[len('total_'):]: v for k, v in res.items() if k.startswith("total_")}))
    clients = st.get("clients", [])
    lines += ["", f"clients: {len(clients)}"]
    aside = st.get("set_aside") or {}
    if aside.get("clients"):  # lapsed while their process may still write: kept out of reuse
        lines.append(f"set aside: {aside['blocks']} private blocks of {aside['clients']} lapsed client(s) "
                     "whose process may still write them"
                     + (f", and {aside['pinned']} blocks they had pinned, kept pinned" if aside.get("pinned") else ""))
    if clients:
        gpus = len(pools) > 1  # which GPU's pool each client uses
        lines += _table([("id", "name", "pid", *(("GPU",) if gpus else ()), "idle s")]
                        + [(str(c["client"]), str(c["name"]), str(c["pid"]), *((str(c.get("device")),) if gpus else ()),
                            f"{c['idle_s']:.1f}") for c in clients])
    return "\n".join(lines)


def _policy_lines(st: dict) -> list[str]:
    """The heat policy's adaptive split per tier and its admission gate at the last tier, per GPU
    pool on a node of several (a node's totals hold only the first pool's policy)."""
    pools = st.get("devices") or {None: st}
    lines = []
    for gpu, pool in pools.items():
        policy = pool.get("policy")
        if not isinstance(policy, dict):
            continue
        where = "" if gpu is None else f" (GPU {gpu})"
        if isinstance(pool.get("duel"), dict):
            lines.append(f"duel{where}: " + _duel_line(pool["duel"], policy.get("ranking")))
        split = policy.get("split") or []
        if split:
            lines.append(f"heat split{where}: " + "; ".join(
                f"{t['tier']} first-timers {t['first_timers']} (target {t['first_timer_target']:.0f}), "
                f"returning {t['returning']}" + _return_rates(t, SPLIT_NAMES) for t in split))
        inner = policy.get("returning_split") or []
        if inner:
            lines.append(f"returning blocks' split{where}: " + "; ".join(
                f"{t['tier']} seen 2-3 times {t['seen_2_3']} (target {t['seen_2_3_target']:.0f}), "
                f"seen 4+ times {t['seen_4_plus']}" + _return_rates(t, INNER_NAMES) for t in inner))
        gate = policy.get("admission") or {}
        if gate:
            rates = ", ".join(f"{k} {gate[f'{k}_return_rate']:.3f}" for k in ("refused", "departed")
                              if gate.get(f"{k}_return_rate") is not None)
            off = (f"off (heat ranks as {gate['following']}: every block admitted)" if gate.get("following")
                   else "off (gate)")
            lines.append(f"last-tier admission{where}: rule {'on' if gate['rule_on'] else off}; "
                         f"refused {gate['refused']}, admitted against the rule {gate['admitted_against_rule']}"
                         + (f"; asked for again: {rates}" if rates else ""))
    return lines


def _duel_line(d: dict, ranking: str | None) -> str:
    """What the heat policy's duel (dflash2/duel.py) decided and on what figures."""
    head = f"heat ranks as {ranking}" if ranking else f"following {d['following']}"
    if d["state"] == "off":
        return f"off ({d['off_reason']}); {head}"
    rates = d["hit_rate"]
    found = (", ".join(f"{c} {r:.3f}" for c, r in rates.items()) if all(r is not None for r in rates.values())
             else "none yet")
    hbm = d.get("hbm_hit_rate") or {}
    if hbm and all(r is not None for r in hbm.values()) and hbm != rates:
        found += " (in HBM " + ", ".join(f"{c} {r:.3f}" for c, r in hbm.items()) + ")"
    switches = f"{d['switches']} switch" + ("" if d["switches"] == 1 else "es")
    first = d.get("first_sample")
    coarser = ("" if first in (None, d["sample"]) else
               f" (coarser than the configured 1 in {first}: the loop fell behind)" if d["sample"] > first else
               f" (finer than the configured 1 in {first}: HBM is small)")
    state = d["state"]
    if state == "warming up" and d.get("turned_over") is not None:
        state += f", {100 * d['turned_over']:.0f}% turned over"  # (judging once a miniature let go what it holds)
    skipped = {why: n for why, n in (d.get("not_replayed") or {}).items() if n}
    return (f"{head} ({state}, {switches}); miniatures of 1 in {d['sample']} keys{coarser} found {found}; "
            f"{d['requests']} lookups served, {d['queued']} queued, {d['dropped']} dropped"
            + ("; not replayed: " + ", ".join(f"{n} {NOT_REPLAYED.get(why, why)}" for why, n in skipped.items())
               if skipped else ""))


# The lists' keys in the policy's stats, with the words shown for them.
SPLIT_NAMES = tuple(zip(LISTS, ("first-timers", "returning")))
INNER_NAMES = tuple(zip(INNER_LISTS, ("seen 2-3 times", "seen 4+ times")))


def _return_rates(tier: dict, names) -> str:
    """Of each list's departures from the tier, the share asked for again soon after; once known,
    the recent rates that decide whose ghosts move the split's target (policy/split.py, RATE_BAND)
    and the lists whose ghosts do not move it now; nothing before a block has left."""
    left, hits = tier.get("departures") or {}, tier.get("ghost_hits") or {}
    rates = [f"{name} {hits[lst] / left[lst]:.3f}" for lst, name in names if left.get(lst)]
    recent = tier.get("recent_return_rate") or {}
    if all(recent.get(lst) is not None for lst, _ in names):
        rates.append("lately " + ", ".join(f"{name} {recent[lst]:.3f}" for lst, name in names))
        moving = tier.get("ghosts_move_target") or {}
        held = [name for lst, name in names if moving.get(lst) is False]
        if held:
            rates.append(f"ghosts not moving the target: {', '.join(held)}")
    return f" (back soon after leaving: {', '.join(rates)})" if rates else ""


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
            for r in rows]


def _brief(d) -> str:
    if not isinstance(d, dict):
        return str(d)
    return ", ".join(f"{k} {round(v, 3) if isinstance(v, float) else v}" for k, v in d.items())


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
