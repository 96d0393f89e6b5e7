"""Real o3edged processes for the reliability suite (tests/ipc/conftest.py's DaemonProcess)."""

import os
import tempfile

import psutil
import pytest

from tests.ipc.conftest import DaemonProcess, clean_env  # noqa: F401 (re-exported)


def open_dir() -> str:
    """A fresh directory other users can traverse (pytest's own tmp dirs are 0700)."""
    path = tempfile.mkdtemp(prefix="o3rel-", dir="/tmp")
    os.chmod(path, 0o755)
    return path


def start_daemon(tiny_dir, server_extra="", engine_extra="", directory=None) -> DaemonProcess:
    d = DaemonProcess(directory or open_dir(), tiny_dir, server_extra=server_extra, engine_extra=engine_extra)
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
