"""Batched sampling: draws follow the filtered distribution, filters are exact, rows are independent."""

import pytest
import torch

from o3edge.engine.sampling import filtered_probs, make_generator, sample
from o3edge.engine.sequence import SamplingParams
from tests.helpers import KERNEL_DEVICE

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -2.0, -4.0])


def draws(params: SamplingParams, n: int, others: list[SamplingParams] = ()) -> torch.Tensor:
    """n tokens for one request (seeds 0..n-1), each drawn in a batch with the other rows."""
    out = []
    for seed in range(n):
        p = SamplingParams(**{**params.__dict__, "seed": seed})
        batch = [p, *others]
        gens = [make_generator(q, torch.device("cpu"), 1000 + i) for i, q in enumerate(batch)]
        out.append(sample(LOGITS.repeat(len(batch), 1), batch, gens)[0])
    return torch.tensor(out)


def test_draws_follow_temperature_softmax():
    p = SamplingParams(temperature=0.7, max_new_tokens=1)
    got = torch.bincount(draws(p, 4000), minlength=len(LOGITS)).float() / 4000
    want = torch.softmax(LOGITS / 0.7, dim=-1)
    assert (got - want).abs().max() < 0.03  # 4,000 draws: about 4 standard errors at the largest p


def test_top_k_and_top_p_never_draw_a_filtered_token():
    top_k = draws(SamplingParams(temperature=1.0, top_k=3, max_new_tokens=1), 600)
    assert set(top_k.tolist()) == {0, 1, 2}
    # top_p keeps a token while the mass of the tokens before it is below top_p
    probs = filtered_probs(LOGITS[None], [SamplingParams(temperature=1.0, top_p=0.6, max_new_tokens=1)])[0]
    kept = (probs > 0).nonzero().flatten().tolist()
    full = torch.softmax(LOGITS, -1)
    assert kept == [i for i in range(len(LOGITS)) if full[:i].sum() < 0.6]
    top_p = draws(SamplingParams(temperature=1.0, top_p=0.6, max_new_tokens=1), 600)
    assert set(top_p.tolist()) <= set(kept)


def test_a_rows_draws_do_not_depend_on_the_rest_of_the_batch():
    p = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=1)
    alone = draws(p, 50)
    mixed = draws(p, 50, others=[SamplingParams(max_new_tokens=1),  # greedy
                                 SamplingParams(temperature=0.5, top_k=2, max_new_tokens=1, seed=9)])
    assert torch.equal(alone, mixed)


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    batch = [SamplingParams(max_new_tokens=1), SamplingParams(temperature=2.0, max_new_tokens=1, seed=1)]
    gens = [make_generator(q, torch.device("cpu"), 0) for q in batch]
    logits = torch.stack([LOGITS.flip(0), LOGITS])
    assert sample(logits, batch, gens)[0] == len(LOGITS) - 1


def _counter_draws(params: SamplingParams, n: int, counter: int = 5) -> torch.Tensor:
    """n tokens for LOGITS by counter_sample (the graph step's draw), seeds 0..n-1 as n rows of one call."""
    pytest.importorskip("triton")
    from o3edge.engine.sampling import counter_sample, counter_settings

    logits = LOGITS.repeat(n, 1).to(KERNEL_DEVICE)
    cfg = torch.tensor(counter_settings([params] * n, len(LOGITS)), dtype=torch.float32, device=KERNEL_DEVICE)
    seeds, counters = torch.arange(n, device=KERNEL_DEVICE), torch.full((n,), counter, device=KERNEL_DEVICE)
    return counter_sample(logits, logits.argmax(-1), cfg, seeds, counters).cpu()


def test_counter_draws_follow_the_same_filtered_distribution():
    """The graph step's draw (counter noise, kernels/noise.py) samples what `sample` samples: the temperature
    softmax, and never a token top-k or top-p filters out; greedy rows keep their argmax."""
    got = torch.bincount(_counter_draws(SamplingParams(temperature=0.7), 800), minlength=len(LOGITS)).float() / 800
    assert (got - torch.softmax(LOGITS / 0.7, dim=-1)).abs().max() < 0.07  # about 4 standard errors
    assert set(_counter_draws(SamplingParams(temperature=1.0, top_k=3), 60).tolist()) == {0, 1, 2}
    kept = (filtered_probs(LOGITS[None], [SamplingParams(temperature=1.0, top_p=0.6)])[0] > 0).nonzero().flatten()
    assert set(_counter_draws(SamplingParams(temperature=1.0, top_p=0.6), 60).tolist()) <= set(kept.tolist())
    assert set(_counter_draws(SamplingParams(temperature=0.0), 20).tolist()) == {0}


