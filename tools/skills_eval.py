"""What the long-context reference model is for, measured: pass-key retrieval and chat answers.

Both take a `generate(ids, max_new) -> new ids` callable (greedy, stopping at the model's end
tokens), so the trainer checks its own PyTorch model and tools/eval_long_reference.py checks o3edge's
engine with the same cases:
  passkey  tools/passkey.py cases in held-out filler, by length and depth: a length L is a prompt of
           L - 8 tokens and 8 greedy tokens after it, so the whole case fits an L-token window; a
           length beyond the model's window is reported as None (not tried)
  chat     every held-out doc_qa pair asked as a ChatML user turn; exact match of the answer's words
           with the documented first sentence, and word-level F1
"""

from __future__ import annotations

import doc_qa
import passkey

LENGTHS = (512, 1024, 2048, 4096)
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
NEW_TOKENS = 8  # generated after a pass-key prompt


def passkey_accuracy(generate, encode, decode, filler: list[int], window: int, lengths=LENGTHS,
                     depths=DEPTHS, per_cell: int = 2, seed: int = 0) -> dict:
    """{"by_length": {L: share found or None}, "by_depth": {...}, "cells": [...], "found", "tried"}."""
    cells = []
    tried = [L - NEW_TOKENS for L in lengths if L <= window]
    for length, depth, ex in passkey.cases(encode, filler, tried, depths, per_cell, seed):
        text = decode(generate(ex.prompt, NEW_TOKENS))
        cells.append({"length": length + NEW_TOKENS, "depth": depth, "key": ex.key,
                      "found": passkey.found(ex.key, text), "output": text})

    def share(rows):
        return sum(r["found"] for r in rows) / len(rows) if rows else None

    return {"by_length": {L: share([c for c in cells if c["length"] == L]) for L in lengths},
            "by_depth": {d: share([c for c in cells if c["depth"] == d]) for d in depths},
            "found": sum(c["found"] for c in cells), "tried": len(cells), "cells": cells}


def chat_accuracy(generate, encode, decode, pairs: list, max_new: int = 64) -> dict:
    """{"n", "exact", "f1", "samples": the first five (question, expected, answer)}."""
    exact, f1, samples = 0, 0.0, []
    for p in pairs:
        got = decode(generate(encode(doc_qa.chat_prompt(p.question())), max_new)).split("<|im_end|>")[0].strip()
        e, f = doc_qa.score(p.answer, got)
        exact, f1 = exact + e, f1 + f
        if len(samples) < 5:
            samples.append({"question": p.question(), "expected": p.answer, "answer": got})
    n = max(1, len(pairs))
    return {"n": len(pairs), "exact": exact / n, "f1": f1 / n, "samples": samples}
