"""systemd service notifications (sd_notify) for o3edged: readiness, status, reload, stop, watchdog.

Call `watchdog()` from the engine loop itself (the loop that runs the steps), never from a side
thread or a timer: a CUDA call that hangs releases the GIL, so a side thread would keep sending
WATCHDOG=1 while the engine is dead and systemd would never restart it. The loop must therefore
come round at least every `watchdog_interval_s` (block on an idle queue no longer than that). The
other messages may come from any thread: each is one datagram, so concurrent sends never mix.

Outside systemd ($NOTIFY_SOCKET unset) every method is a silent no-op, and no method ever raises:
a lost notification must not take the daemon down.

Transport: the sdnotify package (0.3.2). It maps a leading '@' to the abstract namespace
correctly, but encodes with latin-1, so a non-latin-1 STATUS would be dropped and a latin-1 one
would reach systemd as invalid UTF-8 (which systemd ignores); `_send` hands it UTF-8 bytes
spelled as latin-1 text, which round-trip unchanged.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Callable

import sdnotify

log = logging.getLogger(__name__)

# A blocked notify socket (systemd busy) must not stall the engine loop for long.
SEND_TIMEOUT_S = 0.5


class Notifier:
    """Sends sd_notify messages to $NOTIFY_SOCKET; a no-op without it; never raises."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._sd = _connect()
        self._ping_interval_s = _watchdog_interval_s(os.environ)
        self._last_ping: float | None = None
        self._is_ready = False

    @property
    def is_enabled(self) -> bool:
        """True when connected to a notify socket (running under systemd with Type=notify)."""
        return self._sd is not None

    @property
    def watchdog_interval_s(self) -> float | None:
        """Seconds between watchdog pings (half of WATCHDOG_USEC); None when no watchdog is ours."""
        return self._ping_interval_s

    def ready(self, status: str | None = None) -> None:
        """READY=1: the engine is loaded, warmed up and the sockets are bound (also ends a reload)."""
        self._is_ready = True
        self._send("READY=1" + (f"\nSTATUS={_one_line(status)}" if status else ""))

    def status(self, text: str) -> None:
        """STATUS=<text>: the one-line state `systemctl status` shows."""
        self._send(f"STATUS={_one_line(text)}")

    def reloading(self) -> None:
        """RELOADING=1 with MONOTONIC_USEC (systemd ≥ 253 needs it); send ready() when done."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self._send(f"RELOADING=1\nMONOTONIC_USEC={usec}")

    def stopping(self, status: str | None = None) -> None:
        """STOPPING=1: a drain has begun."""
        self._send("STOPPING=1" + (f"\nSTATUS={_one_line(status)}" if status else ""))

    def extend_timeout(self, usec: int) -> None:
        """EXTEND_TIMEOUT_USEC: give the current start (or stop) phase `usec` more from now.

        Re-send it within each extension while a phase lasts; it also pushes the watchdog back.
        """
        self._send(f"EXTEND_TIMEOUT_USEC={max(0, int(usec))}")

    def watchdog(self) -> None:
        """WATCHDOG=1 at most once per `watchdog_interval_s`; call it on every loop iteration.

        Dropped before ready(): systemd arms the watchdog at READY=1, and an early ping would arm it
        while a long blocking load cannot ping (use extend_timeout() while starting).
        """
        if self._ping_interval_s is None or not self._is_ready:
            return
        now = self._clock()
        if self._last_ping is not None and now - self._last_ping < self._ping_interval_s:
            return
        self._last_ping = now
        self._send("WATCHDOG=1")

    def _send(self, message: str) -> None:
        if self._sd is None:
            return
        try:
            self._sd.notify(message.encode("utf-8").decode("latin-1"))
        except Exception:  # sdnotify swallows socket errors itself; this is belt and braces
            log.debug("sd_notify failed", exc_info=True)


def _connect() -> sdnotify.SystemdNotifier | None:
    if not os.environ.get("NOTIFY_SOCKET"):
        return None
    try:
        notifier = sdnotify.SystemdNotifier()
    except Exception:
        return None
    sock: socket.socket | None = getattr(notifier, "socket", None)
    if sock is None:  # connect failed (dead path, unsupported address): stay silent
        log.debug("NOTIFY_SOCKET %r is not reachable; notifications disabled", os.environ["NOTIFY_SOCKET"])
        return None
    sock.settimeout(SEND_TIMEOUT_S)
    return notifier


def _watchdog_interval_s(env) -> float | None:
    """Half of WATCHDOG_USEC when the watchdog applies to this process (sd_watchdog_enabled)."""
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    return usec / 2 / 1_000_000


def _one_line(text: str) -> str:
    # A newline would start a new assignment (STATUS="x\nSTOPPING=1"): flatten it.
    return str(text).replace("\r", " ").replace("\n", " ")
