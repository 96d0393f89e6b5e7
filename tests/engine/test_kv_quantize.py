"""The router's demotion kernel (kernels/kv_quantize.py) against kv_quant.quantize and the torch path.

Runs on CPU tensors under Triton's interpreter here and compiled on the GPU machine (`pytest
tests/engine/test_kv_quantize.py` there), as the other kernel tests do."""

import pytest
import torch

from tests.helpers import KERNEL_DEVICE, require_triton

triton = require_triton()

from o3edge.engine.kernels.kv_quantize import quantize_blocks  # noqa: E402
from o3edge.engine.kv_quant import dequantize, hadamard, quantize  # noqa: E402
from o3edge.engine.router import KVRouter, RouterConfig  # noqa: E402

DEV = KERNEL_DEVICE


def assert_same_codes(mode, codes, scales, want_codes, want_scales):
    """INT8: bit for bit. INT4: the rotation's sums may round apart (cuBLAS on the GPU), so a few codes may
    differ by one step and a scale by one float16 step."""
    if mode == "int8":
        assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
        return
    torch.testing.assert_close(scales.float(), want_scales.float(), rtol=1e-3, atol=0)
    same = (codes == want_codes).float().mean().item()
    assert same >= 0.999, same
    got = dequantize(codes, scales, mode).float()
    want = dequantize(want_codes, want_scales, mode).float()
    step = want_scales.float().amax().item()
    assert (got - want).abs().max().item() <= 1.01 * step


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(2, 2, 64, 32, torch.float16), (2, 3, 96, 16, torch.float32),
                                   (1, 8, 128, 32, torch.float32)])
def test_blocks_are_quantized_as_kv_quant_does(mode, shape):
    """Heads and head sizes that are not powers of two (SmolLM's 3 KV heads, Qwen3's head_dim 96), blocks
    gathered out of order: the kernel's codes and scales are kv_quant.quantize's."""
    L, H, D, bs, dtype = shape
    g = torch.Generator().manual_seed(D + H)
    kv = (3 * torch.randn(L, 2, 10 * bs, H, D, generator=g)).to(DEV, dtype)
    kv[0, 1, 7 * bs] = 0  # a vector of zeros: scale 0, codes 0
    src = torch.tensor([7, 3, 1], device=DEV)
    rot = hadamard(D, device=DEV) if mode == "int4" else None
    codes, scales = quantize_blocks(kv, src, bs, mode, rot)
    slots = (src[:, None] * bs + torch.arange(bs, device=DEV)).reshape(-1)
    want_codes, want_scales = quantize(kv[:, :, slots], mode, rot)
    assert_same_codes(mode, codes, scales, want_codes, want_scales)
    assert float(scales[0, 1, 0].abs().max()) == 0 and int(codes[0, 1, 0].abs().max()) == 0


def routers_after_flushes(kv, mode, bs, nblocks, path, capacity=4):
    """A router over a copy of kv after two flushes: blocks 2 and 5 (5 demoted in place, so that its own bytes
    host compressed blocks 5 * per_host ..., and 2 packed into its next slot, queued first), then block 3.
    path: "torch" (torch operations), "kernel" (move_blocks) or "graph" (MoveGraph, capacity moves a
    replay: captured on CUDA, its operations one by one here)."""
    from o3edge.engine.kernels.kv_quantize import MoveGraph

    router = KVRouter(RouterConfig(mode), kv.clone(), nblocks, bs, 1)
    router.move_kernel = path != "torch"
    if path == "graph":
        router.move_graph = MoveGraph(router.kv_cache, router.codes, router.scales, bs, mode, router.rotation,
                                      capacity, capture=router.device.type == "cuda")
    c = 5 * router.per_host
    router.move([(2, c + 1)])
    router.move([(5, c)])
    router.flush_moves()
    router.move([(3, c + 2)])  # a second flush (on CUDA its ids reuse the pinned buffer of the first)
    router.flush_moves()
    assert not router.moves
    return router


