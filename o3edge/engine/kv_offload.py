"""Moves whole KV blocks between the hot pool (the runner's kv_cache) and the cold tier.

Out (offload), off the engine thread: when a named block loses its last holder it is offered; at
the next flush (after each schedule, and when a request ends) each offer gets an arena slot, the
offers of one flush become a batch, and the engine thread's part ends there (on CUDA it also
records an event on the compute stream: the point after which the batch's blocks hold their
final K/V). The copier thread launches the batch (CUDA: one gather of the blocks and one
device-to-host copy per run of consecutive slots, on a side stream, into the arena registered as
pinned memory with cudaHostRegister; CPU: numpy byte copies, which release the GIL), waits for it
(a blocking event: the thread sleeps), checksums each slab (xxh3, GIL released) and seals its
header. A step never waits for an offload, with one exception that is the point of a swap: a
block that the step is about to overwrite while its batch is still queued. The engine thread then
launches that batch itself, and on CUDA the compute stream waits for the copy on the device (the
host does not); on CPU the copy is made there and then.

In (restore), for the step that needs it, started as soon as the scheduler has admitted its
sequence: the blocks' slots are pinned under one lock; a slot this process has not checksummed yet
(what a restart found) is verified first (header, tokens, parent, slab checksum), in groups on a
thread pool since the hash releases the GIL, each group's copies started as soon as it passes;
slots this process wrote or verified before go straight to the copy. The copies go in slot order,
one per run of consecutive slots (a finished sequence's chain is offered tail first, so it sits in
descending slots: one run all the same). They then fly while the engine thread prepares the step
(metadata, block tables, the graph's inputs): on CUDA, from the pinned arena into a staging buffer
on a restore stream (alongside whatever the compute stream still has queued); on CPU, on a copy
thread (numpy releases the GIL). Only right before the step's first kernel does the runner call
`ready()`: on CUDA the compute stream waits for the copies' event on the device (the host never
waits) and scatters the staging buffer into the hot blocks; on CPU the engine thread waits for the
copy thread. No kernel reads a restored block before its copy has landed. The first block that
fails its check ends the restore; the caller recomputes from there.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from o3edge.engine.cold_tier import ColdTier, Entry

log = logging.getLogger(__name__)

QUEUED, LAUNCHING, LAUNCHED, FAILED = 0, 1, 2, 3  # a batch's states
VERIFY_GROUP = 4  # fewest blocks one pool task verifies (more for long prefixes: one group a thread)


class Job:
    """One block on its way out (its Entry, with the token bytes, is made on the copier thread)."""

    __slots__ = ("block_id", "hash", "parent", "token_ids", "slot", "batch", "done")

    def __init__(self, block_id: int, h: bytes, parent: bytes, token_ids: tuple[int, ...]):
        self.block_id, self.hash, self.parent, self.token_ids = block_id, h, parent, token_ids
        self.slot: int | None = None
        self.batch: Batch | None = None
        self.done = False


class Batch:
    """The jobs of one flush, launched together (slots sorted: runs of consecutive slots are one copy)."""

    __slots__ = ("jobs", "state", "ready", "done", "staged")

    def __init__(self, jobs: list[Job]):
        self.jobs = sorted(jobs, key=lambda j: j.slot)
        self.state = QUEUED
        self.ready = self.done = None  # CUDA: blocks final on the compute stream; copies done
        self.staged = None  # CUDA: the gathered blocks, alive until the copies are done


class HostCopier:
    """CPU: plain byte copies between the pool and the arena (numpy: GIL released)."""

    def __init__(self, tier: ColdTier, kv_cache, block_size: int):
        L, _, S, H, D = kv_cache.shape
        pool = kv_cache if isinstance(kv_cache, np.ndarray) else kv_cache.numpy()  # torch's CPU pool: a view
        chunk = block_size * H * D * pool.itemsize
        self.pool = pool.view(np.uint8).reshape(L, 2, S // block_size, chunk)  # shares memory
        self.arena = np.frombuffer(tier.mm, dtype=np.uint8)
        self.tier, self.shape = tier, (L, 2, chunk)
        self.slabs: list[np.ndarray | None] = [None] * tier.num_slots
        self.pool_exec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="o3edge-kv-restore")
        self.copies: list = []  # restore copies started and not yet waited for (futures)
        self.landing: list[int] = []  # their slots, pinned until then
        self.copy_delay_s = 0.0  # test-only: each restore copy starts this late (nothing may read before it lands)
        self.counts = {"cold_restore_copy_seconds": 0.0, "cold_restore_copied_blocks": 0, "cold_restore_copies": 0}

    def slab(self, slot: int) -> np.ndarray:
        view = self.slabs[slot]
        if view is None:
            off = self.tier.payload_offset(slot)
            view = self.slabs[slot] = self.arena[off:off + self.tier.payload_bytes].reshape(self.shape)
        return view

    def mark(self, batch: Batch) -> None:
        """Nothing to record: the engine thread runs no device work."""

    def launch(self, batch: Batch) -> None:
        for job in batch.jobs:
            np.copyto(self.slab(job.slot), self.pool[:, :, job.block_id])

    def order(self, batch: Batch) -> None:
        """Nothing: launch() made the copies."""

    def wait(self, batch: Batch) -> None:
        """Nothing: launch() made the copies."""

    def abort(self, batch: Batch) -> None:
        """Nothing in flight."""

    def begin_load(self, n: int) -> None:
        """Nothing to prepare: each group of blocks is copied as soon as it is verified."""

    def load(self, block_ids: list[int], slots: list[int]) -> None:
        """Start the copies of verified slabs into their blocks on the copy thread (numpy releases the
        GIL): the engine thread goes on preparing the step, and `ready` waits for them."""
        self.copies.append(self.pool_exec.submit(self._copy, block_ids, slots))
        self.counts["cold_restore_copies"] += 1

    def _copy(self, block_ids: list[int], slots: list[int]) -> None:
        if self.copy_delay_s:
            time.sleep(self.copy_delay_s)
        t0 = time.perf_counter()
        for block_id, slot in zip(block_ids, slots):
            np.copyto(self.pool[:, :, block_id], self.slab(slot))
        self.counts["cold_restore_copy_seconds"] += time.perf_counter() - t0  # this thread alone writes these
        self.counts["cold_restore_copied_blocks"] += len(slots)

    def loaded(self, slots: list[int]) -> None:
        """The restore's copies are started: its slots stay pinned until `ready` has seen them land."""
        self.landing += slots

    def ready(self) -> None:
        """The step is about to read the pool: wait for every restore copy started, then unpin their slots."""
        copies, self.copies = self.copies, []
        try:
            for future in copies:
                future.result()
        finally:
            slots, self.landing = self.landing, []
            self.tier.unpin_all(slots)

    def reap(self) -> None:
        """Nothing to collect: `ready` does."""

    def close(self) -> None:
        self.ready()
        self.pool_exec.shutdown(wait=True)
        self.arena = self.pool = self.slabs = None


