// The token router's decode attention on the CPU (see o3edge/engine/router.py, RouterStep.attend): each
// sequence's decoding query over its full-precision keys (cache rows in float32, bfloat16 or float16, scattered
// slots; other than float32, each row is widened to float32 once for its GQA group's heads) and its
// compressed ones (codes with one float16 scale per token and KV head: INT8, or INT4 in a Hadamard-rotated
// basis), one softmax over both; a step's sequences in one call a layer. Built with cpu_span.cpp (cpu_ext.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <torch/library.h>
#include <cmath>
#include <vector>

#include "cpu_attend.h"

using at::Tensor;
using o3attend::as_float;
using o3attend::dot;
using o3attend::Vec;
using o3attend::W;

// one vector's codes as floats (int8: hd bytes; int4: hd / 2 bytes, the even dimension in the low nibble,
// two's-complement nibbles in [-7, 7])
static inline void decode_codes(const uint8_t* c, bool int4, int64_t hd, float* out) {
  if (!int4) {
    const int8_t* s = reinterpret_cast<const int8_t*>(c);
    for (int64_t d = 0; d < hd; ++d) out[d] = (float)s[d];
    return;
  }
  for (int64_t i = 0; i < hd / 2; ++i) {  // each nibble sign-extended by shifts, no branch
    out[2 * i] = (float)((int8_t)(c[i] << 4) >> 4);
    out[2 * i + 1] = (float)((int8_t)c[i] >> 4);
  }
}

// The attention of router_decode_attention (below) over a cache of T rows.
template <typename T>
static void attend(const float* qpb, const float* qrpb, const T* kb, const T* vb, const int64_t* fsp_all,
                   const int64_t* fop, const uint8_t* kc, const uint8_t* vc, const at::Half* ksp, const at::Half* vsp,
                   const int64_t* csp_all, const int64_t* cop, const float* R, float* opb, int64_t B, int64_t H,
                   int64_t hd, int64_t KVH, int64_t cd, bool int4, int64_t longest, int64_t total) {
  const int64_t rep = H / KVH, row = KVH * hd, crow = KVH * cd;
  const float scale = 1.0f / std::sqrt((float)hd);
  const int64_t grain = total * H >= 4096 ? 1 : B * KVH;  // short contexts: one thread, no fork
  at::parallel_for(0, B * KVH, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> sc(rep * longest), code(hd), oc(rep * hd), wide(hd);
    for (int64_t bg = i0; bg < i1; ++bg) {
      const int64_t b = bg / KVH, g = bg % KVH;
      const int64_t* fsp = fsp_all + fop[b];
      const int64_t* csp = csp_all + cop[b];
      const int64_t Sf = fop[b + 1] - fop[b], Sc = cop[b + 1] - cop[b], n = Sf + Sc;
      const float* qp = qpb + b * H * hd;
      const float* qrp = qrpb + b * H * hd;
      float* op = opb + b * H * hd;
      // scores: each key read (and decoded) once for the GQA group's heads
      for (int64_t t = 0; t < Sf; ++t) {
        const float* kt = as_float(kb + fsp[t] * row + g * hd, hd, wide.data());
        for (int64_t r = 0; r < rep; ++r) sc[r * n + t] = dot(qp + (g * rep + r) * hd, kt, hd) * scale;
      }
      for (int64_t t = 0; t < Sc; ++t) {
        decode_codes(kc + csp[t] * crow + g * cd, int4, hd, code.data());
        const float ks = (float)ksp[csp[t] * KVH + g] * scale;
        for (int64_t r = 0; r < rep; ++r) sc[r * n + Sf + t] = dot(qrp + (g * rep + r) * hd, code.data(), hd) * ks;
      }
      for (int64_t r = 0; r < rep; ++r) {  // each head's softmax over both pools, normalized in place
        float* s = sc.data() + r * n;
        const float inv = 1.f / o3attend::exp_shifted(s, n);
        for (int64_t t = 0; t < n; ++t) s[t] *= inv;
      }
      // full-precision values (the probabilities are normalized already)
      o3attend::weigh_values<T>(sc.data(), n, Sf, rep, hd, [&](int64_t t) { return vb + fsp[t] * row + g * hd; },
                                nullptr, op + g * rep * hd, wide.data());
      Vec acc_c[256 / W];
      std::fill(oc.begin(), oc.end(), 0.f);
      for (int64_t t = 0; t < Sc; ++t) {  // compressed values: decoded once for the group's heads
        decode_codes(vc + csp[t] * crow + g * cd, int4, hd, code.data());
        const float vs = (float)vsp[csp[t] * KVH + g];
        for (int64_t r = 0; r < rep; ++r) {
          const Vec p(sc[r * n + Sf + t] * vs);
          float* o = oc.data() + r * hd;
          for (int64_t i = 0; i < hd / W; ++i)
            at::vec::fmadd(p, Vec::loadu(code.data() + i * W), Vec::loadu(o + i * W)).store(o + i * W);
        }
      }
      if (Sc == 0) continue;
      for (int64_t r = 0; r < rep; ++r) {  // back to the model's basis (INT4: R is its own inverse) and added
        float* o = op + (g * rep + r) * hd;
        const float* c = oc.data() + r * hd;
        if (!int4) {
          for (int64_t d = 0; d < hd; ++d) o[d] += c[d];
          continue;
        }
        for (int64_t i = 0; i < hd / W; ++i) acc_c[i] = Vec::loadu(o + i * W);
        for (int64_t j = 0; j < hd; ++j) {  // o += c @ R: row j of R weighted by c[j]
          const Vec cj(c[j]);
          for (int64_t i = 0; i < hd / W; ++i) acc_c[i] = at::vec::fmadd(cj, Vec::loadu(R + j * hd + i * W), acc_c[i]);
        }
        for (int64_t i = 0; i < hd / W; ++i) acc_c[i].store(o + i * W);
      }
    }
  });
}

