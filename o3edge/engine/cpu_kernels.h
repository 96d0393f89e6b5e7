// o3edge's VNNI row kernels, shared by the per-layer operators (cpu_kernels.cpp) and the decode step (cpu_core.cpp).
// Free of ATen: the step is also built without torch (native_lib.py), so bf16 travels as its uint16 bits.
// Written once for 16 lanes (cpu_vec.h): one AVX-512 VNNI vector, or two AVX-VNNI halves (O3_AVXVNNI), or two AVX2
// halves whose byte dot products are made of vpmaddubsw and vpmaddwd (O3_AVX2).
#pragma once
#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// max |x[i]|, i < n
static inline float abs_max(const float* x, int64_t n) {
  vf16 m = vzerof();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) m = vmax(m, vabs(vloadf(x + i)));
  float r = vreduce_max(m);
  for (; i < n; ++i) r = std::max(r, std::abs(x[i]));
  return r;
}

// ---- INT4 weights x INT8 activations (VNNI) ------------------------------------------------------------
// Weight layout ("rows16"): packed uint8 [N/16, Kp/8, 64]; in the 64 bytes of row block rb and k-octet o, byte
// r*4 + j holds row rb*16+r: column 8o+j in the low nibble, column 8o+4+j in the high one (q in 0..15).
// scales, zeros: bf16 bits (uint16) [Kp/G, N]; w = (q - 8) * scale + zero (o3edge/engine/quant.py's scheme).
// Activations are quantized per group of G columns to int8 (symmetric, scale max|x|/127) on entry.

// several rows on AVX-VNNI, whose 16 lanes are two registers each: one vpdpbusd chain a row instead of two (the
// second chain's registers spilled at 4 rows; int32 sums are exact either way). One row keeps two, for their overlap.
#ifdef O3_AVXVNNI
constexpr bool kOneChainRows = true;
#else
constexpr bool kOneChainRows = false;
#endif

