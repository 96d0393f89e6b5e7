"""`python -m o3edge "prompt"`: one in-process generation on the built-in default model."""

import argparse
import sys

from o3edge import O3Config, O3Model


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m o3edge", description=__doc__)
    ap.add_argument("prompt", nargs="?", default="The json module")
    ap.add_argument("--model", default=None, help="checkpoint or engine directory (default: built-in)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    a = ap.parse_args()
    model = O3Model.from_config(O3Config(model_path=a.model, device=a.device))
    r = model.generate(a.prompt, max_new_tokens=a.max_tokens, temperature=a.temperature)
    print(a.prompt + r.text)
    print(f"[{r.prompt_tokens} prompt + {r.completion_tokens} completion tokens, TTFT {r.ttft_s * 1e3:.0f} ms, "
          f"{r.tokens_per_s:.1f} tokens/s, finish: {r.finish_reason}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
