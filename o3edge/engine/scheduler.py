"""Continuous batching with priorities: which sequences run in the next step, with how many tokens.

Each step has a token budget. Running sequences go first (a decoding one needs one token, a prompt
still being prefilled takes a chunk of what is left), then waiting ones are admitted in order of
priority class, then earliest deadline, then arrival, while budget, batch slots, per-class limits and
KV blocks last. A long prompt is thus split into chunks and never stalls running decodes for more
than one chunk; while a more important sequence runs or waits, a less important prompt's chunks
shrink to an eighth of the budget. When blocks or slots run out, the least important, newest
running sequence is preempted (its blocks freed, its tokens recomputed on resume, or copied back
from the cold tier when the engine has one) — to admit a more important waiting
one, or to let a more important running one grow. An optional batching window lets an idle engine
wait briefly for a fuller first batch (throughput over latency at light load). Plain Python: no
tensors; the clock is given.
"""

from __future__ import annotations

import bisect
import math
import time

from o3edge.engine.block_manager import BlockManager
from o3edge.engine.breaker import OPEN, Breaker
from o3edge.engine.sequence import Priority, Sequence, SequenceStatus
from o3edge.errors import Busy
from o3edge.policy import Policy


BACKGROUND_SHARE = 8  # a less important prefill gets 1/8 of a step's tokens while more important work is on


WAIT_AVERAGE = 0.25  # weight of the newest queue wait in a class's moving average


