#!/usr/bin/env python3
"""Train o3edge's reference model: a small Llama with its own byte-level BPE, on the Python docs.

  python tools/train_reference.py --device cuda --out OUT_DIR            # the shipped model (GPU, minutes)
  python tools/train_reference.py --tiny --device cpu --steps 40 --out D  # the test suite's smoke run
  python tools/train_reference.py --shape long --device cuda --out OUT_DIR  # 4,096-token window, chat

--shape long trains the long-context model: a 4,096-token window (RoPE base 100,000) on a mix of the
corpus packed into 4,096-token rows, pass-key retrieval examples and chat-formatted documentation
Q/A pairs (tools/long_mix.py), keeps the checkpoint with the best validation language + answer loss,
and reports pass-key accuracy by length and depth and chat accuracy on held-out names
(tools/skills_eval.py).

Data: tools/reference_corpus.py (the packed corpus in .corpus/ when present, else this machine's
python3.X-doc reST sources and stdlib docstrings). Output: a Hugging Face checkpoint that transformers
loads (LlamaForCausalLM, model.safetensors, tokenizer.json, ChatML template). The checkpoint with
the best validation loss is kept; held-out figures are reported on a separate split. Same seed, data
and machine give the same run (bitwise on CPU; CUDA kernels may differ in the last bits).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TOOLS))
sys.path.insert(0, TOOLS)

import doc_qa  # noqa: E402
import reference_corpus  # noqa: E402
import skills_eval  # noqa: E402
from long_mix import Mix  # noqa: E402
from o3edge.tiny import CHATML, SPECIALS, hf_config, save_weights, train_tokenizer  # noqa: E402

log = logging.getLogger("train_reference")

# Multiples of 128 everywhere so INT4 group sizes 32/64/128 divide every FFN input dimension.
SHAPES = {
    "ref": dict(vocab_size=6144, hidden_size=384, num_layers=5, num_heads=6, num_kv_heads=2,
                intermediate_size=896, seq_len=1024, batch_size=32, lr=1.5e-3, dropout=0.15, steps=3000),
    "tiny": dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=128, seq_len=64, batch_size=8, lr=3e-3, dropout=0.0, steps=40),
    # 25.7 M parameters: ~27 MB as bf16 attention + INT4 FFN (group 32), within the 40 MB the issue allows
    "long": dict(vocab_size=6144, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2,
                 intermediate_size=1408, seq_len=4096, batch_size=16, lr=1e-3, dropout=0.1, steps=4500,
                 rope_theta=100000.0, long=True),
    "tiny-long": dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=128, seq_len=256, batch_size=8, lr=3e-3, dropout=0.0, steps=20,
                      rope_theta=100000.0, long=True),
}
ROPE_THETA = 10000.0  # the shapes' default
RMS_EPS = 1e-5


# ---- the model: Hugging Face Llama, named as its checkpoints are (prefix "model.") ---------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + RMS_EPS)).to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, s: dict):
        super().__init__()
        D, H, KV = s["hidden_size"], s["num_heads"], s["num_kv_heads"]
        self.H, self.KV, self.hd, self.dropout = H, KV, D // H, s["dropout"]
        self.q_proj = nn.Linear(D, H * self.hd, bias=False)
        self.k_proj = nn.Linear(D, KV * self.hd, bias=False)
        self.v_proj = nn.Linear(D, KV * self.hd, bias=False)
        self.o_proj = nn.Linear(H * self.hd, D, bias=False)

    def forward(self, x, cos, sin):
        B, S, _ = x.shape  # x: [B, S, D]; cos, sin: [S, hd]
        q = self.q_proj(x).view(B, S, self.H, self.hd).transpose(1, 2)  # [B, H, S, hd]
        k = self.k_proj(x).view(B, S, self.KV, self.hd).transpose(1, 2)  # [B, KV, S, hd]
        v = self.v_proj(x).view(B, S, self.KV, self.hd).transpose(1, 2)
        q = (q * cos + rotate_half(q) * sin).to(v.dtype)
        k = (k * cos + rotate_half(k) * sin).to(v.dtype)
        rep = self.H // self.KV
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, s: dict):
        super().__init__()
        D, Fd = s["hidden_size"], s["intermediate_size"]
        self.gate_proj = nn.Linear(D, Fd, bias=False)
        self.up_proj = nn.Linear(D, Fd, bias=False)
        self.down_proj = nn.Linear(Fd, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, s: dict):
        super().__init__()
        self.input_layernorm = RMSNorm(s["hidden_size"])
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s["hidden_size"])
        self.mlp = MLP(s)
        self.drop = nn.Dropout(s["dropout"])

    def forward(self, x, cos, sin):
        x = x + self.drop(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.drop(self.mlp(self.post_attention_layernorm(x)))


class Llama(nn.Module):
    """Tied-embedding Llama decoder; logits [B, S, V]."""

    def __init__(self, s: dict):
        super().__init__()
        self.embed_tokens = nn.Embedding(s["vocab_size"], s["hidden_size"])
        self.layers = nn.ModuleList(Block(s) for _ in range(s["num_layers"]))
        self.norm = RMSNorm(s["hidden_size"])
        hd = s["hidden_size"] // s["num_heads"]
        inv_freq = 1.0 / s.get("rope_theta", ROPE_THETA) ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        freqs = torch.outer(torch.arange(s["seq_len"], dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [S, hd], the rotate_half layout HF uses
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self._init(s["num_layers"])

    def _init(self, num_layers: int):
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * num_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, ids):
        S = ids.shape[1]
        x = self.embed_tokens(ids)  # [B, S, D]
        for layer in self.layers:
            x = layer(x, self.cos[:S], self.sin[:S])
        return F.linear(self.norm(x), self.embed_tokens.weight)


def hf_tensors(model: Llama, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """State dict under Hugging Face names (lm_head is tied, so absent)."""
    return {"model." + k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}


# ---- data -------------------------------------------------------------------------------------
def tokenize(tok, docs: dict[str, str]) -> torch.Tensor:
    """All documents as one stream, each followed by <|endoftext|> (id 0)."""
    eot = tok.token_to_id(SPECIALS[0])
    ids = []
    for enc in tok.encode_batch(list(docs.values())):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int32)


def windows(stream: torch.Tensor, seq_len: int, max_tokens: int | None) -> torch.Tensor:
    """Non-overlapping evaluation windows [N, seq_len]."""
    if max_tokens:
        stream = stream[:max_tokens]
    n = len(stream) // seq_len
    return stream[: n * seq_len].view(n, seq_len).long()


@torch.no_grad()
def mean_loss(model, wins: torch.Tensor, device, autocast, batch: int) -> float:
    """Mean next-token loss over the windows (each window's first token has no context)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(wins), batch):
        x = wins[i:i + batch].to(device)
        with autocast():
            logits = model(x[:, :-1])
        total += F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        count += x[:, 1:].numel()
    model.train(was_training)
    return total / count


# ---- checkpoint -------------------------------------------------------------------------------
def save_checkpoint(out: str, model: Llama, s: dict, tok, dtype: torch.dtype) -> None:
    """config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json."""
    os.makedirs(out, exist_ok=True)
    spec = dict(family="llama", max_position_embeddings=s["seq_len"], tie_word_embeddings=True,
                rope_theta=s.get("rope_theta", ROPE_THETA), rms_norm_eps=RMS_EPS,
                **{k: s[k] for k in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                     "intermediate_size")})
    cfg = hf_config(spec)
    eot, im_end = tok.token_to_id(SPECIALS[0]), tok.token_to_id(SPECIALS[2])
    cfg.update(bos_token_id=eot, eos_token_id=eot, torch_dtype=str(dtype).removeprefix("torch."))
    _write_json(os.path.join(out, "config.json"), cfg)
    _write_json(os.path.join(out, "generation_config.json"),
                {"bos_token_id": eot, "eos_token_id": [eot, im_end], "do_sample": False})
    tok.save(os.path.join(out, "tokenizer.json"))
    _write_json(os.path.join(out, "tokenizer_config.json"),
                {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0], "eos_token": SPECIALS[0],
                 "pad_token": SPECIALS[0], "chat_template": CHATML, "model_max_length": s["seq_len"],
                 "add_bos_token": False, "clean_up_tokenization_spaces": False})
    save_weights(hf_tensors(model, dtype), out)


