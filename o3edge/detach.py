"""`o3edged --detach`: start the daemon in the background, once.

The quick start runs this: a second run finds the first daemon (its endpoint lock is held) and
says so without touching it or its log. The background daemon appends to `o3edged.log` and writes
`o3edged.pid` in the user's state directory ($XDG_STATE_HOME/o3edge or ~/.local/state/o3edge).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from o3edge.paths import user_state_dir

START_WAIT_S = 30.0  # until the socket answers (the engine loads after that)


def holder_of(socket_path: str) -> str | None:
    """The pid written in the endpoint's lock file if a daemon holds the lock, else None."""
    try:
        fd = os.open(socket_path + ".lock", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
            return os.read(fd, 32).decode(errors="replace").strip() or "?"
        raise
    finally:
        os.close(fd)
    return None


def _listening(socket_path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(socket_path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def detach(argv: list[str], endpoint: str, state_dir: Path | None = None) -> int:
    """Start `o3edged argv` in the background unless one already serves `endpoint`; returns an exit status."""
    socket_path = endpoint.removeprefix("ipc://")
    state_dir = state_dir or user_state_dir()
    log_path, pid_path = state_dir / "o3edged.log", state_dir / "o3edged.pid"
    holder = holder_of(socket_path)
    if holder is not None:
        print(f"o3edged is already running (pid {holder}) on {endpoint}; its log: {log_path}", file=sys.stderr)
        return 0
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:  # append: never truncate a log another daemon may be writing
        child = subprocess.Popen([sys.executable, "-m", "o3edge.daemon", *argv, "--pidfile", str(pid_path)],
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    end = time.monotonic() + START_WAIT_S
    while time.monotonic() < end:
        status = child.poll()
        if status is not None:
            holder = holder_of(socket_path)
            if holder is not None:  # another start won the race
                print(f"o3edged is already running (pid {holder}) on {endpoint}; its log: {log_path}",
                      file=sys.stderr)
                return 0
            print(f"o3edged exited with status {status}; see {log_path}", file=sys.stderr)
            return status
        if _listening(socket_path):
            print(f"o3edged started in the background (pid {child.pid}) on {endpoint}; log: {log_path}; "
                  f"stop it with: kill $(cat {pid_path})", file=sys.stderr)
            return 0
        time.sleep(0.05)
    print(f"o3edged (pid {child.pid}) is not listening on {endpoint} after {START_WAIT_S:g} s; see {log_path}",
          file=sys.stderr)
    return 1


class PidFile:
    """Writes this process's pid; removes the file at exit if it still names this process."""

    def __init__(self, path: str | None):
        self.path = path
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(f"{os.getpid()}\n")

    def remove(self) -> None:
        try:
            if self.path and Path(self.path).read_text().strip() == str(os.getpid()):
                os.unlink(self.path)
        except OSError:
            pass
