"""CPU presets: INT8 layers, kernel choice and its fallbacks, preset engine builds that load and generate."""

import os

import pytest
import torch

from o3edge import O3Config, O3Model
from o3edge.engine import cpu_quant
from o3edge.engine.cpu_quant import Int8Linear, dequantize_int8, pick_int8_kernel, quantize_int8
from o3edge.engine.engine_dir import build_engine_dir, read_manifest
from o3edge.engine.precision import alignment_report
from o3edge.engine.quant import Int4Linear
from o3edge.engine.sequence import SamplingParams


def test_int8_round_trip_is_within_half_a_step_per_row():
    w = torch.randn(64, 96) * torch.logspace(-3, 0, 64)[:, None]  # rows of very different scales
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (64,)
    err = (dequantize_int8(q, scales) - w).abs()
    assert (err <= scales[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("kernel,tol", [("dense", 1e-5), ("int8pack", 2e-2), ("fbgemm", 3e-2)])
@pytest.mark.parametrize("rows", [1, 5, 130])
def test_int8_linear_matches_its_dequantized_weight(kernel, tol, rows):
    if kernel == "fbgemm" and not cpu_quant.has_fbgemm():
        pytest.skip("no fbgemm in this build of torch")
    w = torch.randn(48, 80)
    q, scales = quantize_int8(w)
    layer = Int8Linear(80, 48, kernel)
    layer.load_quantized(q, scales)
    x = torch.randn(2, rows, 80)
    ref = x @ dequantize_int8(q, scales).T
    out = layer(x)
    assert out.shape == (2, rows, 48) and out.dtype == torch.float32
    assert (out - ref).norm() / ref.norm() < tol


def test_kernel_choice_falls_back_when_fbgemm_is_missing(monkeypatch):
    assert pick_int8_kernel("dense") == "dense"
    monkeypatch.setattr(cpu_quant, "has_fbgemm", lambda: False)
    assert pick_int8_kernel() == "int8pack"
    assert pick_int8_kernel("fbgemm") == "int8pack"
    with pytest.raises(ValueError):
        pick_int8_kernel("int3")


def test_fbgemm_uses_7_bit_activations_without_vnni(monkeypatch):
    monkeypatch.setattr(cpu_quant, "cpu_features", lambda: {"avx2"})
    assert Int8Linear(16, 16, "dense").reduce_range
    monkeypatch.setattr(cpu_quant, "cpu_features", lambda: {"avx2", "avx512f", "avx512_vnni"})
    assert not Int8Linear(16, 16, "dense").reduce_range


def test_int8_linear_refuses_wrong_shapes():
    layer = Int8Linear(32, 16, "dense")
    with pytest.raises(ValueError):
        layer.load_quantized(torch.zeros(16, 31, dtype=torch.int8), torch.ones(16))
    with pytest.raises(ValueError):
        layer.load_quantized(torch.zeros(16, 32, dtype=torch.int8), torch.ones(15))


@pytest.fixture(scope="module")
def presets(checkpoints, tmp_path_factory):
    """(variant, preset) -> engine directory, built on first use."""
    root, built = tmp_path_factory.mktemp("presets"), {}

    def get(variant, preset):
        if (variant, preset) not in built:
            out = str(root / f"{variant}-{preset}")
            build_engine_dir(checkpoints(variant), out, torch.bfloat16, None, preset=preset)
            built[variant, preset] = out
        return built[variant, preset]

    return get


@pytest.mark.parametrize("variant", ["llama-tied", "qwen2-bias", "qwen3-qknorm"])
@pytest.mark.parametrize("preset", ["cpu-int8", "cpu-int4"])
def test_preset_engine_loads_what_it_stored_and_generates(presets, variant, preset):
    path = presets(variant, preset)
    m = read_manifest(path)
    assert m.raw["format_version"] == 2 and m.preset == preset and m.raw["dtype"] == "float32"
    assert "lm_head" in m.int8_modules  # tied or not, the LM head is INT8
    assert (m.group_size is not None) == (preset == "cpu-int4")
    model = O3Model.from_config(O3Config(backend="torch", model_path=path, device="cpu"))
    layers = dict(model.engine.runner.model.named_modules())
    assert sorted(n for n, mod in layers.items() if isinstance(mod, Int8Linear)) == sorted(m.int8_modules)
    assert sorted(n for n, mod in layers.items() if isinstance(mod, Int4Linear)) == sorted(m.quantized)
    if variant == "qwen2-bias":  # Int8Linear is bias-free: qkv with a bias stays dense
        assert not any(n.endswith("attn.qkv") for n in m.int8_modules)
    ids = model.engine.encode("def main():")
    out = model.generate_batch([ids, ids[:3]], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert [o.completion_tokens for o in out] == [12, 12]


@pytest.mark.parametrize("variant", ["llama-tied", "llama3-rope-untied", "qwen2-bias"])
def test_int8_weights_at_load_take_every_linear_left_dense(checkpoints, presets, tmp_path, variant):
    """int8_weights: alone, every linear INT8 (the LM head too: a tied one as its own copy, the embedding
    staying dense for the lookup; a projection with a bias stays dense); beside int4_ffn, the attention
    projections and the head; the fingerprint says so; a dense engine directory quantized at load matches
    the checkpoint; an engine that stores INT8 layers keeps its own; and the logits stay close to dense."""
    src = checkpoints(variant)
    cfg = dict(device="cpu", dtype="float32", kv_cache_memory_mb=16, max_model_len=256)
    dense = O3Model.from_config(O3Config(model_path=src, **cfg)).engine
    alone = O3Model.from_config(O3Config(model_path=src, int8_weights=True, **cfg)).engine
    mixed = O3Model.from_config(O3Config(model_path=src, int8_weights=True, int4_ffn=True, int4_group_size=32,
                                         **cfg)).engine

    def kinds(engine):
        return {n: type(mod).__name__ for n, mod in engine.runner.model.named_modules()
                if isinstance(mod, (torch.nn.Linear, Int8Linear, Int4Linear))}

    layers = dense.info.args.num_layers
    biased = {f"layers.{i}.attn.qkv" for i in range(layers)} if variant == "qwen2-bias" else set()
    assert {n for n, k in kinds(alone).items() if k != "Int8Linear"} == biased
    assert "lm_head" in kinds(alone) and alone.runner.model.embed.weight.dtype == torch.float32
    got = kinds(mixed)
    assert all(k == ("Int4Linear" if ".mlp." in n else "Linear" if n in biased else "Int8Linear")
               for n, k in got.items()), got
    assert alone.info.fingerprint.endswith(":int8") and mixed.info.fingerprint.endswith(":int4g32:int8")
    ids = alone.encode("def main():\n    return [x for x in range(10)]")
    ref, a = dense.score(ids), alone.score(ids)
    kl = torch.nn.functional.kl_div(a.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean")
    assert kl < 0.01 and (a.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85
    engine = str(tmp_path / "dense")
    build_engine_dir(src, engine, torch.float32, None)
    built = O3Model.from_config(O3Config(model_path=engine, int8_weights=True, **cfg)).engine
    assert kinds(built) == kinds(alone)
    torch.testing.assert_close(built.score(ids), a, rtol=0, atol=0)
    stored = presets(variant, "cpu-int4")  # INT8 attention and head stored, FFN INT4: nothing added at load
    kept = O3Model.from_config(O3Config(backend="torch", model_path=stored, int8_weights=True, **cfg)).engine
    assert sorted(n for n, k in kinds(kept).items() if k == "Int8Linear") == sorted(read_manifest(stored).int8_modules)


@pytest.mark.parametrize("preset,max_kl,min_top1", [("cpu-int8", 0.002, 0.85), ("cpu-int4", 0.01, 0.75)])
def test_preset_precision_report_within_bounds(presets, checkpoints, preset, max_kl, min_top1):
    """Against the float32 engine of the same (random) checkpoint; bounds stated in docs/engine-build.md."""
    src = checkpoints("llama-tied")
    settings = dict(device="cpu", kv_cache_memory_mb=16, max_model_len=256)
    ref = O3Model.from_config(O3Config(model_path=src, dtype="float32", **settings)).engine
    eng = O3Model.from_config(O3Config(backend="torch", model_path=presets("llama-tied", preset), **settings)).engine
    report = alignment_report(ref, eng, num_new_tokens=8)
    assert report.kl_mean <= max_kl and report.top1_agreement >= min_top1, report.format()
    assert "int8" in report.engine


def test_decode_over_the_cache_view_equals_the_gathered_path(checkpoints, monkeypatch):
    """float32: greedy tokens through cpu_decode's spans equal the generic (gather + mask) decode path."""
    from o3edge.engine.cpu_decode import CpuDecode

    model = O3Model.from_config(O3Config(model_path=checkpoints("llama-tied"), device="cpu", dtype="float32",
                                         kv_block_size=8))
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    prompts = [model.engine.encode(p) for p in ("import os", "Once upon a time")]
    calls = {"spans": 0}
    prepare = CpuDecode.prepare

    def counted(self, batch):
        out = prepare(self, batch)
        calls["spans"] += out is not None
        return out

    monkeypatch.setattr(CpuDecode, "prepare", counted)
    fast = [r.token_ids for r in model.generate_batch(prompts, params)]
    assert calls["spans"] > 0
    monkeypatch.setattr(CpuDecode, "prepare", lambda self, batch: None)
    slow = [r.token_ids for r in model.generate_batch(prompts, params)]
    assert fast == slow


def test_scattered_blocks_give_the_logits_of_consecutive_ones(checkpoints):
    """A sequence whose blocks are scattered over the pool (a prefix-cache hit, a pool that wrapped around)
    decodes through the spans too, its slots gathered: the same prompt gives bit-identical logits wherever
    its blocks lie (the generic path rounds differently)."""
    from o3edge.engine.cpu_decode import contiguous_start
    from o3edge.engine.sequence import Sequence

    engine = O3Model.from_config(O3Config(model_path=checkpoints("llama-tied"), device="cpu", dtype="float32",
                                          kv_block_size=8, kv_cache_memory_mb=4, max_model_len=256)).engine
    runner, blocks, prompt = engine.runner, engine.blocks, engine.encode("import os\n" * 12)
    assert runner.cpu_decode.native is None and not runner.cpu_decode.fast_forward  # the model's own forward

    def generate(name):
        seq = Sequence(name, list(prompt), SamplingParams(max_new_tokens=30, ignore_eos=True))
        blocks.allocate(seq, reuse=False)
        rows, n, spans = [], len(seq), 0
        for _ in range(24):
            spans += n == 1 and runner.cpu_decode.prepare([(seq, 1)]) is not None
            runner.run([(seq, n)])
            blocks.mark_computed(seq, n)
            rows.append(runner.last_logits[0].clone())
            seq.token_ids.append(int(rows[-1].argmax()))
            blocks.append_slot(seq)
            n = 1
        table = list(seq.block_table)
        blocks.free_seq(seq)
        runner.release(seq)
        return torch.stack(rows), table, spans

    first, table, spans = generate("a")
    assert contiguous_start(table, len(table)) is not None and spans == 23
    fillers = []
    while blocks.free:  # take every free block, then give back every other one: the next table interleaves
        filler = Sequence(f"f{len(fillers)}", [7 + len(fillers)] * 8, SamplingParams(max_new_tokens=1))
        blocks.allocate(filler, reuse=False)
        fillers.append(filler)
    for filler in fillers[::2]:
        blocks.free_seq(filler)
    again, table, spans = generate("b")
    assert contiguous_start(table, len(table)) is None and spans == 23
    assert torch.equal(first, again)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_decode_query_attends_in_float32(dtype):
    """cpu_decode.span_attention on a bfloat16 / float16 cache: each sequence (a cache view and a scattered
    gather) attends in float32 over the cache's own values, the output rounded back to the cache's type (torch's
    CPU attention of one query in these types is ~7-12x slower: tools/bench_cpu_attention.py)."""
    from o3edge.engine.cpu_decode import span_attention

    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = (torch.randn(40, 2, 64, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(2, 8, 64, generator=g).to(dtype)
    spans = [(5, 30), torch.tensor([1, 7, 8, 33, 39])]
    out = span_attention(q, k_cache, v_cache, spans)
    assert out.dtype == dtype and out.shape == (2, 8, 64)
    for b, span in enumerate(spans):
        idx = torch.arange(*span) if isinstance(span, tuple) else span
        k, v = k_cache[idx].float(), v_cache[idx].float()  # [S, 2, 64]
        qg = q[b].float().view(2, 4, 64)  # GQA: 4 heads a KV head
        p = torch.softmax(torch.einsum("ghd,sgd->ghs", qg, k) / 8.0, -1)
        want = torch.einsum("ghs,sgd->ghd", p, v).reshape(8, 64).to(dtype)
        torch.testing.assert_close(out[b], want, atol=1e-2, rtol=0)


def test_contiguous_start_and_lazy_zeros():
    from o3edge.engine.cpu_decode import contiguous_start, lazy_zeros

    assert contiguous_start([4, 5, 6, 9], 3) == 4
    assert contiguous_start([4, 5, 7], 3) is None
    z = lazy_zeros((3, 5), torch.float32)
    assert z.shape == (3, 5) and not z.any()


def test_default_thread_count_is_physical_cores_capped(monkeypatch):
    from o3edge.engine.threads import default_num_threads

    n = default_num_threads()
    assert 1 <= n <= min(8, len(os.sched_getaffinity(0)))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert default_num_threads() <= 8


@pytest.mark.parametrize("variant", ["llama-tied", "qwen2-bias", "qwen3-qknorm"])
def test_int8_decode_forward_matches_the_model_forward(presets, variant):
    """INT8 engines decode through cpu_decode.decode_forward (RoPE as a matmul); it computes the same step."""
    engine = O3Model.from_config(O3Config(backend="torch", model_path=presets(variant, "cpu-int8"),
                                          device="cpu")).engine
    runner = engine.runner
    assert runner.cpu_decode.fast_forward
    ids = engine.encode("def main():\n    return")
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    logits = {}
    for fast in (True, False):
        runner.cpu_decode.fast_forward = fast
        engine.add_request(f"r{fast}", ids, params)
        steps = []
        while engine.has_unfinished_requests():
            engine.step()
            steps.append(runner.last_logits.clone())
        logits[fast] = torch.cat(steps)
    # the VNNI kernels round activations to int8 per 32 columns: the matmul RoPE's last-bit differences flip
    # a few roundings (one int8 step, ~0.4% of a column's largest activation), so 1% of the largest logit
    torch.testing.assert_close(logits[True], logits[False], atol=1e-2 * logits[False].abs().max().item(), rtol=0)

