"""Paged varlen prefill attention (kernels/prefill_attention.py) against plain torch.

Under TRITON_INTERPRET=1 on CPU tensors in CI, compiled on the GPU machine (`pytest -m gpu`)."""

import pytest
import torch

from tests.helpers import KERNEL_DEVICE, KERNEL_DTYPES, require_triton

triton = require_triton()

from o3edge.engine.kernels.prefill_attention import prefill_attention, prefill_attention_reference  # noqa: E402

DEV, DTYPES = KERNEL_DEVICE, KERNEL_DTYPES
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def _case(chunks, H, KVH, HD, block_size, dtype, seed=0):
    """chunks: (cached prefix length, new tokens) per sequence; blocks scattered through the pool."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(s + n) // block_size) for s, n in chunks]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(chunks), max(need) + 1, dtype=torch.int32)
    seqs, first = [], 0
    for b, ((s, n), k) in enumerate(zip(chunks, need)):
        tables[b, :k] = torch.tensor([perm.pop() for _ in range(k)], dtype=torch.int32)
        seqs.append((first, n, s))
        first += n
    k_cache = torch.randn(num_blocks * block_size, KVH, HD, generator=g).to(DEV, dtype)
    v_cache = torch.randn(num_blocks * block_size, KVH, HD, generator=g).to(DEV, dtype)
    q = torch.randn(first, H, HD, generator=g).to(DEV, dtype)
    return q, k_cache, v_cache, torch.tensor(seqs, dtype=torch.int32).to(DEV), tables.to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunks,H,KVH,HD,block_size", [
    ([(0, 7)], 4, 2, 32, 16),                        # a fresh short prompt
    ([(0, 130), (48, 17), (5, 1)], 8, 2, 64, 16),    # fresh, after a prefix hit, a decode beside them
    ([(250, 70)], 4, 1, 128, 32),                    # a suffix over a long cached prefix, GQA 4, hd 128
    ([(16, 16), (31, 33)], 6, 6, 96, 16),            # block boundaries, MHA, head_dim 96 (padded to 128)
])
def test_prefill_attention_matches_reference(dtype, chunks, H, KVH, HD, block_size):
    q, kc, vc, seqs, tables = _case(chunks, H, KVH, HD, block_size, dtype, seed=H + HD)
    out = prefill_attention(q, kc, vc, seqs, tables, max(n for _, n in chunks), block_size)
    ref = prefill_attention_reference(q, kc, vc, seqs, tables, block_size)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_strided_queries_as_the_model_passes_them():
    """q is a view into the fused q/k projection (every row holds H + KVH heads)."""
    q, kc, vc, seqs, tables = _case([(10, 20)], 4, 2, 32, 16, torch.float32, seed=1)
    qk = torch.cat([q, torch.randn(q.shape[0], 2, 32, device=DEV)], dim=1)
    out = prefill_attention(qk[:, :4], kc, vc, seqs, tables, 20, 16)
    torch.testing.assert_close(out, prefill_attention_reference(q, kc, vc, seqs, tables, 16), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunks,splits", [
    ([(250, 7)], 4),                   # the suffix of a hit: few tiles, keys split over several programs
    ([(3, 20)], 8),                    # a short prefix: later splits find no key for some rows, or none
    ([(0, 130), (48, 17), (5, 1)], 2),  # several sequences, several tiles
])
def test_key_splits_give_the_same_attention(chunks, splits):
    q, kc, vc, seqs, tables = _case(chunks, 8, 2, 64, 16, torch.float32, seed=splits)
    max_q = max(n for _, n in chunks)
    ref = prefill_attention_reference(q, kc, vc, seqs, tables, 16)
    one = prefill_attention(q, kc, vc, seqs, tables, max_q, 16, num_splits=1)
    split = prefill_attention(q, kc, vc, seqs, tables, max_q, 16, num_splits=splits)
    torch.testing.assert_close(split, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(split, one, atol=1e-5, rtol=1e-5)


def test_padding_rows_past_every_chunk_stay_zero_with_splits():
    """A CUDA graph's bucket holds more rows than the chunk: those rows come out 0, split or not."""
    q, kc, vc, seqs, tables = _case([(40, 5)], 4, 2, 32, 16, torch.float32, seed=3)
    padded = torch.cat([q, torch.randn(11, 4, 32, device=DEV)])
    out = prefill_attention(padded, kc, vc, seqs, tables, 16, 16, num_splits=4)
    assert torch.all(out[5:] == 0)
    torch.testing.assert_close(out[:5], prefill_attention_reference(q, kc, vc, seqs, tables, 16), atol=1e-4,
                               rtol=1e-4)