def test_counter_noise_depends_on_seed_and_counter_alone():
    """A row's noise is the same whatever row of whatever batch it is in, changes with its counter, and is
    the same for a token whether drawn over the whole vocabulary or for a few token ids."""
    pytest.importorskip("triton")
    from o3edge.engine.kernels.noise import gumbel_noise

    V, dev = 3000, KERNEL_DEVICE
    one = gumbel_noise(torch.tensor([11], device=dev), torch.tensor([40], device=dev), vocab=V)
    batch = gumbel_noise(torch.tensor([5, 11, 11], device=dev), torch.tensor([40, 41, 40], device=dev), vocab=V)
    assert torch.equal(batch[2], one[0]) and not torch.equal(batch[1], one[0]) and not torch.equal(batch[0], one[0])
    assert bool(torch.isfinite(one).all()) and abs(one.mean().item() - 0.5772) < 0.1  # Gumbel's mean
    ids = torch.tensor([[2999, 0, 17, 17, 1234]], device=dev)
    seed, counter = torch.tensor([11], device=dev), torch.tensor([40], device=dev)
    assert torch.equal(gumbel_noise(seed, counter, ids), one[:, ids[0]])


@pytest.mark.parametrize("triton_topk", ["0", "1"])
def test_counter_draw_methods_agree_where_they_overlap(triton_topk, monkeypatch):
    """counter_sample draws a row one of three ways by its settings (one pass with no filter, the 64 largest
    logits for a small top-k, a cut found by selection for top-p alone or a larger top-k); the way is an
    implementation detail: a row drawn by the selection (WIDE_TOPK) gets the same token as by the cheaper way
    (the 64 largest by torch.topk, or by Triton's bitonic top-k, the default, or the pass with no filter)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("O3EDGE_TRITON_TOPK", triton_topk)
    from o3edge.engine.sampling import METHOD, WIDE_TOPK, counter_sample, counter_settings

    V, n, dev = 512, 12, KERNEL_DEVICE
    logits = (torch.randn(n, V, generator=torch.Generator().manual_seed(0)) * 3).to(dev)
    for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=1.3, top_k=40),
                   SamplingParams(temperature=0.7, top_k=20, top_p=0.8)):
        cfg = torch.tensor(counter_settings([params] * n, V), dtype=torch.float32, device=dev)
        seeds, counters = torch.arange(n, device=dev), torch.full((n,), 9, device=dev)
        cheap = counter_sample(logits, logits.argmax(-1), cfg, seeds, counters, nucleus=False, wide=False)
        cfg[:, METHOD] = WIDE_TOPK
        assert torch.equal(counter_sample(logits, logits.argmax(-1), cfg, seeds, counters), cheap)
        assert len(set(cheap.tolist())) > 4  # draws, not the argmax


def _cut_reference(logits: torch.Tensor, t: float, top_k: int, top_p: float, seeds, counters) -> list[int]:
    """The counter draw of filtered rows by the definition: the best x / T + G over the tokens a stable sort of
    each row keeps (descending value, lower id first among equal ones): top-k those at least the k-th
    largest, ties too; top-p, over what top-k keeps, those whose mass before them is under top_p, summed in
    float64."""
    from o3edge.engine.kernels.noise import gumbel_noise

    v = logits / t
    g = gumbel_noise(seeds.to(KERNEL_DEVICE), counters.to(KERNEL_DEVICE), vocab=logits.shape[1]).cpu()
    out = []
    for r in range(len(v)):
        order = torch.sort(-v[r], stable=True).indices
        if top_k:
            order = order[v[r, order] >= v[r, order[top_k - 1]]]
        w = torch.exp(v[r].double() - v[r].max().double())[order]
        kept = order[(w.cumsum(0) - w) < top_p * w.sum()]
        out.append(kept[(v[r, kept] + g[r, kept]).argmax()].item())
    return out


@pytest.mark.parametrize("rows", ["flat", "peaked", "tied", "all equal"])
def test_top_p_and_large_top_k_are_cut_without_a_sort_exactly_where_the_sorted_row_is_cut(rows):
    """A row with top-p and no top-k, or a top-k above 64 (with or without top-p), is drawn over the tokens a
    cut keeps, found by selection instead of a sort of the row (kernels/nucleus.py): its token is the
    definition's, for rows whose nucleus is most of the vocabulary (flat), a few tokens (peaked), and rows of
    many equal logits (bfloat16 logits; all equal), where the k-th largest has equals (all kept) and the top-p
    cut falls among equal tokens and keeps the lower ids. Its fixed point sums stay exact up to 2**23 tokens:
    on a GPU the rows have 151,936."""
    pytest.importorskip("triton")
    from o3edge.engine.sampling import METHOD, NUCLEUS, WIDE_TOPK, counter_sample, counter_settings

    # three blocks of the select's 2,048 tokens, the last one partial; compiled on a GPU, a Qwen vocabulary
    V, n, dev = (151936 if KERNEL_DEVICE == "cuda" else 5000), 6, KERNEL_DEVICE
    gen = torch.Generator().manual_seed(3)
    logits = {"flat": torch.randn(n, V, generator=gen) * 0.5, "peaked": torch.randn(n, V, generator=gen) * 4,
              "tied": (torch.randn(n, V, generator=gen) * 0.05).bfloat16().float(),
              "all equal": torch.zeros(n, V)}[rows]
    seeds, counters = torch.arange(n) + 11, torch.full((n,), 40)
    for t, top_k, top_p in ((0.7, 0, 0.9), (1.0, 0, 0.05), (1.3, 100, 0.5), (0.9, 0, 0.999), (0.8, 300, 1.0),
                            (1.0, 1000, 0.9)):
        params = SamplingParams(temperature=t, top_k=top_k, top_p=top_p)
        cfg = torch.tensor(counter_settings([params] * n, V), dtype=torch.float32)
        assert (cfg[:, METHOD] == (WIDE_TOPK if top_k else NUCLEUS)).all()
        args = [x.to(dev) for x in (logits, logits.argmax(-1), cfg, seeds, counters)]
        got = counter_sample(*args, topk=False, wide=bool(top_k)).cpu().tolist()
        assert got == _cut_reference(logits, t, top_k, top_p, seeds, counters), (t, top_k, top_p)


def test_counter_draws_of_a_mixed_batch_are_each_rows_own():
    """Greedy rows and rows of every method in one call: each row's token is the one it gets alone."""
    pytest.importorskip("triton")
    from o3edge.engine.sampling import counter_sample, counter_settings

    V, dev = 3000, KERNEL_DEVICE
    kinds = [SamplingParams(temperature=0.9), SamplingParams(), SamplingParams(temperature=1.1, top_k=50),
             SamplingParams(temperature=0.6, top_p=0.7), SamplingParams(temperature=1.0, top_k=500)]
    logits = (torch.randn(len(kinds), V, generator=torch.Generator().manual_seed(1)) * 2).to(dev)
    cfg = torch.tensor(counter_settings(kinds, V), dtype=torch.float32, device=dev)
    seeds, counters = torch.arange(len(kinds), device=dev) + 3, torch.arange(len(kinds), device=dev) + 100
    together = counter_sample(logits, logits.argmax(-1), cfg, seeds, counters)
    for r in range(len(kinds)):
        s = slice(r, r + 1)
        alone = counter_sample(logits[s], logits[s].argmax(-1), cfg[s], seeds[s], counters[s])
        assert alone.item() == together[r].item()
    assert together[1].item() == logits[1].argmax().item()


