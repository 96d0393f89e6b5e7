"""o3edged: the inference daemon, in the foreground, logging to stderr (journald under systemd).

    o3edged [--config PATH] [--endpoint ipc:///path] [--model DIR] [--device cpu|cuda|cuda:N|auto]
            [--log-level debug|info|warning|error] [--drop-cold-tier] [--detach]

--detach starts it in the background (log and pid file in $XDG_STATE_HOME/o3edge, by default
~/.local/state/o3edge) and returns once it listens; if a daemon already serves the endpoint it
says so and exits 0 without touching it. A daemon started by hand (not under the unit's
StateDirectory=) writes its energy log to that same directory.

Settings come from the TOML file (default /etc/o3edge/o3edge.toml, if present), then O3EDGE_*
variables, then these flags. With no model configured, the built-in default model is used.
--drop-cold-tier removes the KV cold tier's shared-memory segments that no running daemon holds
(every model's) before starting, so this start begins with an empty tier.

Exit status: 0 stopped cleanly (SIGTERM/SIGINT, after draining); 1 the engine or the I/O thread
failed (a load error other than the model's, a lost device, repeated step failures, a bug); 2 bad
command line; 73 the endpoint is taken by another o3edged or cannot be bound; 78 bad configuration or model.

systemd (Type=notify): READY=1 once the socket is bound and the engine warmed up; WATCHDOG=1 from
the engine loop (Hooks.on_loop), which then wakes at least twice per ping interval; EXTEND_TIMEOUT_USEC
and STATUS= before loading and before warming up (Hooks.on_phase); STATUS= every few seconds once
ready; STOPPING=1 when the drain begins. SIGHUP re-reads the settings (RELOADING=1 ... READY=1) and
applies the reloadable ones (log level, queue bounds, scheduler classes), logging by name those that
need a restart; a SIGHUP during start-up waits until the engine is ready.

Test-only: O3EDGE_TEST_FAULT=stall_engine_after_s=S hangs the engine loop S seconds after it starts
serving (see `with_test_fault`); it is read nowhere else and does nothing when unset.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import resource
import signal
import sys
import threading
import time
from typing import Callable

from o3edge.config import O3Config
from o3edge.energy_service import EnergyService, state_directory
from o3edge.errors import CheckpointError, ConfigError, O3Error
from o3edge.http.doors import Doors
from o3edge.ipc.endpoint import EndpointInUse
from o3edge.ipc.engine_loop import Hooks
from o3edge.ipc.server import IPCServer
from o3edge.memory import limit_arenas
from o3edge.detach import PidFile, detach
from o3edge.model_path import resolve_model_path
from o3edge.paths import user_state_dir
from o3edge.notify import Notifier
from o3edge.settings import DEFAULT_CONFIG_PATH, Settings, load_settings

log = logging.getLogger("o3edged")

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ENDPOINT, EXIT_CONFIG = 0, 1, 2, 73, 78
STATUS_EVERY_S = 5.0
PHASE_BUDGET_USEC = 120_000_000  # EXTEND_TIMEOUT_USEC per start-up phase (the unit's TimeoutStartSec)
MAX_IDLE_WAKE_S = 1.0  # the engine loop's longest idle wait, when no watchdog asks for less
FAULT_ENV = "O3EDGE_TEST_FAULT"
SWITCH_INTERVAL_S = 0.001  # Python's default is 0.005


class Daemon:
    """Runs an IPCServer until a signal asks it to stop; signal handlers only set flags."""

    def __init__(self, settings: Settings, notifier: Notifier | None = None,
                 reread: Callable[[], Settings] | None = None):
        self.settings = settings
        self.reread = reread  # builds fresh Settings from the same sources (SIGHUP)
        self.notifier = notifier or Notifier()
        self.stop_signal: int | None = None
        self.reload_requested = False
        on_loop = with_test_fault(self.notifier.watchdog, os.environ.get(FAULT_ENV))
        # a daemon started by hand keeps its energy log in the user's state directory
        self.energy = EnergyService(settings.power, settings.metrics,
                                    state_dir=state_directory() or str(user_state_dir()))
        hooks = Hooks(on_loop=on_loop, on_phase=self._on_phase, **self.energy.hooks())
        # The loop pings only when it comes round: waking at least every half ping interval keeps
        # consecutive pings 1/2 to 3/4 of WATCHDOG_USEC apart.
        ping_s = self.notifier.watchdog_interval_s
        idle_wake_s = min(MAX_IDLE_WAKE_S, ping_s / 2) if ping_s else MAX_IDLE_WAKE_S
        self.server = IPCServer(settings.server, self._load_engine, hooks, idle_wake_s, settings.engine.policy.requests)
        self.energy.attach(self.server)
        self.server.about["energy_log"] = str(self.energy.log_path) if self.energy.log_path else None
        self.doors = Doors(settings.http, settings.upstream, self.server, self.energy.registry, self.energy.requests)

    def _on_phase(self, phase: str) -> None:
        """Engine thread: before loading and warming up, each phase gets its own start-up budget."""
        if phase != "ready":
            self.notifier.extend_timeout(PHASE_BUDGET_USEC)
            self.notifier.status(phase.replace("_", " "))

    def _load_engine(self):
        """Runs on the engine thread, after the socket is bound: torch is imported here, not at start-up."""
        from o3edge.engine.engine import LLMEngine

        config: O3Config = self.settings.engine
        engine = LLMEngine(config, resolve_model_path(config.model_path))  # serves by config.policy
        tidy_cold_tier(config.cold_tier_dir, engine.offloader.tier.path if engine.offloader else None)
        return engine

    def apply_limits(self, settings: Settings) -> None:
        """Apply reloadable limits (SIGHUP): server queue bounds and the engine's policy."""
        self.server.update_limits(settings.server)
        policy = settings.engine.policy
        self.server.loop.call(lambda engine: engine.set_policy(policy))

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGHUP, self._on_reload_signal)

    def _on_stop_signal(self, signum, frame) -> None:
        self.stop_signal = signum

    def _on_reload_signal(self, signum, frame) -> None:
        self.reload_requested = True

    def run(self) -> int:
        """Start, serve until stopped, drain; returns the exit status."""
        try:
            self.server.start()
        except (EndpointInUse, O3Error, OSError) as exc:  # taken, unbindable, or no such directory
            log.error("%s", exc)
            self.energy.close()
            return EXIT_ENDPOINT
        try:
            self.doors.start()  # the HTTP port, when [http] is on
        except O3Error as exc:
            log.error("%s", exc)
            self.server.close()
            self.doors.close()
            self.energy.close()
            return EXIT_ENDPOINT
        self.energy.start()
        status = self._serve()
        drain_s = self.settings.server.drain_timeout_s
        self.server.drain()  # refuse new work before STOPPING=1 says so
        self.notifier.stopping(f"draining: {len(self.server.routes)} in flight, up to {drain_s:g} s")
        self.server.shutdown(drain_s)
        self.doors.close()
        self.energy.close()
        return status

    def _serve(self) -> int:
        is_ready, last_status = False, 0.0
        while self.stop_signal is None:
            if is_ready:
                time.sleep(0.2)
            else:
                self.server.wait_ready(0.2)
            state = self.server.state
            if state == "failed":
                bad_setup = isinstance(self.server.loop.error, (ConfigError, CheckpointError))
                return EXIT_CONFIG if bad_setup else EXIT_FAILED
            if state == "ready" and not is_ready:
                is_ready, last_status = True, time.monotonic()
                log.info("ready: %s", self.server.loop.view.describe(self.server.settings.endpoint))
                self.notifier.ready(self.server.status_line())
            if self.reload_requested and is_ready:  # READY=1 ends a reload: not before the first one
                self.reload_requested = False
                self._reload()
            if is_ready and time.monotonic() - last_status >= STATUS_EVERY_S:
                last_status = time.monotonic()
                self.notifier.status(self.server.status_line())
        log.info("%s: draining (up to %.0f s)", signal.Signals(self.stop_signal).name,
                 self.settings.server.drain_timeout_s)
        return EXIT_OK

    def _reload(self) -> None:
        """SIGHUP: apply what can change while running; name what needs a restart."""
        self.notifier.reloading()
        try:
            new = self.reread() if self.reread else self.settings
        except ConfigError as exc:
            log.error("reload failed, keeping the running settings: %s", exc)
        else:
            applied, need_restart = self.settings.reloadable_diff(new)
            self.settings = self.settings.reloaded(new)
            logging.getLogger().setLevel(self.settings.log.level.upper())
            self.apply_limits(self.settings)
            self.energy.reload(self.settings.power)
            log.info("reloaded settings: applied %s%s", ", ".join(applied) or "nothing",
                     f"; need a restart: {', '.join(need_restart)}" if need_restart else "")
        self.notifier.ready(self.server.status_line())


