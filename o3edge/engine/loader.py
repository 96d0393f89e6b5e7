"""Turning checkpoint tensors into a ready Transformer on the chosen device and dtype.

Two sources: a Hugging Face checkpoint (renamed, fused and cast here; INT4 quantized here when
asked) or an o3edge engine directory (already in our names, dtype and INT4 layout: mmap + assign).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from o3edge import memory
from o3edge.engine import gptq
from o3edge.engine.checkpoint import ModelArgs, load_tensors, read_model_args
from o3edge.engine.cpu_quant import (LM_HEAD, Preset, int4_targets, int8_linears, int8_targets, quantize_int8,
                                     swap_to_int8)
from o3edge.engine.cpu_quant import SUFFIXES as INT8_SUFFIXES
from o3edge.engine.engine_dir import is_engine_dir, load_weights, read_manifest
from o3edge.engine.model import RMSNorm, Transformer, hf_weight_map
from o3edge.engine.quant import can_quantize, quantizable, quantize_int4, swap_to_int4
from o3edge.errors import CheckpointError

log = logging.getLogger(__name__)

INT4_SUFFIXES = (".qweight", ".scales_and_zeros")


class _SkipInit(TorchFunctionMode):
    """Skip torch.nn.init's random fills: on meta they run Python decompositions, and the first of
    those imports torch._dynamo (seconds of cold start) for weights that are assigned right after."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta():
    """Build modules on the meta device, uninitialized."""
    with torch.device("meta"), _SkipInit():
        yield


def int4_modules(args: ModelArgs, group_size: int, every_linear: bool = False, lm_head: bool = False) -> list[str]:
    """The linears of this architecture that INT4 applies to: the FFN projections, or every linear; with lm_head
    the LM head too (a tied one: its own INT4 copy of the embedding, which stays dense for the lookup)."""
    with on_meta():
        names = quantizable(Transformer(args), group_size, every_linear)
    if lm_head and LM_HEAD not in names and can_quantize(args.vocab_size, args.hidden_size, group_size):
        names.append(LM_HEAD)
    return names


def int8_modules(args: ModelArgs, int4_names: list[str]) -> list[str]:
    """The linears `int8_weights` stores in INT8: every one not in int4_names, the LM head too (a tied one: its
    own INT8 copy of the embedding, which stays dense for the lookup); a linear with a bias stays dense."""
    with on_meta():
        return int8_linears(Transformer(args), int4_names)


def preset_modules(args: ModelArgs, preset: Preset) -> tuple[list[str], list[str]]:
    """The linears of this architecture that a CPU preset stores in INT4 and in INT8 (LM head included)."""
    with on_meta():
        model = Transformer(args)
        return int4_targets(model, preset), int8_targets(model, preset)


def build_state_dict(args: ModelArgs, tensors: dict, dtype: torch.dtype, int4_group_size: int | None = None,
                     progress: Callable[[str], None] | None = None, int8_modules: list[str] = (),
                     int4_all: bool = False, int4_names: list[str] | None = None, int4_method: str = "rtn",
                     calibration: list[list[int]] | None = None) -> dict:
    """Our state dict from Hugging Face tensors: fused q/k/v and gate/up, cast to dtype.

    With int4_group_size, the FFN projections (int4_all: every linear; int4_names: those) become
    <name>.qweight and <name>.scales_and_zeros, quantized by int4_method (gptq.METHODS; the gptq
    ones run the float32 model over the calibration windows of token ids);
    int8_modules become <name>.qweight8 and <name>.scales8. A tied LM head in either is a copy of
    the embedding, which stays dense for the lookup. Both are quantized from the checkpoint's own
    precision (not from the cast copy).
    """
    if not int4_group_size:
        to_int4 = set()
    else:
        to_int4 = set(int4_modules(args, int4_group_size, int4_all) if int4_names is None else int4_names)
    to_int8 = set(int8_modules)
    calibrated = {}
    if to_int4 and int4_method != "rtn":
        model = float32_model(args, tensors)
        calibrated = gptq.calibrate(model, calibration or [], sorted(to_int4), int4_group_size, int4_method)
        del model

    def int4(module, weight):
        return calibrated[module] if module in calibrated else quantize_int4(weight, int4_group_size)

    with on_meta():
        shapes = {k: tuple(v.shape) for k, v in Transformer(args).state_dict().items()}
    state = {}
    for ours, weight in _fused(args, tensors):
        module = ours.removesuffix(".weight")
        if module in to_int4:
            _check_shape(ours, weight, shapes[ours])
            state[module + ".qweight"], state[module + ".scales_and_zeros"] = int4(module, weight)
        elif module in to_int8:
            _check_shape(ours, weight, shapes[ours])
            state[module + ".qweight8"], state[module + ".scales8"] = quantize_int8(weight)
        else:
            state[ours] = weight.to(dtype)
        if ours == "embed.weight" and args.tie_word_embeddings and LM_HEAD in to_int4:
            state[LM_HEAD + ".qweight"], state[LM_HEAD + ".scales_and_zeros"] = int4(LM_HEAD, weight)
        elif ours == "embed.weight" and args.tie_word_embeddings and LM_HEAD in to_int8:
            state[LM_HEAD + ".qweight8"], state[LM_HEAD + ".scales8"] = quantize_int8(weight)
        if progress is not None:
            progress(ours)
    return state


