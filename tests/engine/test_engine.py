"""The step-level engine: prefix reuse, preemption, chunked prefill, sampling, stops, errors."""

import json
import os
import shutil

import pytest

from o3edge import O3Config, O3Model
from o3edge.engine.sequence import SamplingParams
from o3edge.engine.tokenizer import Detokenizer
from o3edge.errors import CheckpointError, InvalidRequest, O3Error, PromptTooLong
from tests.helpers import KERNEL_DEVICE
from tests.helpers import require

SYSTEM = "You are a careful assistant who answers questions about the Python standard library. " * 3
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


def load(path, **kw):
    return O3Model.from_config(O3Config(model_path=path, device="cpu", **kw))




def load_for_kernels(path, **kw):
    """An engine on the device the Triton kernels run on, in float32, taking the gather + SDPA path for
    every step (the reference); tests switch its kernel paths on one by one."""
    m = O3Model.from_config(O3Config(model_path=path, device=KERNEL_DEVICE, dtype="float32", cuda_graphs=False, **kw))
    m.engine.runner.paged_prefill = False
    return m


def run_all(engine):
    """Step until idle; returns the list of step reports."""
    reports = []
    while engine.has_unfinished_requests():
        _, report = engine.step()
        reports.append(report)
    return reports


def test_prefix_hit_gives_identical_tokens_and_skips_cached_prefill(tiny_dir):
    cold = load(tiny_dir, dynamic_kv_cache=False)
    warm = load(tiny_dir, kv_block_size=16)
    first, second = warm.engine.encode(SYSTEM + "What is os?"), warm.engine.encode(SYSTEM + "What is sys?")
    expected = [cold.generate_batch([ids], GREEDY)[0].token_ids for ids in (first, second)]
    assert warm.generate_batch([first], GREEDY)[0].token_ids == expected[0]
    warm.engine.add_request("b", second, GREEDY)
    reports = run_all(warm.engine)
    seq_prefill = sum(r.tokens["b"][0] for r in reports)
    common = len(os.path.commonprefix([first, second]))
    cached = (common // 16) * 16
    assert cached >= 32
    assert seq_prefill == len(second) - cached  # the cached prefix was not computed again
    assert warm.engine.blocks.num_hit_tokens >= cached
    again = warm.generate_batch([second], GREEDY)[0]
    assert again.token_ids == expected[1] and again.cached_tokens > 0


def test_preempted_sequences_resume_with_identical_output(tiny_dir):
    roomy = load(tiny_dir)
    prompts = [roomy.engine.encode(f"def function_{i}(x):\n    return") for i in range(6)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    expected = [r.token_ids for r in roomy.generate_batch(prompts, params)]
    tight = load(tiny_dir, num_kv_blocks=10, kv_block_size=8)  # 6 sequences need ~30 blocks at the end
    got = [r.token_ids for r in tight.generate_batch(prompts, params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert tight.engine.blocks.num_free_blocks == 10


def test_chunked_prefill_bounds_each_step_and_keeps_output(tiny_dir):
    whole = load(tiny_dir)
    chunked = load(tiny_dir, max_num_batched_tokens=16)
    long_prompt = whole.engine.encode(SYSTEM * 2)
    short = whole.engine.encode("import re")
    expected = [r.token_ids for r in whole.generate_batch([short, long_prompt], GREEDY)]
    chunked.engine.add_request("short", short, GREEDY)
    chunked.engine.step()  # the short request is decoding when the long one arrives
    chunked.engine.add_request("long", long_prompt, GREEDY)
    outputs = {"short": [], "long": []}
    while chunked.engine.has_unfinished_requests():
        outs, report = chunked.engine.step()
        assert sum(p or d for p, d in report.tokens.values()) <= 16  # prompt chunks, one per decode
        if "short" in report.tokens and "long" in report.tokens:
            assert report.tokens["short"] == (0, 1)  # decode keeps going during the long prefill
        for o in outs:
            outputs[o.request_id] += o.token_ids
    assert outputs["long"] == expected[1]


def test_seeded_sampling_is_reproducible_and_independent_of_batch(tiny_dir):
    m = load(tiny_dir)
    ids = m.engine.encode("The ")
    p = SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=7, ignore_eos=True)
    alone = m.generate_batch([ids], p)[0].token_ids
    batched = m.generate_batch([ids, m.engine.encode("while True:")], p)[0].token_ids
    assert alone == batched
    other = m.generate_batch([ids], SamplingParams(**{**p.__dict__, "seed": 8}))[0].token_ids
    assert other != alone
    top1 = m.generate_batch([ids], SamplingParams(max_new_tokens=20, temperature=0.9, top_k=1, ignore_eos=True))
    assert top1[0].token_ids == m.generate_batch([ids], SamplingParams(max_new_tokens=20, ignore_eos=True))[0].token_ids


def test_stop_strings_and_stop_tokens(tiny_dir):
    m = load(tiny_dir)
    full = m.generate("def main(", max_new_tokens=30)
    stop = full.text[10:14]
    cut = m.generate("def main(", max_new_tokens=30, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:full.text.find(stop)]
    token = full.token_ids[5]
    ids = m.engine.encode("def main(")
    r = m.generate_batch([ids], SamplingParams(max_new_tokens=30, stop_token_ids=(token,)))[0]
    assert r.finish_reason == "stop" and r.token_ids[-1] == token and len(r.token_ids) <= 6
    assert full.finish_reason == "length" and len(full.token_ids) == 30


@pytest.mark.parametrize("stream", [True, False])
def test_streamed_text_equals_decoded_tokens(tiny_dir, stream, monkeypatch):
    if not stream:
        monkeypatch.setattr("o3edge.engine.tokenizer.DecodeStream", None)
    m = load(tiny_dir)
    parts = list(m.stream("print('héllo wörld ✓')", max_new_tokens=40, temperature=1.0, seed=3))
    ids = [t for p in parts for t in p.token_ids]
    assert "".join(p.text for p in parts) == m.tokenizer.decode(ids)
    assert parts[-1].finished and m.engine.blocks.num_free_blocks == m.engine.blocks.num_blocks


@pytest.mark.parametrize("stream", [True, False])  # the library's incremental decoder, or two window decodes
def test_detokenizer_holds_back_partial_utf8_and_partial_stops(tiny_dir, stream, monkeypatch):
    if not stream:
        monkeypatch.setattr("o3edge.engine.tokenizer.DecodeStream", None)
    m = load(tiny_dir)
    ids = m.tokenizer.encode("naïve ✓ café", add_special_tokens=False)
    d = Detokenizer(m.tokenizer, stop=("✓ c",))
    shown = ""
    for t in ids:
        delta, hit = d.add(t)
        assert "\ufffd" not in delta
        shown += delta
        if hit:
            break
    assert hit and shown == "naïve "


@pytest.mark.parametrize("stream", [True, False])
def test_detokenizer_shows_a_long_text_whole_and_stops_late_in_it(tiny_dir, stream, monkeypatch):
    """The detokenizer keeps only what it has not shown (and the characters a stop string may start in): over
    thousands of tokens it shows exactly the decoded text, and finds a stop string near the end."""
    if not stream:
        monkeypatch.setattr("o3edge.engine.tokenizer.DecodeStream", None)
    m = load(tiny_dir)
    text = "".join(f"line {i}: naïve ✓ café = {i * 7}\n" for i in range(300)) + "THE END here"
    ids = m.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 2000
    for stop, expected in ((("never there",), m.tokenizer.decode(ids)), (("END",), text[:text.index("END")])):
        d, shown = Detokenizer(m.tokenizer, stop=stop), ""
        for t in ids:
            delta, hit = d.add(t)
            shown += delta
            if hit:
                break
        else:
            shown += d.flush()
        assert shown == expected and hit == (stop == ("END",))
        assert len(d.text) < 40  # what it holds: not the whole text


def test_chat_template_matches_transformers(tiny_dir):
    transformers = require("transformers")
    m = load(tiny_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is json?"}]
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert m.engine.encode(messages=messages) == list(expected)
    r = m.generate(messages=messages, max_new_tokens=8)
    assert r.prompt_tokens == len(expected)


def test_abort_frees_blocks(tiny_dir):
    m = load(tiny_dir)
    e = m.engine
    e.add_request("x", e.encode(SYSTEM), GREEDY)
    e.step()
    assert e.blocks.num_free_blocks < e.blocks.num_blocks
    assert e.abort("x") and not e.abort("x")
    assert e.blocks.num_free_blocks == e.blocks.num_blocks and not e.has_unfinished_requests()


def test_bad_requests_get_coded_errors(tiny_dir):
    m = load(tiny_dir, max_model_len=64)
    e = m.engine
    with pytest.raises(PromptTooLong) as exc:
        e.add_request("a", list(range(64)), GREEDY)
    assert exc.value.code == "prompt_too_long"
    for bad in (dict(temperature=float("nan")), dict(top_p=0), dict(max_new_tokens=0), dict(top_k=-1),
                dict(seed=-1), dict(stop=("",))):
        with pytest.raises(InvalidRequest):
            SamplingParams(**bad)
    for bad in ([e.info.args.vocab_size], [1, -1], [1, 2.0], [1, "2"], [None]):
        with pytest.raises(InvalidRequest):
            e.add_request("b", bad, GREEDY)
    e.add_request("c", [1, 2], GREEDY)
    with pytest.raises(InvalidRequest):
        e.add_request("c", [1, 2], GREEDY)
    with pytest.raises(InvalidRequest):
        m.generate(messages=[{"role": "user"}])
    e.abort("c")
    # generation stops at the context window
    r = m.generate_batch([list(range(1, 60))], SamplingParams(max_new_tokens=100, ignore_eos=True))[0]
    assert r.finish_reason == "length" and r.prompt_tokens + len(r.token_ids) == 64


def broken(tmp_path, tiny_dir, name):
    d = tmp_path / name
    shutil.copytree(tiny_dir, d)
    return d


def test_broken_checkpoints_name_the_problem(tmp_path, tiny_dir):
    d = broken(tmp_path, tiny_dir, "arch")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, architectures=["GPT2LMHeadModel"])))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel.*not supported"):
        load(str(d))
    d = broken(tmp_path, tiny_dir, "trunc")
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load(str(d))
    d = broken(tmp_path, tiny_dir, "shape")
    (d / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=cfg["intermediate_size"] + 8)))
    with pytest.raises(CheckpointError, match="mlp.gate_up.weight has shape"):
        load(str(d))
    d = broken(tmp_path, tiny_dir, "notok")
    (d / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json not found"):
        load(str(d))
    d = broken(tmp_path, tiny_dir, "noconf")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json not found"):
        load(str(d))
    with pytest.raises(O3Error, match="not a directory"):
        load(str(tmp_path / "absent"))


def test_static_shape_decode_path_matches_eager(tiny_dir):
    """The padded, bucketed fused decode step (what CUDA graphs replay; on CPU its Triton kernels run
    under the interpreter) gives the eager path's tokens."""
    eager = load_for_kernels(tiny_dir, kv_block_size=8)
    static = load_for_kernels(tiny_dir, kv_block_size=8, max_model_len=300)
    static.engine.runner.enable_static_decode(max_batch=8, capture=False)
    prompts = [eager.engine.encode(p) for p in ("a = 1", "import json\n" * 30, "def f(x):", "#!", "b")]
    params = SamplingParams(max_new_tokens=14, ignore_eos=True)
    expected = [r.token_ids for r in eager.generate_batch(prompts, params)]
    assert [r.token_ids for r in static.generate_batch(prompts, params)] == expected
    graphs = static.engine.runner.graphs
    assert graphs.batch_buckets == [1, 2, 4, 8] and graphs.splits[1] > 1  # key-axis splits at batch 1
    assert graphs.num_steps == 13  # every decode step of the 5-sequence batch (padded to 8) took it


@pytest.mark.parametrize("paged", [False, True])
def test_prefill_graph_path_matches_eager(tiny_dir, paged):
    """A fresh prompt prefilled on the padded token-bucket path (what CUDA graphs replay) gives the
    eager path's logits and tokens; a prompt longer than the largest bucket takes the eager path.
    With the paged prefill kernel (CUDA's path) the graphs also take the chunk after
    a cached prefix."""
    eager = load_for_kernels(tiny_dir, kv_block_size=8)
    static = load_for_kernels(tiny_dir, kv_block_size=8, max_model_len=300)
    static.engine.runner.paged_prefill = paged
    static.engine.runner.enable_static_decode(max_batch=2, capture=False, max_prefill_tokens=64)
    graphs = static.engine.runner.prefill_graphs
    assert graphs.token_buckets == [16, 32, 64]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    for prompt in ("a = 1\nb = 2\n", "import json\n" * 9):  # 16- and 64-token buckets, partly padded
        ids = eager.engine.encode(prompt)
        want = eager.generate_batch([ids], params)[0].token_ids
        assert static.generate_batch([ids], params)[0].token_ids == want
    assert graphs.num_steps == 2
    hit = eager.engine.encode("import json\n" * 9 + "print(json.dumps({}))")  # a cached prefix, then 9 tokens
    got = static.generate_batch([hit], params)[0]
    assert got.token_ids == eager.generate_batch([hit], params)[0].token_ids and got.cached_tokens > 0
    assert graphs.num_steps == (3 if paged else 2)
    long = eager.engine.encode("import json\n" * 30)  # > 64 tokens
    assert static.generate_batch([long], params)[0].token_ids == eager.generate_batch([long], params)[0].token_ids


@pytest.mark.parametrize("splits", [None, 4])
def test_paged_prefill_kernel_path_matches_eager(tiny_dir, splits, monkeypatch):
    """Prefill through the block tables (the CUDA path, here under Triton's interpreter) gives the gather
    path's tokens: fresh prompts of different lengths batched together, chunked prefill, the suffix
    after a prefix-cache hit, and decodes mixed into the same steps; also with the keys split over
    several programs (what a short suffix after a long prefix gets on a GPU with many SMs)."""
    if splits:
        from o3edge.engine.kernels import prefill_attention as pa

        monkeypatch.setattr(pa, "num_key_splits", lambda num_programs, device: splits)
    eager = load_for_kernels(tiny_dir, kv_block_size=8, max_num_batched_tokens=48)
    paged = load_for_kernels(tiny_dir, kv_block_size=8, max_num_batched_tokens=48)
    paged.engine.runner.paged_prefill = True
    prompts = [eager.engine.encode(p) for p in ("import json\n" * 12, "a = 1", "def f(x):\n    return x")]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    for batch in (prompts, prompts[:1] + [eager.engine.encode("import json\n" * 12 + "print(1)")]):
        want = [r.token_ids for r in eager.generate_batch(batch, params)]
        got = paged.generate_batch(batch, params)
        assert [r.token_ids for r in got] == want
    assert got[1].cached_tokens > 0  # the second round's long prompt reused the first one's prefix


def test_launch_ahead_decode_matches_eager(tiny_dir):
    """Queuing step n+1 before step n's tokens reach the host (what the GPU does to hide host work)
    changes nothing: sequences that end at different lengths, cross block boundaries at different
    steps, join late or are aborted get the eager path's tokens; every step is taken from the queue but
    the first and the one a late request joins (a sequence about to start a block is given it a step
    early, and a queued step serves those left when others end), and no block is kept after."""
    from o3edge.engine.cuda_graph import DecodeGraphs

    eager = load_for_kernels(tiny_dir, kv_block_size=8)
    ahead = load_for_kernels(tiny_dir, kv_block_size=8, max_model_len=300)
    runner = ahead.engine.runner
    runner.graphs = DecodeGraphs(runner, 8, capture=False, launch_ahead=True)
    prompts = [eager.engine.encode(p) for p in ("a = 1", "def f(x):\n    return", "import os", "x = [")]
    lengths = (20, 9, 14, 30)  # rows leave the batch at different steps: the queued step serves the rest

    def run(model):
        e = model.engine
        for i, (ids, n) in enumerate(zip(prompts, lengths)):
            e.add_request(f"r{i}", ids, SamplingParams(max_new_tokens=n, ignore_eos=True))
        out = {f"r{i}": [] for i in range(4)}
        steps = 0
        while e.has_unfinished_requests():
            for o in e.step()[0]:
                out[o.request_id] += o.token_ids
            steps += 1
            if steps == 5:  # a late arrival changes the batch
                e.add_request("late", prompts[0], SamplingParams(max_new_tokens=6, ignore_eos=True))
                out["late"] = []
            if steps == 11:  # a client goes away: its sequence leaves the batch between two steps
                assert e.abort("r3")
        return out

    assert run(ahead) == run(eager)
    graphs = runner.graphs
    print(f"{graphs.num_ahead_taken} of {graphs.num_steps} decode steps taken from the queue")
    assert graphs.num_ahead_taken == graphs.num_steps - 2 and graphs.num_steps > 12
    blocks = ahead.engine.blocks
    assert blocks.num_free_blocks == blocks.num_blocks


def test_sampled_rows_drawn_in_the_graph_step_launch_ahead_and_match_every_other_path(tiny_dir, monkeypatch):
    """Graph sampling (O3EDGE_GRAPH_SAMPLING=1): sampled requests decode in the graph step, launched ahead
    like greedy ones, and each token is the one the eager path draws (the same counter noise: a request's
    draws depend on its seed and positions alone): sequences ending at different lengths, a late arrival,
    an abort, greedy and sampled rows in one batch. The same seeded request alone gets the same tokens."""
    pytest.importorskip("triton")
    from o3edge.engine.cuda_graph import DecodeGraphs

    monkeypatch.setenv("O3EDGE_GRAPH_SAMPLING", "1")
    engines = [load_for_kernels(tiny_dir, kv_block_size=8, max_model_len=300) for _ in range(3)]
    graphs = DecodeGraphs(engines[0].engine.runner, 8, capture=False, launch_ahead=True)
    engines[0].engine.runner.graphs = graphs
    eager = DecodeGraphs(engines[1].engine.runner, 8, capture=False)  # every step eager, sampling alike
    eager.fits = lambda batch: False
    engines[1].engine.runner.graphs = eager
    engines[2].engine.runner.graphs = DecodeGraphs(engines[2].engine.runner, 8, capture=False, launch_ahead=True)
    assert graphs.sampling and eager.sampling
    prompts = [engines[0].engine.encode(p) for p in ("a = 1", "def f(x):\n    return", "import os", "x = [")]
    kinds = [dict(temperature=0.9, top_p=0.9, seed=7), dict(temperature=1.2, top_k=20, seed=8), dict(),
             dict(temperature=0.7, seed=9)]

    def run(model, only=None):
        e, out, steps = model.engine, {}, 0
        for i, (ids, n, kw) in enumerate(zip(prompts, (14, 6, 10, 18), kinds)):
            if only is None or i == only:
                e.add_request(f"r{i}", ids, SamplingParams(max_new_tokens=n, ignore_eos=True, **kw))
                out[f"r{i}"] = []
        while e.has_unfinished_requests():
            for o in e.step()[0]:
                out[o.request_id] += o.token_ids
            steps += 1
            if steps == 5 and only is None:  # a late arrival changes the batch
                e.add_request("late", prompts[0], SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1.0,
                                                                 seed=3))
                out["late"] = []
            if steps == 9 and only is None:
                assert e.abort("r3")
        return out

    got = run(engines[0])
    assert got == run(engines[1])
    assert graphs.num_ahead_taken == graphs.num_steps - 2 and graphs.num_steps >= 12
    assert run(engines[2], only=0)["r0"] == got["r0"]  # seeded: alone as in the batch
    assert len({tuple(t) for t in got.values()}) == len(got)  # sampled rows differ from each other


def test_displaced_request_ends_with_busy_and_frees_nothing_it_never_held(tiny_dir):
    from o3edge.engine.sequence import Priority
    from o3edge.policy import Policy

    e = load(tiny_dir, max_num_seqs=1, policy=Policy(queue_max_requests=1)).engine
    e.add_request("running", e.encode("a = 1"), GREEDY)
    e.step()  # admitted; the queue is empty again
    e.add_request("low", e.encode("b = 2"), GREEDY, priority=Priority.LOW)
    e.add_request("crit", e.encode("c = 3"), GREEDY, priority=Priority.CRITICAL)
    outputs, _ = e.step()
    low = [o for o in outputs if o.request_id == "low"]
    assert len(low) == 1 and low[0].finish_reason == "busy" and low[0].finished and not low[0].token_ids
    assert "low" not in e.seqs and "crit" in e.seqs
