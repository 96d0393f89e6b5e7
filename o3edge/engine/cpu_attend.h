// Decode attention's inner loops on the CPU, shared by span_attention (cpu_span.cpp) and the token router's
// decode attention (cpu_router.cpp). ATen's vectors (at::vec: 16 floats with AVX-512, 8 with AVX2, as the
// attention library is built: cpu_ext.py), so a torch-built file's only: the torch-free row kernels are in
// cpu_kernels.h.
#pragma once
#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace o3attend {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();

// A cache row of hd values as float32: the row itself (float32), or widened into buf (bfloat16, float16).
template <typename T>
inline const float* as_float(const T* x, int64_t hd, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    for (int64_t d = 0; d < hd; ++d) buf[d] = static_cast<float>(x[d]);
    return buf;
  }
}

// f(T{}) with T the element type of a float32, bfloat16 or float16 cache (float, at::BFloat16, at::Half); other
// types are refused, naming `who`.
template <typename F>
inline void with_cache_type(const at::Tensor& cache, const char* who, F&& f) {
  switch (cache.scalar_type()) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    case at::kHalf: f(at::Half{}); break;
    default: TORCH_CHECK(false, who, ": a float32, bfloat16 or float16 cache, got ", cache.scalar_type());
  }
}

// sum of a[d] * b[d] over hd (a multiple of W) floats.
inline float dot(const float* a, const float* b, int64_t hd) {
  Vec acc = Vec::loadu(a) * Vec::loadu(b);
  for (int64_t d = W; d < hd; d += W) acc = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc);
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
}

// The GQA group's weighted values: out[r * hd + d] = scale[r] * sum over t < count of p[r * n + t] * row(t)[d], for
// r < rep heads, where row(t) points at hd values of T (scale nullptr: 1). A float32 row is read in place, each
// head's sum held in registers; a bfloat16 or float16 row is widened into wide once for all the group's heads (not
// once a head), the sums kept in out. Either way each head sums its rows in order t = 0, 1, ...
template <typename T, typename Row>
inline void weigh_values(const float* p, int64_t n, int64_t count, int64_t rep, int64_t hd, Row row,
                         const float* scale, float* out, float* wide) {
  if constexpr (std::is_same_v<T, float>) {
    Vec acc[256 / W];
    for (int64_t r = 0; r < rep; ++r) {
      for (int64_t i = 0; i < hd / W; ++i) acc[i] = Vec(0.f);
      for (int64_t t = 0; t < count; ++t) {
        const float* vt = row(t);
        const Vec pt(p[r * n + t]);
        for (int64_t i = 0; i < hd / W; ++i) acc[i] = at::vec::fmadd(pt, Vec::loadu(vt + i * W), acc[i]);
      }
      const Vec sc(scale ? scale[r] : 1.f);
      for (int64_t i = 0; i < hd / W; ++i) (acc[i] * sc).store(out + r * hd + i * W);
    }
  } else {
    std::fill(out, out + rep * hd, 0.f);
    for (int64_t t = 0; t < count; ++t) {
      const float* vt = as_float(row(t), hd, wide);
      for (int64_t r = 0; r < rep; ++r) {
        const Vec pt(p[r * n + t]);
        float* o = out + r * hd;
        for (int64_t i = 0; i < hd / W; ++i) at::vec::fmadd(pt, Vec::loadu(vt + i * W), Vec::loadu(o + i * W)).store(o + i * W);
      }
    }
    for (int64_t r = 0; r < rep && scale; ++r)
      for (int64_t i = 0; i < hd / W; ++i) (Vec::loadu(out + r * hd + i * W) * Vec(scale[r])).store(out + r * hd + i * W);
  }
}

// s[0 .. n) -> exp(s - max), in place; returns their sum (the softmax's denominator).
inline float exp_shifted(float* s, int64_t n) {
  float m = -INFINITY;
  for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
  const Vec vm(m);
  Vec vsum(0.f);
  int64_t t = 0;
  for (; t + W <= n; t += W) {
    Vec e = (Vec::loadu(s + t) - vm).exp_u20();
    e.store(s + t);
    vsum = vsum + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, vsum);
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  return sum;
}

}  // namespace o3attend
