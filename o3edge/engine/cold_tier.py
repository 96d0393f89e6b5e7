"""The KV cache's cold tier: full KV blocks in a POSIX shared-memory arena that outlives the daemon.

One segment per model identity, `/dev/shm/o3edge-<identity>-<n>`: a superblock page, a table of
slot headers, then the slabs back to back from a page boundary (so a run of consecutive slots is
one DMA copy). A slot's slab holds one block across all layers, in the hot pool's element layout
[layers, K/V, block_size, kv_heads, head_dim]. Its header names the block (chain hash, parent
hash, token ids), its layout version and model identity, and carries a checksum of the slab and a
CRC32 of itself. A slot is written WRITING first, then the slab, then the header, then VALID: a
crash mid-copy leaves a slot that a restarted daemon drops. A restart re-attaches, rebuilds the
index from the headers (the headers are the index: there is no manifest to get out of step with
them), and verifies a slot lazily, the first time this process loads it: header, tokens, parent
and slab checksum, before a byte of it is copied. A slab this process wrote itself was
checksummed from the bytes it wrote and needs no second look (`checked`); the check is what
catches a torn write, a crash or a stray write, which only a restart can meet. Any mismatch drops
the block and the caller recomputes it. Never a corrupt block.

The slab checksum is xxh3-64 (the xxhash package): ~20 GB/s on one core here against ~4 GB/s for
zlib's CRC32, so sealing a 1 MiB slab takes ~50 us of a worker thread and verifying a restarted
daemon's slabs runs near memory speed. It is computed with the GIL released (the hasher object's
constructor does that; xxhash's one-shot functions do not), so checksums on the copier thread and
the verifying pool never stall the engine thread. Layout version 2 (version 1 had a CRC32 per slab):
a segment or slot of another version is dropped, never served. Headers keep zlib's CRC32 (a hundred
bytes or so).

Plain Python (mmap, struct, zlib, xxhash), no torch: the block manager asks it for hits, the offloader in
kv_offload.py moves the bytes. An exclusive flock on the segment keeps a second daemon of the same
model off it (that one takes the next free <n>). A segment is used only if it is this user's and
nobody else may write it: a block planted in the shared /dev/shm would pass its checksums. The
daemon removes segments no live process holds (`remove_unused`); an engine alone never does.
Slots are reserved only on the engine thread; the copier thread commits.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import mmap
import operator
import os
import re
import struct
import threading
import zlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import xxhash

from o3edge.engine.block_manager import chain_hash, leading

log = logging.getLogger(__name__)

LAYOUT_VERSION = 2  # 2: xxh3-64 slab checksums (1: CRC32)
PREFIX = "o3edge-"
PAGE = 4096
MAX_SEGMENTS = 8  # concurrent daemons of one model, each with its own segment
SUPER = struct.Struct("<8sHHI16sQQQ")  # magic, version, 0, block_size, identity, header, payload, slots
SUPER_MAGIC = b"O3EDGEKV"
SLOT = struct.Struct("<8sHHIQ16s16s16sIIQQ")  # see _write_header
SLOT_MAGIC = b"O3KVSLOT"
EMPTY, WRITING, VALID = 0, 1, 2
_STATE_AT, _STAMP_AT, _CRC_AT = 10, 16, 12
_SEGMENT = re.compile(PREFIX + r"[0-9a-f]{32}-[0-9]+")
_TOKEN_BYTES = operator.attrgetter("token_bytes")
_PARENT = operator.attrgetter("parent")
_KEY = operator.attrgetter("hash", "parent", "token_ids")
_FIRST = operator.itemgetter(0)


@dataclass
class Entry:
    """A valid block in the arena, as the index knows it."""

    hash: bytes
    parent: bytes
    token_ids: tuple[int, ...]
    token_bytes: bytes = b""  # the token ids as int32, as the chain hash took them: `match` compares these

    def __post_init__(self):
        if not self.token_bytes:
            self.token_bytes = array("i", self.token_ids).tobytes()


class ColdTierUnavailable(OSError):
    """The tier cannot run here (no /dev/shm, read-only, full, too small)."""


class ColdTier:
    """The shared-memory arena and its index; thread-safe; no tensors."""

    def __init__(self, directory: str, identity: bytes, size_bytes: int, block_size: int, payload_bytes: int):
        self.identity, self.block_size, self.payload_bytes = identity, block_size, payload_bytes
        self.header_bytes = _header_bytes(block_size)
        self.slot_bytes = self.header_bytes + payload_bytes
        self.num_slots = (size_bytes - 2 * PAGE) // self.slot_bytes
        if self.num_slots < 1:
            raise ColdTierUnavailable(errno.EINVAL, f"cold tier of {size_bytes >> 20} MiB holds no block of "
                                                    f"{self.slot_bytes >> 10} KiB")
        self.slab_base = _round_up(PAGE + self.num_slots * self.header_bytes, PAGE)
        self.size = self.slab_base + self.num_slots * payload_bytes
        self.lock = threading.Lock()
        self.path, self.fd, self.attached = self._open(directory)
        try:
            self.mm = mmap.mmap(self.fd, self.size)
        except OSError:
            os.close(self.fd)
            raise
        self.entries: list[Entry | None] = [None] * self.num_slots
        self.index: dict[bytes, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # valid slots, least recently used first
        self.free: list[int] = []
        self.pinned: dict[int, int] = {}  # slot -> readers (an in-flight restore)
        self.checked: set[int] = set()  # slots whose payload this process wrote or has verified
        self.stamp = 0
        self.counts = {"cold_stored": 0, "cold_evicted": 0, "cold_checksum_failures": 0,
                       "cold_dropped": 0}
        self._load_index() if self.attached else self._format()

    # ---- the segment -------------------------------------------------------------------------
    def _open(self, directory: str) -> tuple[str, int, bool]:
        """Lock the first free segment of this identity; (path, fd, whether it was there already)."""
        for n in range(MAX_SEGMENTS):
            path = os.path.join(directory, f"{PREFIX}{self.identity.hex()}-{n}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            if not _private(fd):  # planted by someone else in the shared directory: never read it
                log.warning("cold tier: ignoring %s (not ours alone: owner or mode)", path)
                os.close(fd)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another live daemon of this model holds it
                os.close(fd)
                continue
            try:
                existed = os.fstat(fd).st_size == self.size
                if not existed:
                    os.ftruncate(fd, 0)
                    # reserve the pages now: on a full tmpfs a lazy page would be a SIGBUS later
                    os.posix_fallocate(fd, 0, self.size)
                return path, fd, existed
            except OSError:
                os.close(fd)
                _unlink(path)
                raise
        raise ColdTierUnavailable(errno.EBUSY, f"{MAX_SEGMENTS} daemons of this model hold cold tiers already")

    def _format(self) -> None:
        self.mm[:PAGE] = bytes(PAGE)
        for slot in range(self.num_slots):
            self._set_state(slot, EMPTY)
        self.mm[:SUPER.size] = self._superblock()
        self.free = list(range(self.num_slots - 1, -1, -1))

    def _superblock(self) -> bytes:
        return SUPER.pack(SUPER_MAGIC, LAYOUT_VERSION, 0, self.block_size, self.identity, self.header_bytes,
                          self.payload_bytes, self.num_slots)

    def _load_index(self) -> None:
        """Re-attach: trust nothing but headers that check out; the slabs are checked when loaded."""
        if self.mm[:SUPER.size] != self._superblock():
            log.warning("cold tier %s has another layout: starting it empty", self.path)
            return self._format()
        found = []
        for slot in range(self.num_slots):
            entry, stamp, _ = self._read_header(slot)
            if entry is None:
                self._set_state(slot, EMPTY)
                self.free.append(slot)
            else:
                found.append((stamp, slot, entry))
        for stamp, slot, entry in sorted(found):
            old = self.index.get(entry.hash)
            if old is not None:  # the same block twice (a crash between two writes): keep the newer
                self._forget(old)
            self._index(slot, entry)
            self.stamp = max(self.stamp, stamp)
        self.free.reverse()
        log.info("cold tier: re-attached %s with %d blocks", self.path, len(self.index))

    def close(self) -> None:
        """Unmap and unlock; the segment stays for the next daemon."""
        if self.fd < 0:
            return
        try:
            self.mm.close()
        except BufferError:  # a tensor view still exists: the mapping goes with the process
            pass
        os.close(self.fd)
        self.fd = -1

    # ---- headers -----------------------------------------------------------------------------
    def _offset(self, slot: int) -> int:
        """Where slot's header starts in the segment."""
        return PAGE + slot * self.header_bytes

    def payload_offset(self, slot: int) -> int:
        """Where slot's slab starts: slabs follow each other, so consecutive slots are one copy."""
        return self.slab_base + slot * self.payload_bytes

    @staticmethod
    def size_for(num_slots: int, block_size: int, payload_bytes: int) -> int:
        """The size_bytes that gives exactly num_slots slots."""
        return 2 * PAGE + num_slots * (_header_bytes(block_size) + payload_bytes)

    def payload(self, slot: int) -> memoryview:
        off = self.payload_offset(slot)
        return memoryview(self.mm)[off:off + self.payload_bytes]

    def _set_state(self, slot: int, state: int) -> None:
        off = self._offset(slot)
        self.mm[off + _STATE_AT:off + _STATE_AT + 2] = state.to_bytes(2, "little")

    def _read_header(self, slot: int) -> tuple[Entry | None, int, int]:
        """(entry, stamp, slab checksum) if the slot's header is whole, VALID, ours and self-consistent."""
        off = self._offset(slot)
        head = SLOT.unpack_from(self.mm, off)
        magic, version, state, crc, stamp, identity, h, parent, n, _, nbytes, payload_sum = head
        if (magic != SLOT_MAGIC or version != LAYOUT_VERSION or state != VALID or identity != self.identity
                or n != self.block_size or nbytes != self.payload_bytes):
            return None, 0, 0
        tokens_at = off + SLOT.size
        if crc != _header_crc(self.mm[off:tokens_at + 4 * n]):
            return None, 0, 0
        tokens = struct.unpack_from(f"<{n}i", self.mm, tokens_at)
        if h != chain_hash(parent, tokens):
            return None, 0, 0
        return Entry(h, parent, tokens), stamp, payload_sum

    def _write_header(self, slot: int, entry: Entry, payload_sum: int) -> None:
        """magic, version, state, header CRC32, stamp (LRU order), model identity, hash, parent,
        token count, 0, slab bytes, slab checksum; then the token ids."""
        off, n = self._offset(slot), len(entry.token_ids)
        self.stamp += 1
        SLOT.pack_into(self.mm, off, SLOT_MAGIC, LAYOUT_VERSION, WRITING, 0, self.stamp, self.identity,
                       entry.hash, entry.parent, n, 0, self.payload_bytes, payload_sum)
        struct.pack_into(f"<{n}i", self.mm, off + SLOT.size, *entry.token_ids)
        crc = _header_crc(self.mm[off:off + SLOT.size + 4 * n])
        self.mm[off + _CRC_AT:off + _CRC_AT + 4] = crc.to_bytes(4, "little")

    def _touch(self, slots: list[int]) -> None:
        """Make slots the most recent, in order, in the stamps a restart rebuilds the LRU order from (lock
        held). One call for a whole chain: a long prefix has hundreds."""
        mm, at = self.mm, self._offset(0) + _STAMP_AT
        for slot in slots:
            self.stamp += 1
            off = at + slot * self.header_bytes
            mm[off:off + 8] = self.stamp.to_bytes(8, "little")

    # ---- the index (engine thread: match, reserve, acquire; copier thread: commit) -------------
    def match(self, hashes: list[bytes], parent: bytes, token_bytes: bytes) -> list[tuple[bytes, bytes, tuple]]:
        """(hash, parent, tokens) of the leading blocks of a chain that the arena holds: `hashes` names the
        chain's blocks from the one after `parent` on, `token_bytes` are their token ids end to end, as int32
        (as the chain hash takes them). The hits become most recent. One lock for the chain, and C loops:
        names, parents and tokens are each compared in one go (a 16K-token prefix is hundreds of blocks;
        its tokens, compared as bytes, are one memcmp rather than 16K int objects all over the heap)."""
        step = 4 * self.block_size
        with self.lock:
            entries = _leading(self.index, self.entries, hashes)
            n = _agree(list(map(_PARENT, entries)), [parent, *hashes[:len(entries) - 1]])
            if b"".join(map(_TOKEN_BYTES, entries[:n])) != token_bytes[:n * step]:
                n = next(i for i, e in enumerate(entries) if e.token_bytes != token_bytes[i * step:(i + 1) * step])
            for e in entries[:n]:
                self.lru.move_to_end(self.index[e.hash])
        return list(map(_KEY, entries[:n]))

    def __contains__(self, h: bytes) -> bool:
        return h in self.index

    def slot_of(self, h: bytes) -> int | None:
        return self.index.get(h)

    def reserve(self) -> int | None:
        """A slot to write a new block into (a free one, else the least recently used); None if all busy."""
        got = self.reserve_many(1)
        return got[0] if got else None

    def reserve_many(self, n: int) -> list[int]:
        """Up to n slots to write new blocks into, under one lock (fewer when every other slot is pinned)."""
        slots = []
        with self.lock:
            for _ in range(n):
                if self.free:
                    slot = self.free.pop()
                else:
                    slot = next((s for s in self.lru if s not in self.pinned), None)
                    if slot is None:
                        break
                    self._forget(slot)
                    self.free.pop()  # _forget put it there
                    self.counts["cold_evicted"] += 1
                self._set_state(slot, WRITING)
                slots.append(slot)
        return slots

    def commit(self, slot: int, entry: Entry) -> None:
        """Seal a slot whose slab is written: checksum, header, then VALID; index it."""
        payload_sum = slab_checksum(self.payload(slot))  # outside the lock: the GIL is released
        with self.lock:
            self._write_header(slot, entry, payload_sum)
            self.checked.add(slot)
            self._set_state(slot, VALID)
            if entry.hash in self.index:  # stored twice meanwhile: keep the first
                self._forget(slot)
                return
            self._index(slot, entry)
            self.counts["cold_stored"] += 1

    def abandon(self, slot: int) -> None:
        """Give back a reserved slot whose copy was not made."""
        with self.lock:
            self._set_state(slot, EMPTY)
            self.free.append(slot)
            self.counts["cold_dropped"] += 1

    def acquire(self, keys) -> tuple[list[int], int]:
        """Pin the slots of the leading blocks of keys [(hash, parent, tokens)] the index holds as named.

        Returns (slots, how many of them this process has not checksummed yet: those must pass
        `check` before they are read). One lock for the whole run; no slab is read here.
        """
        keys = list(keys)
        with self.lock:
            index, pinned = self.index, self.pinned
            entries = _leading(index, self.entries, map(_FIRST, keys))
            slots = [index[e.hash] for e in entries[:_agree(list(map(_KEY, entries)), keys)]]
            for slot in slots:
                pinned[slot] = pinned.get(slot, 0) + 1
            self._touch(slots)
            unchecked = len(slots) - len(self.checked.intersection(slots))
        return slots, unchecked

    def check(self, slot: int, h: bytes, parent: bytes, token_ids: tuple[int, ...]) -> bool:
        """Whether an acquired slot's header and slab are exactly this block (any thread; GIL released
        while hashing); a slot that fails is dropped from the index and counted."""
        if slot in self.checked:
            return True
        entry, _, stored = self._read_header(slot)
        ok = (entry is not None and entry.hash == h and entry.parent == parent and entry.token_ids == token_ids
              and slab_checksum(self.payload(slot)) == stored)
        with self.lock:
            if ok:
                self.checked.add(slot)
                return True
            log.warning("cold tier: block in slot %d failed its check; it will be recomputed", slot)
            self.counts["cold_checksum_failures"] += 1
            if self.index.get(h) == slot:
                self._forget(slot)
            return False

    def verify(self, h: bytes, parent: bytes, token_ids: tuple[int, ...]) -> int | None:
        """The slot holding exactly this block, checked byte for byte (made most recent); None if not."""
        token_ids = tuple(token_ids)
        slots, _ = self.acquire([(h, parent, token_ids)])
        if not slots:
            return None
        ok = self.check(slots[0], h, parent, token_ids)
        self.unpin(slots[0])
        return slots[0] if ok else None

    def pin(self, slot: int) -> None:
        """Keep slot from being reused while a copy reads it."""
        with self.lock:
            self.pinned[slot] = self.pinned.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        self.unpin_all([slot])

    def unpin_all(self, slots) -> None:
        with self.lock:
            for slot in slots:
                if self.pinned.get(slot, 0) <= 1:
                    self.pinned.pop(slot, None)
                else:
                    self.pinned[slot] -= 1

    def _index(self, slot: int, entry: Entry) -> None:
        self.entries[slot] = entry
        self.index[entry.hash] = slot
        self.lru[slot] = None

    def _forget(self, slot: int) -> None:
        self.checked.discard(slot)
        entry = self.entries[slot]
        if entry is not None and self.index.get(entry.hash) == slot:
            del self.index[entry.hash]
        self.entries[slot] = None
        self.lru.pop(slot, None)
        self._set_state(slot, EMPTY)
        self.free.append(slot)

    @property
    def num_blocks(self) -> int:
        return len(self.index)

    def stats(self) -> dict:
        with self.lock:
            return {"cold_blocks": len(self.index), "cold_blocks_total": self.num_slots,
                    "cold_bytes": len(self.index) * self.payload_bytes, "cold_capacity_bytes": self.size,
                    **self.counts}