def _write_json(path: str, value: dict) -> None:
    with open(path, "w") as fh:
        json.dump(value, fh, indent=1)
        fh.write("\n")


@torch.no_grad()
def greedy_ids(model, ids: list[int], n: int, stop: set[int], device, autocast) -> list[int]:
    """Greedy new tokens (no KV cache), ending after a stop token."""
    model.eval()
    out = []
    for _ in range(n):
        x = torch.tensor([(ids + out)[-model.cos.shape[0]:]], device=device)
        with autocast():
            out.append(int(model(x)[0, -1].argmax()))
        if out[-1] in stop:
            break
    return out


def greedy(model, tok, prompt: str, n: int, device) -> str:
    """Plain greedy continuation (no KV cache): a sanity sample for the log."""
    ids = tok.encode(prompt).ids
    return tok.decode(ids + greedy_ids(model, ids, n, set(), device, contextlib.nullcontext))


# ---- training ---------------------------------------------------------------------------------
def lr_at(step: int, total: int, warmup: int, peak: float) -> float:
    """Linear warm-up, then cosine down to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def make_optimizer(model: Llama, lr: float, device: torch.device) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def train_loss(step_fn, chunk, autocast) -> torch.Tensor:
    if not isinstance(chunk, torch.Tensor):  # a long_mix.Batch: language loss + answer loss
        return sum(mix_losses(step_fn, chunk, autocast))
    with autocast():
        logits = step_fn(chunk[:, :-1])  # [B, S, V]
    return F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())


def mix_losses(step_fn, b, autocast) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss over language targets, answer loss) of a long_mix.Batch. The answer loss is the mean
    over rows with answers of each row's mean, so a pass key's 4 answer tokens weigh as much as a chat
    row's ~2,000."""
    ids = b.ids
    with autocast():
        logits = step_fn(ids[:, :-1])  # [B, S, V]
    ce = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(ids.shape[0], -1)
    lm, ans = b.lm_mask.to(ce), b.answer_mask.to(ce)  # [B, S]
    per_row = (ce * ans).sum(1) / ans.sum(1).clamp(min=1)
    has = (ans.sum(1) > 0).to(ce)
    return (ce * lm).sum() / lm.sum().clamp(min=1), (per_row * has).sum() / has.sum().clamp(min=1)


