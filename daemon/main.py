"""`dflash2d`: load and validate the config, then run the daemon (or, with `--check`, print the plan).

Exit codes:
  0  ran and stopped cleanly, or `--check` found the config valid
  2  the config (or the command line) is wrong: one line `dflash2d: error: KEY: PROBLEM` on stderr
  3  the config says `enable: false`: the daemon is disabled and says so
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from dflash2.config import Config, check_environment, config_warnings, load_config, require_enabled
from dflash2.errors import ConfigError, DisabledError
from dflash2.plan import resolve_plan

EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_DISABLED = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash2d", description="The dflash2 daemon: one tiered KV-cache memory manager per node.",
        epilog="exit codes: 0 ok, 2 bad config or arguments, 3 disabled (`enable` is false)")
    parser.add_argument("--config", default="dflash2_config.json", metavar="FILE",
                        help="config file (default: dflash2_config.json in the working directory)")
    parser.add_argument("--check", action="store_true",
                        help="validate the config, print warnings and the resolved plan, and exit")
    parser.add_argument("--json", action="store_true", help="with --check: print the plan as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for warning in check_environment():
        _warn(warning)
    try:
        cfg = load_config(args.config)
        require_enabled(cfg)
        for warning in config_warnings(cfg):
            _warn(warning)
        plan = resolve_plan(cfg)
    except ConfigError as exc:
        return _fail(str(exc))
    except DisabledError as exc:
        print(exc, file=sys.stderr)
        return EXIT_DISABLED
    if args.check:
        print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.render_text())
        return EXIT_OK
    return _serve(cfg)


def _serve(cfg: Config) -> int:
    try:
        # Imported here: the server is heavy, and --check must work without it.
        server = importlib.import_module("dflash2.daemon.server")
    except ModuleNotFoundError as exc:
        if exc.name != "dflash2.daemon.server":
            raise
        return _fail("the daemon server (dflash2.daemon.server) is not built yet; only --check works")
    result = server.run(cfg)
    return EXIT_OK if result is None else int(result)


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _fail(message: str) -> int:
    print(f"dflash2d: error: {message}", file=sys.stderr)
    return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
