"""INT8 weights for linears (attention projections, FFN, LM head), as a module swap: CPU kernels, and a GPU's.

On disk a weight is `<name>.qweight8` int8 [N, K] and `<name>.scales8` float32 [N]: symmetric per
output row, w ~ q * scale with scale = max|w_row| / 127. That form is device- and CPU-neutral; the
kernel, and the layout it wants, is picked when the engine loads (`pick_int8_kernel`):

- "vnni": o3edge's own VNNI kernel (cpu_ext.py, cpu_kernels.cpp): activations quantized to int8
  per group of 32 columns, weights 16 rows per 64-byte load; no Python between the operator and the loop,
  traceable by torch.compile. Fastest here at decode row counts and closer to float32 than fbgemm (finer
  activation scales); taken where the CPU has AVX-512 VNNI, AVX-VNNI or AVX2 (its byte products made of
  vpmaddubsw and vpmaddwd, exact: cpu_vec.h) and the kernels build.
- "fbgemm": torch's `quantized::linear_dynamic` (fbgemm, x86): activations are quantized per tensor
  to uint8 on the fly, int8 GEMM, float32 out. Fastest here at every row count (tools/bench_cpu_kernels.py).
  On CPUs without VNNI it runs with `reduce_range` (7-bit activations): its AVX2 path adds pairs of
  u8*s8 products in saturating int16. The fallback of "vnni".
- "int8pack": `_weight_int8pack_mm` with bf16 activations (weight-only, no activation rounding
  beyond bf16); for builds of torch without fbgemm.
- "dense": the dequantized float32 weight and MKL; correct everywhere, as large as float32.
- "triton": on a CUDA GPU (`[engine] int8_weights`), o3edge's own kernels on the codes as stored
  (kernels/int8_matmul.py): one activation row quantized per group of 32 columns as "vnni" does and
  multiplied by dp4a; more rows in the model dtype (W8A16); each output row scaled once. Also runs under
  Triton's interpreter on CPU tensors (the kernel tests).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from o3edge.engine.cpu_features import cpu_bf16, cpu_features  # noqa: F401 (cpu_bf16: for importers)
from o3edge.engine.manifest import INT8_SCHEME
from o3edge.engine.quant import can_quantize, quantizable, swap_modules

log = logging.getLogger(__name__)

SCHEME = INT8_SCHEME
SUFFIXES = (".qweight8", ".scales8")
KERNELS = ("vnni", "fbgemm", "int8pack", "dense", "triton")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (q int8 [N, K], scales float32 [N])."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales.contiguous()


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales.float()[:, None]


def has_fbgemm() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def vnni_fits(out_features: int, in_features: int) -> bool:
    """Whether o3edge's VNNI kernels can run a layer of this shape on this machine."""
    from o3edge.engine import cpu_ext

    return out_features % 16 == 0 and cpu_ext.activation_group(in_features) >= 4 and cpu_ext.available()


def pick_int8_kernel(requested: str = "auto", shape: tuple[int, int] | None = None) -> str:
    """The INT8 kernel for this CPU, build of torch and layer shape (N, K): vnni, else fbgemm, else int8pack."""
    if requested in ("auto", "vnni") and shape is not None and vnni_fits(*shape):
        return "vnni"
    if requested == "vnni":
        requested = "auto"
    if requested != "auto":
        if requested not in KERNELS:
            raise ValueError(f"int8 kernel must be auto or one of {KERNELS}, got {requested!r}")
        if requested == "fbgemm" and not has_fbgemm():
            log.warning("fbgemm is not in this build of torch; INT8 layers fall back to int8pack")
            return "int8pack"
        return requested
    return "fbgemm" if has_fbgemm() else "int8pack"


class Int8Linear(nn.Module):
    """A bias-free linear layer with a per-row INT8 weight; the output in the input's dtype."""

    def __init__(self, in_features: int, out_features: int, kernel: str = "auto"):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.kernel = pick_int8_kernel(kernel, (out_features, in_features))
        self.reduce_range = not {"avx512_vnni", "avx_vnni"} & cpu_features()
        self.packed = None  # fbgemm's packed weight (a torchbind object, not a tensor)
        self.register_buffer("weight", torch.empty(0, dtype=torch.int8), persistent=False)
        self.register_buffer("scales", torch.empty(0), persistent=False)
        self.register_buffer("wsum", torch.empty(0, dtype=torch.int32), persistent=False)  # vnni: per group
        self.group = 0  # vnni: input columns per activation scale

    def load_quantized(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        """Lay the on-disk form out for the chosen kernel."""
        if tuple(q.shape) != (self.out_features, self.in_features) or q.dtype != torch.int8:
            raise ValueError(f"qweight8 must be int8 {(self.out_features, self.in_features)}, "
                             f"got {q.dtype} {tuple(q.shape)}")
        if tuple(scales.shape) != (self.out_features,):
            raise ValueError(f"scales8 must have shape {(self.out_features,)}, got {tuple(scales.shape)}")
        if self.kernel == "vnni":
            from o3edge.engine.cpu_ext import activation_group

            N, K = q.shape
            self.group = activation_group(K)
            self.weight = torch.ops.o3edge_cpu.int8_pack_rows16(q)
            self.wsum = group_sums(q, self.group)
            self.scales = scales.float().contiguous()
        elif self.kernel == "fbgemm":
            with _engine("fbgemm"):
                qt = torch._make_per_channel_quantized_tensor(
                    q, scales.double(), torch.zeros(self.out_features, dtype=torch.long), 0)
                self.packed = torch.ops.quantized.linear_prepack(qt, None)
        elif self.kernel == "int8pack":
            self.weight, self.scales = q.contiguous(), scales.to(torch.bfloat16)
        elif self.kernel == "triton":  # the stored form itself (moved to the GPU with the model)
            self.weight, self.scales = q.contiguous(), scales.float().contiguous()
        else:
            self.weight = dequantize_int8(q, scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        if self.kernel == "triton":
            from o3edge.engine.kernels.int8_matmul import int8_matmul

            return int8_matmul(x, self.weight, self.scales)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.kernel == "vnni":
            y = torch.ops.o3edge_cpu.int8_linear(x2, self.weight, self.wsum, self.scales, self.group)
        elif self.kernel == "fbgemm":
            y = torch.ops.quantized.linear_dynamic(x2.float().contiguous(), self.packed, self.reduce_range)
        elif self.kernel == "int8pack":
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), self.weight, self.scales)
        else:
            y = F.linear(x2.float(), self.weight)
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


