"""Moves whole KV blocks between the hot pool (the runner's kv_cache) and the cold tier.

Out (offload), asynchronously: when a named block loses its last holder it is offered; at the
next flush (after each schedule, and when a request ends) each offer gets an arena slot, and the
copy runs off the step's critical path: on CUDA a gather and device-to-host copies on a side stream into the arena, which is
registered as pinned memory (cudaHostRegister); on CPU a worker thread copies the bytes. The worker
then checksums the slab and seals the header. A step never waits for an offload, with one
exception that is the point of a swap: a block whose copy has not run yet and that the step is
about to overwrite. On CUDA the compute stream then waits for that copy on the device (the host
does not); on CPU that one block is copied at once.

In (restore), synchronously for the step that needs it: each block is verified (header, tokens,
parent, slab checksum; groups of blocks at once on a thread pool, since zlib releases the GIL) and
copied into its hot block as soon as its group passes (a run of consecutive slots in one copy), so
copies overlap the verification of the rest. The first block that fails ends the restore; the
caller recomputes from there.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from o3edge.engine.cold_tier import ColdTier, Entry

log = logging.getLogger(__name__)

QUEUED, COPYING, DONE = 0, 1, 2
VERIFY_GROUP = 4  # fewest blocks one pool task verifies (more for long prefixes: one group a thread)


class Job:
    """One block on its way out."""

    __slots__ = ("block_id", "entry", "slot", "state", "event", "staged")

    def __init__(self, block_id: int, entry: Entry):
        self.block_id, self.entry = block_id, entry
        self.slot: int | None = None
        self.state = QUEUED
        self.event = None  # CUDA: the copy-done event
        self.staged = None  # CUDA: [the batch's gathered blocks], alive until the copy is done


class HostCopier:
    """CPU: plain byte copies between the pool and the arena (numpy: one thread, GIL released)."""

    def __init__(self, tier: ColdTier, kv_cache: torch.Tensor, block_size: int):
        L, _, S, H, D = kv_cache.shape
        chunk = block_size * H * D * kv_cache.element_size()
        self.pool = kv_cache.view(torch.uint8).numpy().reshape(L, 2, S // block_size, chunk)  # shares memory
        self.arena = np.frombuffer(tier.mm, dtype=np.uint8)
        self.tier, self.shape = tier, (L, 2, chunk)
        self.slabs: list[np.ndarray | None] = [None] * tier.num_slots

    def slab(self, slot: int) -> np.ndarray:
        view = self.slabs[slot]
        if view is None:
            off = self.tier.payload_offset(slot)
            view = self.slabs[slot] = self.arena[off:off + self.tier.payload_bytes].reshape(self.shape)
        return view

    def start(self, jobs: list[Job]) -> None:
        """Nothing to start: the worker copies."""

    def copy_out(self, job: Job) -> None:
        np.copyto(self.slab(job.slot), self.pool[:, :, job.block_id])

    def order_before_overwrite(self, job: Job) -> bool:
        return False  # the caller copies the block now

    def begin_load(self, n: int) -> None:
        """Nothing to prepare: each block is copied as soon as it is verified."""

    def load(self, block_ids: list[int], slots: list[int]) -> None:
        for block_id, slot in zip(block_ids, slots):
            np.copyto(self.pool[:, :, block_id], self.slab(slot))

    def loaded(self, slots: list[int]) -> None:
        for slot in slots:
            self.tier.unpin(slot)

    def close(self) -> None:
        self.arena = self.pool = self.slabs = None


class CudaCopier:
    """CUDA: a copy stream, the arena registered as pinned memory, events to order the two."""

    def __init__(self, tier: ColdTier, kv_cache: torch.Tensor, block_size: int):
        L, _, S, H, D = kv_cache.shape
        self.tier, self.device, self.dtype = tier, kv_cache.device, kv_cache.dtype
        self.blocks = kv_cache.view(L, 2, S // block_size, block_size, H, D)
        self.shape = (L, 2, block_size, H, D)
        self.arena = torch.frombuffer(tier.mm, dtype=torch.uint8)
        self.registered = _host_register(self.arena)
        self.stream = torch.cuda.Stream(self.device)
        self.slabs: list[torch.Tensor | None] = [None] * tier.num_slots
        self.restores: deque[tuple[torch.cuda.Event, list[int]]] = deque()

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

    def start(self, jobs: list[Job]) -> None:
        """Queue the gather and the device-to-host copies behind everything the step queued so far."""
        jobs = sorted(jobs, key=lambda j: j.slot)  # runs of consecutive slots go out in one copy each
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(compute)
            ids = torch.tensor([j.block_id for j in jobs]).pin_memory().to(self.device, non_blocking=True)
            staged = self.blocks.index_select(2, ids).permute(2, 0, 1, 3, 4, 5).contiguous()  # [n, L, 2, bs, H, D]
            for i, n in _runs([j.slot for j in jobs]):
                self.slabs_from(jobs[i].slot, n).copy_(staged[i:i + n], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        held = [staged]  # shared by the batch: the first job found done frees it for all
        for job in jobs:
            job.event, job.staged = event, held

    def copy_out(self, job: Job) -> None:
        job.event.synchronize()  # on the worker thread; releases the GIL
        job.staged.clear()  # the batch's gathered blocks are copied: free them now

    def order_before_overwrite(self, job: Job) -> bool:
        torch.cuda.current_stream(self.device).wait_event(job.event)  # the device waits, not the host
        return True

    def begin_load(self, n: int) -> None:
        self._staged = torch.empty((n, *self.shape), dtype=self.dtype, device=self.device)
        self._ids: list[int] = []

    def load(self, block_ids: list[int], slots: list[int]) -> None:
        """Start verified slabs' host-to-device copies on the compute stream (the host goes on)."""
        base = len(self._ids)
        for i, n in _runs(slots):
            self._staged[base + i:base + i + n].copy_(self.slabs_from(slots[i], n), non_blocking=True)
        self._ids += block_ids

    def loaded(self, slots: list[int]) -> None:
        """Scatter the copied slabs into their blocks; their slots stay pinned until the copies are done."""
        if self._ids:
            ids = torch.tensor(self._ids).pin_memory().to(self.device, non_blocking=True)
            self.blocks.index_copy_(2, ids, self._staged[:len(self._ids)].permute(1, 2, 0, 3, 4, 5))
            event = torch.cuda.Event()
            event.record()
            self.restores.append((event, slots))
        self._staged = None
        self.reap()

    def reap(self) -> None:
        """Unpin the slots of restores whose copies are done."""
        while self.restores and self.restores[0][0].query():
            for slot in self.restores.popleft()[1]:
                self.tier.unpin(slot)

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.arena.data_ptr())
        self.arena = self.slabs = None


