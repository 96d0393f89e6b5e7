"""Engine directories: build, load without conversion, refuse broken ones; the precision report."""

import json
import os
import shutil

import pytest
import torch

from o3edge import O3Config, O3Model
from o3edge.engine import loader
from o3edge.engine.checkpoint import fingerprint, read_model_args
from o3edge.engine.engine_dir import (FORMAT_VERSION, MANIFEST, REQUIRED, build_engine_dir, file_sha256,
                                      read_manifest)
from o3edge.engine.precision import PROMPTS, alignment_report
from o3edge.engine.quant import Int4Linear
from o3edge.engine.sequence import SamplingParams
from o3edge.errors import CheckpointError
from tests.helpers import AUTO_CPU_DTYPE, require


@pytest.fixture(scope="module")
def int4_engine(tiny_dir, tmp_path_factory):
    """The tiny checkpoint built as bfloat16 + INT4 FFN, group 64."""
    out = str(tmp_path_factory.mktemp("engines") / "tiny-int4")
    build_engine_dir(tiny_dir, out, torch.bfloat16, 64)
    return out


@pytest.fixture
def broken(int4_engine, tmp_path):
    """A private copy of the INT4 engine to damage, and a helper to edit its manifest."""
    path = str(tmp_path / "engine")
    shutil.copytree(int4_engine, path)

    def edit(change):
        with open(os.path.join(path, MANIFEST)) as fh:
            raw = json.load(fh)
        change(raw)
        with open(os.path.join(path, MANIFEST), "w") as fh:
            json.dump(raw, fh)
        return path

    return path, edit


def engine(path, **kw):
    return O3Model.from_config(O3Config(model_path=path, device="cpu", **kw)).engine


def test_build_writes_manifest_weights_and_tokenizer(tiny_dir, int4_engine):
    files = set(os.listdir(int4_engine))
    assert {"manifest.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json",
            "generation_config.json"} <= files
    m = read_manifest(int4_engine)
    raw = m.raw
    assert raw["format_version"] == 1 and raw["dtype"] == "bfloat16"  # version 2 only for INT8 presets
    assert m.args == read_model_args(tiny_dir)
    assert raw["source"]["fingerprint"] == fingerprint(tiny_dir)
    assert raw["builder"]["torch"] == torch.__version__ and raw["builder"]["o3edge"]
    assert raw["quantization"]["group_size"] == 64 and raw["quantization"]["bits"] == 4
    layers = m.args.num_layers
    assert sorted(m.quantized) == sorted(f"layers.{i}.mlp.{p}" for i in range(layers) for p in ("gate_up", "down"))
    assert raw["tokenizer"]["sha256"] == file_sha256(os.path.join(tiny_dir, "tokenizer.json"))
    assert raw["weights"]["bytes"] == os.path.getsize(os.path.join(int4_engine, "model.safetensors"))
    assert not os.path.exists(int4_engine + ".partial")


def test_engine_dir_loads_as_built_and_generates(tiny_dir, int4_engine):
    """Same weights as quantizing the checkpoint at load time, so the same logits, bit for bit."""
    built = engine(int4_engine, dtype="bfloat16")
    at_load = engine(tiny_dir, dtype="bfloat16", int4_ffn=True, int4_group_size=64)
    # dtype auto: the engine's own bfloat16, or float32 on a CPU that would emulate bf16 products
    assert engine(int4_engine).info.dtype == AUTO_CPU_DTYPE
    assert isinstance(built.runner.model.layers[0].mlp.down, Int4Linear)
    ids = built.encode(PROMPTS[1])
    assert torch.equal(built.score(ids), at_load.score(ids))
    model = O3Model(built)
    result = model.generate(PROMPTS[0], max_new_tokens=12)
    assert result.completion_tokens == 12 or result.finish_reason == "stop"
    assert result.token_ids == O3Model(at_load).generate(PROMPTS[0], max_new_tokens=12).token_ids