def _fused(args: ModelArgs, tensors: dict):
    """(our name, weight) for each of our parameters, Hugging Face tensors concatenated in the checkpoint's dtype."""
    for ours, theirs in hf_weight_map(args).items():
        missing = [n for n in theirs if n not in tensors]
        if missing:
            raise CheckpointError(f"checkpoint lacks tensor(s) {missing}")
        parts = [tensors[n] for n in theirs]
        yield ours, parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def float32_model(args: ModelArgs, tensors: dict) -> Transformer:
    """The checkpoint as a dense float32 Transformer on the CPU (calibration at build time)."""
    with on_meta():
        model = Transformer(args)
    state = {ours: weight.to(torch.float32, copy=True) for ours, weight in _fused(args, tensors)}  # GPTQ edits it
    check_shapes(model, state)
    model.load_state_dict(state, assign=True)
    return model.eval().requires_grad_(False)


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise CheckpointError(f"weight {name} has shape {tuple(tensor.shape)}, config.json implies {tuple(shape)}")


def check_shapes(model: Transformer, state: dict) -> None:
    """Refuse tensors whose shapes disagree with config.json, naming the first offender."""
    expected = {k: v.shape for k, v in model.state_dict().items()}
    for name, shape in expected.items():
        if name not in state:
            raise CheckpointError(f"no weight for {name}")
        _check_shape(name, state[name], shape)
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise CheckpointError(f"unexpected weight(s) {unexpected[:4]}")


def load_model(model_dir: str, device: torch.device, dtype: torch.dtype, int4_ffn: bool = False,
               int4_group_size: int = 128, int4_all: bool = False, int4_lm_head: bool = False,
               int8_weights: bool = False) -> tuple[Transformer, ModelArgs]:
    """Read a checkpoint or engine directory into an eval-mode Transformer.

    int4_ffn quantizes the FFN projections (with int4_all, every linear layer) at load time unless
    the engine directory already holds INT4 modules (then its own modules and group size stand);
    int8_weights then quantizes the linears left dense to INT8 (int8_modules), unless the engine
    directory holds INT8 modules already.
    """
    mapped = []  # INT4/INT8 tensors (and INT4 scales) read from the engine file (mmap), packed into copies
    if is_engine_dir(model_dir):
        args, state, group, stored = _engine_state(model_dir, dtype, int4_ffn, int4_group_size, int4_all,
                                                   int4_lm_head, int8_weights)
        mapped = [state[f"{name}.{part}"] for name in stored for part in ("qweight", "scales_and_zeros")]
        mapped += [state[name + ".qweight8"] for name in read_manifest(model_dir).int8_modules]
    else:
        args = read_model_args(model_dir)
        group = int4_group_size if int4_ffn else None
        names = int4_modules(args, group, int4_all, int4_lm_head) if group else None
        int8 = int8_modules(args, names or []) if int8_weights else []
        state = build_state_dict(args, load_tensors(model_dir), dtype, group, int4_all=int4_all, int4_names=names,
                                 int8_modules=int8)
    # engine dir: drop each INT4/INT8 tensor's file pages as soon as it is packed, so they never pile up (only
    # the file's: a tensor quantized here is anonymous memory, which dropping would zero)
    in_file = {t.data_ptr() for t in mapped}
    model = instantiate(args, state, device, group, release=(lambda ts: _release_memory(
        [t for t in ts if t.data_ptr() in in_file])) if mapped else None)
    if mapped:
        _release_memory(mapped)
    return model, args


def _release_memory(mapped: list[torch.Tensor]) -> None:
    """After INT4 packing: return the packer's freed scratch to the OS (glibc keeps it otherwise), and
    drop the resident pages of the on-disk INT4 tensors, which are packed copies now. Pages only:
    the file stays mapped, and a later read would fault them back in unchanged."""
    for t in mapped:
        memory.drop_pages(t.data_ptr(), t.nbytes)
    memory.trim()