def group_sums(q: torch.Tensor, group: int, chunk: int = 4096) -> torch.Tensor:
    """q int8 [N, K] -> int32 [K / group, N]: the sum of each row's weights per group of columns (a few rows
    at a time: the int32 copy of a whole LM head would be 4x its size in peak memory)."""
    N, K = q.shape
    out = torch.empty(K // group, N, dtype=torch.int32)
    for i in range(0, N, chunk):
        rows = q[i:i + chunk]
        out[:, i:i + chunk] = rows.view(-1, K // group, group).sum(-1, dtype=torch.int32).t()
    return out


class _engine:
    """Select a quantized engine for prepacking (its packed format), then restore the old one."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.old = torch.backends.quantized.engine
        torch.backends.quantized.engine = self.name

    def __exit__(self, *exc):
        torch.backends.quantized.engine = self.old
        return False


def swap_to_int8(model: nn.Module, names: list[str], kernel: str = "auto") -> dict[str, Int8Linear]:
    """Put empty Int8Linear modules at the named places (replacing nn.Linear, or a tied LM head's None)."""
    def make(old):
        if old is None:  # tied LM head: its own quantized copy of the embedding
            n, k = model.embed.weight.shape
        else:
            n, k = old.out_features, old.in_features
        return Int8Linear(k, n, kernel)

    return swap_modules(model, names, make)


# ---- presets -----------------------------------------------------------------------------------

ATTN_MODULES = ("attn.qkv", "attn.o")
FFN_MODULES = ("mlp.gate_up", "mlp.down")
LM_HEAD = "lm_head"


@dataclass(frozen=True)
class Preset:
    """What `o3edge build --preset NAME` stores: the dense dtype and which linears are INT8 / INT4."""

    name: str
    dtype: str  # of everything not quantized (embedding, norms)
    int4_group_size: int | None  # FFN projections in INT4 (torch's int4pack) when set, else INT8
    summary: str
    int4_all: bool = False  # every linear INT4, the LM head included (INT8 where INT4 cannot take the shape)
    int4_method: str = "rtn"  # how INT4 weights are quantized (gptq.METHODS); gptq ones calibrate at build time


PRESETS = {
    "cpu-int8": Preset("cpu-int8", "float32", None,
                       "every linear layer and the LM head INT8 per row (fbgemm on x86); embedding float32"),
    "cpu-int4": Preset("cpu-int4", "float32", 32,
                       "FFN INT4 group 32 (int4pack), attention projections and LM head INT8; embedding float32"),
    "cpu-int4-all": Preset("cpu-int4-all", "float32", 32,
                           "every linear layer and the LM head INT4 group 32, quantized by GPTQ with searched "
                           "scales (calibrated at build time); embedding float32", int4_all=True,
                           int4_method="gptq-mse"),
}


def int4_targets(model: nn.Module, preset: Preset) -> list[str]:
    """Module names a preset stores in INT4: the FFN projections, or with int4_all every linear, the LM head
    included (tied: its own INT4 copy of the embedding); only shapes the INT4 packers take."""
    if not preset.int4_group_size:
        return []
    names = quantizable(model, preset.int4_group_size, preset.int4_all)
    vocab, hidden = model.embed.weight.shape
    if preset.int4_all and model.lm_head is None and can_quantize(vocab, hidden, preset.int4_group_size):
        names.append(LM_HEAD)
    return names


def int8_targets(model: nn.Module, preset: Preset) -> list[str]:
    """Module names a preset stores in INT8: the attention projections, FFN and LM head that are not INT4."""
    return int8_linears(model, int4_targets(model, preset))


def int8_linears(model: nn.Module, int4_names: list[str]) -> list[str]:
    """The attention projections, FFN and LM head of model not in int4_names (a tied LM head too: its own copy).

    Layers with a bias (Qwen2's qkv) stay dense: Int8Linear is bias-free."""
    int4 = set(int4_names)
    names = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and name.endswith(ATTN_MODULES + FFN_MODULES) and name not in int4:
            if mod.bias is None:
                names.append(name)
            else:
                log.warning("%s stays dense: INT8 layers are bias-free", name)
    return names + ([LM_HEAD] if LM_HEAD not in int4 else [])


def int8_tag(model: nn.Module) -> str:
    """':int8' when the model has INT8 layers ('' otherwise), for cache keys and reports."""
    return ":int8" if any(isinstance(m, Int8Linear) for m in model.modules()) else ""
