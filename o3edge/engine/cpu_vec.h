// o3edge's CPU vectors: 16 float or int32 lanes, the width of the row kernels' 16-row weight blocks, on the three
// instruction sets the row kernels (cpu_kernels.h) and the native step (cpu_core.cpp) are built for:
//   AVX-512 VNNI (default): one __m512 / __m512i, one 64-byte weight load feeding 16 rows;
//   AVX-VNNI (O3_AVXVNNI: Alder Lake and later, Zen 5 client, no AVX-512): two __m256 / __m256i, lanes 0-7 and
//   8-15 (a 64-byte block's rows 0-7 and 8-15), vpdpbusd in its VEX form;
//   AVX2 (O3_AVX2: Haswell to Comet Lake, Zen 1-3, no VNNI at all): the same two halves, the byte dot products
//   made of vpmaddubsw and vpmaddwd (exact in the ranges the kernels feed them: vdot_u8s8, and int4_rows' AVX2
//   loop), no vdpbusd.
// The code above this header is written once for 16 lanes; the weight layout is the same on every build. Every
// operation computes lane for lane what the AVX-512 one does, and the reductions add in the same order, so the
// builds give the same numbers where the compiler's own code around them does too (int32 dot products are exact
// on all three).
#pragma once
#include <immintrin.h>

#include <cstdint>

#if defined(O3_AVX2) && !defined(O3_AVXVNNI)
#define O3_AVXVNNI  // the 256-bit halves below, with the byte dot products of AVX2 (O3_AVX2)
#endif

#ifndef O3_AVXVNNI

using vf16 = __m512;
using vi16 = __m512i;
using vm16 = __mmask16;

