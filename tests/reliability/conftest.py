"""Real o3edged processes for the reliability suite (tests/ipc/conftest.py's DaemonProcess).

O3EDGE_RELIABILITY_MODEL=DIR runs the suite against that model instead of the tiny test model
(docs/reliability.md's figures use the shipped reference model), and O3EDGE_RELIABILITY_FIGURES=PATH
makes the tests write the figures they measure to that JSON file.
"""

import json
import os
import platform
import tempfile
import time

import psutil
import pytest

from tests.ipc.conftest import DaemonProcess, clean_env  # noqa: F401 (re-exported)


def open_dir() -> str:
    """A fresh directory other users can traverse (pytest's own tmp dirs are 0700)."""
    path = tempfile.mkdtemp(prefix="o3rel-", dir="/tmp")
    os.chmod(path, 0o755)
    return path


def model_under_test(tiny_dir) -> str:
    return os.environ.get("O3EDGE_RELIABILITY_MODEL") or tiny_dir


def start_daemon(tiny_dir, tables=None, directory=None) -> DaemonProcess:
    d = DaemonProcess(directory or open_dir(), model_under_test(tiny_dir), tables=tables)
    d.start().wait_ready()
    return d


def num_fds(pid: int) -> int:
    return psutil.Process(pid).num_fds()


@pytest.fixture(scope="module")
def rel_daemon(tiny_dir):
    """One o3edged with default limits for a test module."""
    d = start_daemon(tiny_dir)
    yield d
    d.stop()


@pytest.fixture(scope="session")
def figures():
    """record(name, **values): keep a measured figure; written out at the end when asked for."""
    table: dict = {}
    yield lambda name, **values: table.setdefault(name, {}).update(values)
    path = os.environ.get("O3EDGE_RELIABILITY_FIGURES")
    if path and table:
        meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": platform.platform(),
                "cpus": os.cpu_count(), "load_average": os.getloadavg(),
                "model": os.environ.get("O3EDGE_RELIABILITY_MODEL") or "tiny test model (o3edge.tiny)"}
        with open(path, "w") as fh:
            json.dump({"meta": meta, "figures": table}, fh, indent=1, sort_keys=True)