def _leading(index: dict, entries: list, hashes) -> list[Entry]:
    """The entries of the leading names of `hashes` that the index holds (lock held)."""
    return list(map(entries.__getitem__, leading(index, hashes)))  # an indexed slot always has its entry


def _agree(found: list, wanted: list) -> int:
    """How many leading items of found equal wanted's (one C loop when all do)."""
    if found == wanted[:len(found)]:
        return len(found)
    return next(i for i, (a, b) in enumerate(zip(found, wanted)) if a != b)


def slab_checksum(buf) -> int:
    """xxh3-64 of a slab; the hasher object's constructor releases the GIL while it hashes."""
    return xxhash.xxh3_64(buf).intdigest()


def _header_crc(header: bytes) -> int:
    # everything but the mutable state, stamp and the CRC itself
    return zlib.crc32(header[SLOT.size:], zlib.crc32(header[24:SLOT.size], zlib.crc32(header[:10])))


def _private(fd: int) -> bool:
    """The file is ours and nobody else may write it (/dev/shm is shared by every user)."""
    st = os.fstat(fd)
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _header_bytes(block_size: int) -> int:
    return _round_up(SLOT.size + 4 * block_size, 64)  # a whole number of cache lines


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def segments(directory: str) -> list[str]:
    """The cold-tier segments in directory (o3edge-<32 hex digits>-<n>)."""
    return sorted(os.path.join(directory, name) for name in os.listdir(directory) if _SEGMENT.fullmatch(name))


