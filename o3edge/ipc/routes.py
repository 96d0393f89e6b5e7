"""Who waits for what: generate requests in flight per client connection, and banned connections.

Plain bookkeeping for the server (no sockets); the server guards it with its socket lock: every
method that changes it (is_banned too: it forgets an expired ban) runs under that lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

MAX_BANNED = 1024


@dataclass(frozen=True)
class Flight:
    """A generate request whose replies still go to a client."""

    identity: bytes  # the connection's ZeroMQ routing id
    client_id: str  # the id the client gave the request


class Routes:
    """Engine request id <-> (connection, client id), with per-connection counts and a ban list."""

    def __init__(self):
        self.flights: dict[str, Flight] = {}  # engine request id -> flight
        self.peers: dict[bytes, dict[str, str]] = {}  # routing id -> {client id: engine request id}
        self._banned: OrderedDict[bytes, float] = OrderedDict()  # routing id -> until (monotonic)

    def __len__(self) -> int:
        return len(self.flights)

    @property
    def num_clients(self) -> int:
        return len(self.peers)

    def add(self, rid: str, identity: bytes, client_id: str) -> None:
        self.flights[rid] = Flight(identity, client_id)
        self.peers.setdefault(identity, {})[client_id] = rid

    def find(self, identity: bytes, client_id: str) -> str | None:
        """The engine request id of a connection's request, if it is in flight."""
        return self.peers.get(identity, {}).get(client_id)

    def count(self, identity: bytes) -> int:
        return len(self.peers.get(identity, ()))

    def remove(self, rid: str) -> Flight | None:
        flight = self.flights.pop(rid, None)
        if flight is not None:
            mine = self.peers.get(flight.identity)
            mine.pop(flight.client_id, None)
            if not mine:
                del self.peers[flight.identity]
        return flight

    def drop(self, identity: bytes) -> list[str]:
        """Forget a connection; returns the engine request ids it had in flight."""
        rids = list(self.peers.pop(identity, {}).values())
        for rid in rids:
            del self.flights[rid]
        return rids

    def ban(self, identity: bytes, until: float) -> None:
        self._banned[identity] = until
        while len(self._banned) > MAX_BANNED:
            self._banned.popitem(last=False)

    def is_banned(self, identity: bytes, now: float) -> bool:
        until = self._banned.get(identity)
        if until is not None and now >= until:
            del self._banned[identity]
            return False
        return until is not None