static inline vf16 vloadf(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vf16 v) { _mm512_storeu_ps(p, v); }
static inline vf16 vsetf(float x) { return _mm512_set1_ps(x); }
static inline vf16 vzerof() { return _mm512_setzero_ps(); }
static inline vf16 vadd(vf16 a, vf16 b) { return _mm512_add_ps(a, b); }
static inline vf16 vsub(vf16 a, vf16 b) { return _mm512_sub_ps(a, b); }
static inline vf16 vmul(vf16 a, vf16 b) { return _mm512_mul_ps(a, b); }
static inline vf16 vdiv(vf16 a, vf16 b) { return _mm512_div_ps(a, b); }
static inline vf16 vmax(vf16 a, vf16 b) { return _mm512_max_ps(a, b); }
static inline vf16 vmin(vf16 a, vf16 b) { return _mm512_min_ps(a, b); }
static inline vf16 vabs(vf16 a) { return _mm512_abs_ps(a); }
static inline vf16 vneg(vf16 a) { return _mm512_xor_ps(a, _mm512_set1_ps(-0.f)); }
static inline vf16 vfmadd(vf16 a, vf16 b, vf16 c) { return _mm512_fmadd_ps(a, b, c); }   // a b + c
static inline vf16 vfnmadd(vf16 a, vf16 b, vf16 c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b
static inline vf16 vcvtf(vi16 a) { return _mm512_cvtepi32_ps(a); }
static inline vi16 vcvti(vf16 a) { return _mm512_cvtps_epi32(a); }  // rounded to nearest even
static inline vf16 vfloor(vf16 a) {
  return _mm512_cvtepi32_ps(_mm512_cvt_roundps_epi32(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
}
static inline vf16 vasf(vi16 a) { return _mm512_castsi512_ps(a); }
template <int P>
static inline vm16 vcmp(vf16 a, vf16 b) { return _mm512_cmp_ps_mask(a, b, P); }
static inline vf16 vselect(vm16 m, vf16 a, vf16 b) { return _mm512_mask_blend_ps(m, b, a); }  // m ? a : b
static inline float vreduce_max(vf16 v) { return _mm512_reduce_max_ps(v); }
static inline float vreduce_add(vf16 v) { return _mm512_reduce_add_ps(v); }
// the float32 values of 16 bf16 (their bits)
static inline vf16 vload_bf16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
// v opaque to the optimizer (no contraction of what produced it into what uses it)
static inline void vopaque(vf16& v) { __asm__("" : "+v"(v)); }

static inline vi16 vloadi(const void* p) { return _mm512_loadu_si512(p); }
static inline vi16 vseti(int32_t x) { return _mm512_set1_epi32(x); }
static inline vi16 vsetb(char x) { return _mm512_set1_epi8(x); }
static inline vi16 vzeroi() { return _mm512_setzero_si512(); }
static inline vi16 vadd(vi16 a, vi16 b) { return _mm512_add_epi32(a, b); }
static inline vi16 vsub(vi16 a, vi16 b) { return _mm512_sub_epi32(a, b); }
static inline vi16 vand(vi16 a, vi16 b) { return _mm512_and_si512(a, b); }
template <int N>
static inline vi16 vsrli16(vi16 a) { return _mm512_srli_epi16(a, N); }
template <int N>
static inline vi16 vslli32(vi16 a) { return _mm512_slli_epi32(a, N); }
template <int N>
static inline vi16 vsrai32(vi16 a) { return _mm512_srai_epi32(a, N); }
// acc + per lane the sum of 4 products of u's unsigned and s's signed bytes (vpdpbusd)
static inline vi16 vdpbusd(vi16 acc, vi16 u, vi16 s) { return _mm512_dpbusd_epi32(acc, u, s); }

#else  // O3_AVXVNNI: two 256-bit halves

struct vf16 { __m256 lo, hi; };
struct vi16 { __m256i lo, hi; };
struct vm16 { __m256 lo, hi; };  // per lane all ones or all zeros

static inline vf16 vloadf(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vstore(float* p, vf16 v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
static inline vf16 vsetf(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline vf16 vzerof() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vf16 vadd(vf16 a, vf16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline vf16 vsub(vf16 a, vf16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline vf16 vmul(vf16 a, vf16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline vf16 vdiv(vf16 a, vf16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
static inline vf16 vmax(vf16 a, vf16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
static inline vf16 vmin(vf16 a, vf16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
static inline vf16 vabs(vf16 a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
static inline vf16 vneg(vf16 a) {
  const __m256 s = _mm256_set1_ps(-0.f);
  return {_mm256_xor_ps(a.lo, s), _mm256_xor_ps(a.hi, s)};
}
static inline vf16 vfmadd(vf16 a, vf16 b, vf16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline vf16 vfnmadd(vf16 a, vf16 b, vf16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
static inline vf16 vcvtf(vi16 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
static inline vi16 vcvti(vf16 a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
static inline vf16 vfloor(vf16 a) { return {_mm256_floor_ps(a.lo), _mm256_floor_ps(a.hi)}; }
static inline vf16 vasf(vi16 a) { return {_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }
template <int P>
static inline vm16 vcmp(vf16 a, vf16 b) { return {_mm256_cmp_ps(a.lo, b.lo, P), _mm256_cmp_ps(a.hi, b.hi, P)}; }
static inline vf16 vselect(vm16 m, vf16 a, vf16 b) {
  return {_mm256_blendv_ps(b.lo, a.lo, m.lo), _mm256_blendv_ps(b.hi, a.hi, m.hi)};
}
static inline float vreduce_max(vf16 v) {
  const __m256 a = _mm256_max_ps(v.lo, v.hi);
  __m128 b = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_max_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_max_ss(b, _mm_movehdup_ps(b)));
}
// in _mm512_reduce_add_ps's order: halves, quarters, pairs, neighbours
static inline float vreduce_add(vf16 v) {
  const __m256 a = _mm256_add_ps(v.hi, v.lo);
  __m128 b = _mm_add_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(b) + _mm_cvtss_f32(_mm_movehdup_ps(b));
}
static inline vf16 vload_bf16(const uint16_t* p) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16))};
}
static inline void vopaque(vf16& v) { __asm__("" : "+v"(v.lo), "+v"(v.hi)); }

static inline vi16 vloadi(const void* p) {
  const auto* q = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
static inline vi16 vseti(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
static inline vi16 vsetb(char x) { return {_mm256_set1_epi8(x), _mm256_set1_epi8(x)}; }
static inline vi16 vzeroi() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline vi16 vadd(vi16 a, vi16 b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
static inline vi16 vsub(vi16 a, vi16 b) { return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)}; }
static inline vi16 vand(vi16 a, vi16 b) { return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
template <int N>
static inline vi16 vsrli16(vi16 a) { return {_mm256_srli_epi16(a.lo, N), _mm256_srli_epi16(a.hi, N)}; }
template <int N>
static inline vi16 vslli32(vi16 a) { return {_mm256_slli_epi32(a.lo, N), _mm256_slli_epi32(a.hi, N)}; }
template <int N>
static inline vi16 vsrai32(vi16 a) { return {_mm256_srai_epi32(a.lo, N), _mm256_srai_epi32(a.hi, N)}; }
#ifndef O3_AVX2
static inline vi16 vdpbusd(vi16 acc, vi16 u, vi16 s) {
  return {_mm256_dpbusd_avx_epi32(acc.lo, u.lo, s.lo), _mm256_dpbusd_avx_epi32(acc.hi, u.hi, s.hi)};
}
#else
// int16 pair sums to int32 lanes, added to acc
static inline __m256i vpairs(__m256i acc, __m256i p) { return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1))); }
// AVX2's byte dot product in two steps, for callers that add several before widening (int4_rows): vpmaddubsw's
// 16 int16 pair sums a half (u unsigned, s signed bytes), their int16 sum, and their widening into acc's lanes
static inline vi16 vmaddubs(vi16 u, vi16 s) { return {_mm256_maddubs_epi16(u.lo, s.lo), _mm256_maddubs_epi16(u.hi, s.hi)}; }
static inline vi16 vadd16(vi16 a, vi16 b) { return {_mm256_add_epi16(a.lo, b.lo), _mm256_add_epi16(a.hi, b.hi)}; }
static inline vi16 vwiden(vi16 acc, vi16 p) { return {vpairs(acc.lo, p.lo), vpairs(acc.hi, p.hi)}; }
#endif

#endif

// acc + per lane the sum of 4 products of u's bytes (INT8 activations) and s's signed bytes (INT8 weights). With VNNI
// u holds x + 128 (1 to 255, unsigned) and this is vpdpbusd's sum of u * s (kDotBiased: the caller takes 128 times
// the sum of s's bytes out, once per group); on AVX2 u holds x itself (-127 to 127, signed) and this is the sum of
// x * s, by vpmaddubsw of |s| and x signed as s is (at most 2 * 128 * 127 in magnitude: never saturated), then
// vpmaddwd. Exact on every build.
#ifndef O3_AVX2
constexpr bool kDotBiased = true;
#else
constexpr bool kDotBiased = false;
#endif
static inline vi16 vdot_u8s8(vi16 acc, vi16 u, vi16 s) {
#ifndef O3_AVX2
  return vdpbusd(acc, u, s);
#else
  const auto half = [](__m256i a, __m256i x, __m256i w) {
    return vpairs(a, _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)));
  };
  return {half(acc.lo, u.lo, s.lo), half(acc.hi, u.hi, s.hi)};
#endif
}
