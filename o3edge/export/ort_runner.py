"""The engine's runner for `backend = "onnxruntime"`: steps run on an `o3edge export` directory.

Same scheduler, protocol, limits and energy accounting as the torch backend; what differs is below
the runner: each sequence keeps its own dense KV tensors (the graph's outputs fed back as inputs),
the step's sequences run one ONNX Runtime call each, and there is no prefix reuse across requests
(the engine turns it off for this backend). A preempted sequence starts over from its first token,
as with the torch backend.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import torch

from o3edge.engine.sampling import make_generator, pick_tokens
from o3edge.errors import CheckpointError
from o3edge.export.onnx_export import MANIFEST


def is_onnx_dir(path: str) -> bool:
    return os.path.exists(os.path.join(path, MANIFEST)) and os.path.exists(os.path.join(path, "model.onnx"))


def onnx_fingerprint(onnx_dir: str) -> str:
    """The export's identity: its manifest, and the model file's size and first and last bytes."""
    if not is_onnx_dir(onnx_dir):
        raise CheckpointError(f"{onnx_dir}: not an ONNX export (no onnx.json and model.onnx); "
                              "make one with `o3edge export SRC OUT`")
    digest = hashlib.blake2b(digest_size=16)
    for name in (MANIFEST, "model.onnx", "model.onnx.data"):
        path = os.path.join(onnx_dir, name)
        if os.path.exists(path):
            size = os.path.getsize(path)
            digest.update(f"{name}:{size}".encode())
            with open(path, "rb") as fh:
                digest.update(fh.read(1 << 16))
                fh.seek(max(0, size - (1 << 16)))
                digest.update(fh.read())
    return digest.hexdigest() + ":onnx"


def onnx_dtype(onnx_dir: str) -> torch.dtype:
    with open(os.path.join(onnx_dir, MANIFEST)) as fh:
        return getattr(torch, json.load(fh)["dtype"])


class OrtRunner:
    """runner.run / release / prompt_logits over ONNX Runtime (see module docstring)."""

    def __init__(self, onnx_dir: str, device: torch.device, num_threads: int | None, seed: int = 0):
        from o3edge.export.ort_engine import OrtDecoder

        providers = ["CPUExecutionProvider"] if device.type == "cpu" else None
        self.decoder = OrtDecoder(onnx_dir, providers, num_threads)
        self.kv: dict[int, list[np.ndarray]] = {}
        self.generators: dict[int, torch.Generator | None] = {}
        self._seed = seed
        self.last_logits: torch.Tensor | None = None
        self.model = None  # no torch module behind this runner
        self.graphs = self.prefill_graphs = None

    def run(self, batch) -> list[int | None]:
        """Compute each sequence's new tokens (one ONNX Runtime call each) and sample where a prompt is done."""
        rows = []
        for seq, n in batch:
            start = seq.num_computed_tokens
            past = self.kv.get(seq.seq_id) if start else self.decoder.empty_past()
            if past is None:
                raise RuntimeError(f"sequence {seq.seq_id} resumes at {start} without its KV (prefix reuse is off here)")
            logits, self.kv[seq.seq_id] = self.decoder.forward(seq.token_ids[start:start + n], start, past)
            rows.append(logits[-1])
        logits = torch.from_numpy(np.stack(rows).astype(np.float32))  # [B, V]
        self.last_logits = logits
        return pick_tokens(batch, logits, self._generator)

    def _generator(self, seq):
        if seq.seq_id not in self.generators:
            self.generators[seq.seq_id] = make_generator(seq.params, torch.device("cpu"), self._seed + seq.seq_id)
        return self.generators[seq.seq_id]

    def prompt_logits(self, seq) -> torch.Tensor:
        return self.decoder.score(seq.token_ids[seq.num_computed_tokens:])

    def release(self, seq) -> None:
        self.kv.pop(seq.seq_id, None)
        self.generators.pop(seq.seq_id, None)