def _key(seq: Sequence):
    return (seq.priority, seq.deadline if seq.deadline is not None else math.inf, seq.arrival_time, seq.seq_id)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: Policy | None = None, clock=time.monotonic):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.clock = clock
        self.waiting: list[Sequence] = []  # sorted by _key
        self.running: list[Sequence] = []
        self.expired: list[Sequence] = []  # ended here (deadline, displaced) since the engine last looked
        self.num_preemptions = 0
        self.recent_wait_s = {p: 0.0 for p in Priority}  # moving average of each class's queue waits
        self.set_window(0, 1)
        self.set_policy(policy or Policy())

    def set_policy(self, policy: Policy) -> None:
        """Apply (or re-apply, on reload) class limits and queue bounds; breaker states persist."""
        self.policy = {p: policy.classes.of(p) for p in Priority}
        old = getattr(self, "breakers", {})
        self.breakers = {p: old.get(p) or Breaker(v.breaker_threshold, v.breaker_cooldown_ms / 1000)
                         for p, v in self.policy.items()}
        for p, b in self.breakers.items():
            b.threshold, b.cooldown_s = self.policy[p].breaker_threshold, self.policy[p].breaker_cooldown_ms / 1000
        self.max_queue_requests = policy.queue_max_requests
        self.max_queue_prompt_tokens = policy.queue_max_prompt_tokens

    # ---- admission to the queue ----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue seq, or raise Busy: queue full of requests at least as important, or its class (and
        every lower one) shedding load. A full queue drops its least important waiting requests
        (finish reason "busy") to take a more important one: all that it needs, or none."""
        now, cls = self.clock(), seq.priority
        while self.breakers[cls].current(now) == OPEN:
            if cls == Priority.LOW:
                raise Busy(f"priority class {seq.priority.name.lower()} is shedding load (circuit breaker open)")
            cls = Priority(cls + 1)
        for victim in self._displaced_by(seq, cls):  # raises Busy before anything is dropped
            self.finish(victim, "busy")
            self.expired.append(victim)
        if cls != seq.priority:
            seq.requested_priority, seq.priority = seq.priority, cls
        self._enqueue(seq, now)

    def _displaced_by(self, seq: Sequence, cls: Priority) -> list[Sequence]:
        """The waiting requests (never-run, less important than cls) that must go for seq to fit."""
        candidates = sorted((s for s in self.waiting if not s.was_admitted and s.priority > cls), key=_key,
                            reverse=True)
        num, tokens, victims = len(self.waiting), sum(len(s) for s in self.waiting) + len(seq), []
        while num >= self.max_queue_requests or tokens > self.max_queue_prompt_tokens:
            if not candidates:
                raise Busy(f"the queue is full ({self.max_queue_requests} requests or "
                           f"{self.max_queue_prompt_tokens} prompt tokens waiting)")
            victim = candidates.pop(0)
            victims.append(victim)
            num, tokens = num - 1, tokens - len(victim)
        return victims

    def _enqueue(self, seq: Sequence, now: float) -> None:
        seq.status, seq.enqueue_time = SequenceStatus.WAITING, now
        bisect.insort(self.waiting, seq, key=_key)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step's batch ------------------------------------------------------------------------
    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step's batch: (sequence, number of new tokens to compute) pairs."""
        now = self.clock()
        self._expire(now)
        batch: dict[Sequence, int] = {}
        # A running prefill less important than some other running or waiting sequence goes after
        # admission, with a small share of the budget: its chunks would otherwise fill every step
        # while a critical request waits to start, or make each of its decode steps slow.
        classes = [s.priority for s in self.running] + [s.priority for s in self.waiting[:1]]
        top = min(classes, default=None)
        later = [s for s in self.running if s.priority != top and s.num_uncomputed > 1]
        self._continue([s for s in self.running if s not in later], batch, self.token_budget)
        self._admit(now, batch)
        self._continue(later, batch, sum(batch.values()) + max(1, self.token_budget // BACKGROUND_SHARE))
        return list(batch.items())

    def _continue(self, seqs: list[Sequence], batch: dict, limit: int) -> None:
        """Give running sequences their next tokens while the budget (up to `limit` in all) lasts. Linear in the
        sequences: the tokens given are counted as they go (summed again only after a preemption, which may take
        a victim's out of the batch), and a sequence preempted meanwhile is known by its status, not found in
        the running list (both were a pass over the batch for every sequence)."""
        limit = min(limit, self.token_budget)
        used = sum(batch.values())
        for seq in seqs:
            if limit - used <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq in batch:
                continue
            preempted = self.num_preemptions
            room = self._make_room(seq, batch)
            if self.num_preemptions != preempted:
                used = sum(batch.values())
            if room:
                batch[seq] = n = min(seq.num_uncomputed, limit - used)
                used += n

    def _expire(self, now: float) -> None:
        """Finish sequences past their deadline; count queue waits past the class budget."""
        for seq in [s for s in self.running + self.waiting if s.deadline is not None and s.deadline <= now]:
            if seq.status == SequenceStatus.WAITING and not seq.was_admitted:
                self._timed_out(seq, now)
            self.finish(seq, "deadline_exceeded")
            self.expired.append(seq)
        for seq in self.waiting:
            if not seq.was_admitted and now - seq.enqueue_time > self.policy[seq.priority].max_wait_ms / 1000:
                self._timed_out(seq, now)

    def _timed_out(self, seq: Sequence, now: float) -> None:
        if not seq.wait_timed_out:
            seq.wait_timed_out = True
            self.breakers[seq.priority].record_timeout(now)

    def set_window(self, window_ms: int, min_batch_size: int) -> None:
        """The optional batching window: an idle engine waits up to window_ms to start min_batch_size."""
        self.window_s, self.min_batch_size = window_ms / 1000, min_batch_size

    def _holding(self, now: float) -> bool:
        """Whether an idle engine should keep waiting for a fuller first batch (critical never waits)."""
        if self.running or len(self.waiting) >= self.min_batch_size or self.window_s <= 0:
            return False
        if any(s.priority == Priority.CRITICAL for s in self.waiting):
            return False
        return now - min(s.enqueue_time for s in self.waiting) < self.window_s

    def _admit(self, now: float, batch: dict) -> None:
        if self._holding(now):
            return
        for seq in list(self.waiting):
            budget = self.token_budget - sum(batch.values())
            if budget <= 0:
                return
            if self._class_running(seq.priority) >= self.policy[seq.priority].max_concurrent:
                continue
            hits = None  # seq's cached prefix, looked up once: preempting frees blocks but unnames none
            while True:
                if len(self.running) < self.max_num_seqs:
                    hits = self.blocks.match(seq) if hits is None else hits
                    if self.blocks.can_allocate(seq, hits):
                        break
                victim = self._victim()
                if victim is None or victim.priority <= seq.priority:
                    return  # nothing less important to make room with: keep the order
                self.preempt(victim, batch)
            self.waiting.remove(seq)
            self.blocks.allocate(seq, hits=hits)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if not seq.was_admitted:
                seq.was_admitted = True
                self._note_wait(seq.priority, now - seq.enqueue_time)
                if not seq.wait_timed_out:
                    self.breakers[seq.priority].record_success(now)
            batch[seq] = min(seq.num_uncomputed, self.token_budget - sum(batch.values()))

    def _note_wait(self, priority: Priority, waited_s: float) -> None:
        avg = self.recent_wait_s[priority]
        self.recent_wait_s[priority] = waited_s if avg == 0.0 else avg + WAIT_AVERAGE * (waited_s - avg)

    def estimated_wait_ms(self, priority: Priority) -> float:
        """How long a request of this class arriving now would wait to start, by the queue's own figures:
        0 while nothing of its class or a more important one waits and the class has room; otherwise
        the moving average of the class's recent queue waits (WAIT_AVERAGE weight on the newest)."""
        ahead = any(s.priority <= priority for s in self.waiting)
        if not ahead and len(self.running) < self.max_num_seqs \
                and self._class_running(priority) < self.policy[priority].max_concurrent:
            return 0.0
        return self.recent_wait_s[priority] * 1000

    def _class_running(self, priority: Priority) -> int:
        return sum(1 for s in self.running if s.priority == priority)

    def _victim(self) -> Sequence | None:
        """The least important running sequence, newest first among equals."""
        return max(self.running, key=lambda s: (s.priority, s.arrival_time, s.seq_id), default=None)

    def _make_room(self, seq: Sequence, batch: dict) -> bool:
        """Ensure seq has a block for its next token, preempting less important (or newer) ones."""
        while not self.blocks.can_append(seq):
            victim = self._victim()
            self.preempt(victim, batch)
            if victim is seq:
                return False
        self.blocks.append_slot(seq)
        return True

    def preempt(self, seq: Sequence, batch: dict | None = None) -> None:
        """Free seq's blocks and queue it again; its tokens are recomputed when it resumes."""
        if batch is not None:
            batch.pop(seq, None)
        self.running.remove(seq)
        self.blocks.free_seq(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq, seq.enqueue_time)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take seq out of the queues and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.blocks.free_seq(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def stats(self) -> dict:
        now = self.clock()
        return {p.name.lower(): {"waiting": sum(1 for s in self.waiting if s.priority == p),
                                 "running": self._class_running(p), "breaker": self.breakers[p].stats(now),
                                 "est_wait_ms": round(self.estimated_wait_ms(p), 1)}
                for p in Priority}