// A step's decoding queries, one a sequence: q [B, H, hd] float32; qr: q in the compressed pool's basis (int4:
// q @ R; int8: q); k_cache, v_cache [S, KVH, hd] float32, bfloat16 or float16 (one layer's); full_slots int64
// [sum of Sf], sequence b's at [full_offsets[b], full_offsets[b + 1]); k_codes, v_codes [C, KVH, cd] int8 (INT8)
// or uint8 (INT4); k_scales, v_scales [C, KVH] float16; comp_slots, comp_offsets alike; rotation [hd, hd] float32
// (INT4) or empty. Returns the attention output in the model's basis, out [B, H, hd] float32.
Tensor router_decode_attention(
    const Tensor& q, const Tensor& qr, const Tensor& k_cache, const Tensor& v_cache, const Tensor& full_slots,
    const Tensor& full_offsets, const Tensor& k_codes, const Tensor& v_codes, const Tensor& k_scales,
    const Tensor& v_scales, const Tensor& comp_slots, const Tensor& comp_offsets, const Tensor& rotation) {
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "router_decode_attention: contiguous keys and values of one type");
  TORCH_CHECK(k_codes.is_contiguous() && v_codes.is_contiguous() && k_scales.is_contiguous() &&
              v_scales.is_contiguous() && k_scales.scalar_type() == at::kHalf, "router_decode_attention: codes");
  const auto qc = q.contiguous().to(at::kFloat), qrc = qr.contiguous().to(at::kFloat);
  const int64_t B = qc.size(0), H = qc.size(1), hd = qc.size(2), KVH = k_cache.size(1);
  const bool int4 = k_codes.scalar_type() == at::kByte;
  const int64_t cd = k_codes.size(2);
  TORCH_CHECK(hd % W == 0 && hd <= 256 && cd == (int4 ? hd / 2 : hd), "router_decode_attention: head_dim");
  TORCH_CHECK(!int4 || (rotation.dim() == 2 && rotation.size(0) == hd), "router_decode_attention: INT4 rotation");
  const auto fs = full_slots.contiguous(), cs = comp_slots.contiguous();
  const auto fo = full_offsets.contiguous(), co = comp_offsets.contiguous();
  TORCH_CHECK(fo.numel() == B + 1 && co.numel() == B + 1, "router_decode_attention: offsets");
  const int64_t* fsp_all = fs.data_ptr<int64_t>();
  const int64_t* csp_all = cs.data_ptr<int64_t>();
  const int64_t* fop = fo.data_ptr<int64_t>();
  const int64_t* cop = co.data_ptr<int64_t>();
  int64_t longest = 0, total = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = fop[b + 1] - fop[b] + cop[b + 1] - cop[b];
    TORCH_CHECK(n > 0, "router_decode_attention: a query without keys");
    longest = std::max(longest, n);
    total += n;
  }
  const uint8_t* kc = reinterpret_cast<const uint8_t*>(k_codes.data_ptr());
  const uint8_t* vc = reinterpret_cast<const uint8_t*>(v_codes.data_ptr());
  const at::Half* ksp = k_scales.data_ptr<at::Half>();
  const at::Half* vsp = v_scales.data_ptr<at::Half>();
  const auto rot = int4 ? rotation.contiguous().to(at::kFloat) : rotation;
  const float* R = int4 ? rot.data_ptr<float>() : nullptr;
  auto out = at::empty({B, H, hd}, qc.options());
  const float* qp = qc.data_ptr<float>();
  const float* qrp = qrc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  o3attend::with_cache_type(k_cache, "router_decode_attention", [&](auto t) {
    using T = decltype(t);
    attend(qp, qrp, k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), fsp_all, fop, kc, vc, ksp, vsp, csp_all, cop, R,
           op, B, H, hd, KVH, cd, int4, longest, total);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(o3edge_cpu, m) {
  m.def("router_decode_attention(Tensor q, Tensor qr, Tensor k_cache, Tensor v_cache, Tensor full_slots, "
        "Tensor full_offsets, Tensor k_codes, Tensor v_codes, Tensor k_scales, Tensor v_scales, Tensor comp_slots, "
        "Tensor comp_offsets, Tensor rotation) -> Tensor");
}

TORCH_LIBRARY_IMPL(o3edge_cpu, CPU, m) { m.impl("router_decode_attention", router_decode_attention); }
