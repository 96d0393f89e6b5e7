"""The long-context reference model's training batches: corpus text, pass-key examples, chat answers.

Each batch row is seq_len + 1 tokens of one kind (a fixed share of the rows per kind):
  corpus   a window of the training token stream; next-token loss everywhere
  passkey  a pass-key example (tools/passkey.py) of log-uniform random length and uniform depth, its
           filler taken from the stream, then <|endoftext|> and more stream text; loss on the key's
           tokens (answer) and on the text around it (language), including the needle's second copy
           of the key, none on its first (random digits)
  chat     ChatML conversations of documentation Q/A pairs (tools/doc_qa.py), one after another,
           each ended by <|endoftext|>; loss on each answer and its <|im_end|> only
Rows come from a seeded generator: the same seed, stream and pairs give the same batches.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

import doc_qa
import passkey


@dataclass
class Batch:
    ids: torch.Tensor  # [B, S + 1] int64
    lm_mask: torch.Tensor  # [B, S] bool: targets scored as language modelling
    answer_mask: torch.Tensor  # [B, S] bool: targets that are answers (pass keys, chat answers)
    kinds: list[str]  # per row

    def to(self, device) -> "Batch":
        return Batch(self.ids.to(device, non_blocking=True), self.lm_mask.to(device, non_blocking=True),
                     self.answer_mask.to(device, non_blocking=True), self.kinds)


class Mix:
    def __init__(self, tok, stream: torch.Tensor, pairs: list, seq_len: int, seed: int,
                 passkey_share: float = 0.25, chat_share: float = 0.125, min_passkey_len: int = 128):
        self.encode = lambda text: tok.encode(text).ids
        self.eot = tok.token_to_id("<|endoftext|>")
        self.stream = stream.cpu().long()
        self.seq_len, self.rng = seq_len, random.Random(seed)
        self.shares = (passkey_share, chat_share)
        self.min_len = min(min_passkey_len, seq_len // 2)
        # every pair under every question wording, tokenized once: (prompt ids, answer ids)
        self.chats = [(self.encode(doc_qa.chat_prompt(p.question(v))), self.encode(p.answer + doc_qa.CHAT_END))
                      for p in pairs for v in range(len(doc_qa.TEMPLATES[p.kind]))]

    def batch(self, batch_size: int, kinds: list[str] | None = None) -> Batch:
        if kinds is None:
            n_pass = round(batch_size * self.shares[0]) if len(self.stream) > 2 * self.seq_len else 0
            n_chat = round(batch_size * self.shares[1]) if self.chats else 0
            kinds = ["passkey"] * n_pass + ["chat"] * n_chat + ["corpus"] * (batch_size - n_pass - n_chat)
        rows = [getattr(self, kind)() for kind in kinds]
        return Batch(torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]),
                     torch.stack([r[2] for r in rows]), kinds)

    def _text(self, n: int) -> torch.Tensor:
        start = self.rng.randint(0, len(self.stream) - n - 1)
        return self.stream[start:start + n]

    def corpus(self):
        S = self.seq_len
        return self._text(S + 1), torch.ones(S, dtype=torch.bool), torch.zeros(S, dtype=torch.bool)

    def passkey(self):
        S, rng = self.seq_len, self.rng
        key = passkey.random_key(rng)
        answer_len = len(self.encode(passkey.ANSWER.format(k=key)))
        # log-uniform: as many keys at 128-512 tokens as at 1K-4K, where retrieval is learnt first
        length = int(math.exp(rng.uniform(math.log(self.min_len), math.log(S - answer_len - 1))))
        ex = passkey.example(self.encode, self._text(length).tolist(), length, rng.random(), key)
        tail = S + 1 - length - len(ex.answer) - 1
        ids = torch.tensor(ex.prompt + ex.answer + [self.eot] + self._text(tail).tolist())
        lm, ans = torch.ones(S, dtype=torch.bool), torch.zeros(S, dtype=torch.bool)
        # no loss on the needle's first key (random digits); its second is a copy of the first, a short
        # retrieval the model learns first
        first_key_end = ex.needle_at + len(self.encode(passkey.NEEDLE.split("{k}")[0] + key))
        lm[max(0, ex.needle_at - 1):first_key_end - 1] = False
        lm[length - 1:length - 1 + len(ex.answer)] = False
        ans[length - 1:length - 1 + len(ex.answer)] = True  # target t predicts ids[t + 1]
        return ids, lm, ans

    def chat(self):
        S, ids, ans = self.seq_len, [], []
        while len(ids) < S + 1:
            prompt, answer = self.chats[self.rng.randrange(len(self.chats))]
            ids += prompt + answer + [self.eot]
            ans += [False] * len(prompt) + [True] * len(answer) + [False]
        ans_mask = torch.tensor(ans[1:S + 1])  # ans[i] marks token i; target t predicts token t + 1
        return torch.tensor(ids[:S + 1]), torch.zeros(S, dtype=torch.bool), ans_mask
