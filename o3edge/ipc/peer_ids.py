"""The ZeroMQ routing ids of the daemon's peers: unguessable, never logged, none taken from the reserved space.

libzmq's ROUTER names a peer that chose no routing id `\\x00` + a 32-bit counter, one more for each new peer, and
takes any id a peer does choose, one starting with a zero byte included (the docs reserve those; libzmq does not
refuse them). A peer that claims the id the counter will give a later peer aborts the whole process when that
peer connects: libzmq asserts that a new id is free (socket_base.cpp, "Assertion failed: ok"). The counter starts
at libc's rand(), which nothing seeded: 0x6b8b4567 in every process, so any local client could crash the daemon by
claiming the next few hundred ids (found by an adversarial probe, 2026-12-05). Hence:

- libc's rand() is seeded from the OS's randomness before the socket is made (seed_generated_ids), so the counter
  starts where no client can guess;
- peers are logged by a keyed digest of their id (tag), so a log line does not give the counter away;
- a message whose routing id starts with a zero byte but is not 5 bytes long (reserved) came from a peer that chose
  an id in the reserved space, never from the counter; it is dropped unread and unanswered. That space also holds
  the ids of the in-process HTTP door's requests (server.LOCAL_PREFIX), whose replies such a peer could otherwise
  have written into, or whose requests it could have cancelled.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import secrets

log = logging.getLogger(__name__)

_KEY = secrets.token_bytes(16)  # this process's key for tag()


def seed_generated_ids() -> bool:
    """Seed libc's rand() from the OS's randomness, so that a ROUTER socket made after this starts its generated
    routing ids at an unguessable value; False when libc could not be reached (the ids stay guessable)."""
    try:
        ctypes.CDLL(None).srand(secrets.randbits(32))
    except (OSError, AttributeError):
        log.warning("could not seed libc's rand(): ZeroMQ's generated routing ids stay guessable")
        return False
    return True


def tag(identity: bytes) -> str:
    """A peer's name in logs: a keyed digest of its routing id, the same for the same peer within this process."""
    return hashlib.blake2b(identity, key=_KEY, digest_size=6).hexdigest()


def reserved(identity: bytes) -> bool:
    """Whether a routing id is one a peer chose in the space reserved for generated ids (a zero byte first) and
    that the counter cannot have made (not 5 bytes long)."""
    return identity[:1] == b"\x00" and len(identity) != 5
