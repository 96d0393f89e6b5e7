"""Calibrated INT4: the storage format of quant.quantize_int4, with better scales and better rounding.

Every method writes qweight uint8 [N, Kp/2] and scales_and_zeros bf16 [Kp/g, N, 2] with
w = (q - 8) * scale + zero, so the INT4 kernels (and the native CPU step) run it unchanged:

- "rtn": quant.quantize_int4, round to nearest on each group's min/max range.
- "mse": each group's scale and zero are searched for the smallest squared weight error: 21 step
  counts around min/max's 15 (llama.cpp's make_qkx2 grid), each refit by least squares on its own
  rounding (twice), instead of taken from the group's min and max.
- "gptq": GPTQ (Frantar et al., 2022): a layer's columns are quantized one at a time and each one's
  rounding error is spread over the columns not yet quantized through the inverse Hessian of the
  layer's inputs (H = X^T X over calibration text), so the error of the layer's *output* is what is
  minimized. A group takes its scale and zero from the error-updated weights when it starts.
- "gptq-mse": GPTQ whose groups search their scale and zero as "mse" does.

`calibrate` runs the float32 model over calibration windows layer by layer: each linear's Hessian is
taken from the outputs of the layers already quantized (sequential, as GPTQ's reference code does).
"""

from __future__ import annotations

import ast
import glob
import hashlib
import logging
import os
import sysconfig
import time
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F

from o3edge.engine.model import StepBatch, Transformer
from o3edge.engine.quant import (dequantize_int4, int4_levels, minmax_scale_zero, pack_int4, padded_k,
                                 quantize_int4)
from o3edge.engine.rope import rope_tables

log = logging.getLogger(__name__)

METHODS = ("rtn", "mse", "gptq", "gptq-mse")
CALIBRATION_TOKENS = 65536  # o3edge build's default, 128 windows (32K to 128K measured alike)
CALIBRATION_WINDOW = 512  # tokens a calibration window (at most the model's max_position_embeddings)
CALIBRATION_TEXT = "python-stdlib-docstrings"  # what calibration_texts reads, as the manifest names it
STAGES = (("attn.qkv",), ("attn.o",), ("mlp.gate_up",), ("mlp.down",))  # a layer's linears, in data order
LM_HEAD = "lm_head"


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def _error(w, scale, zero):
    return ((int4_levels(w, scale, zero) - 8) * scale + zero - w).square().sum(-1, keepdim=True)


def _least_squares(w, q):
    """(scale, m) minimizing sum (q * scale + m - w)^2 per row; scale 0 where q is constant."""
    n = w.shape[-1]
    sl, sx, sl2, sxl = (q.sum(-1, keepdim=True), w.sum(-1, keepdim=True), (q * q).sum(-1, keepdim=True),
                        (w * q).sum(-1, keepdim=True))
    det = n * sl2 - sl * sl
    ok = det > 0
    det = torch.where(ok, det, torch.ones_like(det))
    scale = torch.where(ok, (n * sxl - sx * sl) / det, torch.zeros_like(det))
    return scale, (sl2 * sx - sl * sxl) / det


def fit_groups(w: torch.Tensor, search: bool = True):
    """w [R, g] -> (scale, zero) [R, 1], bf16-exact: min/max's, or the best of a search (see module doc)."""
    scale, zero = minmax_scale_zero(w)
    if not search:
        return scale, zero
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    span = (hi - lo).clamp(min=1e-6)
    best = _error(w, scale, zero)
    for k in range(21):
        q = ((w - lo) * ((14 + 0.1 * k) / span)).round().clamp(0, 15)
        for _ in range(2):
            s, m = _least_squares(w, q)
            s = torch.where(s > 0, _bf16(s), scale)  # a constant rounding has no scale: keep the current one
            z = _bf16(m + 8 * s)
            q = int4_levels(w, s, z)
        err = _error(w, s, z)
        better = err < best
        scale, zero, best = torch.where(better, s, scale), torch.where(better, z, zero), torch.where(better, err, best)
    return scale, zero