def _runs(slots: list[int]) -> list[tuple[int, int]]:
    """(start index, length) of each run of consecutive slot numbers, in order."""
    runs, start = [], 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((start, i - start))
            start = i
    return runs


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


class KVOffloader:
    """The cold tier's copier: offers in, asynchronous copies out, verified restores back."""

    def __init__(self, tier: ColdTier, kv_cache: torch.Tensor, block_size: int, verify_threads: int | None = None):
        self.tier, self.block_size = tier, block_size
        self.copier = (CudaCopier if kv_cache.is_cuda else HostCopier)(tier, kv_cache, block_size)
        self.cond = threading.Condition()
        self.pending: dict[int, Job] = {}  # hot block id -> its job, until the job is done or overwritten
        self.hashes: set[bytes] = set()  # names of blocks offered and not yet sealed
        self.offered: list[Job] = []  # waiting for the next flush
        self.queue: deque[Job] = deque()  # flushed, waiting for the worker
        self.verify_threads = verify_threads or min(16, os.cpu_count() or 1)
        self.verify_pool = ThreadPoolExecutor(max_workers=self.verify_threads, thread_name_prefix="o3edge-kv-verify")
        self.counts = {"cold_offloaded_blocks": 0, "cold_offload_seconds": 0.0, "cold_restored_blocks": 0,
                       "cold_restore_seconds": 0.0, "cold_offload_skipped": 0, "cold_swap_waits": 0}
        self.running = True
        self.worker = threading.Thread(target=self._work, name="o3edge-kv-offload", daemon=True)
        self.worker.start()
        atexit.register(self._at_exit)  # an in-process user who never closes still gets its blocks sealed

    # ---- out -----------------------------------------------------------------------------------
    def offer(self, block_id: int, h: bytes, parent: bytes, token_ids: tuple[int, ...]) -> None:
        """A named block lost its last holder: keep a copy unless the tier has one or one is on its way."""
        if h in self.tier or h in self.hashes:
            return
        self.before_overwrite(block_id)  # an older job for the same hot block must finish first
        job = Job(block_id, Entry(h, parent, tuple(token_ids)))
        self.offered.append(job)
        with self.cond:  # the worker removes finished jobs: never let it remove this one by mistake
            self.pending[block_id] = job
            self.hashes.add(h)

    def flush(self) -> None:
        """Give the offers so far their slots and start their copies (engine thread)."""
        if isinstance(self.copier, CudaCopier):
            self.copier.reap()
        jobs, self.offered = self.offered, []
        started = []
        for job in jobs:
            job.slot = self.tier.reserve()
            if job.slot is None:  # every slot is being read: skip this block
                self._finished(job, ok=False)
            else:
                started.append(job)
        if not started:
            return
        try:
            self.copier.start(started)
        except Exception:  # a copy that cannot start costs a future hit, never this step
            log.exception("cold tier: starting %d offloads failed; they are skipped", len(started))
            for job in started:
                self.tier.abandon(job.slot)
                self._finished(job, ok=False)
            return
        with self.cond:
            self.queue.extend(started)
            self.cond.notify()

    def before_overwrite(self, block_id: int) -> None:
        """The engine is about to write into block_id: its outgoing copy must be made first."""
        if block_id not in self.pending:  # most blocks: no lock needed to know that
            return
        with self.cond:
            job = self.pending.pop(block_id, None)
        if job is None:
            return
        if job.slot is None:
            self.flush()
            if job.state == DONE:  # no slot for it
                return
        if self.copier.order_before_overwrite(job):
            return
        with self.cond:
            if job.state == QUEUED:
                job.state = COPYING
                claimed = True
            else:
                claimed = False
                self.counts["cold_swap_waits"] += 1
                while job.state != DONE:
                    self.cond.wait()
        if claimed:
            self._copy(job)

    def _work(self) -> None:
        while True:
            with self.cond:
                while self.running and not self.queue:
                    self.cond.wait()
                if not self.queue:
                    return
                job = self.queue.popleft()
                if job.state != QUEUED:
                    continue  # the engine thread took it
                job.state = COPYING
            try:
                self._copy(job)
            except Exception:
                log.exception("cold tier: offload of block %d failed", job.block_id)
                self.tier.abandon(job.slot)
                self._finished(job, ok=False)

    def _copy(self, job: Job) -> None:
        t0 = time.perf_counter()
        self.copier.copy_out(job)
        self.tier.commit(job.slot, job.entry)
        self.counts["cold_offload_seconds"] += time.perf_counter() - t0
        self._finished(job, ok=True)

    def _finished(self, job: Job, ok: bool) -> None:
        with self.cond:
            job.state = DONE
            job.staged = None
            self.hashes.discard(job.entry.hash)
            if self.pending.get(job.block_id) is job:
                del self.pending[job.block_id]
            self.counts["cold_offloaded_blocks" if ok else "cold_offload_skipped"] += 1
            self.cond.notify_all()

    def drain(self, timeout: float = 10.0) -> bool:
        """Flush and wait until every offered block is sealed (tests, benchmarks, shutdown)."""
        self.flush()
        end = time.monotonic() + timeout
        with self.cond:
            while self.hashes and time.monotonic() < end:
                self.cond.wait(0.05)
            return not self.hashes

    # ---- in ------------------------------------------------------------------------------------
    def restore(self, items: list[tuple[int, bytes, bytes, tuple[int, ...]]]) -> int:
        """Copy cold blocks (hot block id, hash, parent, tokens) in; returns how many leading ones made it."""
        t0, slots = time.perf_counter(), []
        self.copier.begin_load(len(items))
        size = max(VERIFY_GROUP, -(-len(items) // self.verify_threads))
        groups = [items[i:i + size] for i in range(0, len(items), size)]
        for group, checks in zip(groups, self.verify_pool.map(self._verify_group, groups)):
            for slot in checks:
                self.tier.pin(slot)
            self.copier.load([block_id for block_id, *_ in group[:len(checks)]], checks)
            slots += checks
            if len(checks) < len(group):
                break
        self.copier.loaded(slots)
        self.counts["cold_restored_blocks"] += len(slots)
        self.counts["cold_restore_seconds"] += time.perf_counter() - t0
        return len(slots)

    def _verify_group(self, group: list) -> list[int]:
        """Slots of the group's leading blocks that pass their checks (a pool thread)."""
        slots = []
        for _, h, parent, tokens in group:
            slot = self.tier.verify(h, parent, tokens)
            if slot is None:
                break
            slots.append(slot)
        return slots

    # ---- the rest ------------------------------------------------------------------------------
    def stats(self) -> dict:
        c, nbytes = self.counts, self.tier.payload_bytes
        rate = lambda n, s: round(n * nbytes / s / 1e9, 3) if s > 0 else 0.0  # noqa: E731
        return {**self.tier.stats(), "cold_offloaded_blocks": c["cold_offloaded_blocks"],
                "cold_restored_blocks": c["cold_restored_blocks"], "cold_offload_skipped": c["cold_offload_skipped"],
                "cold_offload_gb_per_s": rate(c["cold_offloaded_blocks"], c["cold_offload_seconds"]),
                "cold_restore_gb_per_s": rate(c["cold_restored_blocks"], c["cold_restore_seconds"])}

    def _at_exit(self) -> None:
        if self.running:
            self.drain(timeout=5.0)

    def close(self) -> None:
        """Finish the copies under way, stop the worker, release the arena (its segment stays)."""
        atexit.unregister(self._at_exit)
        self.drain()
        with self.cond:
            self.running = False
            self.cond.notify_all()
        self.worker.join(timeout=5)
        self.verify_pool.shutdown(wait=True)
        self.copier.close()
        self.tier.close()
