"""Soak: many requests of every kind (streamed, whole, cancelled, refused, dropped connections) from
several clients at once; every request gets exactly one final reply, and RSS, file descriptors,
threads and KV blocks end where they started. The default run sends 200; `-m reliability_long`
runs 10,000."""

import random
import threading
import time

import psutil
import pytest

from o3edge.ipc.client import O3Client, RequestError

CLIENTS = 4
TEXT = "The json module encodes and decodes JSON documents. The os module talks to the operating system. "


def one_request(client: O3Client, rng: random.Random, outcomes: dict) -> None:
    kind = rng.choice(("short", "short", "short", "cancel", "refused", "long"))
    try:
        if kind == "cancel":
            stream = client.stream(TEXT[:40], max_tokens=64, ignore_eos=True)
            for n, _ in enumerate(stream):
                if n == 2:
                    stream.close()  # cancels it; the cancelled reply is dropped by the client
                    break
            result = "cancelled"
        elif kind == "refused":
            client.generate(TEXT, max_tokens=4, temperature=-1.0)
            result = "done"
        elif kind == "long":
            result = client.generate(TEXT * 20, max_tokens=4).finish_reason
        else:
            result = client.generate(TEXT[:rng.randint(10, 90)], max_tokens=rng.randint(1, 16)).finish_reason
    except RequestError as exc:
        result = exc.code
    outcomes[result] = outcomes.get(result, 0) + 1


def soak(daemon, total: int, figures, name: str) -> None:
    proc = psutil.Process(daemon.proc.pid)
    done, lock, outcomes, errors = [0], threading.Lock(), {}, []

    def worker(seed: int, count: int) -> None:
        rng = random.Random(seed)
        client = O3Client(daemon.endpoint, timeout=30.0)
        try:
            for i in range(count):
                if i and i % 97 == 0:  # now and then a client goes away and a new one comes
                    client.close()
                    client = O3Client(daemon.endpoint, timeout=30.0)
                mine: dict = {}
                one_request(client, rng, mine)
                with lock:
                    for k, v in mine.items():
                        outcomes[k] = outcomes.get(k, 0) + v
                    done[0] += 1
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(repr(exc))
        finally:
            client.close()

    def sample():
        with O3Client(daemon.endpoint, timeout=30.0) as c:
            kv = c.stats()["kv_blocks_used"]
        return {"rss_mib": proc.memory_info().rss / 2**20, "fds": proc.num_fds(), "threads": proc.num_threads(),
                "kv_blocks_used": kv}

    warm = [threading.Thread(target=worker, args=(100 + i, 25)) for i in range(CLIENTS)]
    for t in warm:
        t.start()
    for t in warm:
        t.join()
    time.sleep(1.0)
    before = sample()
    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i, total // CLIENTS)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    time.sleep(1.5)  # connections closed by the last clients are reaped; the trimmer runs when idle
    after = sample()
    figures(name, requests=done[0], seconds=round(elapsed, 1), outcomes=outcomes, before=before, after=after)
    print(f"{name}: {done[0]} requests in {elapsed:.1f} s; {outcomes}; before {before}; after {after}")
    assert not errors, errors[:3]
    assert done[0] == total + 25 * CLIENTS
    assert outcomes.get("unavailable", 0) == 0 and outcomes.get("internal", 0) == 0
    assert after["kv_blocks_used"] == 0
    assert after["fds"] <= before["fds"] + 2 and after["threads"] <= before["threads"]
    assert after["rss_mib"] <= before["rss_mib"] * 1.05 + 8


def test_soak(rel_daemon, figures):
    soak(rel_daemon, 200, figures, "soak_200")


@pytest.mark.reliability_long
@pytest.mark.timeout(3600)
def test_soak_10000(rel_daemon, figures):
    soak(rel_daemon, 10_000, figures, "soak_10000")
