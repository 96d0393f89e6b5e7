"""The cold tier's copier on CUDA (kv_offload.py has the protocol and the CPU copier): a copy stream,
the arena registered as pinned memory, events to order the two."""

from __future__ import annotations

import logging
from collections import deque

import torch

from o3edge.engine.cold_tier import ColdTier
from o3edge.engine.kv_offload import Batch, _runs, by_slot

log = logging.getLogger(__name__)


class CudaCopier:
    """CUDA: a copy stream, the arena registered as pinned memory, events to order the two."""

    def __init__(self, tier: ColdTier, kv_cache: torch.Tensor, block_size: int):
        L, _, S, H, D = kv_cache.shape
        self.tier, self.device, self.dtype = tier, kv_cache.device, kv_cache.dtype
        self.blocks = kv_cache.view(L, 2, S // block_size, block_size, H, D)
        self.by_block = self.blocks.permute(2, 0, 1, 3, 4, 5)  # [blocks, L, 2, bs, H, D], a view
        self.shape = (L, 2, block_size, H, D)
        self.arena = torch.frombuffer(tier.mm, dtype=torch.uint8)
        self.registered = _host_register(self.arena)
        self.stream = torch.cuda.Stream(self.device)  # offload copies
        self.restore_stream = torch.cuda.Stream(self.device)  # restore copies: not behind the offloads' waits
        self.slabs: list[torch.Tensor | None] = [None] * tier.num_slots
        # restores whose copies or scatter may still run: (start, copies done, scatter done, slots), oldest first
        self.restores: deque[tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event, list[int]]] = deque()
        # restores whose copies are queued and whose scatter waits for ready(): (staging, ids, event, start, slots)
        self.landing: list[tuple] = []
        self._ids: list[int] = []
        self.copy_delay_s = 0.0  # test-only: each restore's copies start this late on the restore stream
        self.counts = {"cold_restore_copy_seconds": 0.0, "cold_restore_copied_blocks": 0, "cold_restore_copies": 0}

    def slab(self, slot: int) -> torch.Tensor:
        view = self.slabs[slot]
        if view is None:
            off = self.tier.payload_offset(slot)
            view = self.slabs[slot] = self.arena[off:off + self.tier.payload_bytes].view(self.dtype).view(self.shape)
        return view

    def slabs_from(self, slot: int, n: int) -> torch.Tensor:
        """The slabs of slots slot..slot+n-1, one contiguous [n, L, 2, bs, H, D] view."""
        off = self.tier.payload_offset(slot)
        return self.arena[off:off + n * self.tier.payload_bytes].view(self.dtype).view(n, *self.shape)

    def mark(self, batch: Batch) -> None:
        """Engine thread, at the flush: the batch's blocks hold their final K/V once the compute
        stream gets here (one event record; no other device work on this thread)."""
        batch.ready = torch.cuda.Event()
        batch.ready.record(torch.cuda.current_stream(self.device))

    def launch(self, batch: Batch) -> None:
        """Queue the gather and the device-to-host copies on the side stream (any thread)."""
        jobs = batch.jobs
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.stream.wait_event(batch.ready)
            ids = torch.tensor([j.block_id for j in jobs]).pin_memory().to(self.device, non_blocking=True)
            staged = self.by_block.index_select(0, ids)  # [n, L, 2, bs, H, D], contiguous: one kernel
            for i, n in _runs([j.slot for j in jobs]):
                self.slabs_from(jobs[i].slot, n).copy_(staged[i:i + n], non_blocking=True)
            batch.done = torch.cuda.Event(blocking=True)  # a waiting thread sleeps, not spins
            batch.done.record(self.stream)
        batch.staged = staged

    def order(self, batch: Batch) -> None:
        """The compute stream waits for the batch's copies on the device; the host goes on."""
        torch.cuda.current_stream(self.device).wait_event(batch.done)

    def wait(self, batch: Batch) -> None:
        batch.done.synchronize()  # releases the GIL
        batch.staged = None

    def abort(self, batch: Batch) -> None:
        """A launch that failed halfway: let whatever it queued finish before its blocks are reused."""
        self.stream.synchronize()
        batch.staged = None

    def begin_load(self, n: int) -> None:
        """A staging buffer on the restore stream (the allocator gives it memory no queued kernel uses)."""
        with torch.cuda.stream(self.restore_stream):
            self._staged = torch.empty((n, *self.shape), dtype=self.dtype, device=self.device)
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
            if self.copy_delay_s:  # test-only: the copies land late on the device
                torch.cuda._sleep(int(self.copy_delay_s * 2e9))  # GPU clock cycles, ~2 GHz
        self._ids: list[int] = []

    def load(self, block_ids: list[int], slots: list[int]) -> None:
        """Queue verified slabs' host-to-device copies into the staging buffer on the restore stream,
        so that they run alongside whatever the compute stream still has queued (the host goes on).
        In slot order: a chain offloaded tail first sits in descending slots, one copy all the same."""
        block_ids, slots = by_slot(block_ids, slots)
        base = len(self._ids)
        with torch.cuda.stream(self.restore_stream):
            for i, n in _runs(slots):
                self._staged[base + i:base + i + n].copy_(self.slabs_from(slots[i], n), non_blocking=True)
                self.counts["cold_restore_copies"] += 1
        self._ids += block_ids

    def loaded(self, slots: list[int]) -> None:
        """The restore's copies are queued: mark their end on the restore stream. The scatter into the
        hot blocks waits for `ready`, so the engine thread prepares the step while the copy engine runs."""
        if self._ids:
            copied = torch.cuda.Event(enable_timing=True)  # the copies' own device time: start -> copied
            copied.record(self.restore_stream)
            self.landing.append((self._staged, self._ids, copied, self._start, slots))
        self._staged = self._start = None
        self._ids = []

    def ready(self) -> None:
        """Before the step's first kernel: the compute stream waits for the restore copies on the device
        (an event wait; the host does not wait) and scatters the slabs into their blocks; their slots
        stay pinned until the copies are done (`reap`)."""
        landing, self.landing = self.landing, []
        compute = torch.cuda.current_stream(self.device)
        for staged, block_ids, copied, start, slots in landing:
            compute.wait_event(copied)
            ids = torch.tensor(block_ids).pin_memory().to(self.device, non_blocking=True)
            self.blocks.index_copy_(2, ids, staged[:len(block_ids)].permute(1, 2, 0, 3, 4, 5))
            staged.record_stream(compute)  # not reused before the scatter has read it
            end = torch.cuda.Event()
            end.record(compute)
            self.restores.append((start, copied, end, slots))
        self.reap()

    def reap(self) -> None:
        """Unpin the slots of restores whose copies are done; count their time on the device."""
        while self.restores and self.restores[0][2].query():
            start, copied, _, slots = self.restores.popleft()
            self.counts["cold_restore_copy_seconds"] += start.elapsed_time(copied) / 1000
            self.counts["cold_restore_copied_blocks"] += len(slots)
            self.tier.unpin_all(slots)

    def close(self) -> None:
        self.ready()
        torch.cuda.synchronize(self.device)
        self.reap()
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.arena.data_ptr())
        self.arena = self.slabs = None


def _host_register(arena: torch.Tensor) -> bool:
    """Pin the arena for the DMA engines; pageable copies stall the host and run at a third of the speed."""
    try:
        err = int(torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), arena.numel(), 0))
    except Exception as exc:  # no cudart binding (another backend)
        err = exc
    if err != 0:
        log.warning("cold tier: cudaHostRegister failed (%s); copies are pageable, slower, and stall the host",
                    err)
        if isinstance(err, int):  # clear the error, or the next kernel launch check reports it as its own
            torch.cuda.cudart().cudaGetLastError()
        return False
    return True
