"""Attribution: each engine step's energy split among its requests by weighted token count; idle apart."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from o3edge.power.records import EnergyTotals, RequestEnergy, tokens_per_joule
from o3edge.power.rolling import RollingSums, Sums
from o3edge.power.sampler import EnergySampler

log = logging.getLogger(__name__)

# A decode token pays for a full read of the weights (decode is memory-bound); a prefill token
# shares that read with the rest of its chunk and costs mostly compute. So in a step that mixes
# both, a prefill token carries this fraction of a decode token's share. It only matters in mixed
# steps; totals do not depend on it.
DEFAULT_PREFILL_WEIGHT = 0.1
MAX_PENDING_STEPS = 100_000  # ~3 minutes of 2 ms steps


@dataclass(frozen=True)
class _Step:
    t_start_ns: int
    t_end_ns: int
    tokens: dict[str, tuple[int, int]]


@dataclass
class _Tally:
    joules: float = 0.0
    prompt_tokens: int = 0
    tokens: int = 0
    t_first_ns: int | None = None
    t_last_ns: int | None = None
    low_confidence: bool = False

    def add(self, step: _Step, request_id: str, joules: float, covered: bool) -> None:
        prefill, decode = step.tokens[request_id]
        self.joules += joules
        self.prompt_tokens += prefill
        self.tokens += decode
        self.low_confidence |= not covered
        self.t_first_ns = step.t_start_ns if self.t_first_ns is None else min(self.t_first_ns, step.t_start_ns)
        self.t_last_ns = step.t_end_ns if self.t_last_ns is None else max(self.t_last_ns, step.t_end_ns)


def _parse_step(report) -> _Step:
    """Copy what we need from any object with t_start_ns, t_end_ns and tokens (duck typing)."""
    t_start, t_end = int(report.t_start_ns), int(report.t_end_ns)
    tokens = {str(rid): (int(p), int(d)) for rid, (p, d) in report.tokens.items()}
    if t_end < t_start or any(p < 0 or d < 0 for p, d in tokens.values()):
        raise ValueError(f"step ends before it starts or has negative tokens: {t_start}..{t_end} {tokens}")
    return _Step(t_start, t_end, tokens)


class EnergyAccountant:
    """Splits step energy among requests, keeps idle energy apart, and answers per-request and total figures.

    `report_step` is cheap and never raises (call it from the engine loop). Steps are settled once
    the sampler has read past their end (on the sampler thread), so figures lag by ~one period.

    Two locks. `_lock` guards the pending steps and the per-request tallies and is held only to
    append, pop or copy them, never while computing: it is the only one the engine thread takes
    (report_step, finish without waiting). `_cond` serializes settling (the sampler thread, totals
    on a `stats` or a scrape) and guards the totals; the engine thread never waits on it.
    """

    def __init__(self, sampler: EnergySampler, prefill_weight: float = DEFAULT_PREFILL_WEIGHT,
                 idle_grace_s: float = 1.0, max_pending_s: float = 10.0, windows_s: tuple[float, ...] = (60.0, 900.0),
                 max_open_requests: int = 10_000, clock: Callable[[], int] = time.monotonic_ns,
                 start_ns: int | None = None):
        if prefill_weight < 0:
            raise ValueError(f"prefill_weight must be >= 0, got {prefill_weight}")
        self.sampler = sampler
        self.prefill_weight = prefill_weight
        self.windows_s = tuple(windows_s)
        self._idle_grace_ns = int(idle_grace_s * 1e9)
        self._max_pending_ns = int(max_pending_s * 1e9)
        self._slack_ns = int(sampler.resolution_s * 1e9)
        self._max_open = max_open_requests
        self._clock = clock
        self._pending: deque[_Step] = deque()
        self._lock = threading.Lock()  # pending steps, tallies, closed: held only to append/pop/copy
        self._cond = threading.Condition()  # settling, totals, the idle cursor
        self._tallies: dict[str, _Tally] = {}
        self._closed: dict[str, int] = {}  # finished early: pending steps still naming them
        self._all = Sums()
        self._rolling = RollingSums(span_s=max(self.windows_s, default=60.0))
        self._cursor_ns = self._last_step_end_ns = clock() if start_ns is None else start_ns
        self._num_bad_reports = 0
        self._num_dropped_steps = 0
        sampler.add_listener(self.settle)

    def close(self) -> None:
        """Stop settling on the sampler thread."""
        self.sampler.remove_listener(self.settle)

    def report_step(self, step) -> None:
        """Queue one engine step (StepTokens or the engine's StepReport); never raises."""
        try:
            parsed = _parse_step(step)
        except Exception as exc:
            self._num_bad_reports += 1
            if self._num_bad_reports == 1:
                log.warning("ignored a malformed step report (%s): %r", exc, step)
            return
        with self._lock:
            if len(self._pending) >= MAX_PENDING_STEPS:  # the sampler is stuck: keep memory bounded
                self._pending.popleft()
                self._num_dropped_steps += 1
                if self._num_dropped_steps == 1:
                    log.warning("energy sampler is not keeping up: dropping the oldest unattributed steps")
            self._pending.append(parsed)

    def settle(self) -> None:
        """Attribute every step the timeline now covers, and idle time up to it; never raises."""
        try:
            with self._cond:
                self._settle_locked()
                self._cond.notify_all()
        except Exception:
            log.exception("energy accountant failed to settle steps")

    def _settle_locked(self) -> None:
        now = self._clock()
        covered = self.sampler.covered_until_ns()
        while True:
            with self._lock:
                if not self._pending:
                    break
                step = self._pending[0]
            ready = covered is not None and step.t_end_ns <= covered
            if not ready and now - step.t_end_ns < self._max_pending_ns:
                break
            self._settle_step(step)
        if covered is not None and not self._pending:
            self._add_idle(self._cursor_ns, min(covered, now - self._idle_grace_ns))

    def _window(self, t0_ns: int, t1_ns: int) -> tuple[float, bool]:
        by_domain, covered = self.sampler.timeline.window(t0_ns, t1_ns, self._slack_ns)
        return sum(by_domain.values()), covered

    def _add_idle(self, t0_ns: int, t1_ns: int) -> None:
        if t1_ns <= t0_ns:
            return
        joules, _ = self._window(t0_ns, t1_ns)
        self._all.idle_joules += joules
        self._rolling.add_span(t0_ns, t1_ns, idle_joules=joules)
        self._cursor_ns = max(self._cursor_ns, t1_ns)

    def _take_back_idle(self, step: _Step) -> None:
        """Time already counted idle that turns out to belong to this (long, late-reported) step."""
        lo = max(step.t_start_ns, self._last_step_end_ns)
        hi = min(self._cursor_ns, step.t_end_ns)
        if hi > lo:
            joules, _ = self._window(lo, hi)
            self._all.idle_joules -= joules
            self._rolling.add_span(lo, hi, idle_joules=-joules)

    def _settle_step(self, step: _Step) -> None:
        if step.t_start_ns > self._cursor_ns:
            self._add_idle(self._cursor_ns, step.t_start_ns)
        elif self._cursor_ns > self._last_step_end_ns:
            self._take_back_idle(step)
        joules, covered = self._window(step.t_start_ns, step.t_end_ns)
        prompt = sum(p for p, _ in step.tokens.values())
        decode = sum(d for _, d in step.tokens.values())
        self._all.add(Sums(joules, 0.0, prompt, decode))
        self._rolling.add_span(step.t_start_ns, step.t_end_ns, active_joules=joules,
                               prompt_tokens=prompt, tokens=decode)
        shares = self.split(step.tokens, joules)
        with self._lock:  # the step leaves the queue and enters its requests' tallies at once
            if self._pending and self._pending[0] is step:
                self._pending.popleft()
            for request_id, share in shares.items():
                if request_id in self._closed:  # finished early: its figure already took this step
                    self._closed[request_id] -= 1
                    if self._closed[request_id] <= 0:
                        del self._closed[request_id]
                    continue
                self._tally(request_id).add(step, request_id, share, covered)
        self._cursor_ns = max(self._cursor_ns, step.t_end_ns)
        self._last_step_end_ns = max(self._last_step_end_ns, step.t_end_ns)

    def _tally(self, request_id: str) -> _Tally:
        tally = self._tallies.get(request_id)
        if tally is None:
            if len(self._tallies) >= self._max_open:
                dropped = next(iter(self._tallies))
                del self._tallies[dropped]
                log.warning("more than %d requests never finished: dropped energy of %s", self._max_open, dropped)
            tally = self._tallies[request_id] = _Tally()
        return tally

    def split(self, tokens: dict[str, tuple[int, int]], joules: float) -> dict[str, float]:
        """Joules per request: decode tokens weigh 1, prefill tokens prefill_weight (equal split if all zero)."""
        weights = {rid: self.prefill_weight * p + d for rid, (p, d) in tokens.items()}
        total = sum(weights.values())
        if total <= 0:
            return {rid: joules / len(tokens) for rid in tokens} if tokens else {}
        return {rid: joules * w / total for rid, w in weights.items()}

    def finish(self, request_id: str, wait_s: float = 0.0) -> RequestEnergy:
        """The request's energy; waits up to wait_s for its last steps to be sampled, else extrapolates
        them at the recent power. With wait_s 0 (the engine thread) it never waits on settling."""
        if wait_s > 0:
            self._wait_settled(request_id, time.monotonic() + wait_s)
        with self._lock:
            tally = self._tallies.pop(request_id, None)
            unsettled = [s for s in self._pending if request_id in s.tokens]
            if unsettled:  # provisional here: the steps settle later for the totals
                self._closed[request_id] = self._closed.get(request_id, 0) + len(unsettled)
        tally = tally or _Tally(low_confidence=not unsettled)
        for step in unsettled:
            joules, covered = self._window(step.t_start_ns, step.t_end_ns)
            tally.add(step, request_id, self.split(step.tokens, joules)[request_id], covered)
        return self._result(request_id, tally)

    def _wait_settled(self, request_id: str, deadline: float) -> None:
        with self._cond:
            while True:
                self._settle_locked()
                with self._lock:
                    pending = any(request_id in s.tokens for s in self._pending)
                remaining = deadline - time.monotonic()
                if not pending or remaining <= 0:
                    return
                self._cond.wait(remaining)

    def _result(self, request_id: str, tally: _Tally) -> RequestEnergy:
        meter = self.sampler.meter
        span_ns = (tally.t_last_ns - tally.t_first_ns) if tally.t_first_ns is not None else 0
        too_short = span_ns < 2 * self._slack_ns
        return RequestEnergy(
            request_id=request_id, joules=tally.joules, tokens=tally.tokens, prompt_tokens=tally.prompt_tokens,
            tokens_per_joule=tokens_per_joule(tally.tokens, tally.joules), duration_s=span_ns / 1e9,
            domains=tuple(meter.domains), meter=meter.name, is_estimate=meter.is_estimate,
            low_confidence=tally.low_confidence or too_short,
        )

    def totals(self, window_s: float | None = None) -> EnergyTotals:
        """Active and idle energy and tokens/J over all time, or over the last window_s seconds."""
        self.settle()
        with self._cond:
            if window_s is None:
                sums = Sums(self._all.active_joules, self._all.idle_joules, self._all.prompt_tokens, self._all.tokens)
            else:
                sums = self._rolling.since(self._clock() - int(window_s * 1e9))
        meter = self.sampler.meter
        idle = max(0.0, sums.idle_joules)
        return EnergyTotals(
            window_s=window_s, active_joules=sums.active_joules, idle_joules=idle, tokens=sums.tokens,
            prompt_tokens=sums.prompt_tokens, active_tokens_per_joule=tokens_per_joule(sums.tokens, sums.active_joules),
            tokens_per_joule=tokens_per_joule(sums.tokens, sums.active_joules + idle),
            domains=tuple(meter.domains), meter=meter.name, is_estimate=meter.is_estimate,
        )

    @property
    def num_pending_steps(self) -> int:
        """Steps reported but not yet attributed."""
        return len(self._pending)
