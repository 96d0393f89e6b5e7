"""The daemon's energy service: meter, sampler, accountant, energy log and metrics behind engine-loop hooks.

Built once from [power] and [metrics]; `hooks()` gives the callables for o3edge.ipc.engine_loop.Hooks.
The engine thread only hands work over: on_step queues the step for the accountant, on_finish takes
the request's figure without waiting (its last steps, not yet sampled, are extrapolated at the
recent power) and leaves the log line to the service's own thread, which also rewrites the metrics
textfile every `textfile_interval_s`. The HTTP exporter, when asked for, listens on 127.0.0.1 only.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import start_http_server

from o3edge.errors import ConfigError
from o3edge.ipc.metrics import RequestCounter, ServiceCollector, server_figures
from o3edge.paths import user_state_dir
from o3edge.power import EnergyAccountant, EnergyLog, EnergySampler, auto_meter
from o3edge.power.metrics import new_registry, register_energy_metrics, write_textfile
from o3edge.power.records import EnergyTotals, RequestEnergy
from o3edge.settings import MetricsSettings, PowerSettings, load_settings

if TYPE_CHECKING:
    from o3edge.ipc.server import IPCServer

log = logging.getLogger(__name__)

DEFAULT_STATE_DIR = "/var/lib/o3edge"  # the unit's StateDirectory=
ENERGY_LOG_NAME = "energy.jsonl"
TEXTFILE_INTERVAL_S = 15.0  # node_exporter reads the textfile at each scrape; 15 s is a common scrape period
WINDOWS_S = (60.0, 900.0)
_STOP = object()


def state_directory(env: Mapping[str, str] | None = None) -> str | None:
    """systemd's $STATE_DIRECTORY (the first one if several), or None outside such a unit."""
    value = (os.environ if env is None else env).get("STATE_DIRECTORY", "")
    return value.split(":")[0] or None


def energy_log_path(power: PowerSettings, state_dir: str | None) -> Path | None:
    """[power] energy_log when set, else energy.jsonl in the state directory, else None (no log)."""
    if power.energy_log:
        return Path(power.energy_log)
    return Path(state_dir) / ENERGY_LOG_NAME if state_dir else None


def default_energy_log() -> Path:
    """The log o3edged writes with this machine's settings (file, then O3EDGE_* variables), for the CLI:
    the configured one; else, of the service's (/var/lib/o3edge) and a hand-started daemon's (the
    user's state directory), the one written last; else the user's."""
    try:
        configured = load_settings().power.energy_log
    except ConfigError:  # unreadable or broken settings: the defaults are still the best guess
        configured = ""
    if configured or state_directory():
        return energy_log_path(PowerSettings(energy_log=configured), state_directory())
    candidates = [user_state_dir() / ENERGY_LOG_NAME, Path(DEFAULT_STATE_DIR) / ENERGY_LOG_NAME]
    existing = [p for p in candidates if _exists(p)]
    return max(existing, key=lambda p: p.stat().st_mtime) if existing else candidates[0]


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a directory we may not read
        return False


def reply_energy(energy: RequestEnergy) -> dict:
    """The `done` reply's `energy` map (the engine's request id stays out: clients know their own)."""
    tpj = energy.tokens_per_joule
    return {"joules": round(energy.joules, 6), "tokens_per_joule": None if tpj is None else round(tpj, 6),
            "tokens": energy.tokens, "prompt_tokens": energy.prompt_tokens,
            "duration_s": round(energy.duration_s, 6), "meter": energy.meter, "domains": list(energy.domains),
            "is_estimate": energy.is_estimate, "low_confidence": energy.low_confidence}


def _totals(t: EnergyTotals) -> dict:
    r = lambda x: None if x is None else round(x, 6)  # noqa: E731
    return {"tokens_per_joule": r(t.tokens_per_joule), "active_tokens_per_joule": r(t.active_tokens_per_joule),
            "active_joules": r(t.active_joules), "idle_joules": r(t.idle_joules), "tokens": t.tokens,
            "prompt_tokens": t.prompt_tokens}


