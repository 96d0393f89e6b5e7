"""One o3edged subprocess, for the tests and the tools alike (loadgen.py, bench_ipc.py).

The daemon runs `python -m o3edge.daemon --config FILE` from this repository on an ipc:// socket in
a directory of the caller's, with a TOML file written from tables ({"engine": {...}, "server":
{...}, "scheduler.low": {...}}), its output in a log file next to it and no O3EDGE_* variables from
the caller's environment. Ready means `health` says so; stop() sends SIGTERM (SIGKILL if it hangs).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from o3edge.ipc.client import DaemonUnavailable, O3Client

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def clean_env(**extra) -> dict:
    """This environment without O3EDGE_* settings, with the repository importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("O3EDGE_")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def merge(into: dict, tables: dict) -> dict:
    """Merge {table: {key: value}} into `into`, key by key."""
    for table, values in tables.items():
        into.setdefault(table, {}).update(values)
    return into


class DaemonProcess:
    """An o3edged subprocess with its endpoint, config file and log file, all in `directory`."""

    def __init__(self, directory: str, model_dir: str, name: str = "o3.sock", tables: dict | None = None,
                 env: dict | None = None, args: tuple[str, ...] = ()):
        self.socket_path = os.path.join(directory, name)
        self.endpoint = "ipc://" + self.socket_path
        self.config = os.path.join(directory, name + ".toml")
        self.log_path = os.path.join(directory, name + ".log")
        self.tables = merge({"engine": {"model_path": model_dir, "device": "cpu"},
                             "server": {"endpoint": self.endpoint, "drain_timeout_s": 5.0}}, tables or {})
        # XDG_STATE_HOME: a daemon started by hand writes its energy log there, not in the user's home
        self.env = clean_env(XDG_STATE_HOME=directory, **(env or {}))
        self.args = tuple(args)
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.configure()

    def configure(self, tables: dict | None = None) -> None:
        """Merge tables in and (re)write the config file; a running daemon reads it on SIGHUP."""
        merge(self.tables, tables or {})
        with open(self.config, "w") as fh:
            for table, values in self.tables.items():
                fh.write(f"[{table}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))

    def start(self) -> "DaemonProcess":
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "o3edge.daemon", "--config", self.config, *self.args],
                                     cwd=REPO, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout: float = 60.0) -> "DaemonProcess":
        """Wait until `health` says ready; AssertionError (with the log) if it exits or takes longer."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"o3edged exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with O3Client(self.endpoint, timeout=2.0) as c:
                    if c.health()["ready"]:
                        return self
            except DaemonUnavailable:
                pass
            time.sleep(0.05)
        raise AssertionError(f"o3edged not ready after {timeout} s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Signal it and wait (SIGKILL after `timeout`); its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def log(self) -> str:
        with open(self.log_path, errors="replace") as fh:
            return fh.read()
