"""The shipped reference model (o3edge/models/o3edge-ref) and the script that trains it."""

import json
import os
import subprocess
import sys

import pytest
import torch

from o3edge import O3Config, O3Model
from o3edge.engine.sequence import SamplingParams
from o3edge.model_path import SHIPPED_MODEL, resolve_model_path
from tests.helpers import require

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "The json module"
NUM_NEW = 32
# captured once from the FP32 engine on the shipped checkpoint; the test also checks transformers agrees
# (its smallest top-1 margin along the way is 0.05 logits, far above float32 noise)
EXPECTED = ("The json module is a simple wrapper for the JSON\nrepresentation.  It provides a simple serialization "
            "for JSON,\nrepresentation of JSON, and adds a JSON serial")
DOC_TEXT = """:mod:`json` --- JSON encoder and decoder
========================================

.. function:: dumps(obj, *, skipkeys=False, ensure_ascii=True, indent=None)

   Serialize *obj* to a JSON formatted :class:`str` using this conversion table.
   If *indent* is a non-negative integer or string, then JSON array elements and
   object members will be pretty-printed with that indent level.
"""


@pytest.fixture(scope="module")
def model():
    return O3Model.from_config(O3Config(device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def hf():
    transformers = require("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL, dtype=torch.float32).eval()


def test_shipped_model_is_the_default_and_small():
    assert resolve_model_path(None) == SHIPPED_MODEL
    with open(os.path.join(SHIPPED_MODEL, "config.json")) as fh:
        assert json.load(fh)["architectures"] == ["LlamaForCausalLM"]
    size = sum(os.path.getsize(os.path.join(SHIPPED_MODEL, f)) for f in os.listdir(SHIPPED_MODEL))
    assert size <= 20_000_000
    assert os.path.exists(os.path.join(SHIPPED_MODEL, "MODEL_CARD.md"))


def test_fp32_logits_match_transformers(model, hf):
    ids = model.engine.encode(DOC_TEXT)
    ours = model.engine.score(ids)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


def test_greedy_output_is_stable_and_equals_transformers(model, hf):
    ids = model.engine.encode(PROMPT)
    result = model.generate_batch([ids], SamplingParams(max_new_tokens=NUM_NEW, ignore_eos=True))[0]
    out = hf.generate(torch.tensor([ids]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False,
                      pad_token_id=0, eos_token_id=None)
    assert result.token_ids == out[0, len(ids):].tolist()
    assert PROMPT + result.text == EXPECTED


def test_training_script_lowers_the_loss_on_cpu(tmp_path):
    out, metrics = tmp_path / "ckpt", tmp_path / "metrics.json"
    cmd = [sys.executable, os.path.join(REPO, "tools", "train_reference.py"), "--tiny", "--device", "cpu",
           "--steps", "40", "--sources", "stdlib", "--max-docs", "150", "--eval-every", "20",
           "--out", str(out), "--metrics", str(metrics)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    m = json.loads(metrics.read_text())
    assert m["last_loss"] < m["first_loss"] - 0.5
    assert m["evals"][-1]["valid_loss"] < m["evals"][0]["valid_loss"]
    engine = O3Model.from_config(O3Config(model_path=str(out), device="cpu", dtype="float32")).engine
    assert engine.score(engine.encode("import json")).shape[1] == 512


SHIPPED_ENGINE = os.path.join(os.path.dirname(SHIPPED_MODEL), "o3edge-ref-int4")


def test_shipped_int4_engine_loads_and_stays_close_to_fp32(model):
    """The shipped engine directory (bf16 + INT4 FFN, group 32) loads without re-quantization and
    predicts the same next token as the FP32 checkpoint on >= 85% of a documentation page."""
    with open(os.path.join(SHIPPED_ENGINE, "manifest.json")) as fh:
        manifest = json.load(fh)
    int4 = O3Model.from_config(O3Config(model_path=SHIPPED_ENGINE, device="cpu"))
    assert int4.engine.info.dtype == "bfloat16"
    ids = model.engine.encode(DOC_TEXT)
    ref, got = model.engine.score(ids), int4.engine.score(ids)
    agreement = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert agreement >= 0.85
    assert manifest["precision_report"]  # `o3edge build --check` stored its report
    assert int4.generate(PROMPT, max_new_tokens=8).text.strip()
