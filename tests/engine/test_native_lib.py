"""The native step without torch (native_lib.py): its NumPy packers lay weights out as the torch operators do,
its step gives the torch extension's DecodeModel numbers on the same weights, a prompt chunk in one call
equals the same tokens one at a time, bad input is an error rather than a crash, none of it imports torch, and
the step built for AVX-VNNI decodes what this machine's build does."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from o3edge import O3Config, O3Model
from o3edge.engine import cpu_ext, cpu_features, cpu_quant, native_lib
from o3edge.engine.cpu_step import _linear, _norm
from o3edge.engine.engine_dir import build_engine_dir
from o3edge.engine.sequence import SamplingParams

pytestmark = pytest.mark.skipif(not (native_lib.available() and cpu_ext.available()),
                                reason="this CPU lacks AVX-512 VNNI and AVX-VNNI (or no g++/ninja)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BS = 8  # KV block size


def test_packers_equal_the_torch_operators():
    rng = np.random.default_rng(0)
    qweight = rng.integers(0, 256, (48, 40), dtype=np.uint8)  # N 48, Kp 80
    ref = torch.ops.o3edge_cpu.int4_pack_rows16(torch.from_numpy(qweight)).numpy()
    for chunk in (1, 1 << 22):  # 16 rows at a time, and all at once
        np.testing.assert_array_equal(native_lib.pack_int4_rows16(qweight, chunk_bytes=chunk), ref)
    q = rng.integers(-127, 128, (64, 96), dtype=np.int8)
    ref = torch.ops.o3edge_cpu.int8_pack_rows16(torch.from_numpy(q)).numpy()
    np.testing.assert_array_equal(native_lib.pack_int8_rows16(q), ref)
    for group in (32, 8):
        np.testing.assert_array_equal(native_lib.group_sums(q, group, chunk=16),
                                      cpu_quant.group_sums(torch.from_numpy(q), group).numpy())
    for k in (576, 80, 72, 1540, 6):
        assert native_lib.activation_group(k) == cpu_ext.activation_group(k)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def _linear_np(mod) -> native_lib.Linear:
    """The module's tensors, as DecodeModel gets them (cpu_step._linear), as a native_lib.Linear."""
    tensors, (int4, N, K, Kp, G) = _linear(mod)
    return native_lib.Linear(bool(int4), *(_np(t) for t in tensors), N, K, Kp, G)


def _native_of(model) -> native_lib.Model:
    """A native_lib.Model over the torch model's own tensors (cpu_step.build's mapping)."""
    args = model.args
    layers = []
    for layer in model.layers:
        attn, mlp = layer.attn, layer.mlp
        qn, kn = (None if m is None else _norm(m).numpy() for m in (attn.q_norm, attn.k_norm))
        layers.append({"input_norm": _norm(layer.input_norm).numpy(), "post_norm": _norm(layer.post_norm).numpy(),
                       "q_norm": qn, "k_norm": kn, "qkv": _linear_np(attn.qkv), "o": _linear_np(attn.o),
                       "gate_up": _linear_np(mlp.gate_up), "down": _linear_np(mlp.down)})
    return native_lib.Model(model.embed.weight.detach().numpy(), _norm(model.norm).numpy(), layers,
                            _linear_np(model.lm_head), args.num_heads, args.num_kv_heads, args.head_dim,
                            float(model.norm.eps))


@pytest.fixture(scope="module", params=[("llama-tied", "cpu-int4-all"), ("llama-tied", "cpu-int8"),
                                        ("qwen3-qknorm", "cpu-int4")], ids=lambda p: p[1])
def engines(request, checkpoints, tmp_path_factory):
    """(torch DecodeModel, native_lib.Model, cos, sin, an empty KV cache [L, 2, S, KVH, hd]) of one engine."""
    variant, preset = request.param
    path = str(tmp_path_factory.mktemp("native") / preset)
    build_engine_dir(checkpoints(variant), path, torch.bfloat16, None, preset=preset, calibration_tokens=4096)
    config = O3Config(backend="torch", model_path=path, device="cpu", kv_block_size=BS)
    runner = O3Model.from_config(config).engine.runner
    assert runner.cpu_decode.native is not None
    args = runner.args
    kv = torch.zeros(args.num_layers, 2, 32 * BS, args.num_kv_heads, args.head_dim)
    return runner.cpu_decode.native.native, _native_of(runner.model), runner.cos, runner.sin, kv