@pytest.mark.parametrize("path", ["kernel", "graph"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_flush_reads_every_source_before_writing_into_a_host(mode, path):
    """Whatever order the kernels' programs run in, block 5 is read before block 2's codes land in its bytes,
    and the pools end as the torch operations leave them; so does block 3, moved by a second flush."""
    torch.manual_seed(1)
    L, bs, H, D, nblocks = 2, 16, 2, 64, 8
    kv = torch.randn(L, 2, (nblocks + 1) * bs, H, D).to(DEV)
    torch_path = routers_after_flushes(kv, mode, bs, nblocks, "torch")
    kernel = routers_after_flushes(kv, mode, bs, nblocks, path)
    host = slice(5 * bs, 6 * bs)
    assert not torch.equal(kernel.kv_cache[:, :, host], kv[:, :, host])  # codes went into block 5's bytes
    assert torch.equal(kernel.kv_cache[:, :, :5 * bs], kv[:, :, :5 * bs])  # nothing else was written
    assert torch.equal(kernel.kv_cache[:, :, 6 * bs:], kv[:, :, 6 * bs:])
    c = 5 * kernel.per_host * bs
    rows = slice(c, c + 3 * bs)
    assert_same_codes(mode, kernel.codes[:, :, rows], kernel.scales[:, :, rows], torch_path.codes[:, :, rows],
                      torch_path.scales[:, :, rows])
    for block, at in ((5, c), (2, c + bs), (3, c + 2 * bs)):  # each compressed block stands for its source
        back = dequantize(kernel.codes[:, :, at:at + bs], kernel.scales[:, :, at:at + bs], mode, kernel.rotation)
        want = kv[:, :, block * bs:(block + 1) * bs].float()
        err = (back - want).abs().amax().item() / want.abs().amax().item()
        assert err < (0.01 if mode == "int8" else 0.25), err


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_move_graph_carries_more_moves_than_a_replay_holds(mode):
    """Nine demotions by the block books (the first in place, the next ones into its free slots, then another
    in place when they run out), flushed through a MoveGraph of two moves a replay: five replays in turn (the
    host buffers reused), the pools as the torch operations leave them, and the blocks hosting no codes
    untouched."""
    from o3edge.engine.kernels.kv_quantize import MoveGraph
    from o3edge.engine.router_blocks import RouterBlocks
    from o3edge.engine.sequence import SamplingParams, Sequence

    torch.manual_seed(2)
    L, bs, H, D, nblocks = 2, 16, 2, 64, 12
    kv = torch.randn(L, 2, (nblocks + 1) * bs, H, D).to(DEV)
    out = []
    for path in ("torch", "graph"):
        router = KVRouter(RouterConfig(mode), kv.clone(), nblocks, bs, 1)
        router.move_kernel = path == "graph"
        if path == "graph":
            router.move_graph = MoveGraph(router.kv_cache, router.codes, router.scales, bs, mode, router.rotation,
                                          2, capture=router.device.type == "cuda")
        books = RouterBlocks(nblocks, bs, "test", False, router.per_host)
        books.demoter = router
        seq = Sequence("s", list(range(11 * bs)), SamplingParams())
        books.allocate(seq)
        assert books.demote_all(seq, [3, 0, 7, 1, 9, 2, 8, 4, 6]) == 9
        moves = list(router.moves)
        router.flush_moves()
        assert not router.moves
        out.append((router, moves))
    (want, moves), (got, moves_got) = out
    assert moves == moves_got
    hosts = {comp // got.per_host for _, comp in moves}
    assert len(hosts) >= 2, moves  # in place more than once (per_host slots ran out)
    for _, comp in moves:
        rows = slice(comp * bs, (comp + 1) * bs)
        assert_same_codes(mode, got.codes[:, :, rows], got.scales[:, :, rows], want.codes[:, :, rows],
                          want.scales[:, :, rows])
    for b in set(range(nblocks + 1)) - hosts:  # a block hosting no codes keeps its bytes
        rows = slice(b * bs, (b + 1) * bs)
        assert torch.equal(got.kv_cache[:, :, rows], kv[:, :, rows]), b


def test_no_moves_give_empty_codes_and_scales():
    kv = torch.randn(1, 2, 64, 2, 16).to(DEV)
    codes, scales = quantize_blocks(kv, torch.zeros(0, dtype=torch.long, device=DEV), 16, "int8", None)
    assert codes.shape == (1, 2, 0, 2, 16) and scales.shape == (1, 2, 0, 2)
