"""Start-up and shutdown of the `dflash2d` process around its request loop (server.py): the endpoint's
lock and the ports tried before anything is taken, a killed predecessor's shared memory given back,
the liveness object, the tiers, the metrics and history, the signals, the one start-up line, and
the clean-up on every way out.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
import time

import zmq

from dflash2 import threads
from dflash2.arena.liveness import DaemonLiveness, dead_daemons, liveness_name
from dflash2.arena.shm import cap_malloc_arenas, remove_stale_segments
from dflash2.assemble import build_managers, instance_name
from dflash2.config import Config
from dflash2.daemon.descriptors import raise_open_files_limit, warn_if_few
from dflash2.daemon.endpoint import EndpointBusy, EndpointLock, probe_metrics, probe_port
from dflash2.daemon.main import EXIT_GPU_LOST, EXIT_START_FAILED, EXIT_TABLE_BROKEN
from dflash2.daemon.observe import Observers, log_fallbacks
from dflash2.daemon.roomnow import address_space_now
from dflash2.daemon.service import Service
from dflash2.endpoints import runtime_dir
from dflash2.errors import ArenaError, CapacityError
from dflash2.logs import configure as configure_logging, console_line, event, silence_stdout
from dflash2.mainstack import grow_main_stack
from dflash2.plan import Plan, resolve_plan
from dflash2.tcpkeys import KeyFileError, forget_port, load_or_make, monitor_path, record_port
from dflash2.tiers import Tier
from dflash2.daemon.server import Server

log = logging.getLogger("dflash2.daemon")

GB = 1e9


def cache_bytes(managers: dict) -> tuple[int, int]:
    """(total virtual cache bytes over every tier and GPU, bytes of memory committed: HBM + DRAM)."""
    specs = [s for m in managers.values() for s in m.specs.values()]
    return sum(s.capacity_bytes for s in specs), sum(s.capacity_bytes for s in specs if s.tier != Tier.NVME)


def startup_line(plan: Plan, managers: dict) -> str:
    total, memory = cache_bytes(managers)
    line = f"DFlash2: enabled, total virtual cache size {total / GB:.1f}GB, committed {memory / GB:.1f}GB"
    if plan.device_kind == "host":
        line += " (no GPU: the device tier is in host memory)"
    elif len(managers) > 1:
        line += f" ({len(managers)} GPUs: one block pool each)"
    return line


# Signals whose default action ends the process but that mean nothing to the daemon: logged and
# ignored, so that one sent by mistake does not leave its shared memory, socket and lock behind.
IGNORED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def _ignored(signum: int, frame) -> None:
    log.warning("%s ignored: it means nothing to dflash2d (SIGTERM, SIGINT or SIGHUP stop it)",
                signal.Signals(signum).name)


def clean_up_killed(endpoint: str, lock: EndpointLock) -> None:
    """Give back the shared memory killed daemons left (each segment only when no process holds it;
    logged one by one): the last daemon on this endpoint, when it did not shut down cleanly, and
    those the lock file does not name (its folder removed since, or another endpoint's), whose
    liveness object says they are gone."""
    if lock.previous_pid is not None:
        log.warning("the last dflash2d on %s (pid %d) did not shut down cleanly (killed?)%s; removing the "
                    "shared memory it left", endpoint, lock.previous_pid,
                    ": its socket file was replaced" if lock.replaced_socket else "")
        remove_stale_segments(f"{instance_name(lock.previous_pid)}-")  # its liveness object too
    for pid in dead_daemons():
        log.warning("dflash2d pid %d was killed and left shared memory (its liveness object, which no process "
                    "holds, is still in /dev/shm); removing it", pid)
        remove_stale_segments(f"{instance_name(pid)}-")


def run(cfg: Config) -> int:
    _configure_logging(cfg)
    raise_open_files_limit()
    if (capped := cap_malloc_arenas()) is not None:  # (before the server's threads: shm.py)
        log.info(capped)
    plan = resolve_plan(cfg)
    # Weighed before anything runs that maps (a tcp endpoint's probe leaves ZeroMQ's two thread stacks
    # in glibc's cache, counted twice then) and before any tier is taken (roomnow.py).
    if (space := address_space_now(plan, cfg.metrics.port, "start-up", cfg.policy.name,
                                   cfg.policy.duel_sample)) is not None and not space[1]:
        _error(cfg, f"cannot start: too little address space: {space[0]}; raise the limit, or lower the tiers' "
                    "memory.*_capacity_mb")
        return EXIT_START_FAILED
    try:  # (weighed above: before anything else maps, mainstack.py)
        if (grown := grow_main_stack()) is not None:
            log.info(grown)
    except OSError as e:  # (EFAULT: the kernel refused the growth; else a mapping in its way)
        _error(cfg, f"cannot start: {e}" + (" (under an address-space limit, ulimit -v, or a strict overcommit "
                    "policy); raise the limit, or lower the tiers' memory.*_capacity_mb" if e.errno == errno.EFAULT
                    else ""))
        return EXIT_START_FAILED
    # ZeroMQ's I/O thread and reaper, started now, before anything is taken: libzmq aborts the process
    # where one cannot start, which, once the tiers were taken, left their shared memory (a review).
    context = zmq.Context()
    context.socket(zmq.PAIR).close(0)
    lock = EndpointLock(plan.endpoint, runtime_dir())
    try:
        lock.acquire()
    except EndpointBusy as e:
        _error(cfg, str(e))
        return EXIT_START_FAILED
    except OSError as e:  # the folder changed since the start-up check (main.check_paths)
        _error(cfg, f"cannot take daemon.endpoint {plan.endpoint}: its lock file {lock.lock_path}: {e.strerror or e}")
        return EXIT_START_FAILED
    keys = None
    try:
        probe_port(plan.endpoint)  # both before any tier is taken (endpoint.py)
        probe_metrics(cfg.metrics.host, cfg.metrics.port)
        if plan.tcp_key_file is not None:
            keys, made = load_or_make(plan.tcp_key_file)
            log.info("tcp endpoint %s: only clients that read %s%s can attach; those that read %s only may ask "
                     "status, history and check, at the port written there", plan.endpoint, plan.tcp_key_file,
                     " (made now, mode 0600)" if made else "", monitor_path(plan.tcp_key_file))
        clean_up_killed(plan.endpoint, lock)
    except (EndpointBusy, KeyFileError) as e:
        lock.release()
        _error(cfg, f"daemon.tcp_key_file: {e}" if isinstance(e, KeyFileError) else str(e))
        return EXIT_START_FAILED
    except BaseException:
        # (a stop signal while these run: the lock file goes, as at any clean stop; it stayed, and
        # the next daemon said this one had been killed, a review)
        lock.release()
        raise
    managers: dict = {}
    server = observers = alive = recorded = None
    started = time.monotonic()
    try:
        try:
            # Held for the daemon's whole life, whatever its tiers (arena/liveness.py): how its
            # clients learn that it died. Created after the predecessor's clean-up above, which
            # removes a killed pid-1 predecessor's file of this very name.
            alive = DaemonLiveness.create(liveness_name(instance_name(os.getpid())))
            managers = build_managers(cfg, plan=plan)
        except (CapacityError, ArenaError) as e:
            _error(cfg, f"cannot start: {e}")
            return EXIT_START_FAILED
        manager = next(iter(managers.values()))
        service = Service(managers, lease_timeout_s=cfg.daemon.lease_timeout_s,
                          heartbeat_interval_s=cfg.daemon.heartbeat_interval_s, device=plan.device_kind,
                          set_aside_leases=cfg.daemon.set_aside_leases, liveness=alive.name, liveness_id=alive.nonce)
        try:
            # The history's owner (history.endpoint_id): "default" for the default endpoint, whose
            # path follows the environment, and that path too (a config may write it out later).
            default = cfg.daemon.endpoint is None
            observers = Observers.start(cfg, service, plan.state_dir, plan.device_kind,
                                        "default" if default else plan.endpoint, plan.endpoint if default else None)
        except OSError as e:
            _error(cfg, f"cannot serve metrics on {cfg.metrics.host}:{cfg.metrics.port} (metrics.host, metrics.port): {e}")
            return EXIT_START_FAILED
        server = Server(service, plan.endpoint, cfg.policy.rescore_interval_ms / 1000.0, observers,
                        keys=keys, key_file=plan.tcp_key_file, context=context)
        if keys is not None:  # where the monitoring key's readers connect (tcpkeys.py)
            try:
                record_port(plan.tcp_key_file, keys, service.request_port, server.monitoring_port)
            except KeyFileError as e:
                _error(cfg, f"daemon.tcp_key_file: {e}")
                return EXIT_START_FAILED
            recorded = (plan.tcp_key_file, keys, service.request_port, server.monitoring_port)
        lock.secure_socket()
        warn_if_few()  # (now that the daemon holds its own descriptors)
        stopped_by: list[str] = []  # the stop signal's name, for the shutdown line (it said none, a review)

        def stop_on(signum: int, frame) -> None:
            stopped_by.append(signal.Signals(signum).name)
            server.stop()

        for sig in threads.STOP_SIGNALS:
            if threads.daemon_takes(sig):  # (`nohup`: SIGHUP stays ignored)
                signal.signal(sig, stop_on)
        for sig in IGNORED_SIGNALS:  # their default would kill the daemon without its clean-up
            signal.signal(sig, _ignored)
        _say_enabled(console_line(cfg.logging.format, startup_line(plan, managers), event="dflash2_enabled"))
        log_fallbacks(cfg, plan)
        event(log, "dflash2_start", f"serving {plan.endpoint} (policy {manager.policy.name})",
              endpoint=plan.endpoint, device=plan.device_kind,
              total_bytes=cache_bytes(managers)[0], committed_bytes=cache_bytes(managers)[1],
              policy=manager.policy.name, metrics_port=cfg.metrics.port or None, history=cfg.history_enabled)
        server.serve_forever()
        if server.failed:
            return _failed(cfg, server.failed, service.broken is not None, len(service.sessions), started,
                           "; clients fall back to their own cache, then attach again")
        clients = len(service.sessions)
        service.shutdown()
        if service.broken:  # (found by the stop's check of the refusals still waiting: failing.py)
            return _failed(cfg, service.broken, True, clients, started)
        by = stopped_by[0] if stopped_by else None
        event(log, "dflash2_shutdown", f"shut down{f' (stopped by {by})' if by else ''}: released {clients} clients",
              clients_released=clients, uptime_s=round(time.monotonic() - started, 3), signal=by)
        return 0
    finally:
        # Each step whatever became of the one before: the last history sample asks for stats, and
        # one that raised (a GPU lost) skipped the rest, leaving the segments, the liveness object
        # and the lock file for good.
        steps = [observers.close] if observers is not None else []
        if recorded is not None:  # (named: a step that fails is logged by its name; never by its arguments, keys)
            def forget_monitoring_port() -> None:
                forget_port(*recorded)
            steps.append(forget_monitoring_port)
        steps += [server.close] if server is not None else []
        steps += [m.close for m in managers.values()]
        # What a start-up cut short left of ours that no manager closes (nobody holds it: a live
        # daemon's, pid 1 in another container, stays), while our liveness object still names us.
        steps += [_sweep_own_segments] if alive is not None else []
        steps += [alive.close] if alive is not None else []  # before the lock: a next daemon finds nothing of ours
        for step in [*steps, lock.release]:
            try:
                step()
            except Exception:
                log.exception("stopping: %s failed; the other steps run", getattr(step, "__qualname__", step))
        log.info("stopped")


def _sweep_own_segments() -> None:
    remove_stale_segments(f"{instance_name(os.getpid())}-")


def _failed(cfg: Config, why: str, table: bool, clients: int, started: float, tail: str = "") -> int:
    """The daemon cannot serve any more (`table`: a block table that no longer adds up, failing.py;
    else a lost GPU): its line and event; the exit code that makes the supervisor restart it."""
    code, name = (EXIT_TABLE_BROKEN, "dflash2_table_broken") if table else (EXIT_GPU_LOST, "dflash2_gpu_lost")
    _error(cfg, f"{why}; exiting (code {code}) so that the supervisor restarts the daemon{tail}")
    event(log, name, why, clients=clients, uptime_s=round(time.monotonic() - started, 3))
    return code


def _error(cfg: Config, message: str) -> None:
    """Why the daemon cannot start (or goes), on stderr: `dflash2d: error: ...`, or in json format
    that line as a JSON record (logs.console_line)."""
    print(console_line(cfg.logging.format, f"dflash2d: error: {message}", level="error", event="dflash2_error"),
          file=sys.stderr, flush=True)


def _configure_logging(cfg: Config) -> None:
    configure_logging(cfg.logging.format, cfg.logging.level)  # dflash2/logs.py


def _say_enabled(line: str) -> None:
    """The start-up line on stdout. A stdout that takes nothing (a full disk, /dev/full, a pipe whose
    reader left: journald restarted, `dflash2d | head -1`) does not stop a daemon that has started:
    it stopped it, in a traceback after every tier was taken, or with nothing said at all (a
    review). Said in the log instead (logs.silence_stdout)."""
    if sys.stdout is None:  # (closed at start, `dflash2d >&-`: print would drop it without a word)
        log.warning("the start-up line could not be written to stdout (closed): %s", line)
        return
    try:
        print(line, flush=True)
    except OSError as e:
        silence_stdout()
        log.warning("the start-up line could not be written to stdout (%s): %s", e.strerror or e, line)
