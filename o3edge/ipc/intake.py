"""Prompts on their way to the engine: tokenized off the I/O thread, fairly between connections.

Tokenizing is the one per-request cost that grows with the prompt (about 0.5 s per MiB here), so
it must neither run on the I/O thread (health and every other client would wait) nor let one
connection's stream of long prompts starve the others. Each Lane is a worker thread with one queue
per connection: it takes the most important waiting request, round robin between connections of
the same class. The server keeps two lanes, one for short prompts and one for long ones, so a
short critical request never waits behind a long encode. The tokenizer releases the GIL while it
encodes, so the I/O thread keeps answering meanwhile.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from typing import Callable

from o3edge.policy import CLASSES

log = logging.getLogger(__name__)

PRIORITY_RANK = {name: rank for rank, name in enumerate(CLASSES)}


class Lane:
    """One worker thread serving per-connection queues: best class first, round robin within it."""

    def __init__(self, name: str, work: Callable[[object], None]):
        self._work = work
        self._queues: OrderedDict[bytes, deque] = OrderedDict()  # connection -> items, in turn order
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, identity: bytes, priority: str, item: object) -> None:
        with self._cond:
            self._queues.setdefault(identity, deque()).append((PRIORITY_RANK.get(priority, 2), item))
            self._cond.notify()

    def remove(self, identity: bytes, match: Callable[[object], bool]) -> None:
        """Take a connection's waiting items that `match` out of the lane (a cancelled request's prompt)."""
        with self._cond:
            queue = self._queues.get(identity)
            if queue is None:
                return
            kept = deque(entry for entry in queue if not match(entry[1]))
            if kept:
                self._queues[identity] = kept  # (keeps its place in the turn order)
            else:
                del self._queues[identity]

    def discard(self, identity: bytes) -> None:
        """Forget a connection's waiting items (it was dropped)."""
        with self._cond:
            self._queues.pop(identity, None)

    def __len__(self) -> int:
        with self._cond:
            return sum(map(len, self._queues.values()))

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _take(self):
        """The next item: the connection whose head is most important, earliest in turn among equals."""
        best = min(self._queues, key=lambda ident: self._queues[ident][0][0])
        queue = self._queues.pop(best)
        _, item = queue.popleft()
        if queue:
            self._queues[best] = queue  # to the back of the turn order
        return item

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queues and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                item = self._take()
            try:
                self._work(item)
            except Exception:
                log.exception("tokenizing a request failed")