class EnergyService:
    """Owns the energy figures of one daemon; start() after the server is bound, close() after it stopped."""

    def __init__(self, power: PowerSettings, metrics: MetricsSettings, state_dir: str | None = None,
                 textfile_interval_s: float = TEXTFILE_INTERVAL_S):
        self.state_dir = state_dir
        self.meter = auto_meter(power.meter)
        self.sampler = EnergySampler(self.meter, period_s=power.sample_interval_ms / 1000)
        self.accountant = EnergyAccountant(self.sampler, prefill_weight=power.prefill_weight, windows_s=WINDOWS_S)
        self.requests = RequestCounter()
        self.log_path = energy_log_path(power, state_dir)
        self.energy_log = EnergyLog(self.log_path) if self.log_path else None
        self.textfile = Path(metrics.textfile) if metrics.textfile else None
        self.textfile_interval_s = textfile_interval_s
        self.http_port = metrics.http_port
        self._figures: Callable[[], dict] = dict  # the server's, once attach() is called
        self.registry = new_registry()
        register_energy_metrics(self.registry, self.sampler, self.accountant)
        self.registry.register(ServiceCollector(lambda: self._figures(), self.requests))
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._http = None
        self._closed = False

    # ---- wiring -------------------------------------------------------------------------------
    def hooks(self) -> dict:
        """Keyword arguments for o3edge.ipc.engine_loop.Hooks."""
        return {"on_admit": self.on_admit, "on_step": self.on_step, "on_finish": self.on_finish,
                "stats": self.stats}

    def attach(self, server: "IPCServer") -> None:
        """Read the server's queue, batch and KV-cache figures for the metrics."""
        self._figures = lambda: server_figures(server)

    def start(self) -> None:
        """Start sampling, the log/textfile thread and (if configured) the HTTP exporter."""
        self.sampler.start()
        self._thread = threading.Thread(target=self._run, name="o3edge-energy-out", daemon=True)
        self._thread.start()
        if self.http_port:
            self._start_http(self.http_port)
        log.info("energy: %s; log %s; metrics textfile %s; exporter %s", self.meter.describe(),
                 self.log_path or "off", self.textfile or "off",
                 "127.0.0.1:%d" % self.http_address[1] if self.http_address else "off")

    def reload(self, power: PowerSettings) -> None:
        """Apply a reloaded [power] section: only energy_log changes while running."""
        path = energy_log_path(power, self.state_dir)
        if path != self.log_path:
            self.log_path, self.energy_log = path, EnergyLog(path) if path else None
            log.info("energy log now %s", path or "off")

    def close(self) -> None:
        """Write what is queued and the last textfile, stop the exporter and the sampler; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(5.0)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        self.accountant.close()
        self.sampler.stop()
        self.meter.close()

    # ---- hooks (engine thread, except stats: I/O thread) ---------------------------------------
    def on_admit(self, request_id: str, priority: str) -> None:
        """Remember the request's priority class for its log line and metrics."""
        self.requests.admit(request_id, priority)

    def on_step(self, report) -> None:
        """Queue one engine step for attribution (cheap; never raises)."""
        self.accountant.report_step(report)

    def on_finish(self, request_id: str, outcome: str) -> dict:
        """The request's energy for its `done` reply; counts it and queues its log line."""
        priority = self.requests.finish(request_id, outcome)
        energy = self.accountant.finish(request_id, wait_s=0)
        if self.energy_log is not None:
            self._queue.put((energy, priority, outcome))
        return reply_energy(energy)

    def stats(self) -> dict:
        """The `stats` reply's `energy` map: tokens/J overall and over the recent windows, meter named."""
        m = self.meter
        figures = {"meter": m.name, "domains": list(m.domains), "is_estimate": m.is_estimate,
                   "all": _totals(self.accountant.totals())}
        for window_s in WINDOWS_S:
            figures[f"last_{window_s:g}s"] = _totals(self.accountant.totals(window_s))
        figures["pending_steps"] = self.accountant.num_pending_steps
        figures["log"] = str(self.log_path) if self.log_path else None
        return {"energy": figures}

    # ---- output -------------------------------------------------------------------------------
    @property
    def http_address(self) -> tuple[str, int] | None:
        """(host, port) the exporter listens on, or None."""
        return self._http.server_address[:2] if self._http is not None else None

    def write_metrics(self) -> bool:
        """Rewrite the textfile now (temporary file + rename); False if none is configured or it failed."""
        return self.textfile is not None and write_textfile(self.registry, self.textfile)

    def _start_http(self, port: int) -> None:
        try:
            self._http, _ = start_http_server(port, addr="127.0.0.1", registry=self.registry)
        except OSError as exc:
            log.error("metrics exporter cannot listen on 127.0.0.1:%d (%s); serving goes on without it", port, exc)

    def _run(self) -> None:
        """Write log lines as they come and the textfile every textfile_interval_s."""
        next_write = time.monotonic()
        while True:
            timeout = max(0.0, next_write - time.monotonic()) if self.textfile else None
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                item = None
            if item is _STOP:
                break
            if item is not None:
                self._log(*item)
            if self.textfile and time.monotonic() >= next_write:
                self.write_metrics()
                next_write = time.monotonic() + self.textfile_interval_s
        self.write_metrics()

    def _log(self, energy: RequestEnergy, priority: str, outcome: str) -> None:
        energy_log = self.energy_log
        if energy_log is not None:
            energy_log.log_request(energy, priority=priority, finish_reason=outcome)