def quantize_mse(weight: torch.Tensor, group_size: int):
    """weight [N, K] -> (qweight, scales_and_zeros) with each group's scale and zero searched."""
    N, K = weight.shape
    Kp = padded_k(K, group_size)
    w = F.pad(weight.float(), (0, Kp - K)).view(N * (Kp // group_size), group_size)
    scale, zero = fit_groups(w)
    q = int4_levels(w, scale, zero)
    return pack_int4(q.view(N, Kp), scale.view(N, -1), zero.view(N, -1))


def quantize_gptq(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, search: bool = True,
                  block_size: int = 128, damp: float = 0.01):
    """weight [N, K], hessian [K, K] (sum of x x^T over calibration inputs) -> (qweight, scales_and_zeros)."""
    N, K = weight.shape
    Kp, g = padded_k(K, group_size), group_size
    block = -(-block_size // g) * g  # whole groups per block: a group's params come from its updated columns
    W = F.pad(weight.float(), (0, Kp - K))  # [N, Kp]
    H = torch.zeros(Kp, Kp, dtype=torch.float64)
    H[:K, :K] = hessian.double()
    dead = H.diagonal() == 0  # padding, or inputs never active: weight 0, as the reference code does
    H[dead, dead] = 1
    W[:, dead] = 0
    H.diagonal().add_(damp * H.diagonal().mean())
    # the upper Cholesky factor of H^-1: row i holds how column i's error moves the columns after it
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).float()
    Q = torch.empty(N, Kp)
    scales, zeros = torch.empty(N, Kp // g), torch.empty(N, Kp // g)
    for i1 in range(0, Kp, block):
        i2 = min(i1 + block, Kp)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.empty_like(W1)
        for i in range(i2 - i1):
            col = i1 + i
            if col % g == 0:  # a group starts: its scale and zero from its columns as updated so far
                scale, zero = fit_groups(W1[:, i:i + g], search)  # [N, 1]
                scales[:, col // g], zeros[:, col // g] = scale[:, 0], zero[:, 0]
            w = W1[:, i:i + 1]
            q = int4_levels(w, scale, zero)
            Q[:, col:col + 1] = q
            err = (w - ((q - 8) * scale + zero)) / Hinv1[i, i]
            W1[:, i:] -= err * Hinv1[i:i + 1, i:]
            Err1[:, i:i + 1] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]  # the block's errors, onto the blocks after it at once
    return pack_int4(Q, scales, zeros)


def quantize(weight: torch.Tensor, group_size: int, method: str, hessian: torch.Tensor | None = None):
    """One linear's INT4 (qweight, scales_and_zeros) by method (METHODS); the gptq ones need its Hessian."""
    if method == "rtn":
        return quantize_int4(weight, group_size)
    if method == "mse":
        return quantize_mse(weight, group_size)
    if method in ("gptq", "gptq-mse"):
        return quantize_gptq(weight, hessian, group_size, search=method == "gptq-mse")
    raise ValueError(f"INT4 method must be one of {METHODS}, got {method!r}")


# ---- calibration -----------------------------------------------------------------------------------

def calibration_texts(kind: str = "docstrings") -> Iterator[str]:
    """What `o3edge build` calibrates on: this Python's standard-library modules (present wherever o3edge runs,
    no download), top-level ones in an order fixed by a hash of their names (a spread of subjects); of each,
    its docstrings (prose about code, each under its qualified name) or (kind "sources") its whole source."""
    root = sysconfig.get_paths()["stdlib"]
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(root, "*.py")))
    for name in sorted(names, key=lambda n: hashlib.sha256(n.encode()).hexdigest()):
        try:
            with open(os.path.join(root, name), encoding="utf-8") as fh:
                source = fh.read()
        except (OSError, UnicodeDecodeError):
            continue
        text = source if kind == "sources" else _docstrings(source, name.removesuffix(".py"))
        if text:
            yield text


def _docstrings(source: str, module: str) -> str:
    """The module's, its public classes' and functions' docstrings, each after its qualified name."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    parts = []

    def visit(node, name):
        doc = ast.get_docstring(node)
        if doc:
            parts.append(f"{name}\n{doc}\n")
        for child in getattr(node, "body", []):
            public = not getattr(child, "name", "_").startswith("_")
            if public and isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{name}.{child.name}")

    visit(tree, module)
    return "\n".join(parts)


def calibration_windows(tokenizer, num_tokens: int, window: int, texts: Iterable[str] | None = None):
    """Token windows of `window` ids (as many as fit in num_tokens) of texts (default: calibration_texts)."""
    ids: list[int] = []
    for text in calibration_texts() if texts is None else texts:
        ids += tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= num_tokens:
            break
    return [ids[i:i + window] for i in range(0, min(len(ids), num_tokens) - window + 1, window)]


def _window_batch(T: int) -> StepBatch:
    """One dense causal sequence of T tokens in cache slots 0..T-1."""
    slots = torch.arange(T)
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None]  # [1, 1, T, T]
    return StepBatch(slot_mapping=slots, q_dest=slots, kv_slots=slots[None], attn_mask=mask, num_seqs=1, max_q=T,
                     logits_index=slots, dense=True)


class _Stop(Exception):
    """Raised by the last hooked linear's hook: the rest of the layer is not needed for its Hessian."""


class _Hessians:
    """Sums x^T x of the inputs of some linears (in data order) while hooked on them (float64 sums)."""

    def __init__(self, modules: dict[str, torch.nn.Module]):
        self.sums = {name: None for name in modules}
        last = list(modules)[-1]
        self.hooks = [m.register_forward_pre_hook(self._hook(name, name == last)) for name, m in modules.items()]

    def _hook(self, name, stop: bool):
        def add(module, inputs):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
            xtx = (x.t() @ x).double()
            self.sums[name] = xtx if self.sums[name] is None else self.sums[name] + xtx
            if stop:
                raise _Stop
        return add

    def remove(self) -> dict[str, torch.Tensor]:
        for h in self.hooks:
            h.remove()
        return self.sums


@torch.no_grad()
def calibrate(model: Transformer, windows: list[list[int]], names: list[str], group_size: int, method: str,
              sequential: bool = True) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """INT4 (qweight, scales_and_zeros) of the named linears of a float32 model ("lm_head" of a tied model: of
    its embedding), each quantized by method (METHODS) against the inputs it sees on the calibration windows.

    sequential: a layer's inputs come from the layers (and the linears of its own layer) quantized before it;
    else every Hessian is the float32 model's. The model's weights are left as they were."""
    t0 = time.perf_counter()
    wanted = set(names)
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if method in ("rtn", "mse"):  # no calibration data needed
        return {name: quantize(_weight(model, name), group_size, method) for name in names}
    if not windows:
        raise ValueError(f"INT4 method {method} needs calibration windows")
    args = model.args
    T = max(len(w) for w in windows)
    cos, sin = rope_tables(args, T, torch.device("cpu"), torch.float32)
    kv = torch.zeros(2, T, args.num_kv_heads, args.head_dim)
    xs = [model.embed(torch.tensor(ids)) for ids in windows]  # [T, D] each
    saved = {}

    def run(layer, x):
        n = x.shape[0]
        return layer(x, cos[:n], sin[:n], _window_batch(n), kv[0], kv[1])

    for i, layer in enumerate(model.layers):
        stages = STAGES if sequential else (sum(STAGES, ()),)
        for stage in stages:
            mods = {f"layers.{i}.{s}": layer.get_submodule(s) for s in stage if f"layers.{i}.{s}" in wanted}
            if not mods:
                continue
            hooks = _Hessians(mods)
            for x in xs:
                try:
                    run(layer, x)
                except _Stop:
                    pass
            for name, H in hooks.remove().items():
                out[name] = quantize(mods[name].weight, group_size, method, H)
                if sequential:  # later inputs see this layer as the engine will run it
                    saved[name] = mods[name].weight.data.clone()
                    mods[name].weight.data.copy_(dequantize_int4(*out[name], mods[name].in_features))
        xs = [run(layer, x) for x in xs]
    if LM_HEAD in wanted:
        x = torch.cat([model.norm(x) for x in xs])
        out[LM_HEAD] = quantize(_weight(model, LM_HEAD), group_size, method, (x.t() @ x).double())
    for name, w in saved.items():
        model.get_submodule(name).weight.data.copy_(w)
    log.info("INT4 %s over %d windows (%d tokens): %d linears in %.1f s", method, len(windows),
             sum(map(len, windows)), len(out), time.perf_counter() - t0)
    return out


def _weight(model: Transformer, name: str) -> torch.Tensor:
    if name == LM_HEAD and model.lm_head is None:
        return model.embed.weight
    return model.get_submodule(name).weight
