"""The cold tier's arena in real shared memory: headers, checksums, LRU, re-attach, refusals, clean-up."""

import fcntl
import logging
from array import array
import os
import subprocess
import sys

import pytest

from o3edge.engine import cold_tier as ct
from o3edge.engine.block_manager import chain_hash
from o3edge.engine.cold_tier import ColdTier, Entry, open_cold_tier, remove_unused

BS, PAYLOAD = 8, 3 * 4096 + 100  # tokens per block; an odd slab size (padded to pages in the arena)
ROOT = b"\x01" * 16


def ident(n=0) -> bytes:
    return bytes([n]) * 16


def tier(shm, slots=4, identity=None) -> ColdTier:
    return ColdTier(shm, identity or ident(), ColdTier.size_for(slots, BS, PAYLOAD), BS, PAYLOAD)


def holds(t: ColdTier, h: bytes, parent: bytes, token_ids) -> bool:
    """Whether the tier has this block (same parent, same tokens): a one-block match (a hit becomes most recent)."""
    return bool(t.match([h], parent, array("i", token_ids).tobytes()))


def block(i: int, parent: bytes = ROOT) -> Entry:
    tokens = tuple(range(i * BS, (i + 1) * BS))
    return Entry(chain_hash(parent, tokens), parent, tokens)


def store(t: ColdTier, e: Entry, fill: int) -> int:
    slot = t.reserve()
    t.payload(slot)[:] = bytes([fill]) * PAYLOAD
    t.commit(slot, e)
    return slot


def test_round_trip_and_lookup_checks_parent_and_tokens(shm):
    t = tier(shm)
    e = block(0)
    slot = store(t, e, 7)
    assert holds(t, e.hash, e.parent, e.token_ids)
    assert not holds(t, e.hash, b"\x02" * 16, e.token_ids)  # same name, other parent: not this block
    assert not holds(t, e.hash, e.parent, (0,) * BS)
    assert t.verify(e.hash, e.parent, e.token_ids) == slot
    assert bytes(t.payload(slot)) == bytes([7]) * PAYLOAD
    assert t.num_slots == 4 and t.payload_offset(0) % ct.PAGE == 0
    assert t.payload_offset(3) - t.payload_offset(0) == 3 * PAYLOAD  # slabs back to back: one copy for a run
    assert os.path.basename(t.path) == f"o3edge-{ident().hex()}-0"
    t.close()


def test_match_takes_a_chain_in_one_go_and_stops_at_the_first_wrong_parent_or_token(shm):
    t = tier(shm, slots=6)
    chain, parent = [], ROOT
    for i in range(4):
        chain.append(block(i, parent))
        parent = chain[-1].hash
        store(t, chain[-1], i)
    names = [e.hash for e in chain]
    tokens = array("i", [tok for e in chain for tok in e.token_ids]).tobytes()
    assert t.match(names, ROOT, tokens) == [(e.hash, e.parent, e.token_ids) for e in chain]
    assert t.match(names[1:], names[0], tokens[4 * BS:]) == [(e.hash, e.parent, e.token_ids) for e in chain[1:]]
    assert t.match(names, b"\x02" * 16, tokens) == []  # another parent: not this chain
    wrong = bytearray(tokens)
    wrong[2 * 4 * BS + 5] ^= 1  # a token of the third block differs (as a hash collision would have it)
    assert [h for h, _, _ in t.match(names, ROOT, bytes(wrong))] == names[:2]
    assert [h for h, _, _ in t.match(names[:2] + [b"\x03" * 16] + names[3:], ROOT, tokens)] == names[:2]
    slots, unchecked = t.acquire(t.match(names, ROOT, tokens))
    assert len(slots) == 4 and unchecked == 0 and all(t.pinned[s] == 1 for s in slots)
    t.unpin_all(slots)
    assert not t.pinned
    t.close()


def test_restart_reattaches_and_rebuilds_the_index_in_lru_order(shm):
    t = tier(shm, slots=3)
    entries = [block(i) for i in range(3)]
    for i, e in enumerate(entries):
        store(t, e, i)
    t.verify(entries[0].hash, entries[0].parent, entries[0].token_ids)  # 0 is now the most recent
    t.close()
    again = tier(shm, slots=3)
    assert again.attached and again.num_blocks == 3
    slot = again.verify(entries[2].hash, entries[2].parent, entries[2].token_ids)
    assert bytes(again.payload(slot)[:4]) == b"\x02" * 4
    store(again, block(9), 9)  # full: evicts the least recently used, which is block 1
    assert entries[1].hash not in again and entries[0].hash in again and entries[2].hash in again
    again.close()