def validation_batches(a, s: dict, d) -> list:
    """Fixed pass-key and chat batches from the validation text and Q/A pairs (two batches' worth)."""
    stream = d.valid.flatten()
    if len(stream) < 2 * s["seq_len"] + 2 or not d.pairs[1]:
        return []
    vmix = Mix(d.tok, stream, d.pairs[1], s["seq_len"], a.seed + 1)
    half = s["batch_size"] // 2
    kinds = ["passkey"] * half + ["chat"] * (s["batch_size"] - half)
    return [vmix.batch(s["batch_size"], kinds).to(d.train_ids.device) for _ in range(2)]


@torch.no_grad()
def mean_answer_loss(model, batches: list, device, autocast) -> float:
    was_training = model.training
    model.eval()
    loss = sum(mix_losses(model, b, autocast)[1].item() for b in batches) / len(batches)
    model.train(was_training)
    return loss


def fit_budget(max_minutes: float | None, t_start: float, per_step: float, done: int, steps: int) -> int:
    """Total steps that fit the time budget (judged from step 50 on, when the step time is steady)."""
    if not max_minutes or not per_step:
        return steps
    left = max_minutes * 60 - (time.time() - t_start)
    if left <= 0:
        log.warning("time budget spent at step %d; stopping", done)
        return done
    fits = done + int(0.9 * left / per_step)
    if done >= 50 and fits < steps:
        log.warning("time budget: %.2f s/step fits %d of %d steps; schedule shortened", per_step, fits, steps)
        return fits
    return steps


def fmt_time(seconds: float) -> str:
    return f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"


