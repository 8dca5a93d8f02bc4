"""`dflash2d`: load and validate the config, then run the daemon (or, with `--check`, print the plan).

Exit codes:
  0  ran and stopped cleanly, or `--check` found the config valid
  2  the config (or the command line) is wrong: one line `dflash2d: error: KEY: PROBLEM` on stderr
  3  the config says `enable: false`: the daemon is disabled and says so
  4  start-up failed: the endpoint, a tier's region or the metrics port cannot be had
  5  a GPU's CUDA context was lost while serving: the supervisor restarts the daemon
  6  a block table failed its check after a call or a background step failed part way (failing.py)
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import os
import signal
import stat
import sys
from pathlib import Path

from dflash2 import threads

# Native thread pools that these imports start (numpy's BLAS pool) inherit the stop signals blocked,
# so that the stop signals reach the main thread, which runs Python's handlers (threads.py). The
# importer's own mask is restored after them: importing this module changes no signal mask.
with threads.stop_signals_blocked():
    from dflash2.config import Config, expand_user, load_config, require_enabled
    from dflash2.config_warnings import check_environment, config_warnings
    from dflash2.daemon.roomnow import ports_now, room_now
    from dflash2.errors import ConfigError, DisabledError, UnknownPolicy
    from dflash2.files import nearest_existing as _nearest_existing
    from dflash2.files import read_only as _read_only
    from dflash2.logs import console_line, silence_stdout
    from dflash2.plan import Plan, resolve_plan, rounding_warnings
    from dflash2.policy.base import policy_class, policy_names

EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_DISABLED = 3
EXIT_START_FAILED = 4  # a region, the endpoint or the metrics port cannot be had (the server's code too)
EXIT_GPU_LOST = 5  # a GPU's CUDA context was lost while serving: exit so that the supervisor restarts it
EXIT_TABLE_BROKEN = 6  # a block table failed its check after a call or step failed part way (failing.py): likewise
EXIT_NO_OUTPUT = 1  # `--check` whose plan could not be written to stdout (a full disk, a stdout not open for writing)
EXIT_BROKEN_PIPE = 141  # `--check` into a pipe closed early (`| head -1`), as a shell reports SIGPIPE

# Registered policies that the daemon cannot run: they exist for the benches.
BENCH_ONLY_POLICIES = {"belady": "the offline optimum needs the future: it exists for `dflash2 bench policy` only"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash2d", description="The dflash2 daemon: one tiered KV-cache memory manager per node.",
        epilog="exit codes: 0 ok, 1 --check could not write its plan to stdout, 2 bad config or arguments, "
               "3 disabled (`enable` is false), 4 cannot start (memory, disk, endpoint or metrics port), 5 a GPU's "
               "CUDA context was lost while serving, 6 a block table failed its check after a call or step failed "
               "part way while serving, 141 --check's pipe closed early")
    parser.add_argument("--config", default="dflash2_config.json", metavar="FILE",
                        help="config file (default: dflash2_config.json in the working directory)")
    parser.add_argument("--check", action="store_true",
                        help="validate the config, print warnings and the resolved plan, and exit")
    parser.add_argument("--json", action="store_true", help="with --check: print the plan as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.json and not args.check:  # it would start the daemon and ignore --json
        parser.error("--json only goes with --check (the daemon itself logs as logging.format says)")
    # From the first moment a stop signal unwinds start-up (README: it stops cleanly "during
    # start-up too"): while the config was read and the GPUs probed, SIGINT raised a traceback and
    # SIGHUP killed the process by its default action. The server installs its own once it serves.
    before = {sig: signal.getsignal(sig) for sig in (*threads.STOP_SIGNALS, signal.SIGUSR1, signal.SIGUSR2)}
    for sig in threads.STOP_SIGNALS:
        if threads.daemon_takes(sig):  # (`nohup`: SIGHUP stays ignored)
            signal.signal(sig, _stop_during_startup)
    for sig in (signal.SIGUSR1, signal.SIGUSR2):  # meaningless here; their default kills without clean-up
        signal.signal(sig, signal.SIG_IGN)
    try:
        return _main(args)
    except _Stopped as exc:
        print(console_line(_console_format(args), f"dflash2d: stopped by {exc} during start-up",
                           event="dflash2_shutdown"),
              file=sys.stderr)
        return EXIT_OK
    finally:
        for sig, handler in before.items():  # (main called in-process, by tests: their handlers back)
            signal.signal(sig, handler)


def _main(args: argparse.Namespace) -> int:
    # Warnings wait for the config: they are printed in its logging.format (a journal of JSON
    # lines stays one), as text for --check (a person reads it) or when the file cannot be read as
    # JSON; a config that fails validation is still read for its logging.format.
    warnings = list(check_environment())
    fmt = "text"
    try:
        try:
            cfg = load_config(args.config)
        except ConfigError:
            # The file read once more, only when it fails: for the logging.format it asks for.
            fmt = _console_format(args)
            raise
        fmt = _console_format(args, cfg)
        if not args.check:
            require_enabled(cfg)
        check_policy(cfg)
        plan = resolve_plan(cfg)
        warnings += config_warnings(cfg, device_kind=plan.device_kind)  # `auto` resolved
        warnings += rounding_warnings(plan, frozenset(n for n, lay in cfg.layouts.items() if lay.tokens_per_block))
        warnings += check_paths(plan, history=cfg.history_enabled)
        warnings += config_file_warnings(args.config)
        # --check checks a disabled config all the same, then says it is disabled (exit 3): it exited 3
        # at once, and a config prepared disabled failed (an unknown policy name, say) once enabled (a review).
        require_enabled(cfg)
    except ConfigError as exc:
        _warn_all(fmt, warnings)
        return _fail(str(exc), fmt)
    except DisabledError as exc:
        _warn_all(fmt, warnings)
        print(console_line(fmt, str(exc), event="dflash2_disabled"), file=sys.stderr)
        return EXIT_DISABLED
    _warn_all(fmt, warnings)
    if args.check:
        now = (room_now(plan, cfg.metrics.port, cfg.policy.name, cfg.policy.duel_sample)
               + ports_now(plan.endpoint, cfg.metrics.host, cfg.metrics.port))
        if sys.stdout is None:  # (closed, `>&-`: a traceback on its flush, a review; the config is valid)
            print("dflash2d --check: stdout is closed: the plan is not printed", file=sys.stderr)
            return EXIT_OK
        if args.json:
            text = json.dumps({**plan.to_dict(), "now": now}, indent=2)
        else:
            text = "\n".join([plan.render_text(), *(f"now: {line}" for line in now)])
        try:
            # One write: under PYTHONUNBUFFERED (the Dockerfile's, a shell's) each print was written as it
            # came, the plan, its newline and each `now:` line apart, and `--check --json | head -1` exited
            # 141 one time in two, the reader gone after the first.
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
        except BrokenPipeError:
            # A reader that went away (`| head -1`; a review: a traceback, exit 1, where `dflash2 ... |
            # head` exits 141).
            silence_stdout()
            return EXIT_BROKEN_PIPE
        except OSError as e:  # (a full disk under `> plan.txt`, a stdout open for reading: a traceback)
            silence_stdout()
            print(f"dflash2d --check: cannot write the plan to stdout: {e.strerror or e}", file=sys.stderr)
            return EXIT_NO_OUTPUT  # (not 0: `--check --json > plan.json && jq ...` went on with no plan)
        return EXIT_OK
    return _serve(cfg)


def _console_format(args: argparse.Namespace, cfg: Config | None = None) -> str:
    """How start-up speaks on the console: text for --check (a person reads it), else the config's
    logging.format (as the file asks for it when it did not load)."""
    if args.check:
        return "text"
    return cfg.logging.format if cfg is not None else _format_asked(args.config)


def _format_asked(path: str) -> str:
    """The logging.format a config file asks for, read without validating it (its own default,
    json, when it names none), so that an invalid config's error is a JSON record where its logs
    would be; text when the file is not a JSON object."""
    try:
        with open(expand_user(path, "--config"), encoding="utf-8") as f:  # (`~/x`, as load_config reads it)
            raw = json.load(f)
    except (OSError, ValueError, RecursionError, ConfigError):  # (as load_config: a file nested too deeply)
        return "text"
    section = raw.get("logging") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or (section is not None and not isinstance(section, dict)):
        return "text"
    fmt = (section or {}).get("format", Config.model_fields["logging"].default.format)
    return fmt if fmt in ("json", "text") else "text"


def check_policy(cfg: Config) -> None:
    """`policy.name` must name a policy the daemon can run (the same check for --check and start-up)."""
    try:
        policy_class(cfg.policy.name)
    except UnknownPolicy:
        valid = ", ".join(name for name in policy_names() if name not in BENCH_ONLY_POLICIES)
        raise ConfigError("policy.name", f"unknown policy {cfg.policy.name!r}; valid: {valid}") from None
    if cfg.policy.name in BENCH_ONLY_POLICIES:
        raise ConfigError("policy.name", f"{cfg.policy.name!r} cannot run in the daemon: "
                                         f"{BENCH_ONLY_POLICIES[cfg.policy.name]}")


def check_paths(plan: Plan, history: bool = False) -> list[str]:
    """Its warnings. The endpoint's files must be the daemon's to make: a file at the socket path is replaced and
    the lock file sits beside it, so a shared folder (/tmp: anyone could have planted either) or a
    file that is not a socket is refused here, before anything is touched; a tcp endpoint's lock
    file lives in the node's runtime folder (config.runtime_dir: the state folder may be shared by
    several nodes, an NFS home, where a lock held on one node refused another's daemon), and the
    history in the state folder (`history`: history_enabled); a tcp endpoint's key file its group may
    read is warned of (that group can attach: monitoring users need the monitoring key file only)."""
    warnings: list[str] = []
    if plan.endpoint.startswith("ipc://"):
        socket = Path(plan.endpoint[len("ipc://"):])
        _check_own_folder(socket.parent, "the socket's folder", f"put the socket in a folder of the daemon's own, e.g. "
                                         f"ipc://{socket.parent / f'dflash2-{os.geteuid()}' / socket.name}",
                          unsearchable="give daemon.endpoint a folder the daemon's user may enter (left null, "
                                       "it lies under $XDG_RUNTIME_DIR, which `sudo -u` keeps from the caller: set "
                                       "XDG_RUNTIME_DIR to a folder of the daemon's own)")
        st = _stat_or_none(socket, "daemon.endpoint")
        if st is not None and not stat.S_ISSOCK(st.st_mode):
            raise ConfigError("daemon.endpoint", f"{socket} exists and is not a socket; dflash2d would replace it")
    else:
        from dflash2.endpoints import runtime_dir

        # The lock file's folder, the daemon's own as a socket's must be (/tmp/dflash2-$UID made first
        # by another user: a link there at the lock's path had a root daemon truncate another file).
        _check_own_folder(runtime_dir(), "the folder of its lock file",
                          "set XDG_RUNTIME_DIR to a folder of the daemon's own, or remove that one")
        if plan.tcp_key_file is not None and plan.tcp_key_file.parent != runtime_dir():
            _check_folder("daemon.tcp_key_file", plan.tcp_key_file.parent)
        if plan.tcp_key_file is not None:  # ones there already: start-up's own checks (a folder passed)
            from dflash2.tcpkeys import MONITOR_NAMES, KeyFileError, group_warning, monitor_path, read_own

            try:
                read_own(plan.tcp_key_file)
                read_own(monitor_path(plan.tcp_key_file), MONITOR_NAMES)
            except KeyFileError as e:
                raise ConfigError("daemon.tcp_key_file", str(e)) from None
            warnings += filter(None, [group_warning(plan.tcp_key_file)])
    if history:
        _check_folder("daemon.state_dir", plan.state_dir)
    return warnings


def _check_own_folder(folder: Path, what: str, advice: str, unsearchable: str | None = None) -> None:
    """The endpoint's folder (an ipc socket's, a tcp endpoint's lock file's): one the daemon can make
    files in, and, when it exists, its own and not shared (sticky, or another user's). `unsearchable`:
    the advice where a folder above it may not be entered (`advice` when None)."""
    from dflash2.files import user_name
    st = _stat_or_none(folder, "daemon.endpoint", unsearchable or advice)
    # (whose first: another user's 0755 folder was said only to refuse files, a review)
    if st is not None and stat.S_ISDIR(st.st_mode):
        mode = stat.S_IMODE(st.st_mode)
        # Sticky (/tmp) or writable by every user (anyone could plant the lock file's path); a folder
        # its group may write stays the daemon's own (refused, a config that ran did not start, a review).
        if st.st_mode & stat.S_ISVTX or mode & stat.S_IWOTH:
            raise ConfigError("daemon.endpoint", f"{what} {folder} is shared (mode {mode:o}, owner uid "
                                                 f"{st.st_uid}); {advice}")
        if st.st_uid != os.geteuid():
            # Owner-only, of another user: the daemon's own when it runs as that user (the systemd
            # unit's RuntimeDirectory), where `--check` as root called it shared and advised moving
            # the socket every serving process uses (a review).
            raise ConfigError("daemon.endpoint", f"{what} {folder} belongs to uid {st.st_uid}{user_name(st.st_uid)} "
                                                 f"(mode {mode:o}), not to this user (uid {os.geteuid()}): run dflash2d "
                                                 f"as its owner, `--check` too (sudo -u USER dflash2d ...), or {advice}")
    _check_folder("daemon.endpoint", folder)


def _stat_or_none(path: Path, key: str, advice: str = "") -> os.stat_result | None:
    """`path`'s stat, None where nothing is there; ConfigError naming `key` where a folder above it
    may not be searched (Path.is_dir and exists raise EACCES: a traceback and exit 1 for a socket in
    a folder of another user, or a runtime folder `sudo -u` kept from the caller, a review)."""
    try:
        return path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:  # (the advice is for a folder that may not be entered, not a link loop: a review)
        raise ConfigError(key, f"cannot look at {path}: {e.strerror or e}"
                          + (f"; {advice}" if advice and e.errno in (errno.EACCES, errno.EPERM) else "")) from None


def _check_folder(key: str, folder: Path) -> None:
    """`folder` is a folder the daemon can make files in, or can be made: its nearest existing
    ancestor is a folder the daemon's user may write."""
    try:
        existing = _nearest_existing(folder)
        is_dir = existing.is_dir()
    except OSError as e:  # a folder above it that the daemon's user may not search
        raise ConfigError(key, f"cannot look at {folder}: {e.strerror or e}") from None
    if not is_dir:
        raise ConfigError(key, f"{folder} is not a folder" if existing == folder
                          else f"{existing} is not a folder, so the folder {folder} cannot be made")
    if _read_only(existing):  # (root passes os.access there: the write would fail with EROFS)
        raise ConfigError(key, f"{existing} is on a read-only filesystem: give a folder on a writable one "
                               "(a filesystem remounted read-only after errors needs fixing first)")
    if not os.access(existing, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        raise ConfigError(key, f"the daemon's user (uid {os.geteuid()}) cannot create files in {existing} "
                               "(permission denied): give a folder it may write, or run it as a user who may")
    _try_making(key, folder, existing)


def _try_making(key: str, folder: Path, existing: Path) -> None:
    """Make (and remove) a file in `folder`, or the first missing folder on the way to it: root passes
    os.access where the filesystem still refuses (a state folder under /proc passed `--check`, and the
    daemon kept its history in memory only, a review; a root-squashed NFS share the same)."""
    try:
        if existing == folder:
            import tempfile
            with tempfile.TemporaryFile(dir=folder, prefix=".dflash2-check-"):
                pass
            return
        first = folder
        while first.parent != existing:
            first = first.parent
        first.mkdir()
    except FileExistsError:
        if first.is_dir():  # made by someone else meanwhile: there is a folder
            return
        # A dangling link (or a loop) is "missing" to Path.exists, which follows links: --check passed it,
        # and the daemon could not make the folder (history in memory only, a review)
        raise ConfigError(key, f"{first} is a symbolic link to a missing target (or a link loop), so the folder "
                               f"{folder} cannot be made: point it at a folder, or give another path"
                          if first.is_symlink() else f"{first} is not a folder, so the folder {folder} "
                          "cannot be made") from None
    except OSError as e:
        raise ConfigError(key, f"cannot create {'files in ' + str(folder) if existing == folder else str(first)}: "
                               f"{e.strerror or e} (the daemon's user, uid {os.geteuid()}): give a folder it may "
                               "write") from None
    try:
        first.rmdir()
    except OSError:  # (a file put in it meanwhile: theirs, left)
        pass


class _Stopped(BaseException):
    """SIGTERM, SIGINT or SIGHUP during start-up: unwinds start-up, so that every region taken is given back."""


def _stop_during_startup(signum: int, frame) -> None:
    for sig in threads.STOP_SIGNALS:  # one unwind: a second signal must not cut its clean-up short
        signal.signal(sig, signal.SIG_IGN)
    raise _Stopped(signal.Signals(signum).name)


def _serve(cfg: Config) -> int:
    try:
        # Imported here: the server is heavy, and --check must work without it.
        startup = importlib.import_module("dflash2.daemon.startup")
    except ModuleNotFoundError as exc:
        if exc.name not in ("dflash2.daemon.startup", "dflash2.daemon.server"):
            raise
        return _fail(f"the daemon server ({exc.name}) is not built yet; only --check works")
    import zmq

    # Until the server installs its own handlers (once it serves), a stop signal unwinds start-up
    # (main installed the handlers): killed outright, the daemon would leave its shared-memory
    # segments and lock file behind.
    try:
        result = startup.run(cfg)
    except _Stopped as exc:
        print(console_line(cfg.logging.format, f"dflash2d: stopped by {exc} during start-up",
                           event="dflash2_shutdown"), file=sys.stderr)
        return EXIT_OK
    except zmq.ZMQError as exc:  # the endpoint cannot be bound: taken by another program, or no such address
        _fail(f"cannot serve daemon.endpoint {cfg.resolved_endpoint()}: {exc.strerror}", cfg.logging.format)
        return EXIT_START_FAILED
    except RuntimeError as exc:  # (threading's own words; under `ulimit -v` a traceback and exit 1, a review)
        if "can't start new thread" not in str(exc):
            raise
        from dflash2.arena.shm import address_space_note

        _fail(f"cannot start a thread: {exc}" + (address_space_note() or " (the limit on this user's processes "
              "and threads: ulimit -u, systemd's TasksMax=)"), cfg.logging.format)
        return EXIT_START_FAILED
    return EXIT_OK if result is None else int(result)


def config_file_warnings(path: str) -> list[str]:
    """A config that another user may change chooses where the daemon's files, socket and memory go
    (sshd refuses such a file; the daemon said nothing, a review): its owner another user than the
    daemon's or root, or every user may write it."""
    from dflash2.config import expand_user
    from dflash2.errors import ConfigError

    try:
        written = os.path.abspath(expand_user(path, "--config"))
        full = os.path.realpath(written)
        st = os.stat(full)
    except (OSError, ConfigError):
        return []
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH:
        return [f"the config {path} may be written by every user (mode {mode:o}): whoever writes it chooses the "
                f"daemon's endpoint, tiers and files (chmod o-w {path})"]
    if st.st_uid not in (0, os.geteuid()) and not _unmapped(st.st_uid):
        return [f"the config {path} belongs to uid {st.st_uid}, not to the daemon's user (uid {os.geteuid()}) or "
                "root: that user chooses the daemon's endpoint, tiers and files"]
    # Every folder above it, as written and as its links lead (a link in an open folder, an open
    # folder higher up: anyone may put a file or a folder in its place, a review), as sshd's StrictModes.
    for start in dict.fromkeys((os.path.dirname(written), os.path.dirname(full))):
        folder = start
        while True:
            try:
                fst = os.stat(folder)
            except OSError:
                break
            # (a read-only mount is no one's to write whatever its mode: a Kubernetes ConfigMap's
            # folder is 0777 on a read-only mount, as the DaemonSet gives the config)
            open_to_all = fst.st_mode & stat.S_IWOTH and not fst.st_mode & stat.S_ISVTX and not _read_only(Path(folder))
            if open_to_all or (fst.st_uid not in (0, os.geteuid()) and not _unmapped(fst.st_uid)):
                whose = (f"every user may write (mode {stat.S_IMODE(fst.st_mode):o}, not sticky)" if open_to_all
                         else f"belongs to uid {fst.st_uid}, not to the daemon's user (uid {os.geteuid()}) or root")
                return [f"the config {path} lies under {folder}, which {whose}: whoever puts a file or folder in "
                        "its place chooses the daemon's endpoint, tiers and files"]
            if folder == os.path.dirname(folder):
                break
            folder = os.path.dirname(folder)
    return []


def _unmapped(uid: int) -> bool:
    """Whether `uid` is the kernel's overflow uid in a user namespace: an owner outside its mapping
    (a rootless container's view of the host's root), not a user who could write there."""
    try:
        with open("/proc/sys/kernel/overflowuid") as f:
            overflow = int(f.read())
        with open("/proc/self/uid_map") as f:
            rows = [tuple(map(int, line.split())) for line in f if line.strip()]
        # (a mapped overflow uid is a user of this namespace who may write there: podman maps 65534)
        return uid == overflow and not any(inside <= uid < inside + count for inside, _, count in rows)
    except (OSError, ValueError):
        return False


def _warn_all(fmt: str, warnings: list[str]) -> None:
    for message in warnings:
        print(console_line(fmt, f"warning: {message}", level="warning", event="dflash2_warning"), file=sys.stderr)


def _fail(message: str, fmt: str = "text") -> int:
    print(console_line(fmt, f"dflash2d: error: {message}", level="error", event="dflash2_error"), file=sys.stderr)
    return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
