"""An exported ONNX decoder run by ONNX Runtime, with the two calls the precision report needs.

`score` prefills a token sequence and returns float32 logits at every position; `greedy` decodes
with the graph's own KV outputs fed back as inputs. The execution provider is chosen automatically
(TensorRT, then CUDA, then CPU: whichever this ONNX Runtime build has).
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from o3edge.export.onnx_export import MANIFEST

PREFERRED_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")


class OrtDecoder:
    def __init__(self, onnx_dir: str, providers: list[str] | None = None, num_threads: int | None = None):
        import onnxruntime as ort

        with open(os.path.join(onnx_dir, MANIFEST)) as fh:
            self.manifest = json.load(fh)
        available = ort.get_available_providers()
        chosen = providers or [p for p in PREFERRED_PROVIDERS if p in available]
        options = ort.SessionOptions()
        if num_threads:
            options.intra_op_num_threads = num_threads
        self.session = ort.InferenceSession(os.path.join(onnx_dir, "model.onnx"), options, providers=chosen)
        self.provider = self.session.get_providers()[0]
        m = self.manifest
        self.kv_dtype = np.float16 if m["dtype"] == "float16" else np.float32
        self.kv_shape = (m["num_kv_heads"], m["head_dim"])

    def describe(self) -> str:
        g = self.manifest.get("int4_group_size")
        kind = self.manifest["dtype"] + (f" + int4 g{g} MatMulNBits" if g else "")
        return f"onnxruntime {kind} ({self.provider.removesuffix('ExecutionProvider')})"

    def forward(self, ids: list[int], start: int, past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        """One call for one sequence: logits [T, V] of ids at positions start.., and the new KV."""
        T = len(ids)
        feed = {"input_ids": np.array([ids], dtype=np.int64),
                "position_ids": np.arange(start, start + T, dtype=np.int64)[None],
                "attention_mask": np.ones((1, start + T), dtype=np.int64)}
        feed.update(zip(self.manifest["inputs"][3:], past))
        out = self.session.run(None, feed)
        return out[0][0], out[1:]

    def empty_past(self) -> list[np.ndarray]:
        heads, hd = self.kv_shape
        return [np.zeros((1, heads, 0, hd), dtype=self.kv_dtype) for _ in self.manifest["inputs"][3:]]

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Float32 logits [len, V] at every position, from one prefill."""
        logits, _ = self.forward(list(token_ids), 0, self.empty_past())
        return torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32))

    def greedy(self, prompts: list[list[int]], num_new_tokens: int) -> list[list[int]]:
        """num_new_tokens greedy tokens for each prompt (EOS ignored), decoding with the KV outputs."""
        out = []
        for ids in prompts:
            logits, past = self.forward(list(ids), 0, self.empty_past())
            tokens = [int(logits[-1].argmax())]
            while len(tokens) < num_new_tokens:
                logits, past = self.forward([tokens[-1]], len(ids) + len(tokens) - 1, past)
                tokens.append(int(logits[-1].argmax()))
            out.append(tokens)
        return out