@dataclass
class Data:
    """The tokenizer and every split as tokens: a training stream and evaluation windows."""

    source: str | None  # the packed corpus read, or None for this machine's own files
    tok: object
    train_ids: torch.Tensor  # [N] int32, on the training device
    valid: torch.Tensor  # [W, S] validation windows (checkpoint selection)
    held_all: torch.Tensor  # [W, S] every held-out document
    held_doc: torch.Tensor | None  # [W, S] the held-out documentation pages alone
    num_docs: tuple[int, int, int]  # train, validation, held out
    pairs: tuple = ([], [], [])  # doc_qa pairs (train, validation, held out), long shapes only


def load_data(a, s: dict, device: torch.device) -> Data:
    t0 = time.time()
    source = a.data or (reference_corpus.DEFAULT_PACK if os.path.exists(reference_corpus.DEFAULT_PACK) else None)
    docs = reference_corpus.load(source, tuple(a.sources.split(",")))
    if a.max_docs:
        docs = dict(sorted(docs.items())[: a.max_docs])
    train_docs, valid_docs, held_docs = reference_corpus.split(docs)
    # the tokenizer reads prose and docstrings, not src/ code: the same vocabulary whatever code is added
    # (long: digits one token each, so a pass key is five tokens wherever it stands)
    tok = train_tokenizer(s["vocab_size"], [t for p, t in train_docs.items() if not p.startswith("src/")],
                          split_digits=bool(s.get("long")))
    held_doc_pages = {p: t for p, t in held_docs.items() if p.startswith("docs/")}
    d = Data(source, tok, tokenize(tok, train_docs).to(device),
             windows(tokenize(tok, valid_docs), s["seq_len"], a.eval_tokens),
             windows(tokenize(tok, held_docs), s["seq_len"], a.eval_tokens),
             windows(tokenize(tok, held_doc_pages), s["seq_len"], a.eval_tokens) if held_doc_pages else None,
             (len(train_docs), len(valid_docs), len(held_docs)))
    if d.held_doc is not None and not len(d.held_doc):  # held-out pages shorter than one window
        d.held_doc = None
    if s.get("long"):
        d.pairs = doc_qa.split(doc_qa.pairs(train_docs))
        log.info("doc Q/A pairs: %d train, %d validation, %d held out", *map(len, d.pairs))
    log.info("data: %d train docs, %d train tokens; validation %d docs, %d windows; held out %d docs, %d windows "
             "of %d tokens; %.1fs", d.num_docs[0], len(d.train_ids), d.num_docs[1], len(d.valid), d.num_docs[2],
             len(d.held_all), s["seq_len"], time.time() - t0)
    return d


@dataclass
class Run:
    """What the training loop did."""

    steps: int
    best_valid_loss: float = float("inf")
    best_step: int = -1
    history: list = field(default_factory=list)  # {"step", "loss"} at each progress line
    evals: list = field(default_factory=list)  # {"step", "valid_loss"}


