"""ONNX export: the exported decoder run by ONNX Runtime against the torch engine (the article's
precision-alignment table), and the `o3edge export` / `inspect` commands."""

import json
import os

import pytest

from tests.helpers import require

ort = require("onnxruntime")

from o3edge.build_cli import main as o3edge_main  # noqa: E402
from o3edge.export.onnx_export import check_onnx, export_onnx, load_torch_engine  # noqa: E402
from o3edge.export.ort_engine import OrtDecoder  # noqa: E402
from o3edge.engine.sequence import SamplingParams  # noqa: E402
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


def test_int4_export_uses_matmulnbits_and_agrees_with_torch_int4(tmp_path, monkeypatch):
    from o3edge.engine import cpu_quant

    # against torch's int4pack (float activations, MatMulNBits' math), not o3edge's VNNI kernel (int8 activations)
    monkeypatch.setattr(cpu_quant, "vnni_fits", lambda *shape: False)
    onnx = require("onnx")
    src = SHIPPED_MODEL
    manifest = export_onnx(src, str(tmp_path), int4_group=32)
    ops = {n.op_type for n in onnx.load(str(tmp_path / "model.onnx")).graph.node}
    assert "MatMulNBits" in ops and manifest["int4_modules"] == 2 * 5  # gate_up and down of 5 layers
    report = check_onnx(src, str(tmp_path), num_new_tokens=32)  # against torch's own INT4 g32 engine
    assert report.greedy_agreement >= 0.95 and report.relative_error < 0.01


def test_onnxruntime_backend_generates_what_the_torch_engine_does(tmp_path):
    from o3edge import O3Config, O3Model

    export_onnx(SHIPPED_MODEL, str(tmp_path))
    onnx = O3Model.from_config(O3Config(model_path=str(tmp_path), backend="onnxruntime", device="cpu"))
    torch_engine = O3Model.from_config(O3Config(model_path=SHIPPED_MODEL, device="cpu"))
    prompts = [onnx.engine.encode(p) for p in ("The json module", "import os\n", "class Queue:")]
    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
    assert ([r.token_ids for r in onnx.generate_batch(prompts, greedy)]
            == [r.token_ids for r in torch_engine.generate_batch(prompts, greedy)])  # continuous batching
    sampled = dict(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=7)
    assert onnx.generate("def f(x):", **sampled).token_ids == torch_engine.generate("def f(x):", **sampled).token_ids
    assert not onnx.engine.blocks.prefix_caching  # ONNX Runtime keeps dense KV per sequence: no sharing


def test_daemon_serves_an_onnx_export(tmp_path):
    from o3edge.ipc.client import O3Client
    from tests.ipc.conftest import DaemonProcess

    export = str(tmp_path / "onnx")
    export_onnx(SHIPPED_MODEL, export)
    daemon = DaemonProcess(str(tmp_path), export)
    with open(daemon.config) as fh:
        config = fh.read().replace("[engine]\n", '[engine]\nbackend = "onnxruntime"\n', 1)
    with open(daemon.config, "w") as fh:
        fh.write(config)
    daemon.start()
    try:
        daemon.wait_ready()
        with O3Client(daemon.endpoint, timeout=30.0) as client:
            done = client.generate("The json module", max_tokens=12, ignore_eos=True)
            assert len(done.token_ids) == 12 and done.text and done.finish_reason == "length"
            assert done.usage["prompt_tokens"] > 0 and done.energy is not None  # accounted like torch's
    finally:
        assert daemon.stop() == 0
