#!/usr/bin/env python3
"""Make a small random-weight Hugging Face checkpoint (tests, CI, benchmarks).

  python tools/make_tiny_model.py OUT_DIR [--family llama|qwen2|qwen3] [--shape tiny|smol-135m|llama-1b|tinyllama-1.1b]
"""

import argparse
import sys
import time

sys.path.insert(0, __file__.rsplit("/tools/", 1)[0])

from o3edge.tiny import make_checkpoint  # noqa: E402

SHAPES = {
    "tiny": {},
    "smol-135m": dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536,
                      vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5),
    "llama-1b": dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192,
                     vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=131072,
                     rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "tinyllama-1.1b": dict(hidden_size=2048, num_layers=22, num_heads=32, num_kv_heads=4, intermediate_size=5632,
                           vocab_size=32000, tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-5),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--family", choices=["llama", "qwen2", "qwen3"], default="llama")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=1)
    a = ap.parse_args()
    t0 = time.time()
    print(f"making {a.shape} ({a.family}) in {a.out_dir} ...", flush=True)
    make_checkpoint(a.out_dir, seed=a.seed, num_shards=a.shards, family=a.family, **SHAPES[a.shape])
    print(f"done in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
