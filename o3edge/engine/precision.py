"""The precision-alignment report: an engine's logits and greedy tokens against a reference engine.

As the article's table: the L2 norm of the output logits for the reference and the engine, their
relative error and top-1 agreement; extended with the mean KL divergence and greedy-token
agreement over a fixed prompt set. Logits are compared teacher-forced over each prompt followed
by the reference's own greedy continuation, so both models see the same tokens everywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from o3edge.engine.sequence import SamplingParams

PROMPTS = (
    "The quick brown fox jumps over the lazy dog. Then",
    "import os\nimport sys\n\ndef main(argv):\n",
    "Edge devices run language models when the network is slow or absent, so",
    "class Queue:\n    \"\"\"A first-in, first-out queue.\"\"\"\n\n    def __init__(self):",
    "Question: what is the capital of France?\nAnswer:",
    "for i in range(10):\n    if i % 3 == 0:",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
)


@dataclass(frozen=True)
class PrecisionReport:
    """Logit and greedy-token agreement of an engine with a reference (see module docstring)."""

    reference: str  # what each side was, e.g. "float32" / "bfloat16 + int4 g128"
    engine: str
    num_prompts: int
    num_new_tokens: int  # greedy tokens generated per prompt
    num_positions: int  # logit rows compared
    ref_logits_l2: float  # mean over positions of ||reference logits||_2
    engine_logits_l2: float  # mean over positions of ||engine logits||_2
    relative_error: float  # ||E - R||_F / ||R||_F over all positions
    top1_agreement: float  # fraction of positions whose argmax agrees
    kl_mean: float  # mean KL(reference || engine) per position, nats
    greedy_agreement: float  # fraction of generated tokens equal position by position
    greedy_prefix: float  # mean length of the common prefix, as a fraction of num_new_tokens
    greedy_identical: int  # prompts whose whole greedy continuation is identical

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def rows(self) -> list[tuple[str, str, str]]:
        """(metric, reference, engine) rows, as the article's table lays them out."""
        return [
            ("logits L2 norm (mean per position)", f"{self.ref_logits_l2:.4f}", f"{self.engine_logits_l2:.4f}"),
            ("relative error ||E-R||/||R||", "-", f"{self.relative_error:.4%}"),
            ("top-1 agreement", "-", f"{self.top1_agreement:.2%}"),
            ("mean KL(ref || engine), nats", "-", f"{self.kl_mean:.5f}"),
            (f"greedy tokens agreeing ({self.num_prompts} x {self.num_new_tokens})", "-",
             f"{self.greedy_agreement:.2%}"),
            ("greedy common prefix", "-", f"{self.greedy_prefix:.2%}"),
            ("greedy continuations identical", "-", f"{self.greedy_identical}/{self.num_prompts}"),
        ]

    def format(self) -> str:
        """A plain-text table (logs, the CLI without a terminal)."""
        head = [("metric", self.reference, self.engine)]
        width = [max(len(r[i]) for r in head + self.rows()) for i in range(3)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip() for r in head + self.rows())


def describe(engine) -> str:
    """A short name for an engine's precision: dtype plus INT4 group size if any."""
    from o3edge.engine.cpu_quant import int8_tag
    from o3edge.engine.quant import int4_tag

    if hasattr(engine, "describe"):  # another runtime (an exported model)
        return engine.describe()
    model = engine.runner.model
    return engine.info.dtype + (int4_tag(model) + int8_tag(model)).replace(":int4g", " + int4 g").replace(
        ":int8", " + int8")


def greedy_tokens(engine, prompts: list[list[int]], num_new_tokens: int) -> list[list[int]]:
    """num_new_tokens greedy tokens for each prompt, all run as one batch (EOS ignored)."""
    if hasattr(engine, "greedy"):  # another runtime decodes by itself
        return engine.greedy(prompts, num_new_tokens)
    params = SamplingParams(max_new_tokens=num_new_tokens, ignore_eos=True)
    rids = [f"precision-{i}" for i in range(len(prompts))]
    out: dict[str, list[int]] = {rid: [] for rid in rids}
    for rid, ids in zip(rids, prompts):
        engine.add_request(rid, ids, params)
    while engine.has_unfinished_requests():
        for o in engine.step()[0]:
            out[o.request_id] += o.token_ids
    return [out[rid] for rid in rids]


def alignment_report(reference, engine, prompts: tuple[str, ...] = PROMPTS,
                     num_new_tokens: int = 32) -> PrecisionReport:
    """Compare two idle LLMEngines of the same model (and tokenizer) on a fixed prompt set."""
    ids = [reference.encode(p) for p in prompts]
    ref_greedy = greedy_tokens(reference, ids, num_new_tokens)
    eng_greedy = greedy_tokens(engine, ids, num_new_tokens)
    sums = dict(positions=0, ref_l2=0.0, eng_l2=0.0, diff2=0.0, ref2=0.0, top1=0, kl=0.0)
    for prompt, cont in zip(ids, ref_greedy):
        r, e = reference.score(prompt + cont).double(), engine.score(prompt + cont).double()  # [n, V]
        sums["positions"] += r.shape[0]
        sums["ref_l2"] += r.norm(dim=-1).sum().item()
        sums["eng_l2"] += e.norm(dim=-1).sum().item()
        sums["diff2"] += (e - r).pow(2).sum().item()
        sums["ref2"] += r.pow(2).sum().item()
        sums["top1"] += (r.argmax(-1) == e.argmax(-1)).sum().item()
        logp, logq = r.log_softmax(-1), e.log_softmax(-1)
        sums["kl"] += (logp.exp() * (logp - logq)).sum().item()
    n = sums["positions"]
    agree = [sum(a == b for a, b in zip(x, y)) for x, y in zip(ref_greedy, eng_greedy)]
    prefix = [_common_prefix(x, y) for x, y in zip(ref_greedy, eng_greedy)]
    return PrecisionReport(
        reference=describe(reference), engine=describe(engine), num_prompts=len(ids),
        num_new_tokens=num_new_tokens, num_positions=n, ref_logits_l2=sums["ref_l2"] / n,
        engine_logits_l2=sums["eng_l2"] / n, relative_error=(sums["diff2"] / sums["ref2"]) ** 0.5,
        top1_agreement=sums["top1"] / n, kl_mean=sums["kl"] / n,
        greedy_agreement=sum(agree) / (len(ids) * num_new_tokens),
        greedy_prefix=sum(prefix) / (len(ids) * num_new_tokens),
        greedy_identical=sum(p == num_new_tokens for p in prefix))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def compare_with_checkpoint(engine_dir: str, source_dir: str, device: str = "cpu", num_new_tokens: int = 32,
                            prompts: tuple[str, ...] = PROMPTS) -> PrecisionReport:
    """The report of an engine directory against the float32 engine of its source checkpoint."""
    from o3edge.config import O3Config
    from o3edge.engine.engine import LLMEngine

    settings = dict(device=device, kv_cache_memory_mb=64, max_model_len=1024, cuda_graphs=False)
    reference = LLMEngine(O3Config(model_path=source_dir, dtype="float32", **settings), source_dir)
    candidate = LLMEngine(O3Config(model_path=engine_dir, **settings), engine_dir)
    return alignment_report(reference, candidate, prompts, num_new_tokens)
