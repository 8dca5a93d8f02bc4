"""`dflash2 bench policy`: replay a Mooncake-format trace through the real block manager.

Metadata only (no arenas): the trace's timestamps (ms) drive a virtual clock; a block is 512 tokens
and a request's `hash_ids` are its prefix block keys, in order (used as content keys, +1 so that none
is 0, chained by commit's parent). Each request, in arrival order, is served as replay.py serves it
(lookup, read the hit prefix `--chunk` blocks at a time, write the rest): `prefix_hit_rate` counts the
blocks of its leading run of cached blocks in any tier that it read, `hbm_prefix_hit_rate` only those
already in HBM on arrival (both null for a trace whose requests reference no block), and
`found_not_read` the blocks of that run it could not read (HBM could not be given room: recomputed). With `heat`, its duel (duel.py)
serves its miniatures after every request.

One JSON line per policy with the fields the policy issue defines (plus moves and read ratios).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence

from dflash2 import strictjson
from dflash2.argtypes import block_count, positive_block_count
from dflash2.bench import OptionError, non_negative_int, positive_int
from dflash2.config import (DEFAULT_DECAY_HALF_LIFE_S, DEFAULT_DUEL_SAMPLE, DUEL_SAMPLE_OF_ONE, MAX_DECAY_HALF_LIFE_S,
                             MAX_PREFETCH_WINDOW)
from dflash2.duel import MAX_SAMPLE, Duel
from dflash2.layout import Layout
from dflash2.manager import BlockManager, TierSpec
from dflash2.policy import make_policy, policy_names
from dflash2.prefetch import Prefetcher
from dflash2.replay import Request, Tally, serve
from dflash2.tiers import Tier

TOKENS_PER_BLOCK = 512
# 128 KiB blocks cut into pages of exactly one block: N blocks of capacity hold exactly N blocks.
LAYOUT = Layout("replay", num_layers=1, num_kv_heads=1, head_dim=64, dtype="fp16",
                tokens_per_block=TOKENS_PER_BLOCK)
SLOT = LAYOUT.block_bytes
ALIGN = 256


MAX_HASH_ID = (1 << 64) - 2  # content keys are uint64 and the replay adds 1 (0 means "no key")
MAX_TIMESTAMP_MS = 1e18  # (milliseconds: 30 million years)
# The least the replay's clock moves between requests that share a timestamp (replay): a thousand of
# them fit in a millisecond.
SAME_TIME_STEP_S = 1e-6


def load_trace(path: str, limit: int | None = None) -> list[Request]:
    """The trace's requests, checked: OptionError names the file and line of anything the replay
    cannot use (the file missing or empty, a line that is not a request, timestamps that go back,
    a hash id that is not a uint64 or recurs within its request)."""
    try:
        with open(path, encoding="utf-8") as f:
            out = _requests(f, path, limit)
    except OSError as exc:
        raise OptionError(f"--trace: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise OptionError(f"--trace {path}: not UTF-8 text (a JSONL trace, one request a line)") from None
    if not out:
        raise OptionError(f"--trace {path} holds no requests")
    return out


def _requests(lines, path: str, limit: int | None) -> list[Request]:
    out: list[Request] = []
    parent_of: dict[int, int] = {}  # each hash id's block before it, where it first came
    off: set[int] = set()  # the hash ids (keys) found after another block
    first = None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        req = _request(line, f"--trace {path}, line {number}")
        if out and req.t_s < out[-1].t_s:
            raise OptionError(f"--trace {path}, line {number}: timestamp {_ms_text(req.t_s)} is earlier "
                              f"than the line before's ({_ms_text(out[-1].t_s)}); the replay needs "
                              "arrival order (sort the trace by timestamp)")
        for before, key in zip((0, *req.keys), req.keys):
            if parent_of.setdefault(key, before) != before:
                off.add(key)
                first = first or (number, key - 1)
        out.append(req)
        if limit is not None and len(out) >= limit:
            break
    if off:
        # A prefix block hash names its whole prefix, so it always follows the same block. One
        # that does not is looked up by itself: a request found it cached though its own prefix
        # was not (a review: 2 of 7 blocks counted as hits, none of them read). Said, not refused:
        # a real trace's few such ids (a remapping's collisions) should not stop its replay.
        print(f"dflash2 bench policy: --trace {path}: {len(off)} hash ids follow another block than where they "
              f"first came (the first: line {first[0]}, hash id {first[1]}); hash_ids are prefix block "
              "hashes, so the figures for those blocks are not a prefix cache's", file=sys.stderr)
    return out


def _ms_text(t_s: float) -> str:
    """A request's timestamp in milliseconds, in as few digits as tell it apart (15 said two
    16-digit timestamps, one a millisecond before the other, as one number: a review)."""
    for digits in (15, 16, 17):
        text = f"{t_s * 1000:.{digits}g}"
        if float(text) / 1000.0 == t_s:
            return text
    return text


def _request(line: str, where: str) -> Request:
    try:
        rec = strictjson.decode(line)
    except strictjson.KeyTwice as exc:  # (json keeps the last: `"hash_ids": [1, 2], "hash_ids": []` lost the blocks)
        raise OptionError(f"{where}: {exc.path!r} is named twice in one object") from None
    except json.JSONDecodeError as exc:
        raise OptionError(f"{where}: not JSON ({exc.msg})") from None
    except (ValueError, RecursionError) as exc:  # a number of over 4300 digits; nesting deeper than the stack
        raise OptionError(f"{where}: not JSON ({'nested too deeply' if isinstance(exc, RecursionError) else str(exc).split(';')[0]})") from None
    if not isinstance(rec, dict):
        raise OptionError(f"{where}: not a JSON object (a Mooncake request: timestamp, hash_ids)")
    for field in ("timestamp", "hash_ids"):
        if field not in rec:
            raise OptionError(f"{where}: the request has no {field!r} (a Mooncake request: timestamp, hash_ids)")
    ts, ids = rec["timestamp"], rec["hash_ids"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or (isinstance(ts, float) and not math.isfinite(ts)) \
            or abs(ts) > MAX_TIMESTAMP_MS:  # (an int of 400 digits raised OverflowError in isfinite)
        raise OptionError(f"{where}: timestamp {ts!r} is not a number of milliseconds")
    if not isinstance(ids, list):
        raise OptionError(f"{where}: hash_ids {ids!r} is not a list")
    for h in ids:
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= MAX_HASH_ID:
            raise OptionError(f"{where}: hash id {h!r} is not an integer in 0..2**64-2")
    if len(set(ids)) < len(ids):  # a prefix block hash names its whole prefix: it cannot recur in it
        twice = sorted({h for h in ids if ids.count(h) > 1})
        raise OptionError(f"{where}: hash ids {twice} occur twice in one request; hash_ids are prefix block hashes")
    return Request(ts / 1000.0, tuple(h + 1 for h in ids))


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def prefetch_window_arg(text: str) -> int:
    """`--prefetch-window`: as `kv_block.prefetch_window` is bounded (0 to 65536 blocks)."""
    value = non_negative_int(text)
    if value > MAX_PREFETCH_WINDOW:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_PREFETCH_WINDOW} (as kv_block.prefetch_window), "
                                         f"got {text!r}")
    return value


def replay(requests: Sequence[Request], policy: str, hbm_blocks: int, dram_blocks: int = 0,
           nvme_blocks: int = 0, prefetch_window: int = 4, chunk: int = 16,
           weights: dict[str, float] | None = None, duel_sample: int = DEFAULT_DUEL_SAMPLE,
           decay_half_life_s: float | None = DEFAULT_DECAY_HALF_LIFE_S) -> dict:
    """`weights`: the heat policy's weights to change (`policy.weights`); only for `heat`.
    `duel_sample`: heat follows the best of heat, LRU and LFU in miniature replays of 1 in N keys
    (dflash2/duel.py, `policy.duel_sample`); 0: heat ranks as heat throughout.
    `decay_half_life_s`: heat's access counts halve once per this much of the trace's time, as the
    daemon's do by wall time (`policy.decay_half_life_s`); None: only after their sample of
    references. (Before, the replay never halved them by time: the daemon's heat at its default
    then, 60 s, found fewer blocks than the bench said, fewer than LRU at 2,000 synthetic blocks.)"""
    clock = VirtualClock()
    specs = [TierSpec(Tier.HBM, hbm_blocks * SLOT, SLOT, ALIGN)]
    specs += [TierSpec(t, n * SLOT, SLOT, ALIGN) for t, n in ((Tier.DRAM, dram_blocks), (Tier.NVME, nvme_blocks)) if n]
    pol = _make_policy(policy, weights, decay_half_life_s)
    capacity = 1 << max(10, (hbm_blocks + dram_blocks + nvme_blocks + 1024 - 1).bit_length())  # a power of two
    mgr = BlockManager(specs, policy=pol, clock=clock, table_capacity=capacity)
    lid = mgr.register_layout(LAYOUT)
    client = mgr.attach("replay")
    prefetch = Prefetcher(mgr, prefetch_window)
    duel = Duel(mgr, duel_sample, knob="--duel-sample") if duel_sample and hasattr(pol, "follow") else None
    if hasattr(pol, "set_future"):
        pol.set_future([r.keys for r in requests])
    tally = Tally()
    t0 = time.perf_counter()
    for i, req in enumerate(requests):
        # Strictly later than the request before, by the least step a float takes when the trace
        # gives both the same millisecond (allowed: it need only be in arrival order): at one time,
        # LRU ranked them arbitrarily, and "lru" was not LRU on such a trace (a review's [1] [2] [1]
        # [3] [1] in 2 blocks, every timestamp 0: 1 of 5 found, LRU finds 2). At least SAME_TIME_STEP_S
        # later: a float's least step (5e-324 s at 0) vanished in LFU's recency term, 1 / (2 + age),
        # and "lfu" broke its ties arbitrarily there (a review's [1] [2] [2] [1] [3] [1] in 2 blocks,
        # every timestamp 0: 2 of 6 found, LFU finds 3).
        clock.now = max(req.t_s, clock.now + SAME_TIME_STEP_S, math.nextafter(clock.now, math.inf)) if i else req.t_s
        if hasattr(pol, "advance"):
            pol.advance(i)
        if hasattr(pol, "decay_to"):
            pol.decay_to(clock.now)  # what the daemon's tick does, at each request's time
        serve(mgr, prefetch, client, lid, req, i, tally, chunk)
        if duel is not None:
            duel.run()  # what the daemon's ticks do, as if they always kept up
    elapsed = time.perf_counter() - t0
    mgr.check_invariants()
    out = _record(mgr, prefetch, policy, tally, len(requests), hbm_blocks, dram_blocks, nvme_blocks, elapsed)
    gate = getattr(pol, "gate", None)
    if gate is not None and (gate.counts["refused"] or gate.counts["admitted_against_rule"]):
        # heat: what the last tier's admission rule won and lost (rule_on false while following LRU or LFU:
        # every block admitted then; the gate's own state said true, a review)
        out["admission_gate"] = pol.describe()["admission"]
    if weights:
        out["weights"] = dict(pol.weights)
    if hasattr(pol, "decay_to"):
        out["decay_half_life_s"] = decay_half_life_s
    if duel is not None:
        out["duel"] = duel.describe()
    return out


def _make_policy(policy: str, weights: dict[str, float] | None, decay_half_life_s: float | None = None):
    pol = make_policy(policy, decay_half_life_s=decay_half_life_s) if policy == "heat" else make_policy(policy)
    if weights:
        if not hasattr(pol, "set_weights"):
            raise OptionError(f"--weights: policy {policy!r} has no weights (only heat has)")
        try:
            pol.set_weights(weights)
        except ValueError as exc:  # an unknown name or a negative weight, as the policy says
            raise OptionError(f"--weights: {exc}") from None
    return pol


def _record(mgr: BlockManager, prefetch: Prefetcher, policy: str, tally: Tally, n_req: int,
            hbm: int, dram: int, nvme: int, elapsed: float) -> dict:
    s = mgr.placement.stats
    reads = mgr.access.reads
    total_reads = sum(reads.values())
    return {
        "policy": policy,
        "hbm_blocks": hbm,
        "dram_blocks": dram,
        "nvme_blocks": nvme,
        "requests": n_req,
        "block_refs": tally.refs,
        # (null when the trace references no block, every hash_ids empty: a rate of 0 said that
        # none of them was found)
        "prefix_hit_rate": round(tally.hits / tally.refs, 4) if tally.refs else None,
        "hbm_prefix_hit_rate": round(tally.hbm_hits / tally.refs, 4) if tally.refs else None,
        "hbm_read_ratio": round(reads[Tier.HBM] / total_reads, 4) if total_reads else None,
        "reads_by_tier": {Tier(t).label: n for t, n in sorted(reads.items())},
        "promotions": s.promoted,
        "demotions": s.demoted,
        "evictions": s.evicted,
        "not_admitted": s.not_admitted,
        # batches the moves took (each one copy launch on a GPU): many blocks per batch keep the
        # link busy, one or two per batch pay a launch and a wait for each
        "move_batches": {f"{a.label}->{b.label}": {"batches": st.batches, "blocks": st.blocks}
                         for (a, b), st in sorted(mgr.mover.stats.items()) if st.batches},
        "prefetch_useful": prefetch.useful,
        "prefetch_wasted": prefetch.wasted,
        "found_not_read": tally.found_not_read,
        "uncached_blocks": tally.uncached,
        "replay_s": round(elapsed, 2),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    parser.add_argument("--hbm-blocks", type=positive_block_count, required=True, help="HBM capacity in 512-token blocks")
    parser.add_argument("--dram-blocks", type=block_count, default=0, help="DRAM capacity in blocks (0 = none)")
    parser.add_argument("--nvme-blocks", type=block_count, default=0, help="NVMe capacity in blocks (0 = none)")
    parser.add_argument("--policies", default="heat,lru,lfu,belady", help="comma-separated policy names (default %(default)s)")
    parser.add_argument("--prefetch-window", type=prefetch_window_arg, default=4, help="kv_block.prefetch_window (blocks; default %(default)s)")
    parser.add_argument("--chunk", type=positive_int, default=16, help="blocks read per step of a request (default %(default)s)")
    parser.add_argument("--limit", type=positive_int, default=None, help="replay only the first N requests (default: all)")
    # (--duel-sample and --decay-half-life-s are absent from `args` unless given: `heat_options`)
    parser.add_argument("--duel-sample", type=sample_arg, default=argparse.SUPPRESS,
                        help="heat follows the best of heat, LRU and LFU replayed in miniature on 1 in N content "
                             f"keys (policy.duel_sample; default {DEFAULT_DUEL_SAMPLE}; finer, down to 2, where 1/N "
                             "of HBM holds fewer than 32 blocks; 0: off)")
    parser.add_argument("--weights", default="",
                        help="heat weights to change, NAME=VALUE pairs (comma separated), e.g. recency=2; "
                             "applied to the heat policy, the others replay as they are")
    parser.add_argument("--decay-half-life-s", type=half_life_arg, default=argparse.SUPPRESS,
                        help="heat's access counts halve once per this many seconds of the trace's time "
                             f"(policy.decay_half_life_s; default {DEFAULT_DECAY_HALF_LIFE_S:g}; 0: never by time)")


def half_life_arg(text: str) -> float | None:
    """--decay-half-life-s: as `policy.decay_half_life_s` (> 0, at most MAX_DECAY_HALF_LIFE_S), or 0
    for none (the counts halve only after their sample of references)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value <= MAX_DECAY_HALF_LIFE_S:  # (NaN fails both)
        raise argparse.ArgumentTypeError(f"0 (none) or a half-life in seconds up to {MAX_DECAY_HALF_LIFE_S:g} "
                                         f"(as policy.decay_half_life_s), got {text}")
    return value or None


