"""kernels/route.py: a graph refresh's routing in three kernels and a sort gives what KVRouter's operations one
by one give (observation_of, observe_books, held_observed, plan_mask): the same books, the same demotions."""

import types

import pytest
import torch

from o3edge.engine.router import KVRouter, RouterConfig, SaliencyBooks

pytest.importorskip("triton")


def router_like(books, num_full, bs, cfg, device):
    """What KVRouter's routing methods read of their router."""
    return types.SimpleNamespace(books=books, num_full_blocks=num_full, block_size=bs, cfg=cfg, device=device)


def rows_and_mass(seed, n, W, bs, num_full, kvh, L, device):
    """entry_rows' rows for n sequences of random contexts (full-precision and compressed entries mixed, each
    row its own book row; the last row a padding row of zeros) and an observing step's mass over them."""
    g = torch.Generator().manual_seed(seed)
    entries = torch.zeros(n, W + 3, dtype=torch.long)
    for r in range(n - 1):
        end = int(torch.randint(bs * 3, min(W * bs, L) - 1, (1,), generator=g))
        count = -(-end // bs)
        comp = torch.rand(count, generator=g) < 0.3
        comp[-1] = False  # the new token's block is full precision
        ids = torch.randperm(num_full, generator=g)[:count]
        entries[r, :count] = torch.where(comp, num_full + ids, ids)
        entries[r, W:] = torch.tensor([count, r + 1, end])
    mass = torch.rand(n, kvh, 2, W * bs, generator=g) ** 8  # heavy-tailed, as attention is
    return entries.to(device), mass.to(device)


@pytest.mark.parametrize("threshold,kvh", [(0.85, 2), (0.5, 4), (0.3, 1)])
def test_the_kernels_route_as_the_operations_one_by_one(threshold, kvh, device="cpu"):
    n, W, bs, num_full, L = 7, 24, 8, 64, 200
    cfg = RouterConfig(threshold=threshold, sink_tokens=4, recent_tokens=16)
    out = []
    for fused in (False, True):
        books = SaliencyBooks(L, torch.device(device), rows=8)
        g = torch.Generator().manual_seed(1)  # earlier observations in the books
        books.mass += (torch.rand(8, L, generator=g) ** 4).double().to(device)
        books.count += torch.randint(0, 5, (8, L), generator=g).double().to(device)
        entries, mass = rows_and_mass(int(threshold * 100), n, W, bs, num_full, kvh, L, device)
        r = router_like(books, num_full, bs, cfg, torch.device(device))
        if fused:
            demote = KVRouter.route_in_kernels(r, entries, mass)
        else:
            meta = KVRouter.observation_of(r, entries)
            KVRouter.observe_books(r, meta, mass)
            demote = KVRouter.plan_mask(r, entries, KVRouter.held_observed(r, meta))
        out.append((books.mass.cpu(), books.count.cpu(), demote.cpu()))
    (m0, c0, d0), (m1, c1, d1) = out
    assert torch.equal(c0, c1)
    torch.testing.assert_close(m1, m0, rtol=1e-7, atol=0)  # (the KV heads summed in another order)
    if kvh <= 2:  # one or two heads: the same float32 sum, the same bits
        assert torch.equal(m0, m1)
    assert d0.any() and not d0[-1].any()  # some demotions; the padding row routes nothing
    assert torch.equal(d0, d1)


@pytest.mark.gpu
@pytest.mark.parametrize("threshold,kvh", [(0.85, 2), (0.5, 4)])
def test_the_kernels_route_as_the_operations_one_by_one_on_the_gpu(threshold, kvh):
    test_the_kernels_route_as_the_operations_one_by_one(threshold, kvh, device="cuda")
