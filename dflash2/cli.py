"""`dflash2`: the operator's command. Subcommands are entries of `SUBCOMMANDS`.

`dflash2 bench NAME [--json] ...` runs `dflash2/bench/NAME.py`, which exposes
`add_arguments(parser)` and `run(args) -> dict | list[dict]`. Bench modules are imported only when
asked for, so a missing or heavy one never slows or breaks the others.

To add a subcommand (`status`, `history`, ...): write `configure(parser)` and `handler(args) -> int`
and add a `Subcommand` to `SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import signal
import sys
from collections.abc import Callable

from dflash2 import stopsignals
from dflash2.bench import BenchFailed, OptionError  # light: imports no benchmark
from dflash2.errors import DaemonUnavailable

BENCHES = ("table", "nvme", "policy", "transfer", "swap", "control", "drain", "churn", "calls", "sglang")
EXIT_OK = 0
EXIT_FAILED = 1  # a bench that could not finish its run
EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 141  # as a shell reports a command killed by SIGPIPE (128 + 13)
EXIT_NO_OUTPUT = 1  # its output could not be written (a full disk), as dflash2d --check's plan


@dataclasses.dataclass(frozen=True)
class Subcommand:
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    handler: Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """A command the user can fix: printed as one `dflash2: error:` line, exit 2."""


# ----------------------------------------------------------------------------------------------------
# bench


def _configure_bench(parser: argparse.ArgumentParser) -> None:
    # Optional to argparse only so that a missing name is named alone (a REMAINDER would be listed too).
    parser.add_argument("name", choices=BENCHES, nargs="?", help="which benchmark")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER,
                        help="the benchmark's own options (see `dflash2 bench NAME --help`)")


def _run_bench(args: argparse.Namespace) -> int:
    if args.name is None:
        raise UsageError(f"bench: name the benchmark, one of {', '.join(BENCHES)} (`dflash2 bench NAME --help`)")
    module = _import_bench(args.name)
    parser = argparse.ArgumentParser(prog=f"dflash2 bench {args.name}", description=module.__doc__)
    parser.add_argument("--json", action="store_true", help="print each result as one JSON line")
    module.add_arguments(parser)
    bench_args = parser.parse_args(args.bench_args)
    try:
        result = module.run(bench_args)
    except OptionError as exc:  # a bad option value, named by the benchmark
        parser.error(str(exc))
    except BenchFailed as exc:  # a run that could not finish: said, and no figures
        print(f"dflash2: error: {exc}", file=sys.stderr)  # (it names the bench)
        return EXIT_FAILED
    except DaemonUnavailable as exc:  # the daemon the bench started ended mid-run (its _stop says how)
        print(f"dflash2: error: bench {args.name}: its daemon stopped answering, no figures: {exc}", file=sys.stderr)
        return EXIT_FAILED
    records = result if isinstance(result, list) else [result]
    if sys.stdout is None:  # (closed, `>&-`): its figures are its only output (it ran, dropped them, said nothing)
        # After the run, not before: a bad option is checked in the run and named (exit 2), as a GPU
        # bench without a GPU is (a review of the refusal before the run).
        print(f"dflash2 bench {args.name}: stdout is closed: its figures are not printed", file=sys.stderr)
        return EXIT_NO_OUTPUT
    for i, record in enumerate(records):
        if bench_args.json:
            # allow_nan=False: NaN or Infinity is no JSON; a figure that is not a number is a bug
            print(json.dumps(record, allow_nan=False), flush=True)
        else:
            if i:
                print()
            for key, value in record.items():
                print(f"{key}: {value}")
    return EXIT_OK


def _import_bench(name: str):
    module_name = f"dflash2.bench.{name}"
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise UsageError(f"bench {name!r} is not available: module {module_name} is not built yet") from None
        raise UsageError(f"bench {name!r} needs the module {exc.name!r}, which is not installed") from None


def _configure_history(parser: argparse.ArgumentParser) -> None:
    from dflash2.history_cli import configure  # dflash2/history_cli.py

    configure(parser)


def _run_history(args: argparse.Namespace) -> int:
    from dflash2.history_cli import handler

    return handler(args)


def _configure_status_watch(parser: argparse.ArgumentParser) -> None:
    from dflash2.status_watch import configure  # adds --watch/--interval/--count to status's options

    configure(parser)


def _run_status_watch(args: argparse.Namespace) -> int:
    from dflash2.status_watch import handler

    return handler(args)


SUBCOMMANDS: dict[str, Subcommand] = {
    "bench": Subcommand("run a benchmark and print its figures", _configure_bench, _run_bench),
    "history": Subcommand("print or plot the daemon's history of its key figures", _configure_history, _run_history),
    # `status --watch`: dflash2/status_watch.py wraps dflash2/status.py (without --watch, status runs as is)
    "status": Subcommand("show what a running daemon holds: tiers, hit rates, moves, clients, reservations",
                         _configure_status_watch, _run_status_watch),
}


# ----------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash2", description="Operate and measure dflash2.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, sub in SUBCOMMANDS.items():
        sub.configure(subparsers.add_parser(name, help=sub.help, description=sub.help))
    return parser


class OutputFailed(Exception):
    """A write to stdout failed, not for a reader gone: a full disk under `> out.json`, a stdout not
    open for writing (the error's text)."""


class _Stdout:
    """sys.stdout while a subcommand runs: a failed write or flush raises OutputFailed, which `main`
    says in one line (status, history and the benches ended in a traceback, exit 1, a review). A closed
    pipe stays a BrokenPipeError (exit 141)."""

    def __init__(self, inner):
        self._inner = inner

    def write(self, text: str) -> int:
        return self._guarded(self._inner.write, text)

    def flush(self) -> None:
        self._guarded(self._inner.flush)

    @staticmethod
    def _guarded(call, *args):
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise OutputFailed(e.strerror or str(e)) from None

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:  # Ctrl-C while its parser loads the subcommands' modules (seconds on a busy node)
        return 128 + signal.SIGINT
    stdout = sys.stdout
    if stdout is not None:  # (None where it is closed, `>&-`: nothing is printed)
        sys.stdout = _Stdout(stdout)
    # SIGTERM and SIGHUP (and for a bench, Ctrl-C) end the command through its clean-up, which they
    # wait for (stopsignals.py): a bench stopped by `timeout` or a supervisor left its daemon
    # running, its shared memory and a GB-sized NVMe file.
    saved = stopsignals.install(interrupt=args.command == "bench")  # (Ctrl-C ends `status --watch`, exit 0)
    try:
        return SUBCOMMANDS[args.command].handler(args)
    except UsageError as exc:
        print(f"dflash2: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # Ctrl-C on `status` or `history`: as a shell reports it, without a traceback
        return 128 + signal.SIGINT
    except BrokenPipeError:
        # The reader went away (`dflash2 bench ... --json | head -1`): what it read is all it wanted.
        from dflash2.logs import silence_stdout

        silence_stdout()
        return EXIT_BROKEN_PIPE
    except OutputFailed as exc:
        from dflash2.logs import silence_stdout

        silence_stdout()  # (what is still buffered would fail again at the exit's flush)
        print(f"dflash2: error: cannot write the output to stdout: {exc}", file=sys.stderr)
        return EXIT_NO_OUTPUT
    finally:
        sys.stdout = stdout
        for sig, handler in saved.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    # `python -m dflash2.cli`: run the module that subcommands import (`from dflash2.cli import
    # UsageError`), not this __main__ copy, whose UsageError is another class that main() would not catch.
    from dflash2 import cli

    sys.exit(cli.main())
