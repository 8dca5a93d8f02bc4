"""What `dflash2d --check` can tell of this machine at this moment (its `now:` lines): whether the
memory, address space and disk the plan takes fit now, whether CuPy imports where the plan is
CUDA's, and whether the endpoint's and metrics' ports can be bound. Apart from daemon/main.py because
it is a job of its own; main.py runs it for `--check`.
"""

from __future__ import annotations

import fcntl
import importlib
import os
import stat
from pathlib import Path

from dflash2.files import nearest_existing, read_only
from dflash2.plan import Plan, files_said


# Address space a starting daemon maps beyond its tiers, staging buffers, threads' stacks and block
# table, and beyond what is mapped when it weighs them: its heap and ZeroMQ's sockets (5-9 MB on the
# development VM at 24 MB of tiers, in ulimit -v sweeps of a review's configs).
HEADROOM_BYTES = 32 << 20
# The block table's rows are reserved up front (table/rowspace.py, `reserve_rows`), one a KiB of a
# pool's tiers within its bounds, at about 124 bytes each with `heat` (its per-row state included:
# 31 GiB for 2^28 rows); `heat` also reserves its frequency sketch at its widest (4 x 2^24 counters),
# and its duel's three miniatures, later, about 3/8 as many rows as the pool's table (a review).
ROW_BYTES = 128
DUEL_ROWS_SHARE = 3 / 8
# ... at 1 in 8. Where 1/8 of HBM holds fewer than 32 blocks the duel replays a finer sample, down to
# 1 in 2 (duel.py `_fit_sample`), the coarsest that leaves 32: 1/sample of HBM then holds under 64 of
# them, so the miniatures hold under 64 x (the tiers' bytes / HBM's) blocks, and reserve up to 8 rows
# a block each (four, to a power of two), three of them: under 1536 x the tiers' bytes / HBM's rows.
# Over 3/8 of the table's rows where HBM is under 4 MiB (HBM 1 MB and 16 KiB blocks over DRAM 64 MB
# and NVMe 1 GB: 786,432 rows, twice what 3/8 counted; at a limit `--check` said fits, the daemon
# exited 6 at its first client's calls, a review).
DUEL_FITTED_ROWS_PER_HBM = 1536


def host_taken(plan: Plan) -> tuple[int, int, bool]:
    """What start-up takes of host memory for `plan`: the host memory tiers' bytes, the staging
    buffers' (with an NVMe tier only), and whether it has an NVMe tier."""
    from dflash2.tiers import Tier

    nvme = any(t.tier == Tier.NVME and t.capacity_bytes for t in plan.tiers) and plan.nvme_path is not None
    host = sum(t.capacity_bytes or 0 for t in plan.tiers if t.tier != Tier.NVME and not t.where.startswith("cuda"))
    return host, plan.staging_taken_bytes if nvme else 0, nvme


