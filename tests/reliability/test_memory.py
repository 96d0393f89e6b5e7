"""Memory: RSS returns to its baseline after big inputs (it stayed ~400 MiB up before), the KV
cache is sized from max_num_seqs x max_model_len, and `info` says what RSS is made of."""

import psutil

from o3edge.config import O3Config
from o3edge.engine.engine import kv_blocks_needed
from o3edge.ipc.client import O3Client, RequestError
from tests.helpers import wait_for

TEXT = "The json module encodes and decodes JSON documents. The os module talks to the operating system. "


def test_rss_returns_to_baseline_after_big_inputs(rel_daemon, figures):
    proc = psutil.Process(rel_daemon.proc.pid)
    with O3Client(rel_daemon.endpoint, timeout=30.0) as c:
        c.generate("The json module", max_tokens=8)
        baseline = proc.memory_info().rss
        limit = c.info()["max_prompt_bytes"]
        text = TEXT * ((1 << 20) // len(TEXT) + 1)
        peak, outcomes = baseline, set()
        for _ in range(6):
            for size in ((1 << 20) - 256, limit - 10, 3000):  # refused by size, by tokens, and served
                try:
                    c.generate(text[:size], max_tokens=4)
                    outcomes.add("done")
                except RequestError as exc:
                    outcomes.add(exc.code)
                peak = max(peak, proc.memory_info().rss)
        assert outcomes == {"done", "prompt_too_long"}
        settled = wait_for(lambda: proc.memory_info().rss <= baseline * 1.10, 10.0, 0.25)
        mib = lambda n: round(n / 2**20, 1)  # noqa: E731
        print(f"RSS baseline {mib(baseline)} MiB, peak {mib(peak)}, after {mib(proc.memory_info().rss)}")
        memory = c.info()["memory"]
        figures("memory_after_big_inputs", baseline_mib=mib(baseline), peak_mib=mib(peak),
                after_mib=mib(proc.memory_info().rss), inputs=18, idle_breakdown=memory)
        assert settled, (mib(baseline), mib(peak), mib(proc.memory_info().rss), memory)
        assert memory["rss_mib"] > 0 and memory["anon_mib"] > 0 and memory["kv_cache_mib"] > 0
        assert memory["weights_mib"] > 0


def test_kv_cache_is_sized_from_the_batch_and_context_when_unset():
    block_bytes = 64 << 10
    config = O3Config(max_num_seqs=4, kv_block_size=32, kv_cache_memory_mb=256)
    assert kv_blocks_needed(config, 1024, block_bytes) == 4 * 32  # not 256 MiB worth (4096 blocks)
    big = O3Config(max_num_seqs=256, kv_block_size=32, kv_cache_memory_mb=64)
    assert kv_blocks_needed(big, 4096, block_bytes) == 64 * 16  # still capped by kv_cache_memory_mb
