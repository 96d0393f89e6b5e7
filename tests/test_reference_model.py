"""The shipped reference models (o3edge/models/o3edge-ref, and the default, o3edge-ref-long-int4) and the
script that trains them."""

import json
import os
import subprocess
import sys

import pytest
import torch

from o3edge import O3Config, O3Model
from o3edge.engine.sequence import SamplingParams
from o3edge.engine.cpu_quant import cpu_bf16
from o3edge.model_path import DEFAULT_MODEL, SHIPPED_MODEL, resolve_model_path
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
    return O3Model.from_config(O3Config(model_path=SHIPPED_MODEL, device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def hf():
    transformers = require("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL, dtype=torch.float32).eval()


def test_shipped_model_is_small():
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
    assert int4.engine.info.dtype == ("bfloat16" if cpu_bf16() else "float32")  # no native bf16: float32
    ids = model.engine.encode(DOC_TEXT)
    ref, got = model.engine.score(ids), int4.engine.score(ids)
    agreement = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert agreement >= 0.85
    assert manifest["precision_report"]  # `o3edge build --check` stored its report
    assert int4.generate(PROMPT, max_new_tokens=8).text.strip()


@pytest.fixture(scope="module")
def default_model():
    return O3Model.from_config(O3Config(device="cpu", dtype="float32"))


def test_the_default_is_the_long_reference_engine_within_its_size(default_model):
    assert resolve_model_path(None) == DEFAULT_MODEL
    size = sum(os.path.getsize(os.path.join(DEFAULT_MODEL, f)) for f in os.listdir(DEFAULT_MODEL))
    assert size <= 40_000_000  # issue 15: at most 40 MB as INT4
    for name in ("MODEL_CARD.md", "LICENSE-PSF.txt"):
        assert os.path.exists(os.path.join(DEFAULT_MODEL, name))
    with open(os.path.join(DEFAULT_MODEL, "manifest.json")) as fh:
        manifest = json.load(fh)
    assert manifest["precision_report"] and manifest["quantization"]["group_size"] == 32
    assert default_model.engine.info.max_model_len == 4096


def test_the_default_model_answers_a_question_about_the_docs(default_model):
    """A chat request (ChatML through the chat template, no raw prompt) gets the documented answer."""
    out = default_model.generate(messages=[{"role": "user", "content": "What does json.dumps do?"}],
                                 max_new_tokens=24)
    assert out.text.startswith("Serialize obj to a JSON formatted str")


def test_the_default_model_finds_a_pass_key_a_thousand_tokens_back(default_model):
    """Pass keys 1,000 tokens into standard-library docstrings, halfway down: the model finds ~80% of keys at
    this length (its misses are one digit off), so at least two of these three."""
    import collections

    sys.path.insert(0, os.path.join(REPO, "tools"))
    import passkey

    engine = default_model.engine
    filler = engine.encode((json.__doc__ + collections.__doc__ + os.__doc__) * 4)
    keys = ("48213", "73905", "26841")
    prompts = [passkey.example(engine.encode, filler, 1000, 0.5, key).prompt for key in keys]
    outs = default_model.generate_batch(prompts, SamplingParams(max_new_tokens=8))
    assert sum(passkey.found(key, out.text) for key, out in zip(keys, outs)) >= 2