def tables_bytes(plan: Plan, policy: str, duel_sample: int) -> int:
    """What a serving daemon of `plan` reserves for its block tables and policy beyond HEADROOM_BYTES."""
    from dflash2.policy.heat import MAX_SKETCH_WIDTH
    from dflash2.table.rowspace import reserve_rows
    from dflash2.tiers import Tier

    hbm = max((t.capacity_bytes or 0 for t in plan.tiers if t.tier == Tier.HBM), default=0)  # (a pool's own)
    rows = reserve_rows([hbm] + [plan.pool_bytes(t) for t in plan.tiers if t.tier != Tier.HBM], 0)
    heat = policy == "heat"
    duel_rows = 0
    if heat and duel_sample:
        tiers = hbm + sum(plan.pool_bytes(t) for t in plan.tiers if t.tier != Tier.HBM)
        # (3/8 at 1 in 8: a finer policy.duel_sample, down to 2, holds 8/sample as many blocks in its miniatures)
        duel_rows = max(rows * DUEL_ROWS_SHARE * 8 / min(duel_sample, 8),
                        DUEL_FITTED_ROWS_PER_HBM * tiers // hbm if hbm else 0)
    per_pool = (rows + duel_rows) * ROW_BYTES
    return plan.pools * int(per_pool + (4 * MAX_SKETCH_WIDTH if heat else 0))


def serving_threads(plan: Plan, metrics_port: int) -> int:
    """The threads a serving daemon of `plan` starts besides its main thread and those this check's
    imports start too (numpy's): ZeroMQ's I/O thread and reaper, the stall watch, the host transfer
    thread (host-only), the metrics server (metrics.port), ZeroMQ's authenticator and the key gate
    (a tcp endpoint), and each pool's NVMe I/O workers (started with the tier). Counted in serving
    daemons' threads (tests/test_threads.py); a GPU node's copies start threads of their own, and a
    re-test of NVMe slots set aside one for a while (not counted: one that cannot start is logged,
    and the re-test tried again later)."""
    from dflash2.arena.staging import ring_workers

    count = 3 + (plan.device_kind == "host") + bool(metrics_port) + 2 * plan.endpoint.startswith("tcp://")
    return count + (plan.pools * ring_workers(plan.staging_bytes) if host_taken(plan)[2] else 0)


def address_space_now(plan: Plan, metrics_port: int, mapped: str, policy: str = "lru",
                      duel_sample: int = 0) -> tuple[str, bool] | None:
    """Under an address-space limit (RLIMIT_AS: ulimit -v, systemd's LimitAS=): what the host tiers,
    the staging buffers and the serving daemon's threads' stacks (and the main thread's growth to come
    at start-up: mainstack.py) take of it and what it leaves past what `mapped` ("this check",
    "start-up") maps now, with the tables and the policy's reservations (`tables_bytes`) and
    HEADROOM_BYTES, and whether they fit; None without a limit. `--check` says
    it; start-up refuses to take the tiers where they do not fit (a thread that could not start later
    ended it, or ZeroMQ's aborted it, its shared memory left in /dev/shm: a review). `--check`
    imports the server first, so that what is mapped now is what start-up's is (its libraries,
    ZeroMQ's above all)."""
    from dflash2.arena.shm import address_space, thread_stack_bytes
    from dflash2.mainstack import main_stack_short

    if (limits := address_space()) is None:
        return None
    host, staging, _ = host_taken(plan)
    takes = host + staging
    room, count = limits[0] - limits[1], serving_threads(plan, metrics_port)
    stacks, main = count * thread_stack_bytes(), main_stack_short()  # (the main thread's grown at start-up)
    tables = HEADROOM_BYTES + tables_bytes(plan, policy, duel_sample)
    return (f"they take {takes} bytes of address space, the serving daemon's {count} threads' stacks {stacks} more "
            f"(RLIMIT_STACK each), its main thread's stack's growth {main} and its tables and heap about {tables}, "
            f"and its limit (RLIMIT_AS: ulimit -v, systemd's LimitAS=) leaves {room} of {limits[0]} past what "
            f"{mapped} maps"), takes + stacks + main + tables <= room


def room_now(plan: Plan, metrics_port: int = 0, policy: str = "lru", duel_sample: int = 0) -> list[str]:
    """What `--check` can tell of this machine at this moment: whether the memory and disk the tiers
    take at start-up are free now (when they are not, start-up fails with exit 4). The config may
    still be right for the machine it is meant for: these are lines to read, not errors."""
    from dflash2.arena.nvme import HEADER_BYTES
    from dflash2.arena.nvmefiles import folder_named, unused_cache_files
    from dflash2.arena.shm import mem_available_bytes, shm_free_bytes
    from dflash2.tiers import Tier

    def verdict(need: int, have: int) -> str:
        return "fits" if need <= have else "start-up would fail now (exit 4)"

    lines = [] if plan.device_kind != "cuda" else _cupy_now()
    if plan.device_kind == "cuda" and any(t.tier == Tier.HBM and t.capacity_bytes is None for t in plan.tiers):
        lines.append("device.kind is cuda and no GPU is visible here (the driver, CUDA_VISIBLE_DEVICES): start-up "
                     "would fail now (exit 4)")
    nvme = next((t for t in plan.tiers if t.tier == Tier.NVME), None)
    host, staging, has_nvme = host_taken(plan)  # (the staging buffers taken at start-up too)
    if host or staging:
        shm, avail = shm_free_bytes(), mem_available_bytes()
        takes = f"host memory tiers take {host} bytes of shared memory"
        if staging:
            takes += f" and the staging buffers {staging} bytes of memory"
        fits = host <= shm and host + staging <= avail
        lines.append(f"{takes}; /dev/shm has {shm} free and MemAvailable is {avail}: "
                     f"{'fits' if fits else 'start-up would fail now (exit 4)'}")
        from dflash2.arena.shm import fsize_limit

        segments = [(t.capacity_bytes if t.tier == Tier.HBM else plan.pool_bytes(t), t.tier.label) for t in plan.tiers
                    if t.tier != Tier.NVME and t.capacity_bytes and not t.where.startswith("cuda")]
        if (limit := fsize_limit()) is not None and segments and (big := max(segments))[0] > limit:  # (as shm.py refuses it)
            lines.append(f"the {big[1]} tier's shared-memory segment needs {big[0]} bytes, and this process's file "
                         f"size limit (RLIMIT_FSIZE: ulimit -f) is {limit} bytes: start-up would fail now (exit 4)")
        try:  # (mapped past the limit: ENOMEM with memory free, a review)
            importlib.import_module("dflash2.daemon.startup")  # (its libraries mapped, as start-up's are)
        except ModuleNotFoundError:
            pass  # (no server built: start-up cannot run either, and says so, main.py `_serve`)
        if (space := address_space_now(plan, metrics_port, "this check", policy, duel_sample)) is not None:
            lines.append(f"{space[0]}: {'fits' if space[1] else 'start-up would fail now (exit 4)'}")
    if has_nvme and (why := folder_named(plan.nvme_path)) is not None:
        lines.append(f"{why}: start-up would fail now (exit 4)")
    elif has_nvme:
        try:
            lines.extend(_nvme_now(plan.nvme_files(), plan.pool_bytes(nvme) + HEADER_BYTES, verdict,
                                   unused_cache_files(plan.nvme_path, plan.nvme_files())))
        except OSError as e:
            lines.append(f"cannot look at the NVMe file's place {plan.nvme_path}: {e.strerror or e}: start-up "
                         "would fail now (exit 4)")
    return lines


def _cupy_now() -> list[str]:
    """The `now:` line of a CUDA plan where CuPy cannot be imported: the README's set-up installs no
    `gpu` extra, and on a GPU node the shipped config (`auto`) passed --check with every line saying
    it fits, then start-up exited 4 for want of CuPy (a review). Imported as start-up imports it, so
    that an install that is there but broken is found too."""
    from dflash2.cuda import cupy
    from dflash2.errors import ArenaError

    try:
        cupy()
    except ArenaError as e:
        # (start-up's own words, then what else to do: `[gpu]` brings cupy-cuda12x)
        return [f"{e}: start-up would fail now (exit 4); on CUDA 13 install cupy-cuda13x instead, or set "
                "device.kind host to leave the GPU out"]
    return []


def ports_now(endpoint: str, metrics_host: str, metrics_port: int) -> list[str]:
    """The `now:` lines of the ports start-up binds (a tcp daemon.endpoint, metrics.host:port; and an
    ipc daemon.endpoint another dflash2d serves), tried by the same probes start-up runs before it
    takes any tier (endpoint.py): a metrics.host that is
    no address of this node passed --check and start-up then exited 4. A daemon serving this config
    now holds them too, and is named as such a holder."""
    from dflash2.endpointlock import holder
    from dflash2.daemon.endpoint import EndpointBusy, probe_metrics, probe_port

    # An ipc endpoint's lock, held by a daemon serving it (its pid in the lock file), as start-up's
    # `EndpointLock` finds it: --check said nothing, and start-up then exited 4 (a review).
    lines = [f"another dflash2d (pid {pid}) is serving {endpoint} (daemon.endpoint; a dflash2d serving this config "
             "holds it too): start-up would fail now (exit 4)"] if (pid := holder(endpoint)) is not None else []
    if not lines and endpoint.startswith("ipc://"):
        lines = _socket_listened_on_now(Path(endpoint[len("ipc://"):]))
    for probe, what in ((lambda: probe_port(endpoint), "daemon.endpoint"),
                        (lambda: probe_metrics(metrics_host, metrics_port), "metrics")):
        try:
            probe()
        except EndpointBusy as e:
            held = " in use" in str(e)  # (EADDRINUSE: "Address already in use")
            lines.append(f"{e} ({what}{'; a dflash2d serving this config holds it too' if held else ''}): "
                         "start-up would fail now (exit 4)")
    return lines


def _socket_listened_on_now(socket_path: Path) -> list[str]:
    """The `now:` line of an ipc socket a process listens on while no lock file names it, which
    start-up refuses (EndpointLock.acquire): --check said nothing, exit 0, and start-up exited 4 (a
    review: a dflash2d whose lock file a clean-up of the runtime folder removed, or another program)."""
    from dflash2.daemon.endpoint import _listened_on

    try:
        if not stat.S_ISSOCK(os.stat(socket_path).st_mode) or not _listened_on(socket_path):
            return []
    except PermissionError:
        return [f"{socket_path} is a socket this user may not connect to (another user's, live or not: it cannot be "
                "told) (daemon.endpoint): start-up would fail now (exit 4)"]
    except OSError:
        return []
    return [f"a process is listening on {socket_path} although no lock file names it (a dflash2d whose "
            f"{socket_path.name}.lock was removed, or another program) (daemon.endpoint): start-up would fail now "
            "(exit 4)"]


def _nvme_now(paths: list[Path], need_each: int, verdict, unused: list[tuple[Path, int]] = ()) -> list[str]:
    """The `now:` lines of the NVMe files (one, or one per GPU): whether start-up could create or
    reuse each, and whether each disk has room for the files on it. A file is looked at where a
    symlink at its path leads, as start-up takes it (`nvme.cache.gpuN` linked to a disk per GPU was
    measured on the links' folder). `unused`: an earlier daemon's files that no pool uses
    (nvmefiles.py), which start-up removes: said, and their room counted as free."""
    disks: dict[int, list] = {}  # filesystem -> [folder to measure, files, bytes they hold]
    lines = [f"{path} is an earlier daemon's NVMe cache file ({held} bytes on disk) that no pool of this config "
             "uses (made for another number of GPUs): start-up removes it" if not link else
             f"{path} leads to an earlier daemon's NVMe cache file {os.path.realpath(path)} ({held} bytes on disk) "
             "that no pool of this config uses: start-up leaves the link as it is (remove the file to give its "
             "room back)" for path, held, link in unused]
    freed: dict[int, int] = {}  # filesystem -> bytes the removals give back
    freed_inodes: dict[int, int] = {}  # filesystem -> files the removals take away
    for path, held, link in unused:
        if not link:
            dev = os.stat(path).st_dev
            freed[dev] = freed.get(dev, 0) + held
            freed_inodes[dev] = freed_inodes.get(dev, 0) + 1
    from dflash2.arena.shm import fsize_limit

    if (limit := fsize_limit()) is not None and limit < need_each:  # (as the tier refuses it: nvmeprep.py)
        return [f"the NVMe file needs {need_each} bytes at {paths[0]}, and this process's file size limit "
                f"(RLIMIT_FSIZE: ulimit -f) is {limit} bytes: start-up would fail now (exit 4)"]
    for path in paths:
        target = Path(os.path.realpath(path))
        problem, has = _nvme_file_now(target)
        if problem:
            return [problem]
        folder = nearest_existing(target.parent)
        disk = disks.setdefault(os.stat(folder).st_dev, [folder, [], 0, set()])
        disk[1].append(target)
        disk[2] += has
        if not target.exists():  # (the file and the folders above it still to make: an inode each)
            disk[3].update(p for p in (target, *target.parents) if not p.exists())
    for dev, (folder, files, held, made) in disks.items():
        st = os.statvfs(folder)
        if len(files) > 1 and st.f_files and st.f_favail + freed_inodes.get(dev, 0) < len(made):
            # (each file's own check counted its own inodes: 2 files where 1 inode was free said "fits", a review)
            return [f"{folder} is on a filesystem with {st.f_favail} free inodes (df -i), so the {len(files)} NVMe "
                    f"files {files_said(files)} cannot all be made ({len(made)} inodes with their folders), though "
                    "it has room for bytes: start-up would fail now (exit 4)"]
        free = st.f_bavail * st.f_frsize + held + freed.get(dev, 0)
        need = need_each * len(files)
        where = (f"the NVMe file needs {need} bytes at {files[0]}" if len(files) == 1 else
                 f"{len(files)} NVMe files (one per GPU) need {need} bytes in all at {files_said(files)}")
        lines.append(f"{where}; {free} are free there (with what the files already hold): {verdict(need, free)}")
    return lines


def _nvme_file_now(path: Path) -> tuple[str | None, int]:
    """(why start-up could not create or reuse this NVMe file, or None; the bytes it holds, reused)."""
    from dflash2.arena.nvmefiles import HEADER, is_foreign

    fail = "start-up would fail now (exit 4)"
    held = 0
    if path.exists():
        if not path.is_file():
            return f"{path} exists and is not a regular file: {fail}", 0
        if read_only(path.parent):
            return f"{path} is on a read-only filesystem: {fail}", 0
        if not os.access(path, os.R_OK | os.W_OK):
            return f"{path} exists and the daemon's user (uid {os.geteuid()}) cannot read and write it: {fail}", 0
        if (st := path.stat()).st_uid != os.geteuid():  # (as the tier refuses it: nvmefiles._own_file)
            from dflash2.files import owner_text
            return f"{path} is not this user's ({owner_text(st)}; uid {os.geteuid()} runs --check): {fail}", 0
        with open(path, "rb") as f:
            if is_foreign(f.read(len(HEADER))):
                return f"{path} exists and is not a dflash2 NVMe cache file: start-up would refuse it (exit 4)", 0
            try:  # the lock a running daemon holds on its file (taken and let go at once here)
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                from dflash2.files import holders_text
                return (f"{path} is in use by another process, a daemon serving from it{holders_text(f.fileno())}: "
                        f"{fail}"), 0
        held = path.stat().st_blocks * 512  # reused by the tier
    else:
        existing = nearest_existing(path.parent)
        if not existing.is_dir():
            return f"{existing} is not a folder, so the NVMe file {path} cannot be made: {fail}", 0
        if read_only(existing):
            return f"{existing} is on a read-only filesystem, so the NVMe file {path} cannot be made: {fail}", 0
        st = os.statvfs(existing)
        if st.f_blocks == 0:  # (said "0 are free there", a review)
            return (f"{existing} is on a filesystem of no blocks (such as /proc or /sys), so the NVMe file {path} "
                    f"cannot be made: {fail}"), 0
        # The file and each folder above it still to make take an inode: a filesystem out of them said "fits"
        # here, and start-up failed with "No space left on device" on a disk with room (a review).
        if st.f_files and st.f_favail < len(path.relative_to(existing).parts):
            return (f"{existing} is on a filesystem with {st.f_favail} free inodes (df -i), so the NVMe file {path} "
                    f"cannot be made, though it has room for bytes: {fail}"), 0
        if not os.access(existing, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
            return f"the daemon's user (uid {os.geteuid()}) cannot create files in {existing}: {fail}", 0
    return None, held
