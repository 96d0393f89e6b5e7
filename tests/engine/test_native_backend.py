"""`[engine] backend = "native"` (native_runner.py): a quantized CPU engine served by a process without torch.

The oracle is the torch backend on the same engine directory: its decode steps run the same native step
(cpu_step.py), its prefill torch's attention and o3edge's per-layer VNNI operators, so the two agree to
rounding. Held to that on the trained reference model (decisive logits), with a prefix-cache hit and a
batch of different lengths."""

import json
import subprocess
import sys

import numpy as np
import pytest

from o3edge import O3Config, O3Model
from o3edge.engine import native_lib
from o3edge.engine.sampling_np import filtered_probs, make_rng, sample
from o3edge.engine.sequence import SamplingParams
from o3edge.errors import ConfigError
from tests.test_reference_model import SHIPPED_MODEL
from tools.daemon_process import REPO, clean_env

needs_native = pytest.mark.skipif(not native_lib.available(),
                                  reason="this CPU lacks AVX-512 VNNI and AVX-VNNI (or no g++)")

PROMPTS = ["def read_config(path):\n    \"\"\"Read the", "import os\nimport sys\n\n\ndef main():\n",
           "def read_config(path):\n    \"\"\"Read the file and"]  # the third shares the first's prefix


@pytest.fixture(scope="module")
def ref_engine_dir(tmp_path_factory):
    """The shipped reference checkpoint as a cpu-int4 engine (FFN INT4, attention and LM head INT8)."""
    import torch

    from o3edge.engine.engine_dir import build_engine_dir

    path = str(tmp_path_factory.mktemp("native") / "ref-cpu-int4")
    build_engine_dir(SHIPPED_MODEL, path, torch.float32, None, preset="cpu-int4")
    return path


def generate(model: O3Model, n: int = 24) -> tuple[list[list[int]], list[np.ndarray], int]:
    """Greedy tokens of PROMPTS decoded together, each step's logits, and the third prompt's cached tokens."""
    engine = model.engine
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    outs = {str(i): [] for i in range(len(PROMPTS))}
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(str(i), engine.encode(prompt), params)
    steps, added, cached = [], False, 0
    while engine.has_unfinished_requests():
        for out in engine.step()[0]:
            outs[out.request_id] += out.token_ids
            cached = out.num_cached_tokens if out.request_id == "2" else cached
        logits = engine.runner.last_logits
        steps.append(np.asarray(logits if isinstance(logits, np.ndarray) else logits.numpy()).copy())
        if not added and len(outs["0"]) >= 4:  # joins mid-decode; its prompt hits the first's cached blocks
            engine.add_request("2", engine.encode(PROMPTS[2]), params)
            added = True
    return [outs[str(i)] for i in range(len(PROMPTS))], steps, cached


@needs_native
def test_native_backend_generates_what_the_torch_backend_does(ref_engine_dir):
    cfg = dict(model_path=ref_engine_dir, device="cpu", kv_block_size=8, num_kv_blocks=128)
    native = O3Model.from_config(O3Config(backend="native", **cfg))
    tokens, steps, cached = generate(native)
    ref_tokens, ref_steps, ref_cached = generate(O3Model.from_config(O3Config(backend="torch", **cfg)))
    assert cached == ref_cached > 0  # the third prompt started from the first's blocks on both
    assert tokens == ref_tokens
    assert len(steps) == len(ref_steps)
    for got, ref in zip(steps, ref_steps):
        np.testing.assert_allclose(got, ref, atol=2e-2 * np.abs(ref).max(), rtol=0)
    assert native.engine.info.fingerprint.endswith(":native")


@needs_native
def test_score_gives_every_positions_logits(ref_engine_dir):
    """Prompt logits in one call equal the last-row logits of growing prompts (exact causal prefill)."""
    engine = O3Model.from_config(O3Config(model_path=ref_engine_dir, device="cpu", backend="native",
                                          num_kv_blocks=64, dynamic_kv_cache=False)).engine
    ids = engine.encode(PROMPTS[1])
    full = engine.score(ids)
    assert full.shape == (len(ids), engine.info.args.vocab_size)
    for n in (1, 5, len(ids)):
        np.testing.assert_allclose(engine.score(ids[:n])[-1], full[n - 1], atol=1e-4 * np.abs(full).max(), rtol=0)


