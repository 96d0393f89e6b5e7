"""Per-second sums of energy and tokens over the last minutes, for "tokens/J over the last N s"."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Sums:
    """Active and idle joules, prompt and generated tokens over some span."""

    active_joules: float = 0.0
    idle_joules: float = 0.0
    prompt_tokens: int = 0
    tokens: int = 0

    def add(self, other: "Sums") -> None:
        """Add another span's sums into this one."""
        self.active_joules += other.active_joules
        self.idle_joules += other.idle_joules
        self.prompt_tokens += other.prompt_tokens
        self.tokens += other.tokens


class RollingSums:
    """Buckets of `bucket_s` keeping `span_s` of history; not thread-safe (the accountant locks)."""

    def __init__(self, span_s: float = 900.0, bucket_s: float = 1.0):
        self.span_s = span_s
        self.bucket_ns = int(bucket_s * 1e9)
        self._num_buckets = int(span_s / bucket_s) + 1
        self._buckets: dict[int, Sums] = {}
        self._max_index = 0

    def add(self, t_ns: int, active_joules: float = 0.0, idle_joules: float = 0.0,
            prompt_tokens: int = 0, tokens: int = 0) -> None:
        """Count energy and tokens at monotonic time t_ns."""
        index = t_ns // self.bucket_ns
        if index < self._max_index - self._num_buckets:
            return  # older than the span: only the all-time sums keep it
        bucket = self._buckets.get(index)
        if bucket is None:
            bucket = self._buckets[index] = Sums()
        bucket.add(Sums(active_joules, idle_joules, prompt_tokens, tokens))
        if index > self._max_index:
            self._max_index = index
            if len(self._buckets) > self._num_buckets + 64:
                oldest = self._max_index - self._num_buckets
                for key in [k for k in self._buckets if k < oldest]:
                    del self._buckets[key]

    def add_span(self, t0_ns: int, t1_ns: int, active_joules: float = 0.0, idle_joules: float = 0.0,
                 prompt_tokens: int = 0, tokens: int = 0) -> None:
        """Spread joules evenly over [t0, t1) bucket by bucket; tokens count at t1."""
        span_ns = t1_ns - t0_ns
        if span_ns <= self.bucket_ns:
            self.add(t1_ns, active_joules, idle_joules, prompt_tokens, tokens)
            return
        t = max(t0_ns, t1_ns - self._num_buckets * self.bucket_ns)  # older parts fall outside every window
        while t < t1_ns:
            nxt = min(t1_ns, (t // self.bucket_ns + 1) * self.bucket_ns)
            frac = (nxt - t) / span_ns
            self.add(t, active_joules * frac, idle_joules * frac)
            t = nxt
        self.add(t1_ns - 1, prompt_tokens=prompt_tokens, tokens=tokens)

    def since(self, t_ns: int) -> Sums:
        """Sums over buckets from the one holding t_ns onwards."""
        first = t_ns // self.bucket_ns
        total = Sums()
        for index, bucket in self._buckets.items():
            if index >= first:
                total.add(bucket)
        return total
