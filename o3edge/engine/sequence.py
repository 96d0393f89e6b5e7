"""A request's sequence as the scheduler and block manager see it, and its sampling settings."""

from __future__ import annotations

import enum
import itertools
import math
import time
from array import array
from dataclasses import dataclass, field

from o3edge.errors import InvalidRequest


# a temperature below this picks greedily, as vLLM does: x / T overflowed float32 below ~1e-37 (the torch
# sampler and the graph step's counter draw then drew token 0 or noise; the native CPU sampler's float64 below
# ~1e-308); from 1e-5 up the tokens are the draws a user asked for
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop; temperature 0 (below GREEDY_TEMPERATURE) means greedy."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        # what any request must be; how much one may ask for is policy (o3edge.policy.RequestLimits)
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 1 << 63):
            raise InvalidRequest(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Priority(enum.IntEnum):
    CRITICAL = 0
    HIGH = 1
    NORMAL = 2
    LOW = 3


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """Token ids of one request (prompt then output) and where its KV lives."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    priority: Priority = Priority.NORMAL
    deadline: float | None = None  # time.monotonic() seconds
    seq_id: int = field(default_factory=lambda: next(_ids))
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    # changes of block_table's entries in place (the token router's demotions): with the list's identity and
    # length, what tells that its entries are the same as at the last step (cuda_graph.DecodeGraphs.cached)
    table_edits: int = 0
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    num_cached_tokens: int = 0  # of those, found in the prefix cache rather than computed
    num_cold_tokens: int = 0  # of those, copied in from the cold tier
    cold_pending: list = field(default_factory=list)  # (block id, hash, parent, tokens) to copy in
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of its first full blocks, once
    prompt_array: array | None = None  # the prompt's ids as int32, made when it was checked: hashed from here
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_preemptions: int = 0
    enqueue_time: float = 0.0  # when it last entered the waiting queue (scheduler clock)
    was_admitted: bool = False
    wait_timed_out: bool = False  # waited longer than its class allows (counted once)
    requested_priority: Priority | None = None  # set when a breaker demoted it

    def __post_init__(self):
        self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
