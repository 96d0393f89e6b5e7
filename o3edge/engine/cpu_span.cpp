// span_attention: a decode step's KV write and attention over each sequence's live prefix (see
// o3edge/engine/cpu_decode.py). Built with cpu_router.cpp into o3edge's attention library (cpu_ext.py), for the
// vector width this CPU has (AVX-512, AVX2): unlike the VNNI row kernels of cpu_kernels.cpp it needs no VNNI.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <torch/library.h>
#include <cmath>
#include <vector>

#include "cpu_attend.h"

using at::Tensor;

// span_attention (below) over a pool of T elements.
template <typename T>
static Tensor span_attend(const Tensor& qc, const Tensor& kc, const Tensor& vc, Tensor& kv_cache, int64_t layer,
                          const int64_t* sl, const int64_t* ps) {
  using o3attend::Vec;
  using o3attend::W;
  const int64_t B = qc.size(0), H = qc.size(1), hd = qc.size(2), KVH = kv_cache.size(3), S = kv_cache.size(2);
  const int64_t rep = H / KVH, row = KVH * hd;
  T* kbase = kv_cache.data_ptr<T>() + layer * 2 * S * row;
  T* vbase = kbase + S * row;
  const float* knew = kc.data_ptr<float>();
  const float* vnew = vc.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {  // the new keys and values, rounded to the pool's type as torch rounds
    TORCH_CHECK(sl[b] >= ps[b] && sl[b] < S, "slot out of range");
    for (int64_t i = 0; i < row; ++i) {
      kbase[sl[b] * row + i] = static_cast<T>(knew[b * row + i]);
      vbase[sl[b] * row + i] = static_cast<T>(vnew[b * row + i]);
    }
  }
  auto out = at::empty({B, H, hd}, qc.options());
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float scale = 1.0f / std::sqrt((float)hd);
  int64_t maxlen = 0;
  for (int64_t b = 0; b < B; ++b) maxlen = std::max(maxlen, ps[b] + 1);
  const int64_t grain = maxlen * B * H >= 4096 ? 1 : B * KVH;  // short contexts: one thread, no fork
  TORCH_CHECK(hd % W == 0 && hd <= 256, "head_dim must be a multiple of ", W, " and <= 256");
  at::parallel_for(0, B * KVH, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> sc(rep * maxlen + W), wide(hd), inv(rep);
    for (int64_t bg = begin; bg < end; ++bg) {
      const int64_t b = bg / KVH, g = bg % KVH, n = ps[b] + 1, start = sl[b] - ps[b];
      const float* qh = qp + (b * H + g * rep) * hd;
      for (int64_t t = 0; t < n; ++t) {  // scores: each key row read (and widened) once for the group's heads
        const float* kt = o3attend::as_float(kbase + (start + t) * row + g * hd, hd, wide.data());
        for (int64_t r = 0; r < rep; ++r) sc[r * n + t] = o3attend::dot(qh + r * hd, kt, hd) * scale;
      }
      for (int64_t r = 0; r < rep; ++r) inv[r] = 1.f / o3attend::exp_shifted(sc.data() + r * n, n);
      o3attend::weigh_values<T>(sc.data(), n, n, rep, hd, [&](int64_t t) { return vbase + (start + t) * row + g * hd; },
                                inv.data(), op + (b * H + g * rep) * hd, wide.data());
    }
  });
  return out;
}

// One new token per sequence: write k, v [B, KVH, hd] at cache slots [B] of `layer`, then attend each q
// [B, H, hd] to its sequence's keys, slots [slot - position, slot] (consecutive) -> [B, H, hd].
// kv_cache: [L, 2, S, KVH, hd] float32, bfloat16 or float16, contiguous.
Tensor span_attention(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& kv_cache, int64_t layer,
                      const Tensor& slots, const Tensor& positions) {
  TORCH_CHECK(kv_cache.is_contiguous(), "span_attention: a contiguous kv_cache");
  auto qc = q.contiguous().to(at::kFloat), kc = k.contiguous().to(at::kFloat), vc = v.contiguous().to(at::kFloat);
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* ps = positions.data_ptr<int64_t>();
  Tensor out;
  o3attend::with_cache_type(kv_cache, "span_attention", [&](auto t) {
    out = span_attend<decltype(t)>(qc, kc, vc, kv_cache, layer, sl, ps);
  });
  return out.to(q.scalar_type());
}

TORCH_LIBRARY_FRAGMENT(o3edge_cpu, m) {
  m.def("span_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, int layer, Tensor slots, "
        "Tensor positions) -> Tensor");
}

TORCH_LIBRARY_IMPL(o3edge_cpu, CPU, m) { m.impl("span_attention", span_attention); }
