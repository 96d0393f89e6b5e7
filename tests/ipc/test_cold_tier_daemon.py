"""The KV cold tier in a real o3edged: a long system prompt survives kill -9; an unusable /dev/shm is no outage."""

import os
import signal
import subprocess
import sys


from conftest import REPO, DaemonProcess, clean_env, wait_for
from o3edge.engine.tokenizer import Tokenizer
from o3edge.ipc.client import O3Client
from o3edge.tiny import corpus


def cold_daemon(directory, model_dir, cold_dir, name="o3.sock", size_mb=64) -> DaemonProcess:
    d = DaemonProcess(str(directory), model_dir, name)
    with open(d.config, "a") as fh:
        fh.write(f'[kv]\ncold_tier_mb = {size_mb}\ncold_tier_dir = "{cold_dir}"\n')
    return d


def system_prompt(model_dir, tokens=2000) -> str:
    """About `tokens` tokens of text, ending on a question."""
    tok, text = Tokenizer(model_dir), ""
    for line in corpus(400):
        if len(tok.encode(text + line)) > tokens:
            break
        text += line + "\n"
    return text


def stats(d: DaemonProcess) -> dict:
    with O3Client(d.endpoint, timeout=10) as c:
        return c.stats()


def answer_then_kill_9(first: DaemonProcess, prompt: str, max_tokens: int = 8, check=None):
    """Start `first`, answer `prompt` (no cold hit yet), wait until its full blocks are in the cold tier, then
    kill -9 it; check(daemon) runs while it serves. -> (the answer, its full blocks)."""
    first.start()
    try:
        first.wait_ready(timeout=120)
        with O3Client(first.endpoint, timeout=60) as c:
            before = c.generate(prompt, max_tokens=max_tokens, ignore_eos=True)
        assert before.usage["prompt_tokens"] >= 1900 and before.usage["cold_tokens"] == 0
        if check is not None:
            check(first)
        full_blocks = before.usage["prompt_tokens"] // 32
        assert wait_for(lambda: stats(first)["cold_blocks"] >= full_blocks, timeout=20)  # offloaded meanwhile
        first.proc.kill()
        assert first.proc.wait() == -signal.SIGKILL
    finally:
        first.stop()
    return before, full_blocks


def test_kill_9_then_restart_serves_a_2000_token_system_prompt_from_the_cold_tier(tmp_path, tiny_dir, shm):
    prompt = system_prompt(tiny_dir)
    before, full_blocks = answer_then_kill_9(cold_daemon(tmp_path, tiny_dir, shm), prompt)
    second = cold_daemon(tmp_path, tiny_dir, shm).start()
    try:
        second.wait_ready()
        assert "re-attached" in second.log()
        with O3Client(second.endpoint, timeout=60) as c:
            info = c.info()
            assert info["cold_tier"] == os.path.join(shm, f"o3edge-{info['cache_identity']}-0")
            after = c.generate(prompt, max_tokens=8, ignore_eos=True)
            figures = c.stats()
        assert after.token_ids == before.token_ids
        assert after.usage["cold_tokens"] == after.usage["cached_tokens"] >= full_blocks * 32 - 32
        assert figures["cold_hit_tokens"] == after.usage["cold_tokens"] and figures["cold_checksum_failures"] == 0
    finally:
        assert second.stop() == 0
    # --drop-cold-tier: the next start begins empty
    log = open(tmp_path / "third.log", "ab")
    third = subprocess.Popen([sys.executable, "-m", "o3edge.daemon", "--config", second.config, "--drop-cold-tier"],
                             cwd=REPO, env=clean_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        second.proc = third
        second.wait_ready()
        assert stats(second)["cold_blocks"] == 0
    finally:
        second._log = log
        assert second.stop() == 0
    assert "dropped the KV cold tier: " + shm in (tmp_path / "third.log").read_text()


def test_unusable_shared_memory_turns_the_tier_off_and_the_daemon_serves(tmp_path, tiny_dir):
    d = cold_daemon(tmp_path, tiny_dir, "/sys/fs/o3edge-nowhere").start()
    try:
        d.wait_ready()
        with O3Client(d.endpoint, timeout=30) as c:
            done = c.generate("import os", max_tokens=4, ignore_eos=True)
            assert done.completion_tokens == 4 and done.usage["cold_tokens"] == 0
            assert c.stats()["cold_tier"] == "off"
    finally:
        d.stop()
    assert d.log().count("cold tier off") == 1


def test_a_daemon_with_the_tier_off_removes_what_is_left_and_creates_nothing(tmp_path, tiny_dir, shm):
    from o3edge.engine.cold_tier import ColdTier
    left = ColdTier(shm, bytes(16), 1 << 20, 32, 4096)  # a segment from an earlier configuration
    left.close()
    d = cold_daemon(tmp_path, tiny_dir, shm, size_mb=0).start()
    try:
        d.wait_ready()
        assert stats(d)["cold_tier"] == "off"
    finally:
        d.stop()
    assert os.listdir(shm) == [] and "removed unused KV cold-tier segments" in d.log()