@needs_native
def test_the_process_never_imports_torch(ref_engine_dir):
    """The point of the backend: the whole serving process stays free of torch (and of its memory)."""
    code = (
        "import json, sys\n"
        "from o3edge import O3Config, O3Model\n"
        f"m = O3Model.from_config(O3Config(model_path={ref_engine_dir!r}, backend='native', num_kv_blocks=64))\n"
        "r = m.generate('def main():', max_new_tokens=8)\n"
        "import numpy as np\n"
        "print(json.dumps({'torch': [k for k in sys.modules if k.split('.')[0] == 'torch'], 'n': len(r.token_ids),\n"
        "  'denormal': float(np.float32(1e-40) * np.float32(1.0)),\n"
        "  'peak': [ln for ln in open('/proc/self/status') if ln.startswith('VmHWM')][0]}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=clean_env(),
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["torch"] == [] and got["n"] == 8
    assert got["denormal"] == 0.0  # the step flushes denormals (x86 computes them in microcode), as torch's does
    # this process's own peak (ru_maxrss would carry over the forking test process's), in kB: torch alone is ~220 MB
    assert int(got["peak"].split()[1]) < 150 * 1024


@needs_native
def test_auto_serves_cpu_presets_natively_and_the_rest_on_torch(ref_engine_dir):
    from o3edge.engine.cpu_quant import PRESETS
    from o3edge.engine.engine import pick_backend
    from o3edge.engine.manifest import CPU_PRESETS
    from tests.test_reference_model import SHIPPED_ENGINE

    assert set(CPU_PRESETS) == set(PRESETS)  # what "auto" recognizes without torch is every preset there is

    def picked(path, **kw):
        return pick_backend(O3Config(model_path=path, **kw), path)

    assert picked(ref_engine_dir) == "native" and picked(ref_engine_dir, device="cpu") == "native"
    assert picked(SHIPPED_ENGINE) == "torch"  # a GPU build (INT4 FFN, dense bf16 attention): not a CPU preset
    assert picked(SHIPPED_MODEL) == "torch"  # a checkpoint
    assert picked(ref_engine_dir, device="cuda") == "torch"
    assert picked(ref_engine_dir, kv_router="int8") == "torch"
    assert picked(ref_engine_dir, cpu_compile=True) == "torch"
    assert picked(ref_engine_dir, backend="torch") == "torch"
    engine = O3Model.from_config(O3Config(model_path=ref_engine_dir, num_kv_blocks=64)).engine
    assert engine.info.backend == "native" and engine.runner.model is None


def test_what_the_backend_cannot_do_is_refused_with_a_config_error(checkpoints, ref_engine_dir):
    with pytest.raises(ConfigError, match="engine directory"):
        O3Model.from_config(O3Config(model_path=checkpoints("llama-tied"), backend="native"))
    with pytest.raises(ConfigError, match="token router"):
        O3Model.from_config(O3Config(model_path=ref_engine_dir, backend="native", kv_router="int8"))
    with pytest.raises(ConfigError, match="CPU"):
        O3Model.from_config(O3Config(model_path=ref_engine_dir, backend="native", device="cuda"))


@needs_native
def test_a_bad_step_fails_its_requests_and_the_engine_serves_on(ref_engine_dir):
    """A step the native code refuses (here: a token id beyond the vocabulary, slipped in after the engine's
    own check) ends that step's requests with an error; the next request is served."""
    engine = O3Model.from_config(O3Config(model_path=ref_engine_dir, device="cpu", backend="native",
                                          num_kv_blocks=64)).engine
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    seq = engine.add_request("bad", engine.encode("def f():"), params)
    seq.token_ids[1] = engine.info.args.vocab_size + 5  # the native step checks every id it embeds
    outs = engine.step()[0]
    assert [o.finish_reason for o in outs] == ["error"] and "ValueError" in outs[0].error
    engine.add_request("good", engine.encode("def f():"), params)
    got = []
    while engine.has_unfinished_requests():
        got += [t for o in engine.step()[0] for t in o.token_ids]
    assert len(got) == 4


def test_numpy_sampling_follows_the_request():
    logits = np.log(np.array([[0.5, 0.3, 0.2, 1e-9]], dtype=np.float32))
    greedy = SamplingParams()
    assert sample(logits, [greedy], [None]) == [0]
    p = SamplingParams(temperature=1.0, seed=7)
    draws = [sample(logits, [p], [rng])[0] for rng in [make_rng(p, 0)] for _ in range(4000)]
    freq = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(freq[:3], [0.5, 0.3, 0.2], atol=0.03)
    again = make_rng(p, 0)
    assert [sample(logits, [p], [again])[0] for _ in range(4000)] == draws  # the seed reproduces the tokens
    top_k = filtered_probs(logits[0], SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(top_k, [0.625, 0.375, 0, 0], atol=1e-6)
    top_p = filtered_probs(logits[0], SamplingParams(temperature=1.0, top_p=0.7))
    np.testing.assert_allclose(top_p[2:], 0)  # 0.5 + 0.3 reach 0.7: the rest is cut
    assert top_p[0] > 0 and top_p[1] > 0


def test_numpy_sampling_keeps_what_the_sorted_filters_keep():
    """The sampler finds top-k's and top-p's tokens without sorting the vocabulary (sampling_np.kept): the
    same tokens, with the same probabilities, as the plain definition (filtered_probs: a stable sort of the
    whole row), ties and nuclei larger than its first guesses included."""
    from o3edge.engine.sampling_np import kept

    rs = np.random.default_rng(0)
    for trial in range(200):
        V = int(rs.integers(2, 3000))
        x = (rs.standard_normal(V) * rs.choice([0.1, 1.0, 3.0, 10.0])).astype(np.float32)
        if trial % 4 == 0:
            x = np.round(x)  # many ties
        p = SamplingParams(temperature=float(rs.choice([0.3, 1.0, 1.5])), top_k=int(rs.choice([0, 0, 5, 40, V + 3])),
                           top_p=float(rs.choice([1.0, 0.9, 0.5, 0.999])))
        ref = filtered_probs(x, p)
        ids, probs = kept(x, p)
        np.testing.assert_array_equal(np.sort(ids), np.flatnonzero(ref > 0))
        np.testing.assert_allclose(probs / probs.sum(), ref[ids] / ref[ids].sum(), rtol=1e-9)
    # a vocabulary's worth of flat rows, whose nucleus is found by bins of probability: thousands of tokens
    for x in (rs.standard_normal(49152), np.round(rs.standard_normal(49152)), np.zeros(49152),
              np.concatenate((rs.standard_normal(5000) + 20, rs.standard_normal(44152)))):
        for top_p in (0.3, 0.9, 0.999):
            p = SamplingParams(temperature=1.0, top_p=top_p)
            ids, _ = kept(x.astype(np.float32), p)
            np.testing.assert_array_equal(np.sort(ids), np.flatnonzero(filtered_probs(x.astype(np.float32), p) > 0))
            assert len(ids) > 64


def test_native_tables_match_the_torch_rope(checkpoints):
    import dataclasses

    import torch

    from o3edge.engine import rope
    from o3edge.engine.checkpoint import read_model_args
    from o3edge.engine.native_runner import rope_tables

    args = read_model_args(checkpoints("llama-tied"))
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    for a in (args, dataclasses.replace(args, rope_scaling=llama3)):
        cos, sin = rope_tables(a, 512)
        tcos, tsin = rope.rope_tables(a, 512, "cpu", torch.float32)
        np.testing.assert_allclose(cos, tcos.numpy(), atol=1e-5, rtol=0)  # float32 rounding of the angle
        np.testing.assert_allclose(sin, tsin.numpy(), atol=1e-5, rtol=0)


def test_native_rows_cover_prefill_chunks_and_decodes():
    """The step's rows: a prompt chunk's tokens and a decode, each with its position, slot and table."""
    from types import SimpleNamespace

    from o3edge.engine.native_runner import NativeRunner

    runner = NativeRunner.__new__(NativeRunner)
    runner.block_size = 4
    a = SimpleNamespace(num_computed_tokens=2, token_ids=list(range(10, 17)), block_table=[5, 2])  # chunk of 5
    b = SimpleNamespace(num_computed_tokens=5, token_ids=list(range(20, 26)), block_table=[7, 1])  # decode
    ids, pos, slots, tables, last = runner.rows([(a, 5), (b, 1)])
    assert ids.tolist() == [12, 13, 14, 15, 16, 25]
    assert pos.tolist() == [2, 3, 4, 5, 6, 5]
    assert slots.tolist() == [22, 23, 8, 9, 10, 5]
    assert tables.tolist() == [[5, 2]] * 5 + [[7, 1]]
    assert last.tolist() == [4, 5]
    a.num_computed_tokens = 6  # decodes only: the short path
    ids, pos, slots, tables, last = runner.rows([(a, 1), (b, 1)])
    assert (ids.tolist(), pos.tolist(), slots.tolist(), last.tolist()) == ([16, 25], [6, 5], [10, 5], [0, 1])
    assert tables.tolist() == [[5, 2], [7, 1]]

