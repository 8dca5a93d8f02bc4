"""The key spaces a server's clears move it to (`DFlash2Storage.clear`); no torch, no sglang.

A server that clears (sglang's /clear_hicache_storage_backend, after an in-place weight update, or its
PD role switch) keys its pages in `|clear=<launch>.<epoch>` from then on (keys.namespace):

- `launch`: a random token the plugin draws once per server launch (`rewrite_args`), passed to every
  rank in the extra config (`dflash2_launch`), so a TP / MLA server's ranks clear in step. A counter
  alone was no key space of the server's own: two servers of one identity that each cleared once
  (one after an update to W2, the other after its role switch or an update to W3) both landed on
  `|clear=1` and read each other's KV as hits (a review).
- `epoch`: the clears of this launch on this rank, kept here, at module level, not on the backend:
  sglang detaches and attaches its storage backend again within the process (a new DFlash2Storage),
  and the new one started at epoch 0, back in the key space of the weights before the update, whose
  KV it read as hits (a review). It continues from here.

A backend whose extra config gives no launch (an operator's own attach config), or a launch this
process never cleared under, takes this rank's last key space if this process has cleared, and says
so (`resume`: a cleared rank never goes back to epoch 0); one with none that clears takes the launch
its rank's first backend was given, else draws this process's own token. A rank's backends in one
process (sglang's PD decode offload makes two) follow its clears (`follow`), and a clear reaching
both counts once (`bump`). Epoch 0 is no part of the namespace: a server that never cleared shares
its pages with every server of its identity.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
from collections.abc import Hashable

log = logging.getLogger("dflash2.sglang")

LAUNCH_KEY = "dflash2_launch"  # the extra config's key of the launch token (plugin.backend_extra_config)


def new_launch() -> str:
    """A launch token: unique to one server launch (64 random bits)."""
    return secrets.token_hex(8)


@dataclasses.dataclass(frozen=True)
class KeySpace:
    """Where a server's pages are keyed: its launch token and its clear epoch (0: never cleared)."""

    launch: str | None = None
    epoch: int = 0

    def tag(self) -> str:
        """The namespace's clear part (keys.namespace): "" at epoch 0."""
        return f"{self.launch}.{self.epoch}" if self.epoch else ""


_lock = threading.Lock()  # (sglang's ranks of one process, and tests' backends, may clear at once)
_epochs: dict[tuple[str, Hashable], int] = {}  # (launch, rank) -> its last clear epoch in this process
_last: dict[Hashable, KeySpace] = {}  # rank -> the key space its last clear moved to
_own: list[str] = []  # this process's token for clears whose config gave none (drawn once)
# rank -> the first launch token a backend of it was given in this process: a backend attached again
# with no token clears under it, in step with the server's ranks in other processes (each drew its own
# token, and an MLA model's readers missed its writer's pages till a restart, a review).
_seen: dict[Hashable, str] = {}


def resume(launch, rank: Hashable) -> KeySpace:
    """The key space a backend made now starts in (`launch`: the extra config's token, or None;
    `rank`: which rank of the server it is). A rank of a process that has cleared never goes back to
    epoch 0, whose namespace is the old weights': a config with no token, or with a token this process
    never cleared under (another launch's, copied; the launch's own after a clear under the process's
    own token), keeps the last key space, and says so (it went back, and read the old KV as hits, a
    review)."""
    with _lock:
        last = _last.get(rank)
        if launch:
            launch = str(launch)
            _seen.setdefault(rank, launch)
            if last is None or (launch, rank) in _epochs:
                return KeySpace(launch, _epochs.get((launch, rank), 0))
            given = f"gives {LAUNCH_KEY} {launch}, under which this process never cleared"
        elif last is None:
            return KeySpace(_seen.get(rank))  # (epoch 0: its first launch's token, for a clear)
        else:
            given = f"gives no {LAUNCH_KEY} (an attach config of one's own?)"
    log.warning("dflash2: the storage backend's extra config %s; this process cleared its pages' key space "
                "before, so this backend keeps the last one (launch %s, clear epoch %d), not the one of the "
                "weights before the clear", given, last.launch, last.epoch)
    return last


def follow(space: KeySpace, rank: Hashable) -> KeySpace:
    """The key space a backend of `rank` now in `space` keys its pages in: its rank's last clear's,
    where the rank cleared through another backend of this process. sglang's PD decode with
    --disaggregation-decode-enable-offload-kvcache makes a second storage backend of the rank (its
    offload manager's) from the same extra config; /clear_hicache_storage_backend reaches only the
    tree cache's, and the other kept writing the new weights' KV under the old weights' namespace (a
    review). One process is one server's rank: its backends move together. (Lock-free: a dict read
    of an immutable KeySpace, on every batch call.)"""
    last = _last.get(rank)
    return space if last is None or last == space else last


def bump(space: KeySpace, rank: Hashable) -> KeySpace:
    """The key space of `space`'s next clear on `rank` (recorded here); a token of this process's
    own, drawn where the config gave none, is said. A backend behind its rank (`follow`: the rank
    cleared through another backend since this one last looked) takes the rank's last key space and
    counts no clear: one operator call that reaches two backends of a rank moves it once, as it moves
    the server's ranks in other processes with one backend each (an MLA model's readers stay in step)."""
    note = ""
    with _lock:
        last = _last.get(rank)
        if last is not None and last != space:
            return last
        launch = space.launch or _seen.get(rank)
        if launch is None:
            if not _own:
                _own.append(new_launch())
            launch = _own[0]
            note = (f"dflash2: the storage backend's extra config gives no {LAUNCH_KEY} (--dflash2-config passes "
                    f"one): this process keys its pages under its own token {launch}, which the server's ranks in "
                    "other processes do not share: an MLA model's readers miss its writer's pages from now")
        epoch = max(_epochs.get((launch, rank), 0), space.epoch) + 1
        _epochs[(launch, rank)] = epoch
        _last[rank] = new = KeySpace(launch, epoch)
    if note:
        log.warning(note)
    return new