def _engine_state(model_dir: str, dtype: torch.dtype, int4_ffn: bool, group_size: int, int4_all: bool,
                  int4_lm_head: bool = False, int8_weights: bool = False):
    manifest = read_manifest(model_dir)
    state = load_weights(manifest)
    stored = sorted(k.removesuffix(".qweight") for k in state if k.endswith(".qweight"))
    if stored != sorted(manifest.quantized):
        raise CheckpointError(f"{manifest.weights_path}: INT4 modules {stored[:3]}... differ from the "
                              f"manifest's {list(manifest.quantized)[:3]}...")
    stored8 = sorted(k.removesuffix(".qweight8") for k in state if k.endswith(".qweight8"))
    if stored8 != sorted(manifest.int8_modules):
        raise CheckpointError(f"{manifest.weights_path}: INT8 modules {stored8[:3]}... differ from the "
                              f"manifest's {list(manifest.int8_modules)[:3]}...")
    if dtype != manifest.dtype:
        log.info("engine %s was built in %s; casting its dense weights to %s", model_dir, manifest.dtype, dtype)
        state = {k: v if k.endswith(INT4_SUFFIXES + INT8_SUFFIXES) else v.to(dtype) for k, v in state.items()}
    group = manifest.group_size
    if int4_ffn and group is None:
        group = group_size
        _quantize_at_load(state, manifest.args, int4_modules(manifest.args, group, int4_all, int4_lm_head),
                          lambda w: quantize_int4(w, group), INT4_SUFFIXES)
    elif group is not None and group != group_size:
        log.info("engine %s is INT4 with group size %d (built in; int4_group_size %d ignored)",
                 model_dir, group, group_size)
    if int8_weights and stored8:
        log.info("engine %s holds INT8 modules already (built in; int8_weights adds none)", model_dir)
    elif int8_weights:
        int4 = [k.removesuffix(".qweight") for k in state if k.endswith(".qweight")]
        _quantize_at_load(state, manifest.args, int8_modules(manifest.args, int4), quantize_int8, INT8_SUFFIXES)
    return manifest.args, state, group, stored


def _quantize_at_load(state: dict, args: ModelArgs, names: list[str], quantize, suffixes: tuple[str, str]) -> None:
    """Each named linear of an engine's dense state quantized in place into its two tensors <name><suffixes>
    (quantize(weight) -> both); a tied LM head from the embedding, which stays dense for the lookup."""
    for name in names:
        tied = name == LM_HEAD and args.tie_word_embeddings
        weight = state["embed.weight"] if tied else state.pop(name + ".weight")
        state[name + suffixes[0]], state[name + suffixes[1]] = quantize(weight)


def instantiate(args: ModelArgs, state: dict, device: torch.device, group_size: int | None,
                release: Callable[[list[torch.Tensor]], None] | None = None) -> Transformer:
    """Build the model on meta, swap in Int4Linear / Int8Linear where state holds INT4 / INT8, assign the
    tensors; release([tensor]) after each INT4 or INT8 layer is packed (engine dirs: drop its file pages, so
    that the file's pages and the packed copies are never all resident at once)."""
    int4_names = sorted(k.removesuffix(".qweight") for k in state if k.endswith(".qweight"))
    int8_names = sorted(k.removesuffix(".qweight8") for k in state if k.endswith(".qweight8"))
    with on_meta():
        model = Transformer(args)
        int4 = swap_to_int4(model, int4_names, group_size) if int4_names else {}
    # not on meta: the kernel's packed weight is built in place (on a GPU: Triton's kernels on the stored form)
    int8 = swap_to_int8(model, int8_names, "triton" if device.type == "cuda" else "auto")
    dense = {k: v for k, v in state.items() if not k.endswith(INT4_SUFFIXES + INT8_SUFFIXES)}
    check_shapes(model, dense)
    model.load_state_dict(dense, assign=True)
    for name, module in int4.items():
        try:
            module.load_quantized(state[name + ".qweight"].to(device), state[name + ".scales_and_zeros"].to(device))
        except (KeyError, ValueError) as exc:
            raise CheckpointError(f"INT4 weights of {name}: {exc}") from None
        if release is not None:
            release([state[name + ".qweight"], state[name + ".scales_and_zeros"]])
    for name, module in int8.items():
        try:
            module.load_quantized(state[name + ".qweight8"], state[name + ".scales8"])
        except (KeyError, ValueError) as exc:
            raise CheckpointError(f"INT8 weights of {name}: {exc}") from None
        if release is not None:
            release([state[name + ".qweight8"]])
    if int8:  # a quantized engine does not keep transformers' exact norm rounding: take the fused op
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.fused = True
    return model.to(device).eval().requires_grad_(False)
