"""The daemon's observers: Prometheus metrics and history, fed by the thread that owns the manager.

    Server._tick ─▶ Observers.after_tick ─┬─ DaemonMetrics (snapshot for /metrics, histograms)
                                          ├─ History (one sample per interval, JSON lines file)
                                          └─ HitRateLog (the HBM hit rate in the log, once a minute)
"""

from __future__ import annotations

import logging
from pathlib import Path

from dflash2.config import Config
from dflash2.daemon import sessions
from dflash2.daemon.hitlog import HitRateLog
from dflash2.history import make_history
from dflash2.logs import event
from dflash2.metrics import DaemonMetrics

log = logging.getLogger("dflash2.daemon")
# How often the loop lets the observers sample, steps or not: the /metrics snapshot's and the
# history's interval (README: "a snapshot the daemon's loop refreshes every second").
SAMPLE_INTERVAL_S = 1.0


class Observers:
    def __init__(self, service, metrics: DaemonMetrics | None, history):
        self.service = service
        self.metrics = metrics
        self.history = history
        self.hit_log = HitRateLog(service)

    @classmethod
    def start(cls, cfg: Config, service, state_dir: Path, device: str, endpoint: str | None = None,
              also: str | None = None) -> "Observers":
        """Hook metrics and history into the service; serve /metrics when metrics.port is set.
        OSError when the metrics port cannot be bound (the daemon refuses to start then)."""
        metrics = None
        if cfg.metrics.port:
            metrics = DaemonMetrics(service, device=device)
            metrics.attach()
            metrics.refresh(force=True)
            metrics.serve(cfg.metrics.host, cfg.metrics.port)
        history = make_history(cfg, state_dir, endpoint, also)
        service.history = history
        obs = cls(service, metrics, history)
        obs.sample()  # (a first snapshot and sample; no step has run: a step of 0 s recorded here was a made-up one)
        return obs

    def after_tick(self, late_s: float, seconds: float) -> None:
        """Owner thread, after each background step."""
        if self.metrics is not None:
            self.metrics.after_tick(late_s, seconds)
        self.sample()

    def sample(self) -> None:
        """Owner thread, at least every SAMPLE_INTERVAL_S whatever the step's interval (which may be
        up to an hour): a new /metrics snapshot and a history sample, each when its own is due."""
        if self.metrics is not None:
            self.metrics.refresh()
        if self.history is not None and self.history.due():
            self.history.record(self.service.stats())
        self.hit_log.sample()

    def close(self) -> None:
        if self.history is not None:
            try:
                self.history.record(self.service.stats())  # the last figures before the daemon stops
            except Exception:  # (the file and the metrics server are let go all the same)
                log.exception("history: the last sample could not be taken")
            self.history.close()
        if self.metrics is not None:
            self.metrics.close()


def log_fallbacks(cfg: Config, plan) -> None:
    """One `dflash2_fallback` event per part the config asked for that this node cannot give."""
    if plan.device_kind == "host" and cfg.device.kind != "host":
        # (device.gpu_ids set: warned of as ignored by config_warnings, --check too; said here as well, twice)
        event(log, "dflash2_fallback", "no GPU: the device tier is in host memory", level=logging.WARNING,
              what="device", asked=cfg.device.kind, using="host", reason="; ".join(plan.notes))
    if not sessions.PROCFS:
        event(log, "dflash2_fallback",
              "/proc is not this process's pid namespace's, or cannot be read: whether a client's process still "
              "runs is asked by signal 0 (an exited client not yet reaped by its parent, and one whose pid a "
              "process of another user took since, count as running until the lease lapses)",
              level=logging.WARNING, what="client_liveness", asked="/proc", using="signal 0")
