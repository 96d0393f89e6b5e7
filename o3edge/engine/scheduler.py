"""Continuous batching: which sequences run in the next step, and with how many new tokens.

Each step has a token budget. Running sequences go first (a decoding one needs one token, a
prompt still being prefilled takes a chunk of what is left), then waiting ones are admitted while
budget, batch slots and KV blocks last. So a long prompt is split into chunks and never stalls the
running decodes for more than one chunk. Plain Python: no tensors, deterministic.
"""

from __future__ import annotations

from collections import deque

from o3edge.engine.block_manager import BlockManager
from o3edge.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step's batch: (sequence, number of new tokens to compute) pairs."""
        budget, batch = self.token_budget, []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted to make room earlier in this loop
                continue
            if not self._make_room(seq):
                continue
            n = min(seq.num_uncomputed, budget)
            batch.append((seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.blocks.can_allocate(seq):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed, budget)
            batch.append((seq, n))
            budget -= n
        return batch

    def _make_room(self, seq: Sequence) -> bool:
        """Ensure seq has a block for its next token, preempting the newest others if needed."""
        while not self.blocks.can_append(seq):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        self.blocks.append_slot(seq)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and put it back first in line; its tokens are recomputed on resume."""
        self.running.remove(seq)
        self.blocks.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take seq out of the queues and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.blocks.free_seq(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