def test_full_arena_evicts_lru_and_skips_pinned_slots(shm):
    t = tier(shm, slots=2)
    a, b, c = block(0), block(1), block(2)
    sa = store(t, a, 1)
    store(t, b, 2)
    assert holds(t, a.hash, a.parent, a.token_ids)  # a is used again: b is now the oldest
    store(t, c, 3)
    assert a.hash in t and b.hash not in t and c.hash in t
    assert t.stats()["cold_evicted"] == 1
    t.pin(sa)
    t.pin(t.slot_of(c.hash))
    assert t.reserve() is None  # everything is being read
    t.close()


def test_flipped_byte_is_refused_and_dropped(shm):
    """A slab is checksummed the first time a process loads it: after a restart, a flipped byte is caught."""
    t = tier(shm)
    e = block(0)
    slot = store(t, e, 5)
    t.close()
    t = tier(shm)  # a restarted daemon re-attaches
    t.mm[t.payload_offset(slot) + 1234] ^= 0x40
    assert t.verify(e.hash, e.parent, e.token_ids) is None
    assert e.hash not in t and t.stats()["cold_checksum_failures"] == 1
    t.close()


def test_a_restart_verifies_each_slab_once_and_the_writer_never(shm):
    t = tier(shm)
    a = block(0)
    b = block(1, parent=a.hash)
    keys = [(e.hash, e.parent, e.token_ids) for e in (a, b)]
    for i, e in enumerate((a, b)):
        store(t, e, i)
    slots, unchecked = t.acquire(keys)
    assert len(slots) == 2 and unchecked == 0  # written here: checksummed from the bytes written
    t.unpin_all(slots)
    t.close()
    t = tier(shm)
    slots, unchecked = t.acquire(keys)
    assert len(slots) == 2 and unchecked == 2  # found after a restart: not trusted yet
    assert all(t.check(slot, *key) for slot, key in zip(slots, keys))
    t.unpin_all(slots)
    assert t.acquire(keys)[1] == 0  # verified once is enough
    t.close()


