"""Per-class circuit breaker: repeated queue timeouts in a priority class degrade that class.

closed --(threshold consecutive timeouts)--> open --(cooldown)--> half_open
half_open --(a request admitted in time)--> closed;  half_open --(a timeout)--> open
While open, the class's new requests are demoted one class (low ones are refused with `busy`),
so an overloaded class stops making every other class wait too. Plain Python; the clock is given.
"""

from __future__ import annotations

from dataclasses import dataclass

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass
class Breaker:
    threshold: int
    cooldown_s: float
    state: str = CLOSED
    consecutive_timeouts: int = 0
    opened_at: float = 0.0
    times_opened: int = 0

    def current(self, now: float) -> str:
        """The state at `now` (an open breaker half-opens once its cooldown has passed)."""
        if self.state == OPEN and now - self.opened_at >= self.cooldown_s:
            self.state = HALF_OPEN
        return self.state

    def record_timeout(self, now: float) -> None:
        self.consecutive_timeouts += 1
        state = self.current(now)
        if state == OPEN:  # already open: the cooldown runs from the opening, not from each timeout
            return
        if state == HALF_OPEN or self.consecutive_timeouts >= self.threshold:
            self.times_opened += 1
            self.state, self.opened_at = OPEN, now

    def record_success(self, now: float) -> None:
        self.consecutive_timeouts = 0
        if self.current(now) == HALF_OPEN:
            self.state = CLOSED

    def stats(self, now: float) -> dict:
        return {"state": self.current(now), "consecutive_timeouts": self.consecutive_timeouts,
                "times_opened": self.times_opened}