def fit(a, s: dict, model: Llama, d: Data, steps: int, device: torch.device, t_start: float) -> Run:
    """The training loop; saves the checkpoint to a.out whenever the validation loss improves."""
    mix = Mix(d.tok, d.train_ids, d.pairs[0], s["seq_len"], a.seed) if s.get("long") else None
    val_batches = validation_batches(a, s, d) if mix else []
    opt = make_optimizer(model, s["lr"], device)
    autocast = autocast_for(device)
    step_fn = torch.compile(model) if a.compile else model
    gen = torch.Generator().manual_seed(a.seed)
    offs = torch.arange(s["seq_len"] + 1, device=device)
    warmup = min(100, max(1, steps // 10))
    tokens_per_step = s["batch_size"] * s["seq_len"]
    run = Run(steps)
    t_first = None  # end of the first (compiling) step: speeds are measured from there
    model.train()
    for step in range(steps):
        if mix:
            chunk = mix.batch(s["batch_size"]).to(device)
        else:
            starts = torch.randint(0, len(d.train_ids) - s["seq_len"] - 1, (s["batch_size"],), generator=gen)
            chunk = d.train_ids[starts.to(device)[:, None] + offs].long()  # [B, S+1]
        lr = lr_at(step, steps, warmup, s["lr"])
        for g in opt.param_groups:
            g["lr"] = lr
        try:
            loss = train_loss(step_fn, chunk, autocast)
        except Exception as exc:  # a compiler failure must not cost the run
            if step_fn is model:
                raise
            log.warning("torch.compile failed (%s); training eagerly", str(exc).splitlines()[0][:200])
            step_fn = model
            loss = train_loss(step_fn, chunk, autocast)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

        done = step + 1
        if done == 1 or done % a.log_every == 0 or done == steps:
            loss_v = loss.item()
            now = time.time()
            t_first = t_first or now
            per_step = (now - t_first) / (done - 1) if done > 1 else 0.0
            log.info("step %d/%d loss %.4f lr %.2e tok/s %.0f elapsed %s eta %s", done, steps, loss_v, lr,
                     tokens_per_step / per_step if per_step else 0.0, fmt_time(now - t_start),
                     fmt_time((steps - done) * per_step))
            run.history.append({"step": done, "loss": loss_v})
            steps = run.steps = fit_budget(a.max_minutes, t_start, per_step, done, steps)
        if done % a.eval_every == 0 or done == steps:
            val = mean_loss(model, d.valid, device, autocast, s["batch_size"])
            run.evals.append({"step": done, "valid_loss": val})
            score, extra = val, ""
            if val_batches:  # the long shapes choose on language + answer (pass key, chat) loss
                answer = mean_answer_loss(model, val_batches, device, autocast)
                run.evals[-1]["valid_answer_loss"] = answer
                score, extra = val + answer, f" answer loss {answer:.4f}"
            mark = ""
            if score < run.best_valid_loss:
                run.best_valid_loss, run.best_step, mark = score, done, " (best; saved)"
                save_checkpoint(a.out, model, s, d.tok, a.save_dtype)
            log.info("eval step %d validation loss %.4f ppl %.2f%s%s", done, val, math.exp(val), extra, mark)
        if done >= steps:
            break
    return run


def autocast_for(device: torch.device):
    """bf16 autocast on CUDA; plain float32 elsewhere."""
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return lambda: torch.autocast(device.type, enabled=False)


def report(a, s: dict, model: Llama, d: Data, run: Run, device: torch.device, t_start: float) -> dict:
    """Held-out figures of the saved weights (bf16-rounded as shipped, computed in float32) and a sample."""
    saved = load_file(os.path.join(a.out, "model.safetensors"))
    model.load_state_dict({k.removeprefix("model."): v.float() for k, v in saved.items()})
    fp32 = lambda: torch.autocast(device.type, enabled=False)  # noqa: E731
    final_all = mean_loss(model, d.held_all, device, fp32, s["batch_size"])
    final_doc = mean_loss(model, d.held_doc, device, fp32, s["batch_size"]) if d.held_doc is not None else None
    sample = greedy(model, d.tok, a.prompt, 48, device)
    log.info("saved step %d: held-out loss %.4f (ppl %.2f) all; docs-only %s", run.best_step, final_all,
             math.exp(final_all), f"{final_doc:.4f} (ppl {math.exp(final_doc):.2f})" if final_doc else "n/a")
    log.info("greedy %r -> %r", a.prompt, sample)
    skills = long_skills(a, s, model, d, device) if s.get("long") else {}
    return {**skills,
        "data": os.path.basename(d.source) if d.source else "local sources",
        "data_sha256": reference_corpus.file_sha256(d.source) if d.source else None,
        "shape": s, "steps": run.steps, "seed": a.seed, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "params": sum(p.numel() for p in model.parameters()),
        "train_tokens": len(d.train_ids), "tokens_seen": run.steps * s["batch_size"] * s["seq_len"],
        "train_docs": d.num_docs[0], "valid_docs": d.num_docs[1], "held_out_docs": d.num_docs[2],
        "eval_windows": len(d.held_all), "first_loss": run.history[0]["loss"], "last_loss": run.history[-1]["loss"],
        "best_step": run.best_step, "valid_loss": run.best_valid_loss, "held_out_loss": final_all,
        "held_out_ppl": math.exp(final_all), "held_out_docs_loss": final_doc,
        "held_out_docs_ppl": math.exp(final_doc) if final_doc else None,
        "greedy_sample": sample, "seconds": time.time() - t_start, "history": run.history, "evals": run.evals,
    }


def long_skills(a, s: dict, model: Llama, d: Data, device) -> dict:
    """Pass-key accuracy by length and depth (held-out filler) and chat accuracy on held-out names."""
    stop = {d.tok.token_to_id(t) for t in SPECIALS if t != SPECIALS[1]}
    gen = lambda ids, n: greedy_ids(model, ids, n, stop, device, autocast_for(device))  # noqa: E731
    enc, dec = (lambda t: d.tok.encode(t).ids), (lambda ids: d.tok.decode(ids, skip_special_tokens=False))
    lengths = [L for L in skills_eval.LENGTHS if L <= s["seq_len"]] or [s["seq_len"] // 2, s["seq_len"]]
    pk = skills_eval.passkey_accuracy(gen, enc, dec, d.held_all.flatten().tolist(), s["seq_len"], lengths,
                                      per_cell=a.passkey_per_cell)
    chat = skills_eval.chat_accuracy(gen, enc, dec, d.pairs[2][:a.chat_eval])
    log.info("pass key found %d/%d; by length %s; by depth %s", pk["found"], pk["tried"], pk["by_length"],
             pk["by_depth"])
    log.info("chat on %d held-out names: exact %.1f%%, word F1 %.3f; %s", chat["n"], 100 * chat["exact"],
             chat["f1"], chat["samples"][:2])
    return {"passkey": pk, "chat": chat, "qa_pairs": [len(p) for p in d.pairs]}


def train(a) -> dict:
    """Data, tokenizer, model, loop, saved checkpoint; returns the run's metrics."""
    s = dict(SHAPES[{"ref": "tiny", "long": "tiny-long"}[a.shape] if a.tiny else a.shape])
    steps = a.steps or s["steps"]
    device = torch.device(a.device)
    torch.manual_seed(a.seed)
    t_start = time.time()
    d = load_data(a, s, device)
    model = Llama(s).to(device)
    log.info("model: %s, %.2f M parameters, %d steps of %d x %d tokens",
             {k: s[k] for k in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                "intermediate_size")},
             sum(p.numel() for p in model.parameters()) / 1e6, steps, s["batch_size"], s["seq_len"])
    run = fit(a, s, model, d, steps, device, t_start)
    metrics = report(a, s, model, d, run, device, t_start)
    if a.metrics:
        _write_json(a.metrics, metrics)
    return metrics


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the shape's)")
    ap.add_argument("--tiny", action="store_true", help="a very small model and corpus (tests)")
    ap.add_argument("--shape", default="ref", choices=["ref", "long"],
                    help="ref: the shipped 1,024-token model; long: 4,096 tokens, pass-key and chat data")
    ap.add_argument("--passkey-per-cell", type=int, default=2, help="pass keys per length x depth (long)")
    ap.add_argument("--chat-eval", type=int, default=100, help="held-out Q/A names asked at the end (long)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=None, help="packed corpus (.jsonl.xz); default: .corpus/ or local sources")
    ap.add_argument("--sources", default="docs,stdlib", help="comma list of docs, stdlib, src (whole stdlib source)")
    ap.add_argument("--max-docs", type=int, default=None, help="use only the first N documents (by path)")
    ap.add_argument("--eval-tokens", type=int, default=None, help="cap on held-out tokens evaluated")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="shorten the schedule (decided at step 60) so the run fits this many minutes")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile the training step (default: on for CUDA)")
    ap.add_argument("--save-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's; 1 with --tiny)")
    ap.add_argument("--metrics", default=None, help="write a JSON summary here")
    ap.add_argument("--prompt", default="The json module")
    a = ap.parse_args(argv)
    a.save_dtype = getattr(torch, a.save_dtype)
    if a.compile is None:
        a.compile = a.device.startswith("cuda")
    if a.tiny:  # a model this small only loses to thread hand-offs, and the test suite shares its cores
        a.threads = a.threads or 1
        a.eval_tokens = a.eval_tokens or 8192
    if a.threads:
        torch.set_num_threads(a.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    return train(a)


if __name__ == "__main__":
    main()
