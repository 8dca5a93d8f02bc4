"""Benchmark commands: each prints JSON figures (`dflash2 bench NAME --json`)."""