def test_loading_an_engine_dir_does_not_quantize(int4_engine, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("quantized at load")

    monkeypatch.setattr(loader, "quantize_int4", refuse)
    monkeypatch.setattr(loader, "build_state_dict", refuse)
    engine(int4_engine)


@pytest.mark.parametrize("variant", ["llama-tied", "llama3-rope-untied", "qwen2-bias", "qwen3-qknorm",
                                     "mha-sharded"])
def test_float32_engine_dir_equals_the_checkpoint(checkpoints, tmp_path, variant):
    src = checkpoints(variant)
    out = str(tmp_path / "e")
    build_engine_dir(src, out, torch.float32, None)
    assert read_manifest(out).raw["quantization"] is None
    a, b = engine(src, dtype="float32"), engine(out)
    ids = a.encode(PROMPTS[3])
    assert torch.equal(a.score(ids), b.score(ids))


def test_int4_ffn_on_a_dense_engine_dir_quantizes_at_load(tiny_dir, tmp_path):
    out = str(tmp_path / "dense")
    build_engine_dir(tiny_dir, out, torch.float32, None)
    e = engine(out, int4_ffn=True, int4_group_size=32)
    assert e.runner.model.layers[0].mlp.gate_up.group_size == 32


def test_build_refuses_to_overwrite_and_leaves_nothing_on_failure(tiny_dir, int4_engine, tmp_path):
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        build_engine_dir(tiny_dir, int4_engine, torch.bfloat16, 64)
    no_tok = str(tmp_path / "src")
    shutil.copytree(tiny_dir, no_tok)
    os.remove(os.path.join(no_tok, "tokenizer.json"))
    out = str(tmp_path / "out")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        build_engine_dir(no_tok, out, torch.bfloat16, 64)
    assert not os.path.exists(out) and not os.path.exists(out + ".partial")


def test_force_replaces_an_engine(tiny_dir, tmp_path):
    out = str(tmp_path / "e")
    build_engine_dir(tiny_dir, out, torch.bfloat16, 64)
    build_engine_dir(tiny_dir, out, torch.float32, None, force=True)
    assert read_manifest(out).raw["dtype"] == "float32"


# ---- broken engine directories -----------------------------------------------------------------

def test_newer_format_version_is_refused(broken):
    path = broken[1](lambda raw: raw.update(format_version=FORMAT_VERSION + 1))
    with pytest.raises(CheckpointError, match="newer than this o3edge reads"):
        engine(path)


def test_mismatched_tokenizer_is_refused(broken, checkpoints):
    path, _ = broken
    shutil.copyfile(os.path.join(checkpoints("qwen2-bias"), "tokenizer.json"), os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer.json"), "a") as fh:
        fh.write(" ")  # even an otherwise identical tokenizer file must match byte for byte
    with pytest.raises(CheckpointError, match="does not match the tokenizer the engine was built with"):
        engine(path)


def test_truncated_weights_are_refused(broken):
    path, _ = broken
    weights = os.path.join(path, "model.safetensors")
    with open(weights, "r+b") as fh:
        fh.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(CheckpointError, match="truncated"):
        engine(path)


def test_missing_weights_file_is_refused(broken):
    path, _ = broken
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.safetensors not found"):
        engine(path)


@pytest.mark.parametrize("field", REQUIRED)
def test_missing_manifest_field_is_refused(broken, field):
    path = broken[1](lambda raw: raw.pop(field))
    with pytest.raises(CheckpointError, match=f"missing field.*{field}"):
        engine(path)


@pytest.mark.parametrize("change,message", [
    (lambda raw: raw["model_args"].pop("hidden_size"), r"model_args has missing field\(s\) \['hidden_size'\]"),
    (lambda raw: raw.update(dtype="int8"), "dtype 'int8' is not"),
    (lambda raw: raw["quantization"].update(group_size=48), "group size 48 is not supported"),
    (lambda raw: raw["tokenizer"].pop("sha256"), "tokenizer needs 'sha256'"),
    (lambda raw: raw["quantization"].update(modules=["layers.0.mlp.down"]), "differ from the manifest"),
    (lambda raw: raw["model_args"].update(intermediate_size=512), "INT4 weights of layers.0.mlp"),
    (lambda raw: raw["model_args"].update(hidden_size=128), "has shape"),
    (lambda raw: raw.update(format="something-else"), "not an o3edge-engine manifest"),
])
def test_inconsistent_manifest_is_refused(broken, change, message):
    path = broken[1](change)
    with pytest.raises(CheckpointError, match=message):
        engine(path)


def test_unreadable_manifest_is_refused(broken):
    path, _ = broken
    with open(os.path.join(path, MANIFEST), "w") as fh:
        fh.write("{not json")
    with pytest.raises(CheckpointError, match="not readable JSON"):
        engine(path)


# ---- the precision report ----------------------------------------------------------------------

def test_report_numbers_recomputed_independently(tiny_dir, int4_engine):
    """The report against numbers computed here from transformers' float32 model and the O3Model API."""
    transformers = require("transformers")
    prompts, n = PROMPTS[:3], 6
    ref, eng = engine(tiny_dir, dtype="float32"), engine(int4_engine)
    report = alignment_report(ref, eng, prompts, n)

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    model = O3Model(engine(int4_engine))
    ids = [model.engine.encode(p) for p in prompts]
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    ref_tokens, eng_tokens, R, E = [], [], [], []
    for p in ids:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
            full = out[0].tolist()
            R.append(hf(out).logits[0].double())
        ref_tokens.append(full[len(p):])
        eng_tokens.append(model.generate_batch([p], params)[0].token_ids)
        E.append(model.engine.score(full).double())
    R, E = torch.cat(R), torch.cat(E)
    assert report.num_positions == R.shape[0] == sum(len(p) + n for p in ids)
    assert report.ref_logits_l2 == pytest.approx(R.norm(dim=1).mean().item(), rel=1e-5)
    assert report.engine_logits_l2 == pytest.approx(E.norm(dim=1).mean().item(), rel=1e-6)
    assert report.relative_error == pytest.approx(((E - R).norm() / R.norm()).item(), rel=1e-3)
    assert report.top1_agreement == pytest.approx((E.argmax(1) == R.argmax(1)).double().mean().item())
    kl = torch.nn.functional.kl_div(E.log_softmax(1), R.log_softmax(1), log_target=True, reduction="batchmean")
    assert report.kl_mean == pytest.approx(kl.item(), rel=1e-2, abs=1e-7)
    agree = sum(a == b for r, e in zip(ref_tokens, eng_tokens) for a, b in zip(r, e))
    assert report.greedy_agreement == pytest.approx(agree / (len(ids) * n))
    assert report.greedy_identical == sum(r == e for r, e in zip(ref_tokens, eng_tokens))
    assert 0 < report.relative_error < 0.5 and report.reference == "float32"
    assert report.engine == f"{AUTO_CPU_DTYPE} + int4 g64"  # what the check ran: the engine's dtype here


def test_report_of_identical_engines_is_exact(tiny_dir):
    a, b = engine(tiny_dir, dtype="float32"), engine(tiny_dir, dtype="float32")
    r = alignment_report(a, b, PROMPTS[:2], 4)
    assert r.relative_error == 0 and r.top1_agreement == 1 and r.greedy_identical == 2 and r.kl_mean == 0
    assert r.ref_logits_l2 == r.engine_logits_l2


# ---- CUDA ----------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_engine_dir_built_on_cpu_runs_on_cuda(int4_engine):
    """INT4 packed for CUDA at load; its logits agree with the CPU INT4 engine's (both bf16 math)."""
    cpu = engine(int4_engine)
    gpu = O3Model.from_config(O3Config(model_path=int4_engine, device="cuda")).engine
    assert gpu.runner.model.layers[0].mlp.gate_up.weight.device.type == "cuda"
    ids = cpu.encode(PROMPTS[1] * 2)
    a, b = cpu.score(ids), gpu.score(ids).cpu()
    assert ((a - b).norm() / a.norm()).item() < 0.02
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() > 0.9
    assert len(O3Model(gpu).generate(PROMPTS[0], max_new_tokens=16).token_ids) > 0


def test_a_bf16_engine_runs_in_float32_on_a_cpu_without_native_bf16(monkeypatch):
    """dtype "auto" takes the engine's built dtype, except bf16 on a CPU that only emulates it."""
    import o3edge.engine.engine as eng

    cpu = torch.device("cpu")
    monkeypatch.setattr(eng, "cpu_bf16", lambda: False)
    assert eng.resolve_dtype("auto", cpu, torch.bfloat16) == torch.float32
    assert eng.resolve_dtype("bfloat16", cpu, torch.bfloat16) == torch.bfloat16  # asked for by name
    assert eng.resolve_dtype("auto", torch.device("cuda"), torch.bfloat16) == torch.bfloat16
    monkeypatch.setattr(eng, "cpu_bf16", lambda: True)
    assert eng.resolve_dtype("auto", cpu, torch.bfloat16) == torch.bfloat16



def _mappings(path: str) -> set[tuple[int, int, int]]:
    """(start address, end address, file offset) of each mapping of the file at path (/proc/self/maps)."""
    out = set()
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) >= 6 and parts[5] == path:
                start, end = (int(x, 16) for x in parts[0].split("-"))
                out.add((start, end, int(parts[2], 16)))
    return out


def _present(address: int, pages: int) -> int:
    """How many of the pages from address on are resident in this process (/proc/self/pagemap, bit 63)."""
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/pagemap", "rb") as fh:
        fh.seek(address // page * 8)
        data = fh.read(pages * 8)
    return sum(int.from_bytes(data[i:i + 8], "little") >> 63 for i in range(0, len(data), 8))


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="needs Linux /proc")
def test_loading_an_int4_engine_drops_its_int4_file_pages(tmp_path, texts):
    """INT4 layers are packed into copies at load, and the engine file's pages under every INT4 tensor
    (codes and scales) are dropped as each layer is packed, so the file's bytes and the packed copies
    are never all resident at once: the peak memory of a CPU gateway's process. Checked page by page."""
    import json as _json
    import struct

    from o3edge.tiny import make_checkpoint

    src = make_checkpoint(str(tmp_path / "src"), texts=texts, hidden_size=512, intermediate_size=2048,
                          num_layers=2)
    out = str(tmp_path / "engine")
    build_engine_dir(src, out, torch.float32, 32, int4_all=True)
    path = os.path.realpath(read_manifest(out).weights_path)
    with open(path, "rb") as fh:
        size = struct.unpack("<Q", fh.read(8))[0]
        header = _json.loads(fh.read(size))
    base = 8 + size
    page = os.sysconf("SC_PAGE_SIZE")
    before = _mappings(path)
    eng = engine(out, dtype="float32")
    new = [m for m in _mappings(path) - before if m[2] == 0]
    assert len(new) == 1, "the engine file is mapped once, from its start"
    start = new[0][0]
    checked = resident = 0
    for name, meta in header.items():
        if not name.endswith((".qweight", ".scales_and_zeros")):
            continue
        lo, hi = base + meta["data_offsets"][0], base + meta["data_offsets"][1]
        first, last = -(-lo // page), hi // page  # the pages wholly inside the tensor
        if last > first:
            checked += last - first
            resident += _present(start + first * page, last - first)
    assert checked > 100 and resident == 0, f"{resident} of {checked} INT4 pages still resident"
    assert eng.score(eng.encode("def f(x): return x")).isfinite().all()  # the packed copies serve