def remove_unused(directory: str, keep: str | None = None) -> list[str]:
    """Remove this user's o3edge segments in directory that no live process holds, except `keep`."""
    removed = []
    for path in segments(directory) if os.path.isdir(directory) else []:
        if path == keep:
            continue
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                continue  # another user's: not ours to remove
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
            removed.append(path)
        except OSError:  # held by a live process
            pass
        finally:
            os.close(fd)
    return removed


def open_cold_tier(directory: str, identity: bytes, size_mb: int, block_size: int,
                   payload_bytes: int) -> ColdTier | None:
    """The tier (None when size_mb is 0), or None with one warning when it cannot run here."""
    if size_mb <= 0:
        return None
    try:
        tier = ColdTier(directory, identity, size_mb << 20, block_size, payload_bytes)
    except OSError as exc:
        log.warning("cold tier off: cannot use %s for %d MiB (%s); serving without it", directory, size_mb,
                    exc.strerror or exc)
        return None
    log.info("cold tier: %s, %d slots of %d KiB (%s)", tier.path, tier.num_slots, tier.slot_bytes >> 10,
             f"re-attached, {tier.num_blocks} blocks" if tier.attached else "new")
    return tier


def model_identity(model_dir: str, fingerprint: str, layout: str, weight_paths: list[str]) -> str:
    """What a cached block's K/V depends on, as 32 hex digits: the chained hashes' root, the segment name.

    `fingerprint` covers config.json and each weight file's size, head and tail; this adds 64 pages
    sampled across each weight file (a fine-tune that changed only middle layers), the tokenizer
    files, and `layout` (quantization, dtype, KV block shape) with the tier's layout version.
    """
    digest = hashlib.blake2b(f"{fingerprint}|{layout}|kv-layout-{LAYOUT_VERSION}".encode(), digest_size=16)
    for path in weight_paths:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            for k in range(64):
                fh.seek(size * k // 64)
                digest.update(fh.read(PAGE))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            with open(path, "rb") as fh:
                digest.update(name.encode() + fh.read())
    return digest.hexdigest()
