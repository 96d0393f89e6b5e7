"""Skinny matmuls for decode (a few rows of activations against a whole weight), with the op before fused in.

At batch 1-64 a decode step's linear layers are bound by the bytes of their weights: the GPU's job is
to stream every weight byte once at full bandwidth. Here each program owns a thin slice of output
rows, loads its whole weight slice in wide tiles (many bytes in flight per SM), and multiplies it with
the step's few activation rows: elementwise at one row (and at two rows of an INT4 weight, each tile
dequantized once for both: rows_int4), on the tensor cores (rows padded to a power of 2 >= 16) above.

The op that produces the activations is done inside the same kernel, on the fly, so it costs no
launch and no round trip through memory:
- `NORM`: residual add + RMSNorm (each program computes the rows' statistics itself; the first
  program also writes the updated residual stream to a new buffer);
- `SILU`: SiLU(gate) * up over the fused gate/up projection's output (the down projection's input).
Rounding follows the eager model: each intermediate is rounded to the model dtype where eager
torch would round it.

Weights are the model's own [N, K] dense matrix, o3edge's device-neutral INT4 (quant.py: uint8
[N, Kp/2], high nibble first, and bf16 scales and zeros [Kp/g, N, 2]), dequantized in registers, or
per-row INT8 (cpu_quant.py's form: int8 [N, K] and float32 scales [N], w = q * scale): the products
are summed over the integers and each output scaled once. One row of INT8 weights, and of INT4 weights
whose row is one tile, meets activations quantized per 32 columns on dp4a (W8A8 / W4A8: dp4a_int8,
dp4a_int4), as the CPU's INT8 kernels do (its INT4 kernels quantize per weight group).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from o3edge.engine.kernels import INTERPRET, pdl
from o3edge.engine.kernels.activation import silu_mul_rounded
from o3edge.engine.kernels.arrival import arrival_counters, last_arrival

PRO_NONE, PRO_NORM, PRO_SILU = 0, 1, 2
MAX_ROWS = 64  # the decode batches this serves; larger ones go to cuBLAS
# rows a tiling given by hand may take (tools/bench_gemv.py: INT4 tiles at prefill sizes, against dequantize + cuBLAS)
CONFIG_MAX_ROWS = 256
PREFILL_TILE_ROWS = 128  # INT4 prompt chunks up to this many rows may run on tiles (prefill_tiling)


@triton.jit
def _input_tile(x_ptr, res_ptr, nw_ptr, rm, m_mask, kk, K, stride_x, rstd, PRO: tl.constexpr, dtype: tl.constexpr):
    """Activation rows rm, columns kk, after the fused prologue, in the model dtype."""
    mask = m_mask[:, None] & (kk < K)[None, :]
    x = tl.load(x_ptr + rm[:, None] * stride_x + kk[None, :], mask=mask, other=0.0)
    if PRO == 1:  # NORM: (x + residual) rounded, normalized and rounded, times the norm weight, rounded
        if res_ptr is not None:
            x = (x.to(tl.float32) + tl.load(res_ptr + rm[:, None] * stride_x + kk[None, :], mask=mask,
                                            other=0.0).to(tl.float32)).to(dtype)
        y = (x.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)
        w = tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        x = (w[None, :] * y).to(dtype)
    if PRO == 2:  # SILU: gate is columns [0, K), up [K, 2K)
        x = silu_mul_rounded(x, tl.load(x_ptr + rm[:, None] * stride_x + K + kk[None, :], mask=mask, other=0.0),
                             dtype)
    return x


@triton.jit
def _row_rstd(x_ptr, res_ptr, res_out_ptr, rm, m_mask, K, stride_x, eps, write,
              BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """1/rms of each row of (x + residual); where write, the sum is stored to res_out."""
    ss = tl.zeros([BLOCK_M], tl.float32)
    for i in range(tl.cdiv(K, BLOCK_K)):
        kk = i * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = m_mask[:, None] & (kk < K)[None, :]
        offs = rm[:, None] * stride_x + kk[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if res_ptr is not None:
            x = (x.to(tl.float32) + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
            tl.store(res_out_ptr + offs, x, mask=mask & write)
        xf = x.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
    return 1.0 / tl.sqrt(ss / K + eps)


# scales and zeros read as one 32-bit word a (group, row) (O3EDGE_INT4_SZ_WORD=0: two 16-bit loads, as before,
# which Triton's software pipeline cannot stage into shared memory: each tile's dequantize then waited on them)
SZ_WORD = tl.constexpr(os.environ.get("O3EDGE_INT4_SZ_WORD", "1") != "0")


@triton.jit
def offset_half(u, offset: tl.constexpr):
    """Codes stored with an offset (u = value + offset, 0 <= u < 1024, any int type) as float16 values, exactly,
    by bits: the half 0x6400 | u is 1024 + u, so one logic op and a half-precision subtract replace an
    int-to-float conversion (a quarter-rate instruction)."""
    return (u.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + offset)


@triton.jit
def int8_float(q):
    """int8 codes as float32, exactly, by bits: the float 0x4B000000 | (u ^ 0x80) of the code's byte u is
    2^23 + q + 128, so a logic op and a subtract replace an int-to-float conversion (a quarter-rate
    instruction)."""
    u = q.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x4B000080
    return u.to(tl.float32, bitcast=True) - 8388736.0


# One row of INT8 weights is multiplied as the CPU's INT8 kernels do (cpu_kernels.h): the activations are quantized
# per group of 32 columns (scale max|x| / 127, codes rounded to nearest even), four codes to an int32 word, and
# each word of weights meets its word of activations in one dp4a (four int8 products summed in int32); a word's
# sum is scaled by its group's activation scale as a float, each output row by its weight scale at the end. ~0.75
# instructions a weight, against ~3.3 for a weight turned into a float and multiplied (W8A16: tried first; on
# the H200 one row then streamed no faster than fp16's twice as many bytes).
DP4A = tl.constexpr("dp4a.s32.s32 $0, $1, $2, 0;")
ACT_GROUP = tl.constexpr(32)  # activation columns that share a scale (cpu_ext.activation_group's first choice)


@triton.jit
def _dp4a(w, x):
    """Each int32 word of four int8 codes in w times its word in x, summed: int32."""
    if INTERPRETED:  # the interpreter runs no PTX: the bytes sign-extended and multiplied one by one
        return (((w << 24) >> 24) * ((x << 24) >> 24) + ((w << 16) >> 24) * ((x << 16) >> 24)
                + ((w << 8) >> 24) * ((x << 8) >> 24) + (w >> 24) * (x >> 24))
    return tl.inline_asm_elementwise(DP4A, "=r,r,r", [w, x], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _rounded(v):
    """float32 -> the nearest integer (ties to even), as float32."""
    if INTERPRETED:  # 1.5 * 2^23: adding and subtracting it rounds |v| < 2^22 to an integer in the FPU's mode
        return (v + 12582912.0) - 12582912.0
    return tl.extra.cuda.libdevice.rint(v)


@triton.jit
def _quantized_x(x, BLOCK_K: tl.constexpr):
    """An activation tile x [1, BLOCK_K] quantized per group of ACT_GROUP columns: (int32 words of four codes
    [BLOCK_K // 4], code i of a word in byte i; each word's group scale [BLOCK_K // 4] float32)."""
    xf = tl.reshape(x.to(tl.float32), [BLOCK_K // ACT_GROUP, ACT_GROUP])
    amax = tl.max(tl.abs(xf), axis=1)
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    q = _rounded(xf * inv[:, None]).to(tl.int32)
    words = _code_words(tl.reshape(q, [BLOCK_K // 4, 2, 2]))  # word j: columns 4j .. 4j + 3
    scale = tl.broadcast_to((amax / 127.0)[:, None], [BLOCK_K // ACT_GROUP, ACT_GROUP // 4])
    return words, tl.reshape(scale, [BLOCK_K // 4])


@triton.jit
def _code_words(q):
    """Codes (int32, one byte each) in fours, [..., 2, 2] with code i = 2a + b at [.., a, b], as int32 words, code
    i in byte i: [...]."""
    lo, hi = tl.split(q)  # [.., a]: codes 2a, then codes 2a + 1
    q0, q2 = tl.split(lo)
    q1, q3 = tl.split(hi)
    return (q0 & 0xFF) | ((q1 & 0xFF) << 8) | ((q2 & 0xFF) << 16) | (q3 << 24)


@triton.jit
def _nibble_x(x, BLOCK_K: tl.constexpr):
    """An activation tile x [1, BLOCK_K] quantized per group of ACT_GROUP columns as _quantized_x, in the layout
    of INT4 words (_int4_raw with WORD 4: byte i of word j holds columns 8j + 2i, high nibble, and 8j + 2i + 1):
    (words of the even columns' codes [BLOCK_K // ACT_GROUP, ACT_GROUP // 8], words of the odd columns', each
    group's scale [BLOCK_K // ACT_GROUP] float32 and the sum of its codes, int32)."""
    NA: tl.constexpr = BLOCK_K // ACT_GROUP
    xf = tl.reshape(x.to(tl.float32), [NA, ACT_GROUP])
    amax = tl.max(tl.abs(xf), axis=1)
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    q = _rounded(xf * inv[:, None]).to(tl.int32)
    even, odd = tl.split(tl.reshape(q, [NA, ACT_GROUP // 8, 4, 2]))  # column 8j + 2i + p at [a, j, i, p]
    return (_code_words(tl.reshape(even, [NA, ACT_GROUP // 8, 2, 2])),
            _code_words(tl.reshape(odd, [NA, ACT_GROUP // 8, 2, 2])), amax / 127.0, tl.sum(q, axis=1))


# A word of eight INT4 codes (0..15) against the words of its even and odd columns' activation codes: the high
# nibbles and the low ones masked into two words of four bytes, each met by dp4a, the second summing onto the
# first. Five instructions for eight weights (the packed half-precision dot, PACKED_DOT_*: 22).
NIBBLE_DOT = tl.constexpr("{\n.reg .b32 h, l, t;\nshr.u32 h, $1, 4;\nand.b32 h, h, 0x0F0F0F0F;\n"
                          "and.b32 l, $1, 0x0F0F0F0F;\ndp4a.s32.s32 t, h, $2, 0;\ndp4a.s32.s32 $0, l, $3, t;\n}")


@triton.jit
def _nibble_dot(q, xe, xo):
    """Each int32 word of eight INT4 codes in q times its even- and odd-column activation words: int32."""
    if INTERPRETED:
        return _dp4a((q >> 4) & 0x0F0F0F0F, xe) + _dp4a(q & 0x0F0F0F0F, xo)
    return tl.inline_asm_elementwise(NIBBLE_DOT, "=r,r,r,r", [q, xe, xo], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _int4_word_dots(q, scale, zero, xe, xo, xs, xsum, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """One quantized activation row (_nibble_x) against a tile of INT4 words (_int4_raw with WORD 4): each
    activation group's integer dot sum q x over its codes, then w = (q - 8) * scale + zero per weight group:
    sum_a xs_a (dot_a - 8 sum_a) * scale + zero * sum_a xs_a sum_a, with sum_a the group's activation codes'
    sum. [BLOCK_N] float32."""
    NA: tl.constexpr = BLOCK_K // ACT_GROUP
    NG: tl.constexpr = BLOCK_K // GROUP
    BN: tl.constexpr = q.shape[0]
    qa = tl.reshape(q, [BN, NA, ACT_GROUP // 8])  # a weight group's words are whole activation groups'
    dots = tl.sum(_nibble_dot(qa, xe[None, :, :], xo[None, :, :]), axis=2)  # [BN, NA] int32
    part = (dots - 8 * xsum[None, :]).to(tl.float32) * xs[None, :]
    part = tl.sum(tl.reshape(part, [BN, NG, GROUP // ACT_GROUP]), axis=2)  # [BN, NG]
    xz = tl.sum(tl.reshape(xs * xsum.to(tl.float32), [NG, GROUP // ACT_GROUP]), axis=1)  # [NG]
    return tl.sum(part * scale + zero * xz[None, :], axis=1)


@triton.jit
def _int8_words(w_ptr, rn, n_mask, k0, K, stride_w, BLOCK_K: tl.constexpr):
    """INT8 rows rn, columns k0 .. k0+BLOCK_K, as int32 words of four codes [BLOCK_N, BLOCK_K // 4] (K and the
    row stride multiples of 4; columns past K read as code 0)."""
    j = k0 // 4 + tl.arange(0, BLOCK_K // 4)
    return tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + rn[:, None] * (stride_w // 4) + j[None, :],
                   mask=n_mask[:, None] & (j < K // 4)[None, :], other=0)


@triton.jit
def _int8_word_dots(acc, q, xw, xs):
    """acc [BLOCK_N, BLOCK_K // 4] float32 + each weight word's dp4a with its activation word, times the word's
    activation scale."""
    return acc + _dp4a(q, xw[None, :]).to(tl.float32) * xs[None, :]


@triton.jit
def _int8_half(q, dtype: tl.constexpr):
    """A tile of INT8 codes in the model dtype, exactly: float16 by bits (offset_half: no int-to-float conversion,
    which the compiler emits for float16), other types by conversion (bfloat16's the compiler makes by bits)."""
    if dtype == tl.float16:
        return offset_half(q.to(tl.uint8, bitcast=True) ^ 0x80, 128)
    return q.to(dtype)


@triton.jit
def _as_float(w, INT8: tl.constexpr):
    """A dense or INT8 weight tile as float32."""
    if INT8:
        return int8_float(w)
    return w.to(tl.float32)


@triton.jit
def _row_scaled(acc, sz_ptr, rn, n_mask, INT8: tl.constexpr):
    """acc [..., BLOCK_N] (sums over INT8 codes: each output row's scale applied) float32."""
    if INT8:
        acc = acc * tl.load(sz_ptr + rn, mask=n_mask, other=0.0)
    return acc


@triton.jit
def _centered(n):
    """Nibbles 0..15 -> (n - 8) as float16."""
    return offset_half(n, 8)


@triton.jit
def _int4_raw(w_ptr, sz_ptr, rn, n_mask, k0, K, N, stride_w, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
              WORD: tl.constexpr = 1):
    """INT4 rows rn, columns k0 .. k0+BLOCK_K (whole groups), as stored: [BLOCK_N, BLOCK_K // GROUP, GROUP //
    (2 * WORD)] bytes (WORD 1: even column in the high nibble) or int32 words of eight columns (WORD 4), and
    each group's scale and zero [BLOCK_N, groups] as float32."""
    NG: tl.constexpr = BLOCK_K // GROUP
    PER: tl.constexpr = 2 * WORD  # columns an element holds
    gi = tl.arange(0, NG)
    j = tl.arange(0, GROUP // PER)
    in_k = k0 + gi * GROUP < K
    col = (k0 // PER + gi * (GROUP // PER))[None, :, None] + j[None, None, :]
    mask = n_mask[:, None, None] & in_k[None, :, None]
    if WORD == 4:  # 0x88888888: every nibble 8, a weight of 0 after centering
        q = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + rn[:, None, None] * (stride_w // 4) + col, mask=mask,
                    other=-2004318072)
    else:
        q = tl.load(w_ptr + rn[:, None, None] * stride_w + col, mask=mask, other=0x88)
    sz_mask = n_mask[:, None] & in_k[None, :]
    if SZ_WORD:  # a row's scale and zero (adjacent bf16s) as one 32-bit word: a load the pipeline can stage
        sz = tl.load(sz_ptr.to(tl.pointer_type(tl.int32)) + (k0 // GROUP + gi)[None, :] * N + rn[:, None],
                     mask=sz_mask, other=0)
        scale, zero = (sz << 16).to(tl.float32, bitcast=True), (sz & -65536).to(tl.float32, bitcast=True)
    else:
        sz = sz_ptr + ((k0 // GROUP + gi)[None, :] * N + rn[:, None]) * 2
        scale = tl.load(sz, mask=sz_mask, other=0.0).to(tl.float32)
        zero = tl.load(sz + 1, mask=sz_mask, other=0.0).to(tl.float32)
    return q, scale, zero


@triton.jit
def _int4_tile(w_ptr, sz_ptr, rn, n_mask, k0, K, N, stride_w, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """_int4_raw's tile unpacked: the even and odd columns' (q - 8) as [BLOCK_N, BLOCK_K // GROUP, GROUP // 2]
    float16, and the scales and zeros as float32."""
    q, scale, zero = _int4_raw(w_ptr, sz_ptr, rn, n_mask, k0, K, N, stride_w, GROUP, BLOCK_K)
    return _centered(q >> 4), _centered(q & 0xF), scale.to(tl.float32), zero.to(tl.float32)


@triton.jit
def _group_sums(part, x, scale, zero, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum_k x_k w_k of one activation row x [1, BLOCK_K] from each group's sum x (q - 8) (part [BLOCK_N,
    groups], float32): scale * part + zero * sum x, over the groups. [BLOCK_N] float32."""
    xsum = tl.sum(tl.reshape(x.to(tl.float32), [BLOCK_K // GROUP, GROUP]), axis=1)  # [NG]
    return tl.sum(part * scale.to(tl.float32) + zero.to(tl.float32) * xsum[None, :], axis=1)


@triton.jit
def _int4_centered_dot(x, hi, lo, scale, zero, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """One activation row x [1, BLOCK_K] against an unpacked INT4 tile (the even and odd columns' q - 8,
    [BLOCK_N, groups, GROUP // 2]): one multiply-add per weight. [BLOCK_N] float32."""
    NG: tl.constexpr = BLOCK_K // GROUP
    xe, xo = tl.split(tl.reshape(x.to(tl.float32), [NG, GROUP // 2, 2]))  # even and odd columns
    part = tl.sum(hi.to(tl.float32) * xe[None, :, :] + lo.to(tl.float32) * xo[None, :, :], axis=2)  # [BN, NG]
    return _group_sums(part, x, scale, zero, GROUP, BLOCK_K)


@triton.jit
def _int4_row_dot(x, q, scale, zero, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """One activation row x [1, BLOCK_K] against a stored INT4 tile (_int4_raw): sum_k x_k w_k = scale *
    sum x (q - 8) + zero * sum x per group. [BLOCK_N] float32."""
    return _int4_centered_dot(x, _centered(q >> 4), _centered(q & 0xF), scale, zero, GROUP, BLOCK_K)


# One int32 word of eight INT4 weights (bytes of column pairs, even column in the high nibble) as the eight
# halves (q - 8), in column order: per byte pair, a byte permute puts two nibbles in the two halves, one
# logic op makes them 1024 + q (bf16: 128 + q), one packed subtract centers them. 1.5 instructions a
# weight, against ~6 for nibble -> float32 one weight at a time.
def _word_pairs(word: str, out) -> str:
    """PTX that unpacks the int32 word operand `word` into four registers of two halves (q - 8), pair i
    (columns 2i, low half, and 2i + 1) into out(i)'s register, then out(i)'s line, if any; registers hi, d, c
    and the placeholders _ptx fills."""
    return (f"mov.b32 c, CENTER;\nshr.u32 hi, {word}, 4;\n" + "".join(
        f"prmt.b32 d, hi, {word}, 0x0{4 + i}0{i};\nlop3.b32 {out(i)[0]}, d, 0x000F000F, MAGIC, 0xEA;\n"
        f"sub.TYPE {out(i)[0]}, {out(i)[0]}, c;\n{out(i)[1]}" for i in range(4)))


def _ptx(template: str) -> tuple:
    """template for float16 and for bfloat16, as (f16, bf16) constexprs: MAGIC (the half whose low bits a
    nibble fills: 1024 + q, bf16 128 + q) and CENTER (1024 + 8 in both halves, bf16 128 + 8), TYPE for a
    packed subtract, multiply or add (bf16 takes the rounding mode there), FTYPE for a packed fused
    multiply-add (rounding mode given), HALF for one half."""
    f16 = (template.replace("MAGIC", "0x64006400").replace("CENTER", "0x64086408").replace("FTYPE", "f16x2")
           .replace("TYPE", "f16x2").replace("HALF", "f16"))
    bf16 = (template.replace("MAGIC", "0x43004300").replace("CENTER", "0x43084308").replace("FTYPE", "bf16x2")
            .replace(".TYPE", ".rn.bf16x2").replace("HALF", "bf16"))
    return tl.constexpr(f16), tl.constexpr(bf16)


# Eight INT4 weights (one 32-bit word: bytes of column pairs, even column in the high nibble) times eight
# activations (four words of two halves, even column in the low half), summed: the word unpacked as
# _word_pairs does; the first pair's products are a packed multiply and the other three pairs' packed
# multiply-adds into it (O3EDGE_INT4_FMA=0: a multiply and an add each, as before); the two halves are
# then added as float32. 22 PTX instructions a word (25 before), against seven a weight for nibble ->
# float32, center, multiply-add.
def _packed_dot(fma: bool) -> str:
    def product(i: int) -> str:
        if i == 0:
            return "mul.TYPE s, w, $2;\n"
        return f"fma.rn.FTYPE s, w, ${i + 2}, s;\n" if fma else f"mul.TYPE p, w, ${i + 2};\nadd.TYPE s, s, p;\n"
    return ("{\n.reg .b32 hi, d, w, s, p, c;\n.reg .b16 h0, h1;\n.reg .f32 f0, f1;\n"
            + _word_pairs("$1", lambda i: ("w", product(i)))
            + "mov.b32 {h0, h1}, s;\ncvt.f32.HALF f0, h0;\ncvt.f32.HALF f1, h1;\nadd.f32 $0, f0, f1;\n}")


PACKED_DOT_F16, PACKED_DOT_BF16 = _ptx(_packed_dot(os.environ.get("O3EDGE_INT4_FMA", "1") != "0"))


@triton.jit
def _pairs(x, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """Activations [1, BLOCK_K] (float16 or bfloat16) as four int32 words of two halves per eight columns:
    each [BLOCK_K // GROUP, GROUP // 8], word j of columns 8i .. 8i+7 holding columns 8i+2j (low) and 8i+2j+1."""
    bits = tl.reshape(x, [BLOCK_K]).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    even, odd = tl.split(tl.reshape(bits, [BLOCK_K // 2, 2]))
    words = tl.reshape(even | (odd << 16), [BLOCK_K // GROUP, GROUP // 8, 2, 2])  # word j = 2a + b at [.., a, b]
    j02, j13 = tl.split(words)
    j0, j2 = tl.split(j02)
    j1, j3 = tl.split(j13)
    return j0, j1, j2, j3


@triton.jit
def _int4_packed_row_dot(x, q, scale, zero, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """_int4_row_dot on the GPU's packed half-precision instructions (PACKED_DOT_*), for a tile of int32 words
    (_int4_raw with WORD 4): [BLOCK_N] float32."""
    w0, w1, w2, w3 = _pairs(x, BLOCK_K, GROUP)
    args = [q, w0[None], w1[None], w2[None], w3[None]]
    if x.dtype == tl.bfloat16:
        part = tl.inline_asm_elementwise(PACKED_DOT_BF16, "=r,r,r,r,r,r", args, dtype=tl.float32, is_pure=True, pack=1)
    else:
        part = tl.inline_asm_elementwise(PACKED_DOT_F16, "=r,r,r,r,r,r", args, dtype=tl.float32, is_pure=True, pack=1)
    return _group_sums(tl.sum(part, axis=2), x, scale, zero, GROUP, BLOCK_K)


@triton.jit
def _int4_row_tile(w_ptr, sz_ptr, rn, n_mask, k0, K, N, stride_w, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                   PACKED: tl.constexpr):
    """The stored INT4 tile a one-row dot takes: int32 words for the packed dot, bytes otherwise."""
    return _int4_raw(w_ptr, sz_ptr, rn, n_mask, k0, K, N, stride_w, GROUP, BLOCK_K, 1 + 3 * PACKED)


@triton.jit
def _int4_tile_row_dot(x, q, scale, zero, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, PACKED: tl.constexpr):
    """One activation row x [1, BLOCK_K] against a stored tile from _int4_row_tile: [BLOCK_N] float32."""
    if PACKED:
        acc = _int4_packed_row_dot(x, q, scale, zero, GROUP, BLOCK_K)
    else:
        acc = _int4_row_dot(x, q, scale, zero, GROUP, BLOCK_K)
    return acc


_DEQUANT_WORD = ("{\n.reg .b32 hi, d, w, c;\n"  # byte pair i: columns 2i, 2i + 1, as halves $2i, $2i+1
                 + _word_pairs("$8", lambda i: ("w", f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, w;\n")) + "}")
DEQUANT_WORD_F16, DEQUANT_WORD_BF16 = _ptx(_DEQUANT_WORD)


INTERPRETED = tl.constexpr(INTERPRET)

# One int32 word of eight INT4 weights as four words of two halves (q - 8): word i holds columns 2i (low half)
# and 2i + 1, the layout _pairs gives the activations. 13 instructions for eight weights, done once a tile
# for both rows of _rows_stream_kernel.
_DEQUANT_PAIRS = "{\n.reg .b32 hi, d, c;\n" + _word_pairs("$4", lambda i: (f"${i}", "")) + "}"
DEQUANT_PAIRS_F16, DEQUANT_PAIRS_BF16 = _ptx(_DEQUANT_PAIRS)

# Four words of weight pairs ($1-$4) times four words of activation pairs ($5-$8): one packed multiply, three
# packed multiply-adds, the two halves' sum in float32 (as PACKED_DOT_* sums a word's eight products).
_PAIRS_DOT = """{
.reg .b32 s;
.reg .b16 h0, h1;
.reg .f32 f0, f1;
mul.TYPE s, $1, $5;
fma.rn.FTYPE s, $2, $6, s;
fma.rn.FTYPE s, $3, $7, s;
fma.rn.FTYPE s, $4, $8, s;
mov.b32 {h0, h1}, s;
cvt.f32.HALF f0, h0;
cvt.f32.HALF f1, h1;
add.f32 $0, f0, f1;
}"""
PAIRS_DOT_F16, PAIRS_DOT_BF16 = _ptx(_PAIRS_DOT)


@triton.jit
def _dequant_pairs(q, dtype: tl.constexpr):
    """A tile of int32 words (_int4_raw with WORD 4) as four tiles of words of two halves (q - 8), on the GPU."""
    if dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(DEQUANT_PAIRS_BF16, "=r,=r,=r,=r,r", [q], is_pure=True, pack=1,
                                         dtype=(tl.int32, tl.int32, tl.int32, tl.int32))
    return tl.inline_asm_elementwise(DEQUANT_PAIRS_F16, "=r,=r,=r,=r,r", [q], is_pure=True, pack=1,
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32))


@triton.jit
def _pairs_row_dot(x, p0, p1, p2, p3, scale, zero, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """One activation row x [1, BLOCK_K] against a tile of weight pairs (_dequant_pairs): [BLOCK_N] float32."""
    x0, x1, x2, x3 = _pairs(x, BLOCK_K, GROUP)
    args = [p0, p1, p2, p3, x0[None], x1[None], x2[None], x3[None]]
    if x.dtype == tl.bfloat16:
        part = tl.inline_asm_elementwise(PAIRS_DOT_BF16, "=r,r,r,r,r,r,r,r,r", args, dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        part = tl.inline_asm_elementwise(PAIRS_DOT_F16, "=r,r,r,r,r,r,r,r,r", args, dtype=tl.float32,
                                         is_pure=True, pack=1)
    return _group_sums(tl.sum(part, axis=2), x, scale, zero, GROUP, BLOCK_K)


@triton.jit
def _word_nibble(q, shift: tl.constexpr, dtype: tl.constexpr):
    return (((q >> shift) & 0xF) - 8).to(dtype)


@triton.jit
def _int4_tile_asm(w_ptr, sz_ptr, rn, n_mask, k0, K, N, stride_w, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                   dtype: tl.constexpr):
    """weight_tile's INT4 tile on the GPU's packed half-precision instructions (DEQUANT_WORD_*), scaled in the
    model dtype: [BLOCK_N, BLOCK_K]."""
    q, scale, zero = _int4_raw(w_ptr, sz_ptr, rn, n_mask, k0, K, N, stride_w, GROUP, BLOCK_K, 4)
    if INTERPRETED:  # the interpreter runs no PTX: the same eight halves from plain integer ops
        c = (_word_nibble(q, 4, dtype), _word_nibble(q, 0, dtype), _word_nibble(q, 12, dtype),
             _word_nibble(q, 8, dtype), _word_nibble(q, 20, dtype), _word_nibble(q, 16, dtype),
             _word_nibble(q, 28, dtype), _word_nibble(q, 24, dtype))
    elif dtype == tl.bfloat16:
        c = tl.inline_asm_elementwise(DEQUANT_WORD_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r", [q], is_pure=True, pack=1,
                                      dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16,
                                             tl.bfloat16, tl.bfloat16, tl.bfloat16))
    else:
        c = tl.inline_asm_elementwise(DEQUANT_WORD_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r", [q], is_pure=True, pack=1,
                                      dtype=(tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16,
                                             tl.float16, tl.float16))
    s, z = scale.to(dtype)[:, :, None], zero.to(dtype)[:, :, None]
    c0, c1, c2, c3 = c[0] * s + z, c[1] * s + z, c[2] * s + z, c[3] * s + z
    c4, c5, c6, c7 = c[4] * s + z, c[5] * s + z, c[6] * s + z, c[7] * s + z
    # join stacks on a new last axis, so column 4a + 2b + c sits at [.., a, b, c] after three joins
    w = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
    return tl.reshape(w, [w.shape[0], BLOCK_K])


@triton.jit
def _dot(x, w, acc, IEEE: tl.constexpr):
    """acc + x @ w.T on the tensor cores (float32 inputs: IEEE precision)."""
    if IEEE:
        return tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w), acc)


@triton.jit
def weight_tile(w_ptr, sz_ptr, rn, n_mask, k0, K, N, stride_w, INT4: tl.constexpr, GROUP: tl.constexpr,
                 BLOCK_K: tl.constexpr, dtype: tl.constexpr, ASM: tl.constexpr = False):
    """Weight rows rn, columns k0 .. k0+BLOCK_K, as [BLOCK_N, BLOCK_K] in the model dtype (INT8: the codes
    as stored, int8)."""
    if INT4 and ASM:
        w = _int4_tile_asm(w_ptr, sz_ptr, rn, n_mask, k0, K, N, stride_w, GROUP, BLOCK_K, dtype)
    elif INT4:
        hi, lo, scale, zero = _int4_tile(w_ptr, sz_ptr, rn, n_mask, k0, K, N, stride_w, GROUP, BLOCK_K)
        hi = hi.to(tl.float32) * scale[:, :, None] + zero[:, :, None]
        lo = lo.to(tl.float32) * scale[:, :, None] + zero[:, :, None]
        w = tl.reshape(tl.join(hi, lo), [hi.shape[0], BLOCK_K]).to(dtype)  # columns 2i, 2i+1 interleaved
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rn[:, None] * stride_w + kk[None, :], mask=n_mask[:, None] & (kk < K)[None, :],
                    other=0.0)
    return w


@triton.jit
def _skinny_kernel(x_ptr, res_ptr, res_out_ptr, nw_ptr, w_ptr, sz_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
                   M, N, K: tl.constexpr, stride_x, stride_w, stride_out, stride_split, eps, K_PER_SPLIT,
                   PRO: tl.constexpr, INT4: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ITERS: tl.constexpr, IEEE: tl.constexpr,
                   SPLITS: tl.constexpr, PDL: tl.constexpr, PACKED: tl.constexpr = False,
                   SWAP: tl.constexpr = False, ASM: tl.constexpr = False, SILU_OUT: tl.constexpr = False,
                   INT8: tl.constexpr = False):
    pdl.launch_next(PDL)
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    dtype = x_ptr.dtype.element_ty
    rm = tl.arange(0, BLOCK_M)
    if SILU_OUT:  # gate rows [0, N/2), up rows [N/2, N): half a tile of each, the same output columns
        j = tl.arange(0, BLOCK_N) % (BLOCK_N // 2)
        col = pid_n * (BLOCK_N // 2) + j
        rn = tl.where(tl.arange(0, BLOCK_N) < BLOCK_N // 2, col, N // 2 + col)
        n_mask = col < N // 2
    else:
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < N
    m_mask = rm < M
    pdl.wait_for_previous(PDL)  # the activations are the previous kernel's output
    rstd = tl.zeros([BLOCK_M], tl.float32)
    if PRO == 1:
        rstd = _row_rstd(x_ptr, res_ptr, res_out_ptr, rm, m_mask, K, stride_x, eps,
                         (pid_n == 0) & (pid_k == 0), BLOCK_M, BLOCK_K, dtype)
    if BLOCK_M == 1:
        acc1 = tl.zeros([BLOCK_N], tl.float32)
    elif SWAP:
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for i in range(ITERS):  # a constant: the interpreter takes no tensor as a bound
        k0 = pid_k * K_PER_SPLIT + i * BLOCK_K
        x = _input_tile(x_ptr, res_ptr, nw_ptr, rm, m_mask, k0 + tl.arange(0, BLOCK_K), K, stride_x, rstd, PRO,
                        dtype)
        if BLOCK_M == 1 and INT4:
            q, scale, zero = _int4_row_tile(w_ptr, sz_ptr, rn, n_mask, k0, K, N, stride_w, GROUP, BLOCK_K, PACKED)
            acc1 += _int4_tile_row_dot(x, q, scale, zero, GROUP, BLOCK_K, PACKED)
        else:
            w = weight_tile(w_ptr, sz_ptr, rn, n_mask, k0, K, N, stride_w, INT4, GROUP, BLOCK_K, dtype, ASM)
            if BLOCK_M == 1:
                acc1 += tl.sum(_as_float(w, INT8) * x.to(tl.float32), axis=1)
            else:
                if INT8:  # codes of at most 127 are exact in either half type
                    w = _int8_half(w, dtype)
                if SWAP:  # the weight tile is the dot's first operand (on Hopper it may stay in registers)
                    acc_t = _dot(w, x, acc_t, IEEE)  # w @ x.T
                else:
                    acc = _dot(x, w, acc, IEEE)
    if BLOCK_M == 1:
        acc = acc1[None, :]
    elif SWAP:
        acc = tl.trans(acc_t)
    acc = _row_scaled(acc, sz_ptr, rn[None, :], n_mask[None, :], INT8)
    if bias_ptr is not None:
        acc += tl.load(bias_ptr + rn, mask=n_mask & (pid_k == 0), other=0.0).to(tl.float32)[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLITS == 1:
        _store_out(acc, out_ptr, rm, m_mask, rn, n_mask, pid_n, N, stride_out, BLOCK_N, SILU_OUT)
    else:
        tile = rm[:, None] * N + rn[None, :]  # the partial sums: [splits, M, N]
        if last_arrival(part_ptr + pid_k * stride_split + tile, acc, mask, count_ptr + pid_n, SPLITS):
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # the splits in order: the same sum whoever is last
            for s in range(SPLITS):
                total += tl.load(part_ptr + s * stride_split + tile, mask=mask, other=0.0, cache_modifier=".cg")
            _store_out(total, out_ptr, rm, m_mask, rn, n_mask, pid_n, N, stride_out, BLOCK_N, SILU_OUT)


@triton.jit
def _store_out(acc, out_ptr, rm, m_mask, rn, n_mask, pid_n, N, stride_out, BLOCK_N: tl.constexpr,
               SILU_OUT: tl.constexpr):
    """A finished output tile [BLOCK_M, BLOCK_N] (weight rows rn) into out; with SILU_OUT the tile holds gate
    then up columns and SiLU(gate) * up goes to the tile's BLOCK_N / 2 columns of out [M, N / 2], rounded
    where eager torch rounds: the projection's output, the SiLU, the product (kernels/activation.py)."""
    dtype = out_ptr.dtype.element_ty
    if SILU_OUT:
        HALF: tl.constexpr = BLOCK_N // 2
        gate, up = tl.split(tl.permute(tl.reshape(acc.to(dtype), [acc.shape[0], 2, HALF]), (0, 2, 1)))
        col = pid_n * HALF + tl.arange(0, HALF)
        tl.store(out_ptr + rm[:, None] * stride_out + col[None, :], silu_mul_rounded(gate, up, dtype),
                 mask=m_mask[:, None] & (col < N // 2)[None, :])
    else:
        tl.store(out_ptr + rm[:, None] * stride_out + rn[None, :], acc.to(dtype),
                 mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _next_tile(rn, item, k_item, kt: tl.constexpr, programs, rows, SPLITS: tl.constexpr, K_TILES: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(rows, first column) of the tile a stream loads while tile kt of work item `item` (rows rn, its K tiles from
    column k_item) is used: this item's next tile, or the next item's first. Item i is row block i // SPLITS, K
    tiles (i % SPLITS) * K_TILES on."""
    if kt + 1 < K_TILES:
        return rn, k_item + (kt + 1) * BLOCK_K
    if SPLITS == 1:
        return rn + programs * BLOCK_N, 0
    nxt = item + programs
    return (nxt // SPLITS) * BLOCK_N + rows, (nxt % SPLITS) * (K_TILES * BLOCK_K)


@triton.jit
def _x_codes(x, INT4: tl.constexpr, BLOCK_K: tl.constexpr):
    """An activation tile [1, BLOCK_K] quantized for dp4a: _nibble_x's words (INT4 weights) or _quantized_x's."""
    if INT4:
        codes = _nibble_x(x, BLOCK_K)
    else:
        codes = _quantized_x(x, BLOCK_K)
    return codes


@triton.jit
def _tile_codes(x, codes0, ONE_TILE: tl.constexpr, INT4: tl.constexpr, BLOCK_K: tl.constexpr):
    """dp4a's activation codes for tile x: the row's one tile's, quantized once a program (codes0), or x's own."""
    if ONE_TILE:
        codes = codes0
    else:
        codes = _x_codes(x, INT4, BLOCK_K)
    return codes


@triton.jit
def _finish_rows(acc, rn, N, sz_ptr, bias_ptr, out_ptr, INT8: tl.constexpr):
    """A row block's sums [BLOCK_N] float32: INT8 rows scaled, the bias added, stored in out's dtype."""
    acc = _row_scaled(acc, sz_ptr, rn, rn < N, INT8)
    if bias_ptr is not None:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + rn, acc.to(out_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _row_stream_kernel(x_ptr, res_ptr, res_out_ptr, nw_ptr, w_ptr, sz_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, N,
                       K: tl.constexpr, stride_x, stride_w, eps, PRO: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, K_TILES: tl.constexpr, BLOCKS: tl.constexpr, DEFER: tl.constexpr,
                       PDL: tl.constexpr, INT4: tl.constexpr = False, GROUP: tl.constexpr = 1,
                       PACKED: tl.constexpr = False, INT8: tl.constexpr = False, WORDS: tl.constexpr = False,
                       SPLITS: tl.constexpr = 1, X_AHEAD: tl.constexpr = False):
    """One activation row, a few programs per SM: each streams the work items pid, pid + programs, ... tile after
    tile, the next weight tile's load issued before the current tile is used. A work item is a row block's
    K_TILES tiles; with SPLITS > 1 a row block's row is split in SPLITS items along K (stream_splits), each item's
    partial sums stored and the block's last item to finish summing them in order (last_arrival). The prologue's
    statistics are computed once per program, not once per item, and the first tile is in flight before the
    wait for the previous kernel (weights are no kernel's output).
    DEFER (dense): products are summed across threads once per item instead of once per tile.
    INT4: the stored tile (words for the packed dot) is what is in flight; it is unpacked when used.
    INT8: as dense, on the codes (int8_float), each row's sum scaled at the end; WORDS: int32 words of four
    codes, the activations quantized (_quantized_x) and multiplied by dp4a. INT4 with WORDS: the stored words
    against activations quantized alike (_nibble_x), each word's nibbles met by two dp4a (_int4_word_dots)."""
    pdl.launch_next(PDL)
    pid, programs = tl.program_id(0), tl.num_programs(0)
    dtype = x_ptr.dtype.element_ty
    rm = tl.arange(0, 1)
    m_mask = rm < 1
    rows = tl.arange(0, BLOCK_N)
    rn = (pid // SPLITS) * BLOCK_N + rows
    k_first = (pid % SPLITS) * (K_TILES * BLOCK_K)
    if INT4:
        q_next, s_next, z_next = _int4_row_tile(w_ptr, sz_ptr, rn, rn < N, k_first, K, N, stride_w, GROUP, BLOCK_K,
                                                PACKED or WORDS)
    elif WORDS:
        w_next = _int8_words(w_ptr, rn, rn < N, k_first, K, stride_w, BLOCK_K)
    else:
        w_next = weight_tile(w_ptr, None, rn, rn < N, k_first, K, N, stride_w, False, 1, BLOCK_K, dtype)
    pdl.wait_for_previous(PDL)
    rstd = tl.zeros([1], tl.float32)
    if PRO == 1:
        rstd = _row_rstd(x_ptr, res_ptr, res_out_ptr, rm, m_mask, K, stride_x, eps, pid == 0, 1, BLOCK_K, dtype)
    ONE_TILE: tl.constexpr = K_TILES * SPLITS == 1
    codes0 = None
    if WORDS and ONE_TILE:  # the whole row quantized once, for every row block
        x0 = _input_tile(x_ptr, res_ptr, nw_ptr, rm, m_mask, tl.arange(0, BLOCK_K), K, stride_x, rstd, PRO, dtype)
        codes0 = _x_codes(x0, INT4, BLOCK_K)
    if X_AHEAD:
        x_next = _input_tile(x_ptr, res_ptr, nw_ptr, rm, m_mask, k_first + tl.arange(0, BLOCK_K), K, stride_x, rstd,
                             PRO, dtype)
    for b in range(BLOCKS):
        item = pid + b * programs
        rn = (item // SPLITS) * BLOCK_N + rows
        k_item = (item % SPLITS) * (K_TILES * BLOCK_K)
        acc = tl.zeros([BLOCK_N], tl.float32)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K // (1 + 3 * WORDS)], tl.float32)
        for kt in tl.static_range(K_TILES):
            rn2, k2 = _next_tile(rn, item, k_item, kt, programs, rows, SPLITS, K_TILES, BLOCK_N, BLOCK_K)
            if X_AHEAD:  # this tile's activations were loaded with the tile before; the next tile's now
                x = x_next
                x_next = _input_tile(x_ptr, res_ptr, nw_ptr, rm, m_mask, k2 + tl.arange(0, BLOCK_K), K, stride_x, rstd,
                                     PRO, dtype)
            else:
                x = _input_tile(x_ptr, res_ptr, nw_ptr, rm, m_mask, k_item + kt * BLOCK_K + tl.arange(0, BLOCK_K), K,
                                stride_x, rstd, PRO, dtype)
            if INT4:
                q, sc, zr = q_next, s_next, z_next
                q_next, s_next, z_next = _int4_row_tile(w_ptr, sz_ptr, rn2, rn2 < N, k2, K, N, stride_w, GROUP,
                                                        BLOCK_K, PACKED or WORDS)
                if WORDS:
                    xe, xo, xs, xsum = _tile_codes(x, codes0, ONE_TILE, INT4, BLOCK_K)
                    acc += _int4_word_dots(q, sc, zr, xe, xo, xs, xsum, GROUP, BLOCK_K)
                else:
                    acc += _int4_tile_row_dot(x, q, sc, zr, GROUP, BLOCK_K, PACKED)
            elif WORDS:
                w = w_next
                w_next = _int8_words(w_ptr, rn2, rn2 < N, k2, K, stride_w, BLOCK_K)
                xw, xs = _tile_codes(x, codes0, ONE_TILE, INT4, BLOCK_K)
                if DEFER:
                    acc2 = _int8_word_dots(acc2, w, xw, xs)
                else:
                    acc += tl.sum(_int8_word_dots(tl.zeros([BLOCK_N, BLOCK_K // 4], tl.float32), w, xw, xs), axis=1)
            else:
                w = w_next
                w_next = weight_tile(w_ptr, None, rn2, rn2 < N, k2, K, N, stride_w, False, 1, BLOCK_K, dtype)
                if DEFER:
                    acc2 += _as_float(w, INT8) * x.to(tl.float32)
                else:
                    acc += tl.sum(_as_float(w, INT8) * x.to(tl.float32), axis=1)
        if DEFER and not INT4:
            acc = tl.sum(acc2, axis=1)
        if SPLITS == 1:
            _finish_rows(acc, rn, N, sz_ptr, bias_ptr, out_ptr, INT8)
        elif (item // SPLITS) * BLOCK_N < N:  # a row block's items: partial sums [SPLITS, N], summed in order
            if last_arrival(part_ptr + (item % SPLITS) * N + rn, acc, rn < N, count_ptr + item // SPLITS, SPLITS):
                total = tl.zeros([BLOCK_N], tl.float32)
                for s in tl.static_range(SPLITS):
                    total += tl.load(part_ptr + s * N + rn, mask=rn < N, other=0.0, cache_modifier=".cg")
                _finish_rows(total, rn, N, sz_ptr, bias_ptr, out_ptr, INT8)


@triton.jit
def _row_into(acc, rm, m, x_ptr, k0, K, stride_x, t0, t1, t2, t3, scale, zero, GROUP: tl.constexpr,
              BLOCK_K: tl.constexpr, PACKED: tl.constexpr, dtype: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] with activation row m's products with a dequantized tile added to its row m: the
    tile as four words of half pairs (PACKED, _dequant_pairs) or as the even and odd columns' q - 8 (t0, t1)."""
    one = tl.arange(0, 1)
    x = _input_tile(x_ptr, None, None, one + m, one < 1, k0 + tl.arange(0, BLOCK_K), K, stride_x,
                    tl.zeros([1], tl.float32), 0, dtype)
    if PACKED:
        part = _pairs_row_dot(x, t0, t1, t2, t3, scale, zero, GROUP, BLOCK_K)
    else:
        part = _int4_centered_dot(x, t0, t1, scale, zero, GROUP, BLOCK_K)
    return tl.where(rm[:, None] == m, acc + part[None, :], acc)


@triton.jit
def _rows_stream_kernel(x_ptr, w_ptr, sz_ptr, bias_ptr, out_ptr, N, K: tl.constexpr, stride_x, stride_w, stride_out,
                        ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        K_TILES: tl.constexpr, BLOCKS: tl.constexpr, PDL: tl.constexpr, GROUP: tl.constexpr,
                        PACKED: tl.constexpr, UNROLL: tl.constexpr = False):
    """A few activation rows (ROWS) of INT4 weights without the tensor cores: row blocks streamed as in
    _row_stream_kernel, each tile dequantized once (PACKED: to words of half pairs, _dequant_pairs; under
    the interpreter, to float32 pairs) and multiplied with each row in turn, as the one-row kernel does
    with its row. No prologue (above one row the decode step runs the op before as its own kernel)."""
    pdl.launch_next(PDL)
    pid, programs = tl.program_id(0), tl.num_programs(0)
    dtype = x_ptr.dtype.element_ty
    rm = tl.arange(0, BLOCK_M)
    rows = tl.arange(0, BLOCK_N)
    rn = pid * BLOCK_N + rows
    q_next, s_next, z_next = _int4_row_tile(w_ptr, sz_ptr, rn, rn < N, 0, K, N, stride_w, GROUP, BLOCK_K, PACKED)
    pdl.wait_for_previous(PDL)
    for b in range(BLOCKS):
        rn = (pid + b * programs) * BLOCK_N + rows
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kt in tl.static_range(K_TILES):
            rn2, k2 = _next_tile(rn, pid + b * programs, 0, kt, programs, rows, 1, K_TILES, BLOCK_N, BLOCK_K)
            q, sc, zr = q_next, s_next, z_next
            q_next, s_next, z_next = _int4_row_tile(w_ptr, sz_ptr, rn2, rn2 < N, k2, K, N, stride_w, GROUP, BLOCK_K,
                                                    PACKED)
            if PACKED:
                t0, t1, t2, t3 = _dequant_pairs(q, dtype)
            else:  # the even and odd columns' q - 8 (t2, t3 unused)
                t0, t1 = _centered(q >> 4), _centered(q & 0xF)
                t2, t3 = t0, t1
            if UNROLL:  # every row's loads in one straight run of code (O3EDGE_INT4_ROWS_UNROLL=0: a loop)
                for m in tl.static_range(ROWS):
                    acc = _row_into(acc, rm, m, x_ptr, kt * BLOCK_K, K, stride_x, t0, t1, t2, t3, sc, zr, GROUP,
                                    BLOCK_K, PACKED, dtype)
            else:
                for m in range(ROWS):
                    acc = _row_into(acc, rm, m, x_ptr, kt * BLOCK_K, K, stride_x, t0, t1, t2, t3, sc, zr, GROUP,
                                    BLOCK_K, PACKED, dtype)
        if bias_ptr is not None:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_out + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rm < ROWS)[:, None] & (rn < N)[None, :])


def packed_int4(x: torch.Tensor) -> bool:
    """Whether one-row INT4 tiles use the packed half-precision dot (PACKED_DOT_*): on a CUDA GPU, for
    float16 and bfloat16 activations, unless O3EDGE_INT4_PACKED=0; otherwise (and always under the
    interpreter) the float32 path. On the H200 it took gate/up at one row from 11.7 to 9.2 us and down
    from 9.1 to 7.2 us (tinyllama; llama-1b 15.1 to 11.7 and 11.5 to 9.0 us), and a llama-1b INT4-FFN
    step from 0.758 to 0.686 ms (docs/results/gpu-2026-12-01/int4-packed/, int4-cold/); its output is
    checked on the GPU at model shapes (tests/engine/test_gemv.py, marked gpu). The same trick for the
    dequantized tiles of 8-32 rows was faster at some shapes and slower at others; multiplying those
    tiles' even and odd columns as two dots (no interleave through shared memory) was 1.7-7x slower, and
    two dots a group on the raw nibbles with the scales applied after, 1.9-5.9x slower
    (docs/results/gpu-2026-12-01/int4-ab/, fifth/), so tiles of more rows keep the interleaved float32
    dequantize. Multiply-adds in place of a multiply and an add per pair (O3EDGE_INT4_FMA, default; in bf16
    ptxas does not fuse the rounded pair itself: 1176 -> 1072 instructions in llama-1b's gate/up kernel
    at 8 programs per SM) took llama-1b's gate/up from 10.1 to 9.6 us and its INT4 LM head from 61.0 to
    57.8; summing the scaled per-word partials once a row block instead of once a tile was slower (LM head
    67.4 us) and is not kept (docs/results/gpu-2026-12-02j/int4-fma/)."""
    return (x.is_cuda and not INTERPRET and x.dtype in (torch.float16, torch.bfloat16)
            and os.environ.get("O3EDGE_INT4_PACKED", "1") != "0")


def asm_int4(x: torch.Tensor) -> bool:
    """Whether INT4 tiles of several rows are dequantized a word of eight weights at a time (DEQUANT_WORD_*,
    scaled in the model dtype; under the interpreter, the same from plain integer ops) rather than nibble
    by nibble through float32: for float16 and bfloat16 activations, unless O3EDGE_INT4_ASM=0.

    In the sm_90 code of tinyllama's gate/up tile at 8 rows (tools/kernel_sass.py gemv), the float32 path's
    96 HADD2 + 64 FFMA + 34 F2FP + 122 LOP3 become 32 HADD2 + 32 HFMA2 + 63 LOP3 (both software-pipelined,
    cp.async). On the H200 (tools/bench_gemv.py
    --grid, tinyllama-1.1b, op before included; docs/results/gpu-2026-12-01e/), best tilings: gate/up
    26.2 -> 17.1 us at 8 rows and 20.1 -> 19.5 at 32; down 18.9 -> 13.3 and 21.0 -> 14.7 (fp16 on cuBLAS:
    15.5 / 15.9 and 11.1 / 11.6)."""
    return (x.dtype in (torch.float16, torch.bfloat16) and (x.is_cuda or INTERPRET)
            and os.environ.get("O3EDGE_INT4_ASM", "1") != "0")


def dp4a_int8(K: int, block_k: int) -> bool:
    """Whether one row of INT8 weights runs on dp4a, its activations quantized per group of 32 columns as the CPU's
    INT8 kernels quantize them (W8A8), rather than multiplied in float (W8A16): where K and the tile are whole
    groups, unless O3EDGE_INT8_DP4A=0."""
    return K % ACT_GROUP.value == 0 and block_k % ACT_GROUP.value == 0 and os.environ.get("O3EDGE_INT8_DP4A") != "0"


def dp4a_int4(K: int, block_k: int, splits: int = 1) -> bool:
    """Whether one streamed row of INT4 weights runs on dp4a (W4A8), its activations quantized per group of 32
    columns as INT8's one-row kernel does (_nibble_x, _int4_word_dots), rather than on the packed half-precision
    dot (W4A16, PACKED_DOT_*): where the row is one tile, quantized once a program, or where a row split along K
    (stream_splits) gives each work item one tile, unless O3EDGE_INT4_DP4A=0.

    On the H200 (tools/bench_gemv.py --weights int4 --rows 1 --grid, group 128, op before fused in;
    docs/results/gpu-2026-12-04-w4a8/call1/), µs, packed dot -> dp4a: gate/up tinyllama-1.1b 8.5 -> 5.4 and
    llama-1b 8.9 -> 6.6, the INT4 LM head 15.5 -> 11.0 and 57.7 -> 38.0. The down projection (its row in three
    or four tiles, each quantized in turn) was slower on dp4a: 5.0 -> 6.1-6.2 and 6.4 -> 7.2-8.2
    (O3EDGE_INT4_DP4A=all: every shape, to measure); llama-1b's, split in one item a tile, is faster (5.67 us)."""
    forced = os.environ.get("O3EDGE_INT4_DP4A")
    return forced != "0" and (K <= block_k * splits or forced == "all")


def x_ahead() -> bool:
    """Whether a streamed row whose work items hold several K tiles loads each tile's activations (and its prologue)
    with the tile before, as it does the weights, rather than when the tile is used: unless O3EDGE_GEMV_X_AHEAD=0.
    On the H200 (tools/bench_gemv.py --rows 1 --weights all --layers down, with and without;
    docs/results/gpu-2026-12-04-split/call2/down-xa{1,0}.json), µs: tinyllama-1.1b's INT4 down 5.0 -> 4.7, INT8
    5.8 -> 5.5; llama-1b's dense down 10.1 -> 9.2, INT8 6.8 -> 6.1; tinyllama's dense down (six 1,024-column
    tiles) 7.4 either way."""
    return os.environ.get("O3EDGE_GEMV_X_AHEAD") != "0"


def stream_splits(K: int, block_k: int) -> int:
    """Work items a streamed row of K columns is split in along K (_row_stream_kernel's SPLITS): one per tile of
    block_k columns, unless O3EDGE_GEMV_SPLIT=0 (a row block's tiles streamed by one program). Each item's
    partial sums are stored, and the row block's last item to finish adds them up in order (last_arrival).

    The plan splits only INT4 rows of whole 2,048-column tiles (llama-1b's down projection, 8,192 columns), in
    16-row blocks: 512 items, about one a program in one wave, each item's tile on dp4a (one tile: dp4a_int4).
    On the H200 (tools/bench_gemv.py --rows 1 --layers down --grid, GRID_SPLITS=1,2,3,4,6;
    docs/results/gpu-2026-12-04-split/call1/): llama-1b's INT4 down 6.38 us (packed dot, unsplit) -> 5.67, and a
    llama-1b bf16 INT4-FFN step's graph 0.580 -> 0.535 ms (tools/profile_gpu_step.py --variants, call2). Not
    split, because it was no faster or slower: tinyllama-1.1b's INT4 down (5,632 columns: 5.0 either way), the
    dense and INT8 downs (7.4 -> 7.7, 9.9 -> 10.0 at best), and splits of 8-row blocks (7.1-7.6: two items a
    program)."""
    return 1 if os.environ.get("O3EDGE_GEMV_SPLIT") == "0" else triton.cdiv(K, block_k)


def stream_int4(N: int, K: int) -> bool:
    """Whether a one-row INT4 matmul streams its row blocks (_row_stream_kernel, the packed dot on stored
    words in flight) like dense ones: every shape, unless O3EDGE_INT4_STREAM=0 (or O3EDGE_GEMV_STREAM=0);
    O3EDGE_INT4_STREAM=wide streams only many rows (N >= 8,192: gate/up, LM head) or long rows (K >= 4,096:
    down), the rule before.

    On the H200 (tools/bench_gemv.py --rows 1 --grid, op before fused in; docs/results/gpu-2026-12-01e/stream/)
    against the skinny kernel: tinyllama-1.1b gate/up 9.2 -> 8.5 us, down 7.2 -> 4.9, LM head 19.0 -> 18.7;
    llama-1b 11.6 -> 10.1, 9.0 -> 6.4, 71.1 -> 59.9. Before the packed dot, streamed INT4 tiles were slower.
    The attention projections (INT4 only with --int4-all) stream too: whole generations of tinyllama with every
    linear INT4 at batch 1 went from 1,573 tok/s (3.80 tok/J) to 1,688 (4.32) (tools/bench_gpu.py --int4-all
    --batches 1, O3EDGE_INT4_STREAM=1 then; docs/results/gpu-2026-12-02k/int4all/)."""
    forced = os.environ.get("O3EDGE_INT4_STREAM")
    if forced == "0" or os.environ.get("O3EDGE_GEMV_STREAM") == "0":
        return False
    return forced != "wide" or N >= 8192 or K >= 4096


def rows_int4(M: int) -> bool:
    """Whether an INT4 matmul of M > 1 rows streams its row blocks without the tensor cores
    (_rows_stream_kernel: each tile dequantized once, then multiplied with each row on the packed
    half-precision units, the row loop unrolled so that the rows' loads overlap): every INT4 matmul of two
    rows, unless O3EDGE_INT4_ROWS=0; O3EDGE_INT4_ROWS=N streams every INT4 matmul of 2..N rows (to
    measure), O3EDGE_INT4_ROWS_UNROLL=0 keeps the row loop.

    On the H200 (tools/bench_gemv_rows.py --rows 2 --variants tiles,default,cublas;
    docs/results/gpu-2026-12-02e/rows2-unrolled.json), µs a call at 2 rows, streamed / the tensor-core tiles
    / cuBLAS on the dense weight: tinyllama gate/up 10.6 / 14.2 / 13.7, down 6.5 / 9.8 / 10.4, LM head
    26.9 / 41.1 / 35.8; llama-1b 14.3 / 19.3 / 18.2, 8.8 / 12.0 / 13.3, 104.5 / 149.1 / 127.4. From 4 rows
    the tiles win (rows-unroll-partial.txt: llama-1b gate/up at 4 rows 26.8 at best against 21.6; each
    row's activations are made into words inside the row loop)."""
    forced = os.environ.get("O3EDGE_INT4_ROWS")
    if forced is not None and forced.isdigit():
        return 1 < M <= min(int(forced), 16)
    return M == 2


def int4_register_cap(M: int, warps: int, programs: int, sms: int) -> dict:
    """Launch options capping the registers of an INT4 tile of 2-31 rows (not a multiple of 16) at 128 a
    thread, so that four programs of four warps fit an SM at once, where the grid is more than one wave
    at three an SM. O3EDGE_INT4_MAXNREG=0 never caps, =1 caps every such tile whatever its grid, =R (32 or
    more) caps every INT4 tile of several rows at R registers (to measure).

    Compiled for sm_90 (tools/kernel_sass.py gemv --rows 8 --n 16384 --k 2048 --dtype bfloat16), the tile of
    2-8 rows takes 136 registers (tinyllama's gate/up 144): three programs an SM. With 16 rows Triton
    specializes the row count (divisible by 16) and the same tile takes 128: four. On the H200
    (tools/bench_gemv_rows.py, docs/results/gpu-2026-12-02d/rows.json), at 2 and 8 rows: llama-1b gate/up
    (512 programs) 29.6 -> 21.6 us, its LM head (4,008) 156.3 -> 147.9, tinyllama's LM head (1,000) 43.5 ->
    41.0; but tinyllama's gate/up (352 programs, one wave either way) 16.1 -> 21.3, hence the grid rule.
    Whole generations, llama-1b bf16 INT4-FFN + INT4 LM head at batch 8: 6,318 -> 6,888 tok/s (same call).
    Since then the FFN's tiles of 2-16 rows run on eight warps (_asm_tiling) and are not capped; the cap
    still applies to INT4 LM heads and to tiles of 17-31 rows."""
    forced = os.environ.get("O3EDGE_INT4_MAXNREG")
    if forced is not None and forced.isdigit() and int(forced) >= 32 and M > 1 and not INTERPRET:
        return {"maxnreg": int(forced)}
    if forced == "0" or not 1 < M < 32 or M % 16 == 0 or warps != 4 or INTERPRET:
        return {}
    return {"maxnreg": 128} if forced == "1" or programs > 3 * sms else {}


def swap_int4(M: int, N: int) -> bool:
    """Whether INT4 tiles of M > 1 rows multiply as W @ x.T, the dequantized weight tile as the dot's first
    operand (which Hopper's wgmma can read from registers), rather than x @ W.T: from 32 rows.

    On the H200 (bench_gemv.py, docs/results/gpu-2026-12-01/swap/), tinyllama-1.1b: gate/up (N = 11,264)
    26.3 -> 18.1 us at 8 rows and 20.6 -> 20.0 at 32; down (N = 2,048) 23.8 -> 20.9 at 32 rows but
    18.8 -> 21.9 at 8. Whole generations in the same calls: INT4-FFN at batch 32 19,797 -> 20,601 tok/s,
    but at batch 8 6,097 -> 5,943 (the 8-row kernel gain did not carry into the step), so only tiles
    of 32 rows and more swap. O3EDGE_INT4_SWAP=0 / 1 turns it off / on for every M > 1 (to measure)."""
    forced = os.environ.get("O3EDGE_INT4_SWAP")
    if forced in ("0", "1"):
        return M > 1 and forced == "1"
    return M >= 32


def plan(M: int, N: int, K: int, int4: bool, num_sms: int, asm: bool = False, int8: bool = False) -> tuple[int, ...]:
    """(BLOCK_N, BLOCK_K, splits, num_warps[, programs per SM[, pipeline stages]]) for an M x K by K x N
    skinny matmul; a fifth entry streams one row (_row_stream_kernel; dense weights, INT4 where stream_int4
    says; splits > 1: the row split along K in that many work items, stream_splits) or two INT4 rows
    (_rows_stream_kernel, rows_int4) on that many programs per SM, a sixth sets the software pipeline's stages.

    At one row: wide K tiles (1,024-2,048 columns) over thin row slices, so each SM has many weight bytes
    in flight; dense weights stream on 6-8 programs per SM. The best tilings of H200 grid searches
    (tools/bench_gemv.py --grid: docs/results/gpu-2026-11-30/gemv-grid*.json, then
    docs/results/gpu-2026-12-01/gemv-grid-stream*.json), as rules by shape. O3EDGE_GEMV_STREAM=0 turns
    streaming off (to measure against). INT8 weights have their own rules (int8_plan)."""
    if int8:
        return int8_plan(M, N, K, num_sms)
    if M > 1 and int4 and rows_int4(M):  # streamed rows (rows_int4): fifth entry, programs per SM
        return (8, 2048, 1, 8, 4) if K >= 4096 else (8, 1024, 1, 4, 4)
    if M > 1 and int4 and asm:  # the packed dequantize (asm_int4), sixth entry: pipeline stages
        return _asm_tiling(M, N)
    if M > 1 and int4 and swap_int4(M, N):  # weight rows are the dot's rows: 64-128 of them a program
        wide = N >= 8192
        if M >= 32:
            return (64, 64, 4, 4) if wide else (64, 256, 4, 4)
        return (128, 64, 4, 8) if wide else (64, 256, 4, 4)
    if M > 1 and int4:  # the down projection (few rows of output, long rows) splits K in two
        wide, long = N >= 8192, K >= 4096
        if M >= 32:
            return (64, 128, 2, 4) if wide else (16, 512, 2, 4)
        return (32, 256, 1, 4) if wide else (32, 512 if long else 256, 2, 4)
    if M > 1:
        return 32, min(256, triton.next_power_of_2(K)), 1, 4
    if int4 and stream_int4(N, K) and dp4a_int4(K, min(2048, triton.next_power_of_2(K))):  # W4A8, as INT8's
        if N < 8192:  # the attention projections (--int4-all): o in blocks of 4 rows, QKV of 16 (an H200 grid,
            # docs/results/gpu-2026-12-04-split/call4/: tinyllama o 2.56 -> 2.02 us, QKV 3.64 -> 3.06; llama-1b o
            # 2.64 -> 2.04, QKV 3.27 -> 3.37)
            return (4 if N <= K else 16), min(2048, triton.next_power_of_2(K)), 1, 8, 4
        return int8_plan(M, N, K, num_sms)
    if int4 and stream_int4(N, K):  # the FFN, the LM head, --int4-all's attention projections; from 16,384 rows
        # on, 4 programs per SM (a grid with the packed dot's multiply-adds, docs/results/gpu-2026-12-02j/int4-fma/:
        # llama-1b gate/up 9.7 -> 8.7 us, tinyllama's head 16.2 -> 15.4)
        if K >= 4096:
            return (16, 2048, stream_splits(K, 2048), 8, 4) if K % 2048 == 0 else (8, 2048, 1, 8, 4)
        if N < 8192:  # the attention projections: whole rows of 2,048 columns, 8 warps (a grid,
            # docs/results/gpu-2026-12-02k/gemv/: tinyllama QKV 4.6 -> 3.4 us, o 3.7 -> 2.3; llama-1b 5.0 -> 3.4,
            # 3.8 -> 2.2)
            return 8, min(2048, triton.next_power_of_2(K)), 1, 8, 8
        wide = 4 if N >= 16384 else 8
        return 16, min(1024, triton.next_power_of_2(K)), 1, 4, wide
    if not int4 and os.environ.get("O3EDGE_GEMV_STREAM") != "0":  # whole 2,048-column tiles where they fit
        if K >= 4096:  # the down projection
            return (8, 2048, 1, 8, 6) if K % 2048 == 0 else (4, 1024, 1, 4, 8)
        block_k = min(2048, triton.next_power_of_2(K))
        if N <= K:  # the output projection
            return 4, block_k, 1, 4, 6
        return (8, block_k, 1, 8, 6) if N < 2 * K else (8, block_k, 1, 4, 6)  # QKV; gate/up and LM head
    block_k = min(1024, triton.next_power_of_2(K))
    if K >= 4096:
        return (8, block_k, 2, 8) if int4 else (16, block_k, 2, 8)
    if N >= 8192:
        return (16, block_k, 1, 4) if int4 else (8, block_k, 1, 4)
    return 4, block_k, 1, 8


def int8_plan(M: int, N: int, K: int, num_sms: int) -> tuple[int, ...]:
    """plan() for INT8 weights. One row: streamed, whole 2,048-column tiles of 8 rows, 8 warps, 4 programs per SM
    (within 0.3 us of the best of an H200 grid for every projection of tinyllama-1.1b and llama-1b; the dense
    rules were up to 1.7 us slower: docs/results/gpu-2026-12-04-int8/call2/gemv-int8-grid1.json). Tiles of several
    rows (from 32 swapped, swap_int4), by the grid at 8 and 32 rows (gemv-int8-grid32.json): the LM head in whole
    256-column steps, wide layers (gate/up) split in four along K, narrow ones (QKV, down) in eight. One row of
    INT4 weights on dp4a (dp4a_int4) takes the same tiling: the best or within 0.1 us of it for gate/up and the
    LM head of both models (docs/results/gpu-2026-12-04-w4a8/call1/gemv-int4-dp4a-grid.json)."""
    if M == 1:
        return 8, min(2048, triton.next_power_of_2(K)), 1, 8, 4
    if N > 16384:
        return (64, 256, 1, 4, 0, 3) if M <= 16 else (64, 128, 1, 4, 0, 4)
    if N >= 8192:
        return 64, 128, 4, 4, 0, 3
    return (32, 256, 8, 4, 0, 4) if M <= 16 else (64, 256, 8, 4, 0, 3)


def _asm_tiling(M: int, N: int) -> tuple[int, ...]:
    """plan() for INT4 tiles of 2-64 rows dequantized a word at a time (asm_int4). 2-16 rows run one
    16-row tile (Triton pads to it), so the best tilings at 8 rows hold there; at 32 the tiles are swapped
    (swap_int4). H200 grid (tools/bench_gemv.py --grid --rows 8,32 --weights int4 --layers down,gate_up,
    op before included; docs/results/gpu-2026-12-02e/grid-int4.json), µs, the tiling before -> this one:
    down (N < 8,192) at 8 rows tinyllama 13.3 -> 11.3, llama-1b 16.1 -> 13.6, at 32 rows 15.3 -> 12.3 and
    19.6 -> 14.6: eight splits of K, so that 256 programs share its 2,048 output columns; gate/up at 8
    rows 17.3 -> 15.7 and 22.9 -> 20.9 (eight splits, eight warps); at 32 as before (18.4, 19.4). LM heads
    (N > 16,384) and 17-31 or 33-64 rows keep the tilings of the grids before (gpu-2026-12-01e)."""
    wide = N >= 8192
    if M >= 32:  # swapped (swap_int4); the narrow tiling of 33-64 rows is the one before
        return (64, 256, 1, 4, 0, 3) if wide else (64, 256, 8, 4, 0, 3) if M == 32 else (32, 256, 4, 4, 0, 3)
    if M > 16 or N > 16384:  # not in that grid: the tilings before
        return (32, 256, 1, 4) if wide else (64, 256, 4, 8, 0, 4)
    return (64, 256, 8, 8, 0, 4) if wide else (64, 256, 8, 4, 0, 3)


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, *, scales_and_zeros: torch.Tensor | None = None,
                  group_size: int = 0, out_features: int | None = None, bias: torch.Tensor | None = None,
                  norm_weight: torch.Tensor | None = None, residual: torch.Tensor | None = None, eps: float = 0.0,
                  silu: bool = False, silu_out: bool = False, scales8: torch.Tensor | None = None,
                  config: tuple[int, ...] | None = None):
    """y = prologue(x) @ W.T (+ bias) for x [M <= MAX_ROWS, *].

    - plain: x [M, K];
    - norm_weight given: prologue = RMSNorm(x + residual) * norm_weight; returns (y, new residual) where
      the new residual is x + residual in a fresh tensor (x itself when residual is None);
    - silu: x [M, 2K] holds gate then up; prologue = SiLU(gate) * up;
    - silu_out: W's rows are gate then up (a fused gate/up projection, N even); returns SiLU(gate) * up
      [M, N / 2], made in the tiles' epilogue (tiles of 2-64 rows, not streamed rows), no kernel after.
    weight: dense [N, K] in x's dtype, INT4 qweight uint8 [N, Kp/2] with scales_and_zeros, group_size
    and out_features, or INT8 codes int8 [N, K] with their rows' float32 scales8 [N]. config overrides
    plan() (for the benchmark).
    """
    M = x.shape[0]
    int4, int8 = scales_and_zeros is not None, scales8 is not None
    N = out_features if int4 else weight.shape[0]
    K = x.shape[1] // 2 if silu else x.shape[1]
    limit = MAX_ROWS if config is None else CONFIG_MAX_ROWS
    if M > limit or x.stride(-1) != 1:
        raise ValueError(f"skinny_matmul takes at most {limit} contiguous rows, got {tuple(x.shape)}")
    from o3edge.engine.kernels import num_sms

    sms = num_sms(str(x.device))
    asm = int4 and M > 1 and asm_int4(x)
    block_n, block_k, splits, warps, *extra = config or plan(M, N, K, int4, sms, asm, int8)
    per_sm = extra[0] if extra else 0  # a fifth entry: programs per SM of a stream; a sixth: pipeline stages
    stages = {"num_stages": extra[1]} if len(extra) > 1 and extra[1] else {}
    if INTERPRET and config is None:  # Triton's interpreter (CPU tests): fewer, wider programs run faster
        block_n = max(block_n, min(64, triton.next_power_of_2(N)))
    if int4:
        block_k = max(block_k, group_size)
    pro = PRO_NORM if norm_weight is not None else PRO_SILU if silu else PRO_NONE
    res_out = torch.empty_like(x) if pro == PRO_NORM and residual is not None else None
    on = pdl.enabled(str(x.device))
    out = torch.empty(M, N // 2 if silu_out else N, device=x.device, dtype=x.dtype)
    if per_sm:  # work items (row blocks, each split in `splits` along K at one row) on a few programs per SM
        blocks = triton.cdiv(N, block_n)
        splits = splits if M == 1 else 1
        items = blocks * splits
        programs = min(items, sms * per_sm)
    if silu_out and (per_sm or M == 1 or pro != PRO_NONE or N % 2):
        raise ValueError(f"SiLU in the epilogue takes tiles of 2-{MAX_ROWS} rows, no prologue, an even N; got "
                         f"{M} rows, N={N}" + (", streamed" if per_sm else ""))
    if per_sm and M == 1:
        # one row of INT8 weights by dp4a where whole activation groups tile the row (dp4a_int8); INT4 (dp4a_int4)
        k_tiles = triton.cdiv(triton.cdiv(K, block_k), splits)  # an item's tiles
        words = (int8 and dp4a_int8(K, block_k) and weight.stride(0) % 4 == 0 and weight.data_ptr() % 4 == 0
                 or int4 and dp4a_int4(K, block_k, splits))
        if INTERPRET and config is None:  # each program recomputes the prologue's statistics: two programs
            programs = min(programs, 2)
        part = out if splits == 1 else torch.empty(splits, N, device=x.device, dtype=torch.float32)
        count = out if splits == 1 else arrival_counters(x.device, blocks)
        _row_stream_kernel[(programs,)](
            x, residual, res_out, norm_weight, weight, scales8 if int8 else scales_and_zeros, bias, out, part, count,
            N, K, x.stride(0), weight.stride(0), eps, PRO=pro, BLOCK_N=block_n, BLOCK_K=block_k,
            K_TILES=k_tiles, BLOCKS=triton.cdiv(items, programs), SPLITS=splits, X_AHEAD=k_tiles > 1 and x_ahead(),
            # at most 32 float32 partial sums a thread
            DEFER=not int4 and block_n * block_k // (4 if words else 1) <= 32 * 32 * warps,
            PDL=on, INT4=int4, GROUP=max(group_size, 1), PACKED=int4 and packed_int4(x), INT8=int8, WORDS=words,
            num_warps=warps, **pdl.launch_options(on))
        return (out, x if residual is None else res_out) if pro == PRO_NORM else out
    if per_sm and int4:  # several rows of INT4 weights, streamed (rows_int4)
        if pro != PRO_NONE or M > 16:
            raise ValueError(f"streamed INT4 tiles of several rows take no prologue and at most 16 rows, got {M}")
        _rows_stream_kernel[(programs,)](
            x, weight, scales_and_zeros, bias, out, N, K, x.stride(0), weight.stride(0), N, ROWS=M,
            BLOCK_M=max(2, triton.next_power_of_2(M)), BLOCK_N=block_n, BLOCK_K=block_k,
            K_TILES=triton.cdiv(K, block_k), BLOCKS=triton.cdiv(items, programs), PDL=on, GROUP=max(group_size, 1),
            PACKED=packed_int4(x), UNROLL=os.environ.get("O3EDGE_INT4_ROWS_UNROLL") != "0", num_warps=warps,
            **pdl.launch_options(on))
        return out
    k_per_split = -(-K // (splits * block_k)) * block_k
    iters = k_per_split // block_k
    grid = (triton.cdiv(N // 2, block_n // 2) if silu_out else triton.cdiv(N, block_n), splits)
    part = out if splits == 1 else torch.empty(splits, M, N, device=x.device, dtype=torch.float32)
    count = out if splits == 1 else arrival_counters(x.device, grid[0])
    _skinny_kernel[grid](
        x, residual, res_out, norm_weight, weight, scales8 if int8 else scales_and_zeros, bias, out, part, count,
        M, N, K, x.stride(0), weight.stride(0), out.stride(0), M * N, eps, k_per_split,
        PRO=pro, INT4=int4, GROUP=max(group_size, 1), BLOCK_M=1 if M == 1 else max(16, triton.next_power_of_2(M)),
        BLOCK_N=block_n, BLOCK_K=block_k, ITERS=iters, IEEE=x.dtype == torch.float32, SPLITS=splits,
        PDL=on, PACKED=packed_int4(x) and int4 and M == 1, SWAP=(int4 or int8) and swap_int4(M, N),
        ASM=asm, SILU_OUT=silu_out, INT8=int8, num_warps=warps, **stages, **pdl.launch_options(on),
        **(int4_register_cap(M, warps, grid[0] * grid[1], sms) if asm else {}))
    return (out, x if residual is None else res_out) if pro == PRO_NORM else out


def prefill_tiling(M: int, N: int, K: int) -> tuple[int, ...] | None:
    """The tiling of an INT4 matmul of MAX_ROWS < M <= PREFILL_TILE_ROWS rows (a prompt chunk) on tiles dequantized
    in registers, where that beat dequantize + cuBLAS; None: dequantize + cuBLAS (always, with
    O3EDGE_INT4_PREFILL_TILES=0, to measure against).

    On the H200 at 128 rows (tools/bench_gemv.py --shapes tinyllama-1.1b --rows 128 --weights int4 --grid --layers
    qkv,o,gate_up,down; docs/results/gpu-2026-12-04-fifteenth/call2/), µs, dequantize + cuBLAS -> best tile: gate/up
    34.0 -> 25.4 (64 rows a tile, 128 columns, one split, 4 warps), down 21.2 -> 18.2 (64 x 64, four splits along
    K, 8 warps); QKV (12.0) and o (10.2) were no faster on tiles. At llama-1b's shapes (bench_gemv.py --shapes
    llama-1b --rows 128 --weights int4 --layers gate_up,down; docs/results/gpu-2026-12-05/call2/): gate/up 48.3 ->
    26.5, down 30.3 -> 23.3; the time to first token of a 128-token prompt on tinyllama with every linear INT4
    3.19 -> 2.94 ms (tools/bench_gpu.py --int4-all --batches 1, the switch off then on; the kernels' tests compiled
    on the H200 in the same call)."""
    if not MAX_ROWS < M <= PREFILL_TILE_ROWS or os.environ.get("O3EDGE_INT4_PREFILL_TILES") == "0":
        return None
    if K >= 4096:  # the down projection
        return 64, 64, 4, 8, 0, 3
    if N >= 8192:  # gate/up
        return 64, 128, 1, 4, 0, 3
    return None


def skinny_or_dequantized(x: torch.Tensor, out_features: int, skinny, dequantized, tiled: bool = False) -> torch.Tensor:
    """A quantized linear: x [..., K] -> [..., out_features] in x's dtype. Decode-sized inputs (at most MAX_ROWS
    rows) by skinny(x2) (skinny_matmul on the weight as stored); larger ones (prefill, compute-bound) by cuBLAS on
    dequantized(dtype), the weight dequantized into a scratch matrix (kernels/int4_matmul.py, int8_matmul.py), or
    by skinny(x2) where `tiled` (a prompt chunk prefill_tiling gave a tiling)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = skinny(x2) if tiled or x2.shape[0] <= MAX_ROWS else F.linear(x2, dequantized(x2.dtype))
    return y.view(*shape[:-1], out_features)