def _slots(tables: np.ndarray, positions: np.ndarray) -> np.ndarray:
    return tables[np.arange(len(positions)), positions // BS] * BS + positions % BS


def test_decode_step_equals_the_torch_extension(engines):
    """Two sequences of different lengths in scattered blocks (over a random cached prefix): the same logits and
    the same cache as DecodeModel.step, step after step."""
    ours, native, cos, sin, kv = engines
    rng = np.random.default_rng(1)
    kv_t = torch.from_numpy(rng.standard_normal(kv.shape, dtype=np.float32))
    kv_n = kv_t.numpy().copy()
    tables = np.array([[5, 2, 9, 1, 0, 0], [3, 12, 7, 20, 14, 30]], dtype=np.int64)
    threads = torch.get_num_threads()  # attention splits keys by thread: same count on both sides
    for p in range(14, 20):
        positions = np.array([p, p + 21], dtype=np.int64)
        ids = rng.integers(0, native.V, 2)
        slots = _slots(tables, positions)
        ref = ours.step(*(torch.from_numpy(a) for a in (ids, positions, slots, tables)), BS, cos, sin, kv_t, threads)
        got = native.step(ids, positions, slots, tables, BS, cos.numpy(), sin.numpy(), kv_n, [0, 1], threads=threads)
        np.testing.assert_array_equal(got, ref.numpy())  # one source, one compiler, the same flags
    np.testing.assert_array_equal(kv_n, kv_t.numpy())


def test_prompt_chunk_in_one_call_equals_token_by_token(engines):
    """n prompt rows (positions 0..n-1, one table) plus another sequence's decode row in one call: the prompt's
    last-row logits, the decode row's logits and the cache equal those of n + 1 single-row calls, bit for bit."""
    _, native, cos, sin, kv = engines
    cos, sin = cos.numpy(), sin.numpy()
    rng = np.random.default_rng(2)
    n, other = 19, 9  # the other sequence's position (its prefix: random keys and values)
    table = np.array([7, 3, 11, 0], dtype=np.int64)
    other_table = np.array([4, 10, 1, 0], dtype=np.int64)
    kv0 = rng.standard_normal(kv.shape, dtype=np.float32)
    ids = rng.integers(0, native.V, n + 1)
    positions = np.append(np.arange(n), other)
    tables = np.vstack([np.tile(table, (n, 1)), other_table])
    slots = _slots(tables, positions)

    kv_one = kv0.copy()
    one = native.step(ids, positions, slots, tables, BS, cos, sin, kv_one, [n - 1, n])
    kv_seq, rows = kv0.copy(), []
    for b in range(n + 1):
        rows.append(native.step(ids[b:b + 1], positions[b:b + 1], slots[b:b + 1], tables[b:b + 1], BS, cos, sin,
                                kv_seq, [0])[0])
    want = np.stack([rows[n - 1], rows[n]])
    # bit-equal: every row's arithmetic is the same whatever rows come with it (cpu_kernels.h's int8_rows)
    np.testing.assert_array_equal(one, want)
    np.testing.assert_array_equal(kv_one, kv_seq)
    assert one.shape == (2, native.V)


def test_bad_input_is_a_value_error_and_changes_nothing(engines):
    _, native, cos, sin, kv = engines
    cos, sin = cos.numpy(), sin.numpy()
    kv_n = np.zeros(kv.shape, dtype=np.float32)
    S = kv_n.shape[2]
    tables = np.array([[0, 1]], dtype=np.int64)
    good = dict(ids=[5], positions=[3], slots=[3], tables=tables, logit_rows=[0])
    bad = [dict(slots=[S]), dict(slots=[-1]), dict(ids=[native.V]), dict(ids=[-2]), dict(positions=[len(cos)]),
           dict(positions=[2 * BS]), dict(logit_rows=[1]), dict(tables=np.array([[S // BS, 0]])),
           dict(tables=np.array([[-1, 0]]))]
    for change in bad:
        call = dict(good, **change)
        with pytest.raises(ValueError, match="out of range"):
            native.step(call["ids"], call["positions"], call["slots"], call["tables"], BS, cos, sin, kv_n,
                        call["logit_rows"])
        assert not kv_n.any()
    with pytest.raises(ValueError, match="kv_cache"):
        native.step([5], [3], [3], tables, BS, cos, sin, kv_n[:, :, :, :1], [0])
    assert native.step(**good, block_size=BS, cos=cos, sin=sin, kv_cache=kv_n).shape == (1, native.V)


def test_import_and_step_without_torch(tmp_path):
    """A random two-layer model (an INT8 and an INT4 projection in each layer) built and stepped: torch is never
    imported."""
    script = textwrap.dedent("""
        import sys
        import numpy as np
        from o3edge.engine import native_lib as nl

        rng = np.random.default_rng(0)
        D, H, KVH, hd, I, V = 64, 4, 2, 16, 96, 160

        def int8(N, K):
            q = rng.integers(-127, 128, (N, K), dtype=np.int8)
            G = nl.activation_group(K)
            return nl.Linear(False, nl.pack_int8_rows16(q), nl.group_sums(q, G), rng.random(N, np.float32) / 100,
                             N, K, K, G)

        def int4(N, K, G=32):
            bf16 = lambda a: (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            qw = rng.integers(0, 256, (N, K // 2), dtype=np.uint8)
            return nl.Linear(True, nl.pack_int4_rows16(qw), bf16(rng.random((K // G, N)) / 100),
                             bf16(rng.random((K // G, N)) / 100), N, K, K, G)

        ones = lambda n: np.ones(n, np.float32)
        layers = [{"input_norm": ones(D), "post_norm": ones(D), "q_norm": None, "k_norm": None,
                   "qkv": int8((H + 2 * KVH) * hd, D), "o": int4(D, H * hd), "gate_up": int4(2 * I, D),
                   "down": int8(D, I)} for _ in range(2)]
        model = nl.Model(rng.standard_normal((V, D), np.float32), ones(D), layers, int8(V, D), H, KVH, hd, 1e-5)
        kv = np.zeros((2, 2, 64, KVH, hd), np.float32)
        cos, sin = np.ones((64, hd), np.float32), np.zeros((64, hd), np.float32)
        logits = model.step([1, 2, 3], [0, 1, 2], [8, 9, 10], [[1, 2]] * 3, 8, cos, sin, kv, [2])
        assert logits.shape == (1, V) and np.isfinite(logits).all() and kv[:, :, 8:11].any()
        print("torch" in sys.modules)
    """)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_packed_arrays_start_on_64_byte_boundaries():
    """The kernels load weights 64 bytes at a time: misaligned arrays straddle cache lines on every load (decode
    ran 5-13% slower than the same kernels on torch's 64-byte aligned tensors)."""
    rng = np.random.default_rng(0)
    for _ in range(4):  # NumPy's own large arrays start 16 bytes into a page: each would fail alone
        assert native_lib.pack_int4_rows16(rng.integers(0, 256, (64, 96), dtype=np.uint8)).ctypes.data % 64 == 0
        q = rng.integers(-127, 128, (64, 192), dtype=np.int8)
        assert native_lib.pack_int8_rows16(q).ctypes.data % 64 == 0
        assert native_lib.group_sums(q, 32).ctypes.data % 64 == 0
        odd = np.arange(1000, dtype=np.float32)[1:]
        assert native_lib.aligned(odd).ctypes.data % 64 == 0 and np.array_equal(native_lib.aligned(odd), odd)


def _greedy(path: str) -> dict:
    """The row kernels' instruction set, and the greedy tokens of two prompts decoded together by the engine at path
    on the native backend (native_lib) and on the torch backend (its decode steps: cpu_step's DecodeModel)."""
    out = {"isa": cpu_features.row_kernel_isa()}
    for backend in ("native", "torch"):
        model = O3Model.from_config(O3Config(backend=backend, model_path=path, device="cpu", kv_block_size=BS))
        prompts = [model.engine.encode("def main():\n    return the value"), model.engine.encode("import os")]
        results = model.generate_batch(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
        out[backend] = [r.token_ids for r in results]
        assert backend == "native" or model.engine.runner.cpu_decode.native is not None  # decoded by cpu_step
    return out


@pytest.mark.parametrize("isa", ["avxvnni", "avx2"])
def test_the_step_built_for_a_cpu_without_avx512_decodes_the_same_greedy_tokens(isa, checkpoints, tmp_path):
    """O3EDGE_CPU_ISA=avxvnni|avx2 (a real process): a tiny cpu-int4 engine (INT4 FFN, INT8 attention and LM head,
    q/k norms, GQA) decodes the same greedy tokens as this process's build (AVX-512 VNNI where the CPU has it) on
    both backends, i.e. through native_lib's library and through cpu_step's."""
    missing = cpu_features.ROW_KERNEL_NEEDS[isa] - cpu_features.cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(sorted(missing))}")
    path = str(tmp_path / "cpu-int4")
    build_engine_dir(checkpoints("qwen3-qknorm"), path, torch.bfloat16, None, preset="cpu-int4",
                     calibration_tokens=4096)
    script = f"import json; from tests.engine.test_native_lib import _greedy; print(json.dumps(_greedy({path!r})))"
    run = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, O3EDGE_CPU_ISA=isa), cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    want = _greedy(path)
    assert got["isa"] == isa and want["isa"] is not None
    assert got["native"] == want["native"] and got["torch"] == want["torch"]
    assert all(len(t) == 16 for t in got["native"])
