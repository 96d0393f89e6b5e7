"""The in-process API of the article: O3Model.from_config(O3Config(...)).generate(prompt=...).text"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Iterator

from o3edge.config import O3Config
from o3edge.engine.engine import LLMEngine, RequestOutput
from o3edge.engine.sequence import SamplingParams
from o3edge.errors import O3Error
from o3edge.model_path import resolve_model_path


@dataclass
class GenerationResult:
    """One finished generation: text, tokens, why it stopped, and how long it took."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length", or "error": this request failed in a step (the others went on)
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float  # submission to first token
    total_s: float

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        """Decode speed after the first token."""
        decode_s = self.total_s - self.ttft_s
        return (len(self.token_ids) - 1) / decode_s if len(self.token_ids) > 1 and decode_s > 0 else 0.0


class O3Model:
    """A loaded model that generates text in this process, by its config's policy (o3edge.policy):
    class limits, a bounded queue (a full one raises Busy) and request limits, as o3edged's."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: O3Config) -> "O3Model":
        return cls(LLMEngine(config, resolve_model_path(config.model_path)))

    def generate(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                 max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, stop: list[str] | tuple[str, ...] = ()) -> GenerationResult:
        """Generate a completion of a prompt, or the assistant's reply to chat messages."""
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, seed=seed, stop=tuple(stop))
        return self.generate_batch([self.engine.encode(prompt, messages)], params)[0]

    def generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationResult]:
        """Run several tokenized prompts together (continuous batching); results in input order."""
        starts, rids = time.perf_counter(), [f"local-{next(self._ids)}" for _ in prompts]
        try:
            for rid, ids in zip(rids, prompts):
                self.engine.add_request(rid, ids, params)
        except O3Error:  # one refused (a full queue, a bad prompt): none of the batch runs
            for rid in rids:
                self.engine.abort(rid)
            raise
        parts: dict[str, list[RequestOutput]] = {rid: [] for rid in rids}
        first: dict[str, float] = {}
        results: dict[str, GenerationResult] = {}
        while len(results) < len(rids):
            outputs, _ = self.engine.step()
            now = time.perf_counter()
            for out in outputs:
                if out.request_id not in parts:  # someone else's request on a shared engine
                    continue
                parts[out.request_id].append(out)
                first.setdefault(out.request_id, now)
                if out.finished:
                    results[out.request_id] = _result(parts[out.request_id], first[out.request_id] - starts,
                                                      now - starts)
        return [results[rid] for rid in rids]

    def stream(self, prompt: str | None = None, *, messages: list[dict] | None = None,
               **sampling) -> Iterator[RequestOutput]:
        """Yield each step's output for one request as it is produced."""
        rid = f"local-{next(self._ids)}"
        self.engine.add_request(rid, self.engine.encode(prompt, messages), SamplingParams(**sampling))
        try:
            while True:
                outputs, _ = self.engine.step()
                for out in outputs:
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(rid)


def _result(parts: list[RequestOutput], ttft: float, total: float) -> GenerationResult:
    last = parts[-1]
    return GenerationResult(text="".join(p.text for p in parts), token_ids=[t for p in parts for t in p.token_ids],
                            finish_reason=last.finish_reason, prompt_tokens=last.num_prompt_tokens,
                            cached_tokens=last.num_cached_tokens, ttft_s=ttft, total_s=total)