def with_test_fault(on_loop: Callable[[], None], spec: str | None) -> Callable[[], None]:
    """Test-only fault (O3EDGE_TEST_FAULT): `stall_engine_after_s=S` hangs the engine loop S s into serving.

    The hang waits on an Event with the GIL released, as a hung CUDA call does: every other thread
    runs on, but the loop never comes round to send WATCHDOG=1 again. Unset, on_loop is returned as is.
    """
    if not spec:
        return on_loop
    name, _, value = spec.partition("=")
    try:
        after_s = float(value) if name.strip() == "stall_engine_after_s" else None
    except ValueError:
        after_s = None
    if after_s is None:
        log.warning("ignoring %s=%r: the only fault is stall_engine_after_s=<seconds>", FAULT_ENV, spec)
        return on_loop
    log.warning("TEST FAULT (%s): the engine loop will hang %g s after it starts serving", FAULT_ENV, after_s)
    serving_since: list[float] = []  # when the loop first came round

    def stalling_on_loop() -> None:
        if not serving_since:
            serving_since.append(time.monotonic())
        if time.monotonic() - serving_since[0] >= after_s:
            log.warning("TEST FAULT: the engine loop hangs now")
            threading.Event().wait()
        on_loop()

    return stalling_on_loop


def tidy_cold_tier(directory: str, keep: str | None) -> None:
    """Remove the cold-tier segments no running process holds, except ours: another model's (after a
    model change), a daemon that is gone, or all of them when the tier is off (`cold_tier_mb = 0`)."""
    from o3edge.engine.cold_tier import remove_unused

    removed = remove_unused(directory, keep)
    if removed:
        log.info("removed unused KV cold-tier segments: %s", ", ".join(removed))