// MB activation rows m0.. against one block of 16 weight rows: each weight load and unpack serves MB rows
template <int MB>
static inline void int4_rows(const uint8_t* wb, const int8_t* xq, const float* xs, const int32_t* xsum,
                             const uint16_t* sp, const uint16_t* zp, float* op, int64_t m0, int64_t rb,
                             int64_t N, int64_t Kp, int64_t NG, int64_t per_group, bool add = false) {
  const vi16 mask = vsetb(0x0F);
  vf16 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = vzerof();
  for (int64_t g = 0; g < NG; ++g) {
    constexpr bool kOneChain = kOneChainRows && MB > 1;
    vi16 ai[MB], bi[MB];  // low and high nibbles: two independent vpdpbusd chains (or one: kOneChainRows)
    for (int i = 0; i < MB; ++i) ai[i] = bi[i] = vzeroi();
    const uint8_t* w = wb + g * per_group * 64;
#ifdef O3_AVX2
    // AVX2: the int16 pair sums of up to four k-octets (eight vpmaddubsw, each pair at most 2 * 15 * 127 in
    // magnitude: 30,480 in all, below int16's limit) added before one widening, instead of widening each
    for (int64_t o0 = 0; o0 < per_group; o0 += 4) {
      vi16 p[MB];
      for (int i = 0; i < MB; ++i) p[i] = vzeroi();
      for (int64_t o = o0; o < std::min(per_group, o0 + 4); ++o) {
        const vi16 v = vloadi(w + o * 64);
        const vi16 lo = vand(v, mask);
        const vi16 hi = vand(vsrli16<4>(v), mask);
        for (int i = 0; i < MB; ++i) {
          const int32_t* xg = reinterpret_cast<const int32_t*>(xq + (m0 + i) * Kp) + (g * per_group + o) * 2;
          p[i] = vadd16(p[i], vadd16(vmaddubs(lo, vseti(xg[0])), vmaddubs(hi, vseti(xg[1]))));
        }
      }
      for (int i = 0; i < MB; ++i) ai[i] = vwiden(ai[i], p[i]);
    }
#else
    for (int64_t o = 0; o < per_group; ++o) {
      const vi16 v = vloadi(w + o * 64);
      const vi16 lo = vand(v, mask);
      const vi16 hi = vand(vsrli16<4>(v), mask);
      for (int i = 0; i < MB; ++i) {
        const int32_t* xg = reinterpret_cast<const int32_t*>(xq + (m0 + i) * Kp) + (g * per_group + o) * 2;
        ai[i] = vdpbusd(ai[i], lo, vseti(xg[0]));
        if (kOneChain) {
          ai[i] = vdpbusd(ai[i], hi, vseti(xg[1]));
        } else {
          bi[i] = vdpbusd(bi[i], hi, vseti(xg[1]));
        }
      }
    }
#endif
    if (!kOneChain)
      for (int i = 0; i < MB; ++i) ai[i] = vadd(ai[i], bi[i]);
    const vf16 sc = vload_bf16(sp + g * N + rb * 16);
    const vf16 ze = vload_bf16(zp + g * N + rb * 16);
    for (int i = 0; i < MB; ++i) {
      const float s = xs[(m0 + i) * NG + g];
      const int32_t xsm = xsum[(m0 + i) * NG + g];
      const vi16 a = vsub(ai[i], vseti(8 * xsm));
      acc[i] = vfmadd(vcvtf(a), vmul(sc, vsetf(s)), acc[i]);
      acc[i] = vfmadd(ze, vsetf(s * (float)xsm), acc[i]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    float* o = op + (m0 + i) * N + rb * 16;
    vstore(o, add ? vadd(vloadf(o), acc[i]) : acc[i]);
  }
}

// ---- INT8 weights x INT8 activations (VNNI) ------------------------------------------------------------
// Weight layout: packed int8 [N/16, K/4, 64]: byte r*4 + j of row block rb and k-quad o is w[rb*16+r][4o+j].
// wsum int32 [K/G, N]: per group sums of the row's int8 weights; scales float32 [N]: w ~ q * scale[row].
// Activations are quantized per group of G columns to int8 and fed to vpdpbusd as x + 128 (unsigned); the
// 128 * sum(w) that adds is taken out per group (on AVX2 the byte products are of x itself, stored as int8 bits:
// kDotBiased, cpu_vec.h).
template <int MB>
static inline void int8_rows(const int8_t* wb, const uint8_t* xu, const float* xs, const int32_t* ws,
                             const float* sp, float* op, int64_t m0, int64_t rb, int64_t N, int64_t K, int64_t NG,
                             int64_t per_group, bool add = false) {
  vf16 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = vzerof();
  for (int64_t g = 0; g < NG; ++g) {
    constexpr bool kOneChain = kOneChainRows && MB > 1;
    vi16 a0[MB], a1[MB];  // even and odd k-quads: two vpdpbusd chains (or one: kOneChainRows)
    for (int i = 0; i < MB; ++i) a0[i] = a1[i] = vzeroi();
    const int8_t* w = wb + g * per_group * 64;
    int64_t o = 0;
    for (; o + 2 <= per_group; o += 2) {
      const vi16 w0 = vloadi(w + o * 64), w1 = vloadi(w + o * 64 + 64);
      for (int i = 0; i < MB; ++i) {
        const int32_t* xg = reinterpret_cast<const int32_t*>(xu + (m0 + i) * K) + g * per_group + o;
        a0[i] = vdot_u8s8(a0[i], vseti(xg[0]), w0);
        if (kOneChain) {
          a0[i] = vdot_u8s8(a0[i], vseti(xg[1]), w1);
        } else {
          a1[i] = vdot_u8s8(a1[i], vseti(xg[1]), w1);
        }
      }
    }
    for (; o < per_group; ++o) {
      const vi16 w0 = vloadi(w + o * 64);
      for (int i = 0; i < MB; ++i) {
        const int32_t* xg = reinterpret_cast<const int32_t*>(xu + (m0 + i) * K) + g * per_group + o;
        a0[i] = vdot_u8s8(a0[i], vseti(xg[0]), w0);
      }
    }
    const vi16 corr = kDotBiased ? vslli32<7>(vloadi(ws + g * N + rb * 16)) : vzeroi();
    for (int i = 0; i < MB; ++i) {
      const vi16 sum = kOneChain ? a0[i] : vadd(a0[i], a1[i]);
      const vi16 a = kDotBiased ? vsub(sum, corr) : sum;
      acc[i] = vfmadd(vcvtf(a), vsetf(xs[(m0 + i) * NG + g]), acc[i]);
    }
  }
  const vf16 s = vloadf(sp + rb * 16);
  for (int i = 0; i < MB; ++i) {
    float* o = op + (m0 + i) * N + rb * 16;
    vf16 y = vmul(acc[i], s);
    // y opaque to the optimizer: GCC's -ffp-contract=fast fused the residual add into an FMA for some MB and not
    // for others, so a row's result depended on how many rows came with it (a prompt chunk vs token by token)
    vopaque(y);
    vstore(o, add ? vadd(vloadf(o), y) : y);
  }
}


// ---- activation quantization (the operators and the decode step quantize alike) --------------------------
// for int4_rows: x [M, K] -> xq int8 [M, Kp] (zero beyond K), per group of G columns a scale xs and a sum xsum
static inline void quantize_s8(const float* xp, int64_t M, int64_t K, int64_t Kp, int64_t G, int8_t* xq, float* xs,
                               int32_t* xsum) {
  const int64_t NG = Kp / G;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < NG; ++g) {
      const int64_t k0 = g * G, k1 = std::min(K, k0 + G);
      const float amax = abs_max(xp + m * K + k0, k1 - k0);
      const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int64_t k = k0; k < k0 + G; ++k) {
        const int32_t q = k < k1 ? (int32_t)std::nearbyint(xp[m * K + k] * inv) : 0;
        xq[m * Kp + k] = (int8_t)q;
        sum += q;
      }
      xs[m * NG + g] = s;
      xsum[m * NG + g] = sum;
    }
  }
}

// for int8_rows: x [M, K] -> xu uint8 [M, K] (x / scale + 128; on AVX2, where the byte products take x itself,
// x / scale as int8 bits: kDotBiased), per group of G columns a scale xs
static inline void quantize_u8(const float* xp, int64_t M, int64_t K, int64_t G, uint8_t* xu, float* xs) {
  constexpr int32_t bias = kDotBiased ? 128 : 0;
  const int64_t NG = K / G;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < NG; ++g) {
      const float amax = abs_max(xp + m * K + g * G, G);
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      xs[m * NG + g] = amax / 127.f;
      for (int64_t k = g * G; k < (g + 1) * G; ++k)
        xu[m * K + k] = (uint8_t)((int32_t)std::nearbyint(xp[m * K + k] * inv) + bias);
    }
}
