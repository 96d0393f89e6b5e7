"""Serving policy, defined once: priority classes, queue bounds and request limits.

O3Config holds one Policy (`O3Config.policy`); the engine's scheduler and request checks, the wire
protocol's validator, the daemon and O3Model all read that one object. o3edged loads it from its
settings (o3edge.settings): [scheduler] has one table per class, [server] the queue bounds
(queue_max_requests, queue_max_prompt_tokens); request limits are not settings. Plain Python, no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from o3edge.errors import ConfigError, InvalidRequest

CLASSES = ("critical", "high", "normal", "low")  # most important first; Priority's values are the indexes


@dataclass(frozen=True)
class ClassLimits:
    """One priority class: longest queue wait, concurrent sequences, timeouts that open the breaker."""

    max_wait_ms: int
    max_concurrent: int
    breaker_threshold: int
    breaker_cooldown_ms: int = 5000  # how long an open breaker stays open before it half-opens

    def __post_init__(self):
        if self.breaker_cooldown_ms < 0:
            raise ConfigError(f"breaker_cooldown_ms must be >= 0, got {self.breaker_cooldown_ms}")
        if self.max_wait_ms < 0:
            raise ConfigError(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
        for name in ("max_concurrent", "breaker_threshold"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class SchedulerPolicy:
    """Per-priority-class limits (the seed article's table, plus `low`: long waits tolerated, breaker
    slow to trip)."""

    critical: ClassLimits = field(default_factory=lambda: ClassLimits(50, 8, 3))
    high: ClassLimits = field(default_factory=lambda: ClassLimits(200, 16, 5))
    normal: ClassLimits = field(default_factory=lambda: ClassLimits(1000, 32, 10))
    low: ClassLimits = field(default_factory=lambda: ClassLimits(5000, 32, 20))

    def of(self, priority: int) -> ClassLimits:
        """The limits of a class by its Priority (0 critical ... 3 low)."""
        return getattr(self, CLASSES[priority])

    @classmethod
    def from_dict(cls, values: dict) -> "SchedulerPolicy":
        """Build from {class: {key: value}}; keys not given keep that class's default."""
        base, classes = cls(), {}
        for name, limits in values.items():
            try:
                classes[name] = dataclasses.replace(getattr(base, name), **limits)
            except ConfigError as e:
                raise ConfigError(f"scheduler.{name}.{e}") from None
        return cls(**classes)


@dataclass(frozen=True)
class RequestLimits:
    """The most one request may ask for; the protocol validator and the engine check these same values."""

    max_new_tokens: int = 1 << 20
    max_temperature: float = 100.0
    max_top_k: int = 1 << 20
    max_stop: int = 16  # stop strings per request
    max_stop_chars: int = 256  # characters per stop string

    def check(self, max_new_tokens: int, temperature: float, top_k: int, stop: tuple) -> None:
        """Raise InvalidRequest naming the first value over its limit."""
        if max_new_tokens > self.max_new_tokens:
            raise InvalidRequest(f"max_new_tokens must be at most {self.max_new_tokens}, got {max_new_tokens}")
        if temperature > self.max_temperature:
            raise InvalidRequest(f"temperature must be at most {self.max_temperature}, got {temperature}")
        if top_k > self.max_top_k:
            raise InvalidRequest(f"top_k must be at most {self.max_top_k}, got {top_k}")
        if len(stop) > self.max_stop or any(len(s) > self.max_stop_chars for s in stop):
            raise InvalidRequest(f"stop must be at most {self.max_stop} strings of at most "
                                 f"{self.max_stop_chars} characters")


@dataclass(frozen=True)
class Policy:
    """Who runs when, how much may wait, and how much one request may ask for."""

    classes: SchedulerPolicy = field(default_factory=SchedulerPolicy)
    queue_max_requests: int = 256  # waiting requests; a full queue answers `busy`
    queue_max_prompt_tokens: int = 262144  # prompt tokens of the waiting requests, all together
    requests: RequestLimits = field(default_factory=RequestLimits)

    def __post_init__(self):
        for name in ("queue_max_requests", "queue_max_prompt_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
