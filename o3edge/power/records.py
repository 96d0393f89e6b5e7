"""What goes into the accountant (a step's tokens) and what comes out (a request's or a period's energy)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StepTokens:
    """One engine step: monotonic start/end and request_id -> (prefill_tokens, decode_tokens).

    The engine's own StepReport works too: any object with these three attributes does.
    """

    t_start_ns: int
    t_end_ns: int
    tokens: Mapping[str, tuple[int, int]]


def tokens_per_joule(tokens: int, joules: float) -> float | None:
    """Tokens per joule, or None when no energy was measured."""
    return tokens / joules if joules > 0 else None


@dataclass(frozen=True)
class RequestEnergy:
    """A finished request's energy. `tokens` counts generated (decode) tokens; tokens_per_joule is over them."""

    request_id: str
    joules: float
    tokens: int
    prompt_tokens: int
    tokens_per_joule: float | None
    duration_s: float
    domains: tuple[str, ...]
    meter: str
    is_estimate: bool
    low_confidence: bool

    def to_dict(self) -> dict:
        """A plain dict for the wire and the log (domains as a list)."""
        out = asdict(self)
        out["domains"] = list(self.domains)
        return out


@dataclass(frozen=True)
class EnergyTotals:
    """Energy and tokens over all time (window_s None) or the last window_s seconds.

    active_tokens_per_joule divides by the energy of engine steps only; tokens_per_joule divides
    by active + idle energy (what the machine really spent while serving).
    """

    window_s: float | None
    active_joules: float
    idle_joules: float
    tokens: int
    prompt_tokens: int
    active_tokens_per_joule: float | None
    tokens_per_joule: float | None
    domains: tuple[str, ...]
    meter: str
    is_estimate: bool

    def to_dict(self) -> dict:
        """A plain dict for `stats` replies."""
        out = asdict(self)
        out["domains"] = list(self.domains)
        return out
