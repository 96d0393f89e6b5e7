"""Where the daemon listens: ipc:// socket files, their permissions, and the one-daemon lock.

libzmq's ipc bind silently unlinks an existing socket file, so a second daemon would steal the
endpoint from the first. An fcntl lock on `<socket>.lock`, taken before binding, prevents that;
the kernel drops it when the process dies, so a crash leaves nothing that blocks a restart.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os

from o3edge.errors import ConfigError, O3Error

log = logging.getLogger(__name__)

MAX_SUN_PATH = 107  # bytes in sockaddr_un.sun_path, less the terminating NUL


class EndpointInUse(O3Error):
    code = "endpoint_in_use"


def ipc_path(endpoint: str) -> str | None:
    """The socket file of an ipc:// endpoint; None for tcp://."""
    if endpoint.startswith("tcp://"):
        return None
    path = endpoint.removeprefix("ipc://")
    if path == endpoint or not path.startswith("/"):
        raise ConfigError(f"endpoint must be ipc:///absolute/path or tcp://host:port, got {endpoint!r}")
    if len(os.fsencode(path)) > MAX_SUN_PATH:
        raise ConfigError(f"ipc socket path is longer than {MAX_SUN_PATH} bytes: {path}")
    return path


class EndpointLock:
    """An exclusive lock on `<socket path>.lock`, held for the daemon's lifetime."""

    def __init__(self, socket_path: str):
        self.path = socket_path + ".lock"
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise EndpointInUse naming the holder's pid."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            raise EndpointInUse(f"another o3edged (pid {holder}) already serves "
                                f"ipc://{self.path.removesuffix('.lock')} (lock file {self.path})") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        # The lock file stays: unlinking it would let a third daemon lock a fresh inode meanwhile.
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def prepare_socket_dir(socket_path: str) -> None:
    """Create the socket's directory (0750) if it is missing; systemd's RuntimeDirectory does it too."""
    directory = os.path.dirname(socket_path)
    if not os.path.isdir(directory):
        os.makedirs(directory, mode=0o750, exist_ok=True)
    mode = os.stat(directory).st_mode & 0o777
    if mode & 0o007:
        log.warning("socket directory %s is open to other users (mode %o); 0750 keeps the socket to its group",
                    directory, mode)


def secure_socket(socket_path: str, mode: int) -> None:
    """Set the socket file's mode after bind (connecting needs write permission on it)."""
    os.chmod(socket_path, mode)


def remove_socket(socket_path: str) -> None:
    """Remove our socket file at shutdown (only while we still hold the lock)."""
    try:
        os.unlink(socket_path)
    except FileNotFoundError:
        pass