def test_torn_and_truncated_slabs_are_refused(shm):
    t = tier(shm)
    whole, torn = block(0), block(1)
    slot = store(t, whole, 5)
    t.close()
    t = tier(shm)  # what a restart finds (this process's own slabs were checksummed as it wrote them)
    half = t.payload_offset(slot) + PAYLOAD // 2
    t.mm[half:t.payload_offset(slot) + PAYLOAD] = bytes(PAYLOAD - PAYLOAD // 2)  # the tail never arrived
    assert t.verify(whole.hash, whole.parent, whole.token_ids) is None
    writing = t.reserve()  # a crash mid-copy: the slot stays WRITING
    t.payload(writing)[:100] = b"\x09" * 100
    t.close()
    again = tier(shm)
    assert again.num_blocks == 0 and torn.hash not in again
    store(again, torn, 4)
    again.close()
    os.truncate(again.path, again.size - PAYLOAD // 2)  # the segment itself cut short
    short = tier(shm)
    assert short.num_blocks == 0 and short.size == os.path.getsize(short.path)  # started anew, full size
    short.close()


def test_header_tampering_and_other_layouts_are_refused(shm):
    t = tier(shm)
    entries = [block(i) for i in range(3)]
    slots = [store(t, e, i) for i, e in enumerate(entries)]
    off = t._offset
    t.mm[off(slots[0]) + ct.SLOT.size] ^= 1  # a stored token id
    t.mm[off(slots[1]) + 8] = ct.LAYOUT_VERSION + 1  # another layout version
    t.mm[off(slots[2]) + 24] ^= 1  # another model's identity
    t.close()
    again = tier(shm)
    assert again.num_blocks == 0
    store(again, entries[0], 1)
    again.mm[8] = ct.LAYOUT_VERSION + 1  # the superblock: a segment of another layout version
    again.close()
    fresh = tier(shm)
    assert fresh.num_blocks == 0 and not holds(fresh, entries[0].hash, entries[0].parent, entries[0].token_ids)
    fresh.close()


def test_another_model_never_opens_this_models_segment(shm):
    mine = tier(shm, identity=ident(1))
    e = block(0)
    store(mine, e, 3)
    other = tier(shm, identity=ident(2))
    assert other.path != mine.path and other.num_blocks == 0 and e.hash not in other
    mine.close(), other.close()


def test_a_second_daemon_of_the_same_model_gets_its_own_segment(shm):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = (f"import sys, time; sys.path.insert(0, {repo!r}); from o3edge.engine.cold_tier import ColdTier;"
            f"t = ColdTier({shm!r}, bytes([1]) * 16, {ColdTier.size_for(4, BS, PAYLOAD)}, {BS}, {PAYLOAD});"
            "print(t.path, flush=True); time.sleep(30)")
    other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        held = other.stdout.readline().strip()
        assert held.endswith("-0")
        mine = tier(shm, identity=ident(1))
        assert mine.path.endswith("-1")  # -0 is locked by the live process: never shared
        assert remove_unused(shm) == []  # both are held
        mine.close()
    finally:
        other.kill()
        other.wait()
    assert remove_unused(shm) == sorted([held, os.path.join(shm, f"o3edge-{ident(1).hex()}-1")])


def test_unused_segments_are_removed_and_off_creates_nothing(shm):
    stale = tier(shm, identity=ident(3))
    store(stale, block(0), 1)
    stale.close()
    on = open_cold_tier(shm, ident(4), 1, BS, PAYLOAD)
    assert sorted(os.listdir(shm)) == sorted([os.path.basename(stale.path), os.path.basename(on.path)])
    assert remove_unused(shm, keep=on.path) == [stale.path]  # another model's, no longer held
    assert remove_unused(shm) == []  # the live one is held
    on.close()
    assert open_cold_tier(shm, ident(4), 0, BS, PAYLOAD) is None
    assert remove_unused(shm) == [on.path] and os.listdir(shm) == []


@pytest.mark.parametrize("where", ["absent", "sysfs"])
def test_unusable_directory_turns_the_tier_off_with_one_warning(shm, caplog, where):
    directory = os.path.join(shm, "absent") if where == "absent" else "/sys"
    with caplog.at_level(logging.WARNING):
        assert open_cold_tier(directory, ident(), 4, BS, PAYLOAD) is None
    assert [r.levelno for r in caplog.records] == [logging.WARNING] and "cold tier off" in caplog.text


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs (needs mount privileges: root in CI); yields a remount function."""
    target = tmp_path / "mnt"
    target.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(target)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield str(target)
    subprocess.run(["umount", str(target)], capture_output=True)


def test_full_or_read_only_tmpfs_turns_the_tier_off(small_tmpfs, caplog):
    with caplog.at_level(logging.WARNING):
        assert open_cold_tier(small_tmpfs, ident(), 4, BS, PAYLOAD) is None  # 4 MiB on a 1 MiB tmpfs
    assert "No space left" in caplog.text and os.listdir(small_tmpfs) == []  # no half-made segment
    subprocess.run(["mount", "-o", "remount,ro", small_tmpfs], check=True)
    assert open_cold_tier(small_tmpfs, ident(), 1, BS, PAYLOAD) is None
    assert "Read-only" in caplog.text


def test_the_lock_is_the_kernels_so_a_killed_holder_frees_it(shm):
    t = tier(shm)
    fd = os.open(t.path, os.O_RDWR)
    with pytest.raises(BlockingIOError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    t.close()
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # closing (or dying) released it
    os.close(fd)


@pytest.mark.parametrize("planted", ["other owner", "group writable"])
def test_a_segment_planted_by_someone_else_is_never_read(shm, planted):
    mine = tier(shm)
    e = block(0)
    store(mine, e, 1)
    mine.close()
    if planted == "other owner":
        os.chown(mine.path, 65534, 65534)
    else:
        os.chmod(mine.path, 0o666)
    again = tier(shm)
    assert again.path.endswith("-1") and e.hash not in again  # a fresh segment of its own
    assert remove_unused(shm, keep=again.path) == ([] if planted == "other owner" else [mine.path])
    again.close()