def test_a_temperature_too_small_to_divide_by_picks_the_argmax_on_every_sampler():
    """x / T overflows float32 for temperatures below ~1e-37, and the torch sampler and the graph step's
    counter draw then drew token 0 or noise for such a request (a client's "almost greedy"; the native CPU
    sampler, in float64, below ~1e-308); a temperature below 1e-5 now picks greedily, on all three, with or
    without filters."""
    pytest.importorskip("triton")
    import numpy as np

    from o3edge.engine import sampling_np
    from o3edge.engine.sampling import counter_sample, counter_settings

    V = 3000
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0)) * 2
    for t in (9e-6, 1e-30, 1e-40, 1e-320):
        kinds = [SamplingParams(temperature=t, seed=1), SamplingParams(temperature=t, top_k=40, seed=1),
                 SamplingParams(temperature=t, top_p=0.9, seed=1), SamplingParams(temperature=t, top_k=100, seed=1)]
        argmax = logits.argmax(-1).tolist()
        gens = [make_generator(k, torch.device("cpu"), 0) for k in kinds]
        assert sample(logits, kinds, gens) == argmax
        rngs = [sampling_np.make_rng(k, 0) for k in kinds]
        assert sampling_np.sample(logits.numpy().astype(np.float32), kinds, rngs) == argmax
        dev = KERNEL_DEVICE
        cfg = torch.tensor(counter_settings(kinds, V), dtype=torch.float32, device=dev)
        x = logits.to(dev)
        assert counter_sample(x, x.argmax(-1), cfg, torch.arange(4, device=dev),
                              torch.arange(4, device=dev)).tolist() == argmax
