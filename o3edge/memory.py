"""Giving memory back to the system after big inputs, and what the process's RSS is made of.

glibc keeps freed memory in its heaps (one arena per thread that allocated, up to 8 per core) and
returns it only from the top of each heap, so after a few large prompts the daemon stayed hundreds
of MiB above its idle size. `limit_arenas` caps the arena count before threads start, and
`Trimmer` calls malloc_trim(0) when the daemon goes idle after large inputs. Both do nothing where
the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import math
import time

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # mallopt parameter (glibc's malloc.h)
TRIM_AFTER_BYTES = 1 << 20  # input seen since the last trim that makes a trim worth its cost
TRIM_EVERY_S = 1.0
QUIET_S = 1.0  # no input for this long and nothing in flight: the work on the last inputs is done


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim, libc.mallopt  # noqa: B018 (glibc only)
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def limit_arenas(count: int = 2) -> bool:
    """Cap glibc's malloc arenas (call before starting threads); False where that is not possible."""
    return bool(_LIBC and _LIBC.mallopt(M_ARENA_MAX, count))


def trim() -> bool:
    """Return free heap memory to the system; True if some was returned."""
    return bool(_LIBC and _LIBC.malloc_trim(0))


def drop_pages(address: int, nbytes: int) -> None:
    """Drop the resident pages that lie wholly inside [address, address + nbytes) of a file mapping (a tensor
    of an engine file that was copied into a packed layout): the mapping stays, and a later read faults them
    back in unchanged."""
    if _LIBC is None:
        return
    page = mmap.PAGESIZE
    start, end = -(-address // page) * page, (address + nbytes) // page * page
    if end > start:
        _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED)


class Trimmer:
    """Counts large inputs; trims at most once a TRIM_EVERY_S, when at least TRIM_AFTER_BYTES came in.

    A trim made between or during requests cannot return what later work still holds (a long prompt
    being tokenized, a prompt being served) and smaller inputs after it never reach the threshold
    again, so one more trim follows once the daemon is quiet: no input for QUIET_S and nothing in
    flight. Without it the daemon could stay tens of MiB up for good after its last big input."""

    def __init__(self):
        self.pending_bytes = 0
        self.last = -math.inf  # the first trim waits for nothing (time.monotonic() may start near 0 after a boot)
        self.last_input = 0.0
        self.num_trims = 0
        self.follow_up = False

    def note(self, num_bytes: int) -> None:
        self.pending_bytes += num_bytes
        self.last_input = time.monotonic()

    def maybe_trim(self, busy: bool = False) -> None:
        """Call when idle; busy: requests are still in flight."""
        now = time.monotonic()
        big = self.pending_bytes >= TRIM_AFTER_BYTES
        quiet = self.follow_up and not busy and now - self.last_input >= QUIET_S
        if now - self.last < TRIM_EVERY_S or not (big or quiet):
            return
        self.pending_bytes, self.last, self.follow_up = 0, now, big  # a big input's trim is followed up
        trim()
        self.num_trims += 1


def rss_breakdown() -> dict:
    """Resident memory in bytes, from /proc/self/status: total, anonymous (heap, KV cache, tensors
    not backed by files), file-backed (mmap'd weights, libraries) and shared memory."""
    fields = {"VmRSS": "rss_bytes", "RssAnon": "anon_bytes", "RssFile": "file_bytes", "RssShmem": "shmem_bytes"}
    out = {}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key in fields:
                    out[fields[key]] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out
