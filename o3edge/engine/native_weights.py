"""An engine directory's weights as the native CPU step's model (native_lib.Model), read without torch.

The safetensors file is mapped, not read: the dense float32 embedding stays a view of the file, so only
the rows of tokens actually seen become resident. Quantized linears are packed into the VNNI layouts of
cpu_kernels.h (the same packing the torch backend does through its operators), and each layer's file
pages are dropped once it is packed, so file and packed copies are never all resident at once.

What the step runs is what the CPU presets store: INT4 (group-wise) and INT8 (per row) linears. A dense
linear (a GPU build's attention projections, a tied LM head without its own quantized copy) is quantized
to INT8 per row here, exactly as `o3edge build --preset cpu-int8` stores it.
"""

from __future__ import annotations

import json
import mmap

import numpy as np

from o3edge import memory
from o3edge.engine import native_lib
from o3edge.engine.manifest import Manifest
from o3edge.errors import CheckpointError

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U8": np.uint8, "I8": np.int8,
           "I32": np.int32, "I64": np.int64}


class SafeTensors:
    """A safetensors file's tensors as numpy views of one read-only mapping (bf16 as its uint16 bits)."""

    def __init__(self, path: str):
        try:
            with open(path, "rb") as fh:
                self.map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            size = int.from_bytes(self.map[:8], "little")
            header = json.loads(self.map[8:8 + size])
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from None
        header.pop("__metadata__", None)
        self.base, self.path = 8 + size, path
        self.entries = header
        self.buffer = np.frombuffer(self.map, dtype=np.uint8)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def get(self, name: str) -> np.ndarray:
        entry = self.entries.get(name)
        if entry is None:
            raise CheckpointError(f"{self.path}: no tensor {name}")
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {entry['dtype']}")
        start, end = entry["data_offsets"]
        return self.buffer[self.base + start:self.base + end].view(dtype).reshape(entry["shape"])

    def is_bf16(self, name: str) -> bool:
        return self.entries[name]["dtype"] == "BF16"

    def drop_pages(self, names: list[str]) -> None:
        """Drop the resident file pages of these tensors (they were copied into packed layouts); a later
        read would fault them back in unchanged."""
        for name in names:
            start, end = self.entries[name]["data_offsets"]
            memory.drop_pages(self.buffer.ctypes.data + self.base + start, end - start)


def as_float32(values: np.ndarray, bf16: bool) -> np.ndarray:
    """A dense tensor as float32 (bf16 bits widen exactly; float32 stays the file's view)."""
    if bf16:
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values if values.dtype == np.float32 else values.astype(np.float32)


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w float32 [N, K] -> (q int8 [N, K], scales float32 [N]): cpu_quant.quantize_int8's rounding."""
    scales = np.maximum(np.abs(w).max(axis=1) / np.float32(127), np.float32(1e-12)).astype(np.float32)
    q = np.clip(np.round(w / scales[:, None]), -127, 127).astype(np.int8)
    return q, scales


class _Reader:
    """Turns the engine's tensors, module by module, into native_lib.Linear layers."""

    def __init__(self, st: SafeTensors, manifest: Manifest):
        self.st, self.group = st, manifest.group_size
        self.int4 = set(manifest.quantized)

    def dense(self, name: str) -> np.ndarray:
        return as_float32(self.st.get(name), self.st.is_bf16(name))

    def linear(self, module: str, out_features: int, in_features: int, dense_from: str | None = None) -> native_lib.Linear:
        """The module's INT4, INT8 or dense weight as a packed layer (dense_from: the tensor a tied head
        without a quantized copy of its own is made from)."""
        st = self.st
        if module in self.int4:
            qweight, sz = st.get(module + ".qweight"), st.get(module + ".scales_and_zeros")
            Kp = qweight.shape[1] * 2
            if qweight.shape[0] != out_features or sz.shape != (Kp // self.group, out_features, 2):
                raise CheckpointError(f"INT4 weights of {module}: shapes {qweight.shape}, {sz.shape}")
            layer = native_lib.Linear(True, native_lib.pack_int4_rows16(qweight), native_lib.aligned(sz[..., 0]),
                                      native_lib.aligned(sz[..., 1]), out_features, in_features, Kp, self.group)
            st.drop_pages([module + ".qweight", module + ".scales_and_zeros"])
            return layer
        if module + ".qweight8" in st:
            q = st.get(module + ".qweight8")
            scales = native_lib.aligned(st.get(module + ".scales8").astype(np.float32))
            dropped = [module + ".qweight8"]
        else:
            name = dense_from or module + ".weight"
            if name not in st:
                raise CheckpointError(f"{st.path}: no weights for {module}")
            q, scales = quantize_int8(self.dense(name))
            dropped = [] if dense_from else [name]
        if q.shape != (out_features, in_features):
            raise CheckpointError(f"weights of {module}: shape {q.shape}, expected {(out_features, in_features)}")
        G = native_lib.activation_group(in_features)
        if out_features % 16 or G < 4:
            raise CheckpointError(f"{module} ({out_features}x{in_features}): the native step needs rows in "
                                  "multiples of 16 and columns in multiples of 4")
        layer = native_lib.Linear(False, native_lib.pack_int8_rows16(q), native_lib.group_sums(q, G), scales,
                                  out_features, in_features, in_features, G)
        st.drop_pages(dropped)
        return layer


def load_native_model(manifest: Manifest) -> native_lib.Model:
    """The engine directory's model for the native step; CheckpointError for what it cannot run."""
    args = manifest.args
    if args.attention_bias:
        raise CheckpointError("the native backend runs bias-free llama-family models; this one has attention "
                              "biases (Qwen2): use backend = \"torch\"")
    st = SafeTensors(manifest.weights_path)
    r = _Reader(st, manifest)
    D, H, KVH, hd, I = args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim, args.intermediate_size
    layers = []
    for i in range(args.num_layers):
        p = f"layers.{i}."
        layers.append({
            "input_norm": r.dense(p + "input_norm.weight"), "post_norm": r.dense(p + "post_norm.weight"),
            "q_norm": r.dense(p + "attn.q_norm.weight") if args.qk_norm else None,
            "k_norm": r.dense(p + "attn.k_norm.weight") if args.qk_norm else None,
            "qkv": r.linear(p + "attn.qkv", (H + 2 * KVH) * hd, D), "o": r.linear(p + "attn.o", D, H * hd),
            "gate_up": r.linear(p + "mlp.gate_up", 2 * I, D), "down": r.linear(p + "mlp.down", D, I)})
    embed = r.dense("embed.weight")  # float32 engines: a view of the file, resident row by row as tokens come
    tied = args.tie_word_embeddings and "lm_head.qweight" not in st and "lm_head.qweight8" not in st
    head = r.linear("lm_head", args.vocab_size, D, dense_from="embed.weight" if tied else None)
    memory.trim()  # the packers' freed scratch back to the OS (glibc keeps it otherwise)
    return native_lib.Model(embed, r.dense("norm.weight"), layers, head, H, KVH, hd, args.rms_norm_eps)