def drop_cold_tier(directory: str) -> None:
    """--drop-cold-tier: remove every o3edge segment in the cold tier's directory that no daemon holds."""
    from o3edge.engine.cold_tier import remove_unused  # plain Python: no torch at start-up

    removed = remove_unused(directory)
    log.info("dropped the KV cold tier: %s", ", ".join(removed) or "nothing to remove")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="o3edged", description="o3edge on-device LLM inference daemon")
    ap.add_argument("--config", help=f"TOML settings file (default {DEFAULT_CONFIG_PATH} if it exists)")
    ap.add_argument("--endpoint", help="ipc:///path/to/socket to listen on")
    ap.add_argument("--model", help="model directory (HF checkpoint or o3edge engine); default: built-in tiny")
    ap.add_argument("--device", help="cpu, cuda, cuda:N or auto")
    ap.add_argument("--log-level", choices=("debug", "info", "warning", "error", "critical"))
    ap.add_argument("--drop-cold-tier", action="store_true",
                    help="remove the KV cold tier's shared-memory segments (unused ones) before starting")
    ap.add_argument("--detach", action="store_true", help="run in the background (log and pid file in "
                    "~/.local/state/o3edge); if one already runs on the endpoint, say so and exit 0")
    ap.add_argument("--pidfile", help=argparse.SUPPRESS)  # written by --detach's background daemon
    return ap.parse_args(argv)


def configure_logging(level: str) -> None:
    # journald stamps each line itself; a terminal wants the time
    fmt = "%(levelname)s %(name)s: %(message)s" if os.environ.get("JOURNAL_STREAM") else \
        "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level.upper(), format=fmt, stream=sys.stderr, force=True)


def raise_fd_limit() -> int:
    """Raise the soft open-files limit to the hard one (libzmq aborts the process when accept() hits it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, hard, exc)
    return soft


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    faulthandler.enable()  # the watchdog's SIGABRT then prints every thread's stack
    configure_logging(args.log_level or "info")
    raise_fd_limit()
    limit_arenas()  # before any thread starts: per-thread heaps kept big inputs' memory for good
    # The I/O thread answers health in well under a millisecond of Python, but waits for the GIL
    # behind the engine and tokenizer threads: a shorter switch interval bounds that wait.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    overrides = {"server.endpoint": args.endpoint, "engine.model_path": args.model, "engine.device": args.device,
                 "log.level": args.log_level}
    try:
        settings = load_settings(args.config, None, overrides)
    except ConfigError as exc:
        log.error("%s", exc)
        return EXIT_CONFIG
    if args.detach:
        rest = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--detach"]
        return detach(rest, settings.server.endpoint)
    configure_logging(settings.log.level)
    if args.drop_cold_tier:
        drop_cold_tier(settings.kv.cold_tier_dir)
    try:
        daemon = Daemon(settings, reread=lambda: load_settings(args.config, None, overrides))
    except ConfigError as exc:  # an unreadable upstream.api_key_file
        log.error("%s", exc)
        return EXIT_CONFIG
    pidfile = PidFile(args.pidfile)
    daemon.install_signal_handlers()
    try:
        return daemon.run()
    finally:
        pidfile.remove()


if __name__ == "__main__":
    sys.exit(main())
