"""`dflash2 bench table`: the block table at scale (metadata only, one process, CPU).

- bytes_per_block: memory the table grows by per cached block (numpy and Python allocations traced,
  and the rows in use of the columns' reserved mappings, which tracemalloc does not see: rowspace.py),
  with a million blocks committed under content keys and released (the steady state of a cache;
  a million is about 2^20, the best case: the table's capacity doubles as it grows, so just past a
  power of two a block costs up to twice as much);
  policy_bytes_per_block: what the policy keeps per block on top, after its first scoring pass
  (traced in the same build; heat's per-row state, its gate's ghost tables and, past 2^16 rows, its
  frequency sketch, sized by the table's rows, and the two score buffers its passes take turns
  with (one of them was left out before 2026-12-04's sixth session: 4.2 bytes); not its split's, made once blocks leave a tier,
  which none does here; LRU's and LFU's none to speak of); policy_fixed_bytes: what the policy
  takes when it is made,
  whatever the table's size (heat's hit-density ghosts: a fixed 2^20 entries);
- build_s: that build timed in a build of its own, untraced (tracing allocations slows it 5-7x);
- select_ms: the choice alone, from the policy's current scores (what a demotion costs between passes);
  both it and rescore_ms run on a served cache's access history (each chain written, then read in
  prefixes from its root: `_served`), whose coldest blocks are whole cold tails, so that the choice
  takes the 1% asked for; select_victims: the fewest victims a timed choice took (of select_asked),
  select_short: true, and a line on stderr, where it or chain_select_victims is fewer than asked (before 2026-12-06 the
  ages were random per block, and the choice took a few leaves: one round of make_room, not 1%);
- chain_select_ms: the same choice when the coldest blocks are whole prefix chains 1,024 blocks deep
  (each commit of the build is one chain; the chains are then read in a random order): what making
  room for a long prompt's prefix costs, victims taken whole, leaves first (chain_select_victims);
- rescore_ms: one full scoring pass of the policy over every block plus the choice of 1% of them as
  victims (placement's own selection), against baseline_ms: numpy argpartition of as many float32;
- alloc_free_per_s: blocks allocated and freed again per second, in calls of `--batch` blocks, on the
  loaded table;
- table_doubling_ms, table_doubled_to: the manager's allocate (its policy's state included) that
  last doubled the table while a build of its own through the manager's calls filled it, and the
  rows the table doubled to; key_index_doubling_ms, key_index_doubled_to: the commit that last
  doubled the key index, and its slots then (null where the build doubled neither). The daemon's
  loop stands still for as long, once per doubling while a cache fills (rowspace.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import tracemalloc

import numpy as np

from dflash2.argtypes import positive_block_count
from dflash2.bench import OptionError, positive_int
from dflash2.layout import Layout
from dflash2.manager import BlockManager, TierSpec
from dflash2.policy import Policy, make_policy, policy_names
from dflash2.tiers import Tier

LAYOUT = Layout("bench", num_layers=1, num_kv_heads=1, head_dim=64, dtype="fp16", tokens_per_block=64)


# The least a cached block takes of the table (its columns and key index: about 115 bytes at a million
# blocks, up to twice that just past a power of two; README's bench table row).
TABLE_BYTES_FLOOR = 100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # (at most 2^40: a count past numpy's largest array ended in a ValueError traceback, a review)
    parser.add_argument("--blocks", type=positive_block_count, default=1_000_000,
                        help="cached blocks to build (default %(default)s)")
    parser.add_argument("--policy", default="lru", help="policy to score with (default lru)")
    parser.add_argument("--batch", type=positive_int, default=32, help="blocks per allocate/free call (default 32)")
    parser.add_argument("--repeat", type=positive_int, default=5, help="timed repeats; the median is reported (default %(default)s)")


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return float(np.median(times))


CHUNK = 1024  # blocks per commit of the build: one prefix chain each


def _empty(n: int, policy: str) -> tuple[BlockManager, int, int]:
    """(manager, layout id, client) for a table of n blocks. Metadata only: the tier's capacity is
    bytes of address space, nothing lies behind it."""
    slot = LAYOUT.block_bytes  # 16 KiB: a multiple of the alignment, so no rounding
    mgr = BlockManager([TierSpec(Tier.HBM, 2 * n * slot + (64 << 20), 2 << 20, 256)], policy=policy)
    return mgr, mgr.register_layout(LAYOUT), mgr.attach("bench")


def _fill(mgr: BlockManager, lid: int, client: int, n: int) -> None:
    """n cached blocks, committed under content keys and released."""
    for start in range(0, n, CHUNK):
        k = min(CHUNK, n - start)
        vids = mgr.table.allocate(client, lid, k)
        vids = mgr.table.commit(client, vids, keys=range(start + 1, start + k + 1))
        mgr.table.free(client, vids)


def _served(mgr: BlockManager, rng: np.random.Generator, n: int, reads: int = 4) -> None:
    """The access history of a served cache, in the table and the policy (told of each write and
    read, as in the daemon: heat's ticks and classes come from those calls, not the columns): each
    chain written whole (in a random order), then read `reads` times, each read a prefix of random
    length from its root, ancestors first. An ancestor is so never older nor less read than its
    descendants, and the coldest blocks are whole subtrees (a chain's unread tail) that the choice
    of 1% takes whole. (Random ages and counts per block stood here: a child was as often hotter
    than its parent, and since only leaves and wholly cold subtrees may leave, the timed choice
    asked for 10,000 victims of a million and took 6, a review.) Every time here lies before the
    chains' reads of chain_select_ms (2.0 on)."""
    c = mgr.table.cols
    starts = np.arange(0, n, CHUNK)
    c.hits[mgr.table.live_rows()] = 0
    def chain(start: int, depth: int) -> np.ndarray:
        return mgr.table.keys.lookup(np.arange(start + 1, start + depth + 1, dtype=np.uint64))
    for i, start in enumerate(rng.permutation(starts).tolist()):
        rows, now = chain(start, min(CHUNK, n - start)), 0.5 * i / len(starts)
        c.last_access[rows] = now
        mgr.policy.on_insert(mgr.table, rows, now)
        mgr.policy.on_commit(mgr.table, rows, now)
    order = rng.permutation(np.repeat(starts, reads)).tolist()
    for i, start in enumerate(order):
        rows = chain(start, int(rng.integers(1, min(CHUNK, n - start) + 1)))
        now = 0.5 + 0.5 * (i + 1) / (len(order) + 1)
        mgr.table.touch(rows, now=now)
        mgr.policy.on_access(mgr.table, rows, now)


def _say_short(figures: str, victims: int, asked: int) -> None:
    """A line on stderr where a timed choice took fewer victims than asked: `figures` time less than
    the choice of 1% (`select_short` in the JSON, for either choice)."""
    if victims < asked:
        print(f"dflash2 bench table: the timed choice took {victims} of the {asked} victims asked for (blocks "
              f"held back by hotter descendants): {figures} time less than the choice of 1% (select_short in "
              "the figures)", file=sys.stderr)


def _traced_bytes(n: int, policy: str) -> tuple[float, float]:
    """(table bytes per block, policy bytes per block after its first scoring pass), traced."""
    mgr, lid, client = _empty(n, policy)
    tracemalloc.start()
    try:
        # (the columns and heat's per-row state lie in reserved mappings, which tracemalloc does
        # not see: their rows in use are added, rowspace.py; so do the key index's arrays, whole)
        def mapped() -> int:
            return mgr.table.cols.mapped_bytes + mgr.table.keys.mapped_bytes
        before = tracemalloc.get_traced_memory()[0] + mapped()
        made = mgr.policy.mapped_bytes()  # (in policy_fixed_bytes: heat's sketch, 1 MiB, was counted per block too)
        _fill(mgr, lid, client, n)
        table = tracemalloc.get_traced_memory()[0] + mapped() - before
        mgr.policy.rescore(mgr.table, mgr.table.clock())  # heat sizes its per-row state here
        after = tracemalloc.get_traced_memory()[0] + mapped() + mgr.policy.mapped_bytes() - made
        kept = after - before - table
    finally:
        tracemalloc.stop()
    mgr.close()
    return table / n, kept / n


def _doublings(n: int, policy: str) -> dict:
    """The calls that last doubled the table and its key index, in a build of n blocks through the
    manager's own allocate, commit and free (the policy told of each, as in the daemon)."""
    mgr, lid, client = _empty(n, policy)
    out = {"table_doubling_ms": None, "table_doubled_to": None, "key_index_doubling_ms": None,
           "key_index_doubled_to": None}
    for start in range(0, n, CHUNK):
        k = min(CHUNK, n - start)
        rows, slots = mgr.table.cols.capacity, mgr.table.keys.slots
        t = time.perf_counter()
        vids = mgr.allocate(client, lid, k)
        took = time.perf_counter() - t
        if mgr.table.cols.capacity != rows:
            out["table_doubling_ms"], out["table_doubled_to"] = round(took * 1e3, 2), mgr.table.cols.capacity
        t = time.perf_counter()
        vids = mgr.commit(client, vids, keys=range(start + 1, start + k + 1))
        took = time.perf_counter() - t
        if mgr.table.keys.slots != slots:
            out["key_index_doubling_ms"], out["key_index_doubled_to"] = round(took * 1e3, 2), mgr.table.keys.slots
        mgr.free(client, vids)
    mgr.close()
    return out


def _policy_fixed_bytes(policy: str) -> int:
    """Bytes the policy allocates when it is made (traced; it is dropped after)."""
    tracemalloc.start()
    try:
        made = make_policy(policy)
        fixed = tracemalloc.get_traced_memory()[0] + made.mapped_bytes()  # while it is alive
    finally:
        tracemalloc.stop()
    del made
    return fixed


def run(args) -> dict:
    if args.policy not in policy_names():
        raise OptionError(f"--policy: unknown {args.policy!r}; valid: "
                          f"{', '.join(n for n in policy_names() if n != 'belady')}")
    if args.policy == "belady":  # without a trace it has no future to rank by: every block ties
        raise OptionError("--policy belady ranks blocks by a trace's future: it runs in `bench policy` only")
    if args.batch > args.blocks:  # (past the table's tier, which holds --blocks and some slack: a TypeError)
        raise OptionError(f"--batch {args.batch} is more than --blocks {args.blocks}")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if args.blocks * TABLE_BYTES_FLOOR > memory:  # (numpy maps far more than it has: it ran on, a review)
        raise OptionError(f"--blocks {args.blocks}: the table does not fit in this machine's memory (at least "
                          f"{TABLE_BYTES_FLOOR} bytes a block, {memory} bytes here)")
    try:
        return _run(args)
    except MemoryError as e:
        raise OptionError(f"--blocks {args.blocks}: the table does not fit in this machine's memory ({e})") from None


def _run(args) -> dict:
    n = args.blocks
    slot = LAYOUT.block_bytes
    table_bytes, policy_bytes = _traced_bytes(n, args.policy)
    mgr, lid, client = _empty(n, args.policy)
    # The bench's passes are its own (full_pass): heat's scores, expiring rescore_interval_s of wall
    # clock after its last pass, made the timed choices run full passes once a repeat took that long
    # (at --blocks 4000000 four of select_ms's five, a review).
    if hasattr(mgr.policy, "rescore_interval_s"):
        mgr.policy.rescore_interval_s = float("inf")
    t0 = time.perf_counter()
    _fill(mgr, lid, client, n)
    build_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    _served(mgr, rng, n)
    need = (n // 100) * slot
    chosen: list[int] = []  # victims per timed choice: the figures are of 1% only if each chose it
    def choose():
        chosen.append(len(mgr.placement.select(Tier.HBM, need, evict=True)))
    # (a policy whose rescore is the base's, its scores_all, caches nothing: the choice's own pass is
    # the pass; the bench's, thrown away, made LFU's rescore_ms two passes, a review)
    caches = type(mgr.policy).rescore is not Policy.rescore
    def full_pass():  # a fresh scoring pass over every block, then the choice of 1% as victims
        if caches:
            mgr.policy.rescore(mgr.table, mgr.table.clock())
        choose()
    rescore = _median_ms(full_pass, args.repeat)
    select = _median_ms(choose, args.repeat)
    victims = min(chosen)
    _say_short("rescore_ms and select_ms", victims, n // 100)
    # Chains as the coldest blocks: each chunk of the build is one chain (block i's parent is i-1).
    starts = np.arange(0, n, CHUNK)
    for i, start in enumerate(rng.permutation(starts).tolist()):
        rows = mgr.table.keys.lookup(np.arange(start + 1, min(start + CHUNK, n) + 1, dtype=np.uint64))
        mgr.table.touch(rows, now=2.0 + i)
        mgr.policy.on_access(mgr.table, rows, 2.0 + i)
    mgr.policy.rescore(mgr.table, mgr.table.clock())
    chosen.clear()
    chain_select = _median_ms(choose, args.repeat)
    chain_victims = min(chosen)
    _say_short("chain_select_ms", chain_victims, n // 100)
    baseline_data = rng.random(n).astype(np.float32)
    baseline = _median_ms(lambda: np.argpartition(baseline_data, n // 100), args.repeat)
    cycles = max(1, 200_000 // args.batch)
    t0 = time.perf_counter()
    for _ in range(cycles):
        mgr.table.free(client, mgr.table.allocate(client, lid, args.batch))
    alloc_free = cycles * args.batch / (time.perf_counter() - t0)
    mgr.check_invariants()
    return {
        "blocks": n,
        "policy": args.policy,
        "bytes_per_block": round(table_bytes, 1),
        "policy_bytes_per_block": round(policy_bytes, 1),
        "policy_fixed_bytes": _policy_fixed_bytes(args.policy),
        "build_s": round(build_s, 2),
        "rescore_ms": round(rescore, 2),
        "select_ms": round(select, 2),
        "select_victims": victims,
        "select_asked": n // 100,
        "select_short": min(victims, chain_victims) < n // 100,
        "chain_select_ms": round(chain_select, 2),
        "chain_select_victims": chain_victims,
        "baseline_ms": round(baseline, 2),
        "rescore_over_baseline": round(rescore / baseline, 2),
        "alloc_free_per_s": round(alloc_free),
        "alloc_batch": args.batch,
        **_doublings(n, args.policy),
    }
