"""Pass-key retrieval: a random key hidden at a chosen depth of filler text, asked for at the end.

The same text as tools/bench_router.py's needle: "The pass key is 12345. Remember it. The pass key is
12345." somewhere in the filler, then "What is the pass key? The pass key is" at the end; the answer
is " 12345." The trainer makes training examples with it (filler from the training split), the
evaluator makes test cases (filler from the held-out split); both see exactly these token layouts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

NEEDLE = "The pass key is {k}. Remember it. The pass key is {k}.\n"
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER = " {k}."


@dataclass
class Example:
    prompt: list[int]  # filler with the needle inside, then the question
    answer: list[int]  # the key's tokens, which the model must produce next
    key: str
    needle_at: int  # index in prompt of the needle's first token


def random_key(rng: random.Random) -> str:
    return str(rng.randint(10000, 99999))


def example(encode: Callable[[str], list[int]], filler: list[int], length: int, depth: float,
            key: str) -> Example:
    """A prompt of exactly `length` tokens (filler[:...] cut at `depth` of its length, the needle
    there, the question last); filler must hold at least `length` tokens."""
    needle, question = encode(NEEDLE.format(k=key)), encode(QUESTION)
    body = filler[:length - len(needle) - len(question)]
    if len(body) + len(needle) + len(question) != length:
        raise ValueError(f"filler of {len(filler)} tokens is too short for a {length}-token prompt")
    cut = int(len(body) * depth)
    return Example(body[:cut] + needle + body[cut:] + question, encode(ANSWER.format(k=key)), key, cut)


def cases(encode, filler: list[int], lengths, depths, per_cell: int, seed: int = 0) -> list[tuple]:
    """(length, depth, Example) for every length x depth, per_cell keys each, filler taken from
    different offsets so cells do not share text; deterministic in seed."""
    rng, out = random.Random(seed), []
    for length in lengths:
        for depth in depths:
            for _ in range(per_cell):
                start = rng.randint(0, max(0, len(filler) - length))
                out.append((length, depth, example(encode, filler[start:], length, depth, random_key(rng))))
    return out


def found(key: str, generated_text: str) -> bool:
    """Whether the first number in the continuation is the key (spaces ignored, as bench_router does)."""
    digits = "".join(ch for ch in generated_text.replace(" ", "").split(".")[0] if ch.isdigit())
    return digits == key
