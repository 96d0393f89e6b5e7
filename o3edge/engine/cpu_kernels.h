// o3edge's VNNI row kernels, shared by the per-layer operators (cpu_kernels.cpp) and the decode step (cpu_core.cpp).
// Free of ATen: the step is also built without torch (native_lib.py), so bf16 travels as its uint16 bits.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// max |x[i]|, i < n
static inline float abs_max(const float* x, int64_t n) {
  __m512 m = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  float r = _mm512_reduce_max_ps(m);
  for (; i < n; ++i) r = std::max(r, std::abs(x[i]));
  return r;
}

// ---- INT4 weights x INT8 activations (AVX-512 VNNI) ------------------------------------------------------
// Weight layout ("rows16"): packed uint8 [N/16, Kp/8, 64]; in the 64 bytes of row block rb and k-octet o, byte
// r*4 + j holds row rb*16+r: column 8o+j in the low nibble, column 8o+4+j in the high one (q in 0..15).
// scales, zeros: bf16 bits (uint16) [Kp/G, N]; w = (q - 8) * scale + zero (o3edge/engine/quant.py's scheme).
// Activations are quantized per group of G columns to int8 (symmetric, scale max|x|/127) on entry.

static inline __m512 bf16x16_to_f32(const uint16_t* p) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// MB activation rows m0.. against one block of 16 weight rows: each weight load and unpack serves MB rows
template <int MB>
static inline void int4_rows(const uint8_t* wb, const int8_t* xq, const float* xs, const int32_t* xsum,
                             const uint16_t* sp, const uint16_t* zp, float* op, int64_t m0, int64_t rb,
                             int64_t N, int64_t Kp, int64_t NG, int64_t per_group, bool add = false) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < NG; ++g) {
    __m512i ai[MB], bi[MB];  // low and high nibbles: two independent vpdpbusd chains
    for (int i = 0; i < MB; ++i) ai[i] = bi[i] = _mm512_setzero_si512();
    const uint8_t* w = wb + g * per_group * 64;
    for (int64_t o = 0; o < per_group; ++o) {
      const __m512i v = _mm512_loadu_si512(w + o * 64);
      const __m512i lo = _mm512_and_si512(v, mask);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
      for (int i = 0; i < MB; ++i) {
        const int32_t* xg = reinterpret_cast<const int32_t*>(xq + (m0 + i) * Kp) + (g * per_group + o) * 2;
        ai[i] = _mm512_dpbusd_epi32(ai[i], lo, _mm512_set1_epi32(xg[0]));
        bi[i] = _mm512_dpbusd_epi32(bi[i], hi, _mm512_set1_epi32(xg[1]));
      }
    }
    for (int i = 0; i < MB; ++i) ai[i] = _mm512_add_epi32(ai[i], bi[i]);
    const __m512 sc = bf16x16_to_f32(sp + g * N + rb * 16);
    const __m512 ze = bf16x16_to_f32(zp + g * N + rb * 16);
    for (int i = 0; i < MB; ++i) {
      const float s = xs[(m0 + i) * NG + g];
      const int32_t xsm = xsum[(m0 + i) * NG + g];
      const __m512i a = _mm512_sub_epi32(ai[i], _mm512_set1_epi32(8 * xsm));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(sc, _mm512_set1_ps(s)), acc[i]);
      acc[i] = _mm512_fmadd_ps(ze, _mm512_set1_ps(s * (float)xsm), acc[i]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    float* o = op + (m0 + i) * N + rb * 16;
    _mm512_storeu_ps(o, add ? _mm512_add_ps(_mm512_loadu_ps(o), acc[i]) : acc[i]);
  }
}

// ---- INT8 weights x INT8 activations (AVX-512 VNNI) ------------------------------------------------------
// Weight layout: packed int8 [N/16, K/4, 64]: byte r*4 + j of row block rb and k-quad o is w[rb*16+r][4o+j].
// wsum int32 [K/G, N]: per group sums of the row's int8 weights; scales float32 [N]: w ~ q * scale[row].
// Activations are quantized per group of G columns to int8 and fed to vpdpbusd as x + 128 (unsigned); the
// 128 * sum(w) that adds is taken out per group.
template <int MB>
static inline void int8_rows(const int8_t* wb, const uint8_t* xu, const float* xs, const int32_t* ws,
                             const float* sp, float* op, int64_t m0, int64_t rb, int64_t N, int64_t K, int64_t NG,
                             int64_t per_group, bool add = false) {
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < NG; ++g) {
    __m512i a0[MB], a1[MB];
    for (int i = 0; i < MB; ++i) a0[i] = a1[i] = _mm512_setzero_si512();
    const int8_t* w = wb + g * per_group * 64;
    int64_t o = 0;
    for (; o + 2 <= per_group; o += 2) {
      const __m512i w0 = _mm512_loadu_si512(w + o * 64), w1 = _mm512_loadu_si512(w + o * 64 + 64);
      for (int i = 0; i < MB; ++i) {
        const int32_t* xg = reinterpret_cast<const int32_t*>(xu + (m0 + i) * K) + g * per_group + o;
        a0[i] = _mm512_dpbusd_epi32(a0[i], _mm512_set1_epi32(xg[0]), w0);
        a1[i] = _mm512_dpbusd_epi32(a1[i], _mm512_set1_epi32(xg[1]), w1);
      }
    }
    for (; o < per_group; ++o) {
      const __m512i w0 = _mm512_loadu_si512(w + o * 64);
      for (int i = 0; i < MB; ++i) {
        const int32_t* xg = reinterpret_cast<const int32_t*>(xu + (m0 + i) * K) + g * per_group + o;
        a0[i] = _mm512_dpbusd_epi32(a0[i], _mm512_set1_epi32(xg[0]), w0);
      }
    }
    const __m512i corr = _mm512_slli_epi32(_mm512_loadu_si512(ws + g * N + rb * 16), 7);
    for (int i = 0; i < MB; ++i) {
      const __m512i a = _mm512_sub_epi32(_mm512_add_epi32(a0[i], a1[i]), corr);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(xs[(m0 + i) * NG + g]), acc[i]);
    }
  }
  const __m512 s = _mm512_loadu_ps(sp + rb * 16);
  for (int i = 0; i < MB; ++i) {
    float* o = op + (m0 + i) * N + rb * 16;
    __m512 y = _mm512_mul_ps(acc[i], s);
    // y opaque to the optimizer: GCC's -ffp-contract=fast fused the residual add into an FMA for some MB and not
    // for others, so a row's result depended on how many rows came with it (a prompt chunk vs token by token)
    __asm__("" : "+v"(y));
    _mm512_storeu_ps(o, add ? _mm512_add_ps(_mm512_loadu_ps(o), y) : y);
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

// for int8_rows: x [M, K] -> xu uint8 [M, K] (x / scale + 128), per group of G columns a scale xs
static inline void quantize_u8(const float* xp, int64_t M, int64_t K, int64_t G, uint8_t* xu, float* xs) {
  const int64_t NG = K / G;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < NG; ++g) {
      const float amax = abs_max(xp + m * K + g * G, G);
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      xs[m * NG + g] = amax / 127.f;
      for (int64_t k = g * G; k < (g + 1) * G; ++k)
        xu[m * K + k] = (uint8_t)((int32_t)std::nearbyint(xp[m * K + k] * inv) + 128);
    }
}
