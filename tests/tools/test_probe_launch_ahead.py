"""tools/probe_launch_ahead.py: one mark a decode step, as a user reading it for misses would need."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_lone_sequence_within_one_block_takes_every_step_after_the_first_from_the_queue():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, os.path.join(REPO, "tools", "probe_launch_ahead.py"), "--seqs", "1",
                          "--prompt-tokens", "16", "--new-tokens", "6"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    marks, summary = out.stdout.strip().splitlines()[-2:]
    # the first decode step has nothing queued before it; positions 16-20 stay in the first 32-token block
    assert marks == "-TTTT"
    assert summary == "4 of 5 decode steps taken from the launch-ahead queue"