def by_slot(block_ids: list[int], slots: list[int]) -> tuple[list[int], list[int]]:
    """(block ids, slots) reordered by slot, so that slabs next to each other in the arena are one copy."""
    pairs = sorted(zip(slots, block_ids))
    return [b for _, b in pairs], [s for s, _ in pairs]


def _runs(slots: list[int]) -> list[tuple[int, int]]:
    """(start index, length) of each run of consecutive slot numbers, in order."""
    runs, start = [], 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((start, i - start))
            start = i
    return runs


class KVOffloader:
    """The cold tier's copier: offers in, batches copied out off the engine thread, verified restores back."""

    def __init__(self, tier: ColdTier, kv_cache, block_size: int, verify_threads: int | None = None):
        """kv_cache: the runner's pool, a torch tensor (CPU or CUDA) or a NumPy array (the native backend)."""
        self.tier, self.block_size = tier, block_size
        if getattr(kv_cache, "is_cuda", False):
            from o3edge.engine.kv_offload_cuda import CudaCopier

            self.copier = CudaCopier(tier, kv_cache, block_size)
        else:
            self.copier = HostCopier(tier, kv_cache, block_size)
        self.cond = threading.Condition()
        self.pending: dict[int, Job] = {}  # hot block id -> its flushed job, until done or overwritten
        self.hashes: set[bytes] = set()  # names of blocks flushed and not yet sealed
        self.offered: dict[int, Job] = {}  # hot block id -> its job, until the next flush (engine thread only)
        self.offered_hashes: set[bytes] = set()
        self.queue: deque[Batch] = deque()  # flushed, waiting for the worker
        self.verify_threads = verify_threads or min(16, os.cpu_count() or 1)
        self.verify_pool = ThreadPoolExecutor(max_workers=self.verify_threads, thread_name_prefix="o3edge-kv-verify")
        self.counts = {"cold_offloaded_blocks": 0, "cold_offload_seconds": 0.0, "cold_restored_blocks": 0,
                       "cold_restore_seconds": 0.0, "cold_offload_skipped": 0,
                       "cold_verified_blocks": 0}
        self.running = True
        self.worker = threading.Thread(target=self._work, name="o3edge-kv-offload", daemon=True)
        self.worker.start()
        atexit.register(self._at_exit)  # an in-process user who never closes still gets its blocks sealed

    # ---- out -----------------------------------------------------------------------------------
    def offer(self, block_id: int, h: bytes, parent: bytes, token_ids: tuple[int, ...]) -> None:
        """A named block lost its last holder: keep a copy unless the tier has one or one is on its way.
        The engine thread's part per block is kept to a few lookups: slots, locks and the worker's
        bookkeeping are taken once per flush (offers come by the hundred when a long sequence ends)."""
        if h in self.tier.index or h in self.hashes or h in self.offered_hashes:
            return
        if block_id in self.pending or block_id in self.offered:
            self.before_overwrite(block_id)  # an older job for the same hot block must be copied first
        self.offered[block_id] = Job(block_id, h, parent, tuple(token_ids))
        self.offered_hashes.add(h)

    def offer_block(self, block) -> None:
        """The block manager's on_cached_free."""
        self.offer(block.block_id, block.hash, block.parent, block.token_ids)

    def flush(self) -> None:
        """Give the offers so far their slots and hand them to the worker as one batch (engine thread)."""
        self.copier.reap()
        if not self.offered:
            return
        jobs = list(self.offered.values())
        self.offered, self.offered_hashes = {}, set()
        slots = self.tier.reserve_many(len(jobs))  # fewer when every other slot is being read
        started = jobs[:len(slots)]
        for job, slot in zip(started, slots):
            job.slot = slot
        if len(started) < len(jobs):
            with self.cond:
                self.counts["cold_offload_skipped"] += len(jobs) - len(started)
        if not started:
            return
        batch = Batch(started)
        try:
            self.copier.mark(batch)
        except Exception:  # a copy that cannot start costs a future hit, never this step
            log.exception("cold tier: starting %d offloads failed; they are skipped", len(started))
            self._give_up(batch.jobs)
            return
        with self.cond:
            for job in started:
                job.batch = batch
                self.pending[job.block_id] = job
                self.hashes.add(job.hash)
            self.queue.append(batch)
            self.cond.notify_all()

    def before_overwrite(self, block_id: int) -> None:
        """The engine is about to write into block_id: its outgoing copy must be made (or ordered) first."""
        if block_id in self.offered:  # not flushed yet: the flush gives it a batch (or no slot)
            self.flush()
        if block_id not in self.pending:  # most blocks: no lock needed to know that
            return
        with self.cond:
            job = self.pending.pop(block_id, None)
        if job is None:
            return
        batch = job.batch
        with self.cond:
            claimed = batch.state == QUEUED
            if claimed:
                batch.state = LAUNCHING
            else:
                while batch.state == LAUNCHING:  # the copier thread is launching it
                    self.cond.wait()
        if claimed:
            self._launch(batch)
        if batch.state == LAUNCHED:
            self.copier.order(batch)

    def _launch(self, batch: Batch) -> None:
        """Launch a batch this thread claimed; FAILED if it could not (its jobs are then dropped by the worker)."""
        try:
            self.copier.launch(batch)
            state = LAUNCHED
        except Exception:
            log.exception("cold tier: offload of %d blocks failed", len(batch.jobs))
            self.copier.abort(batch)
            state = FAILED
        with self.cond:
            batch.state = state
            self.cond.notify_all()

    def _work(self) -> None:
        while True:
            with self.cond:
                while self.running and not self.queue:
                    self.cond.wait()
                if not self.queue:
                    return
                batch = self.queue.popleft()
                claimed = batch.state == QUEUED
                if claimed:
                    batch.state = LAUNCHING
            if claimed:
                self._launch(batch)
            with self.cond:
                while batch.state == LAUNCHING:  # the engine thread took it
                    self.cond.wait()
            if batch.state == FAILED:
                self._give_up(batch.jobs)
                continue
            try:
                self._seal(batch)
            except Exception:
                log.exception("cold tier: sealing %d offloaded blocks failed", len(batch.jobs))
                self._give_up([j for j in batch.jobs if not j.done])

    def _seal(self, batch: Batch) -> None:
        """Wait for the batch's copies, then checksum and seal each slab (worker thread)."""
        t0 = time.perf_counter()
        self.copier.wait(batch)
        for job in batch.jobs:
            self.tier.commit(job.slot, Entry(job.hash, job.parent, job.token_ids))
            self._finished(job, ok=True)
        self.counts["cold_offload_seconds"] += time.perf_counter() - t0

    def _give_up(self, jobs: list[Job]) -> None:
        for job in jobs:
            self.tier.abandon(job.slot)
            self._finished(job, ok=False)

    def _finished(self, job: Job, ok: bool) -> None:
        with self.cond:
            job.done = True
            self.hashes.discard(job.hash)
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
            sealed = not self.hashes
        self.copier.reap()
        return sealed

    # ---- in ------------------------------------------------------------------------------------
    def restore(self, items: list[tuple[int, bytes, bytes, tuple[int, ...]]]) -> int:
        """Copy cold blocks (hot block id, hash, parent, tokens) in; returns how many leading ones made it."""
        t0 = time.perf_counter()
        slots, unchecked = self.tier.acquire([item[1:] for item in items])
        ids = [item[0] for item in items[:len(slots)]]
        self.copier.begin_load(len(slots))
        n = len(slots)
        if unchecked:
            n = self._verify_and_load(items, slots)
            self.counts["cold_verified_blocks"] += n
        elif slots:
            self.copier.load(ids, slots)
        self.tier.unpin_all(slots[n:])
        self.copier.loaded(slots[:n])
        self.counts["cold_restored_blocks"] += n
        self.counts["cold_restore_seconds"] += time.perf_counter() - t0
        return n

    def ready(self) -> None:
        """The step is about to run: its first kernel must see every restored block (engine thread, right
        before the forward; CUDA: a wait on the device, CPU: for the copy thread). Idempotent."""
        self.copier.ready()

    def _verify_and_load(self, items: list, slots: list[int]) -> int:
        """Verify the slots in groups on the pool, copying each group in as soon as it passes (in order);
        how many leading slots passed."""
        size = max(VERIFY_GROUP, -(-len(slots) // self.verify_threads))
        bounds = [(i, min(i + size, len(slots))) for i in range(0, len(slots), size)]
        futures = [self.verify_pool.submit(self._check, items, slots, lo, hi) for lo, hi in bounds]
        ok = 0
        for (lo, hi), future in zip(bounds, futures):
            passed = future.result()
            self.copier.load([item[0] for item in items[lo:lo + passed]], slots[lo:lo + passed])
            ok += passed
            if passed < hi - lo:
                break
        for future in futures:
            future.cancel()
        wait(futures)  # none may still read a slot once it is unpinned
        return ok

    def _check(self, items: list, slots: list[int], lo: int, hi: int) -> int:
        """How many of slots[lo:hi] pass their checks, from the first (a pool thread)."""
        for i in range(lo, hi):
            _, h, parent, tokens = items[i]
            if not self.tier.check(slots[i], h, parent, tokens):
                return i - lo
        return hi - lo

    # ---- the rest ------------------------------------------------------------------------------
    def stats(self) -> dict:
        c, nbytes = {**self.counts, **self.copier.counts}, self.tier.payload_bytes
        rate = lambda n, s: round(n * nbytes / s / 1e9, 3) if s > 0 else 0.0  # noqa: E731
        restore = rate(c["cold_restore_copied_blocks"], c["cold_restore_copy_seconds"])  # CUDA: device time
        return {**self.tier.stats(), "cold_offloaded_blocks": c["cold_offloaded_blocks"],
                "cold_restored_blocks": c["cold_restored_blocks"], "cold_offload_skipped": c["cold_offload_skipped"],
                "cold_verified_blocks": c["cold_verified_blocks"],
                "cold_offload_gb_per_s": rate(c["cold_offloaded_blocks"], c["cold_offload_seconds"]),
                "cold_restore_gb_per_s": restore}

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
