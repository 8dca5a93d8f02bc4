"""Benchmark commands: each prints JSON figures (`dflash2 bench NAME --json`)."""


class OptionError(ValueError):
    """A benchmark option with a value it cannot run with; `dflash2 bench` prints it as a usage
    error (exit 2). Any other exception is a bug and keeps its traceback."""
