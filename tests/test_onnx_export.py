"""ONNX export: the exported decoder run by ONNX Runtime against the torch engine (the article's
precision-alignment table), and the `o3edge export` / `inspect` commands."""

import json
import os

import pytest

ort = pytest.importorskip("onnxruntime")

from o3edge.build_cli import main as o3edge_main  # noqa: E402
from o3edge.export.onnx_export import check_onnx, export_onnx, load_torch_engine  # noqa: E402
from o3edge.export.ort_engine import OrtDecoder  # noqa: E402
from o3edge.model_path import SHIPPED_MODEL  # noqa: E402


@pytest.mark.parametrize("variant", ["llama-tied", "qwen2-bias", "qwen3-qknorm"])
def test_float32_export_matches_the_torch_engine(checkpoints, tmp_path, variant):
    src = checkpoints(variant)
    export_onnx(src, str(tmp_path))
    engine, onnx = load_torch_engine(src), OrtDecoder(str(tmp_path))
    ids = engine.encode("import os\nimport sys\n\ndef main(argv):\n" * 3)
    assert (onnx.score(ids) - engine.score(ids)).abs().max() < 1e-4
    report = check_onnx(src, str(tmp_path), num_new_tokens=32)
    assert report.top1_agreement == 1.0 and report.greedy_identical == report.num_prompts  # 8 x 32 tokens
    assert report.relative_error < 1e-5


def test_reference_model_exports_in_float32_and_float16(tmp_path):
    src = SHIPPED_MODEL
    export_onnx(src, str(tmp_path / "fp32"))
    engine = load_torch_engine(src)
    ids = engine.encode("The json module")
    assert (OrtDecoder(str(tmp_path / "fp32")).score(ids) - engine.score(ids)).abs().max() < 1e-4
    export_onnx(src, str(tmp_path / "fp16"), "float16")
    report = check_onnx(src, str(tmp_path / "fp16"), num_new_tokens=16)  # against the torch engine in fp16
    assert report.relative_error < 0.01 and report.top1_agreement > 0.95


def test_export_command_stores_the_table_and_inspect_shows_it(tiny_dir, tmp_path, capsys):
    out = str(tmp_path / "onnx")
    assert o3edge_main(["export", tiny_dir, out, "--check", "--check-tokens", "8"]) == 0
    manifest = json.load(open(os.path.join(out, "onnx.json")))
    assert manifest["precision_report"]["greedy_identical"] == 8
    assert manifest["inputs"][:3] == ["input_ids", "position_ids", "attention_mask"]
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    capsys.readouterr()
    assert o3edge_main(["inspect", out]) == 0
    shown = capsys.readouterr().out
    assert "opset 17" in shown and "top-1 agreement" in shown and "100.00%" in shown
