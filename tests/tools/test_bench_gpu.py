"""tools/bench_gpu.py: llama.cpp's figures parsed from the peer script's logs."""

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

bench_gpu = pytest.importorskip("tools.bench_gpu")

# the energy phase's log as .peer/run.sh energy writes it (docs/results/gpu-2026-12-05e/call3/)
ENERGY_LOG = """== energy Q4_0 npl=1 ntg=2048
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|   128 |   2048 |    1 |   2176 |    0.022 |  5703.08 |    2.263 |   905.13 |    2.285 |   952.26 |
ENERGY joules=761.7 wall_s=3.07 avg_W=248
== energy Q4_0 npl=32 ntg=1024
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|   128 |   1024 |   32 |  36864 |    0.114 | 35873.18 |    3.832 |  8551.02 |    3.946 |  9341.55 |
ENERGY joules=1015.8 wall_s=4.65 avg_W=219
== energy: load only (ntg 1)
ENERGY joules=89.0 wall_s=0.69 avg_W=129
"""


def test_an_energy_log_alone_gives_decode_speed_and_tokens_per_joule(tmp_path):
    """Without a bench log, each energy run's own batched-bench row gives the decode speed, and its joules less
    the load-only run's give tokens per joule: the table of the H200's same-run comparison can be made."""
    log = tmp_path / "llamacpp-energy.log"
    log.write_text(ENERGY_LOG)
    out = bench_gpu.parse_llamacpp(str(log), str(log))
    q4 = out["llama.cpp Q4_0"]
    assert q4["b1"]["tok_s"] == pytest.approx(905.13)
    assert q4["b1"]["tok_j"] == pytest.approx(2048 / (761.7 - 89.0))
    assert q4["b32"]["tok_s"] == pytest.approx(8551.02)
    assert q4["b32"]["tok_j"] == pytest.approx(32 * 1024 / (1015.8 - 89.0))
    r = dict(shape="tinyllama-1.1b", dtype="float16", gpu="NVIDIA H200", date="2026-12-05",
             systems={"o3edge INT4 (all linears)": {"ttft_ms": 3.1, "b1": dict(tok_s=2154.4, tok_j=4.67),
                                                     "b32": dict(tok_s=25214.5, tok_j=47.6)}, **out},
             floor_ms={"o3edge INT4 (all linears)": 0.114})
    table = bench_gpu.table(r, [1, 32])
    assert "| llama.cpp Q4_0 | — | 905 (3.0) | 8,551 (35.4) |" in table
    assert "o3edge INT4 (all linears) / llama.cpp Q4_0: b=1 2.38x, b=32 2.95x" in table
    assert "o3edge INT4 (all linears) / llama.cpp Q4_0, tokens per joule: b=1 1.53x, b=32 1.35x" in table