def sample_arg(text: str) -> int:
    """--duel-sample: as `policy.duel_sample`, 0 or N >= 2, at most MAX_SAMPLE."""
    n = non_negative_int(text)
    if n == 1:
        raise argparse.ArgumentTypeError(DUEL_SAMPLE_OF_ONE)
    if n > MAX_SAMPLE:
        raise argparse.ArgumentTypeError(f"at most {MAX_SAMPLE} (as policy.duel_sample), got {n}")
    return n


def parse_weights(text: str) -> dict[str, float]:
    """'recency=2,fanout=0' -> {'recency': 2.0, 'fanout': 0.0}; names are checked by the policy."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, value = item.partition("=")
        try:
            if not eq or not name.strip() or not math.isfinite(float(value)):
                raise ValueError
        except ValueError:
            raise OptionError(f"--weights: {item!r} is not NAME=NUMBER") from None
        if name.strip() in out:
            raise OptionError(f"--weights names {name.strip()!r} twice")
        out[name.strip()] = float(value)
    return out


def parse_policies(text: str) -> list[str]:
    """'heat,lru' -> ['heat', 'lru'], checked before any replay (a bad name found after an hour of
    replaying the others would lose that hour)."""
    names = [name.strip() for name in text.split(",")]
    valid = policy_names()
    if not any(names):
        raise OptionError(f"--policies names no policy; valid: {', '.join(valid)}")
    if not all(names):  # ('heat,,lru': a name left out, it was dropped without a word)
        raise OptionError(f"--policies {text!r} has an empty name; valid: {', '.join(valid)}")
    unknown = [name for name in names if name not in valid]
    if unknown:
        raise OptionError(f"--policies: unknown {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}")
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise OptionError(f"--policies names {', '.join(map(repr, twice))} more than once")
    return names


def heat_options(args, names: list[str], weights: dict[str, float]) -> tuple[int, float | None]:
    """The heat policy's options (--duel-sample, --decay-half-life-s), their defaults where not given;
    OptionError for any of them (--weights too) given while --policies does not list heat (before,
    the first two were ignored without a word)."""
    given = [opt for opt, on in (("--weights", bool(weights)), ("--duel-sample", hasattr(args, "duel_sample")),
                                 ("--decay-half-life-s", hasattr(args, "decay_half_life_s"))) if on]
    if given and "heat" not in names:
        raise OptionError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to the heat policy, "
                          "which --policies does not list")
    return (getattr(args, "duel_sample", DEFAULT_DUEL_SAMPLE),
            getattr(args, "decay_half_life_s", DEFAULT_DECAY_HALF_LIFE_S))


def run(args) -> list[dict]:
    weights = parse_weights(args.weights)
    names = parse_policies(args.policies)
    duel_sample, half_life = heat_options(args, names, weights)
    if weights:
        _make_policy("heat", weights)  # names and values checked before any replay, not after the others
    requests = load_trace(args.trace, args.limit)
    try:
        return [replay(requests, name, args.hbm_blocks, args.dram_blocks, args.nvme_blocks,
                       args.prefetch_window, args.chunk, weights if name == "heat" else None, duel_sample,
                       half_life)
                for name in names]
    except MemoryError as e:  # the tiers' slot records do not fit: say which sizes, not a traceback
        raise OptionError(f"--hbm-blocks {args.hbm_blocks} --dram-blocks {args.dram_blocks} --nvme-blocks "
                          f"{args.nvme_blocks}: the tiers' metadata does not fit in this machine's memory "
                          f"({e})") from None
