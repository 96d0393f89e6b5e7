// o3edge's native CPU decode step (see o3edge/engine/cpu_step.py): a whole decode step of a quantized
// llama-family model (one new token per sequence) in one OpenMP parallel region. Every matmul splits its
// 16-row weight blocks over the threads, attention splits the keys, and the threads meet at a barrier
// between phases; activations are normed and quantized by every thread for itself (a few hundred floats),
// residual adds are fused into the matmul that produces them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <omp.h>
#include <cmath>
#include <vector>

#include "cpu_kernels.h"

#ifdef O3_PROFILE
#include <chrono>
#include <cstdio>
static double g_prof[8];
static int64_t g_steps;
#define PROF_MARK(i) if (t == 0) { auto now_ = std::chrono::steady_clock::now(); g_prof[i] += std::chrono::duration<double>(now_ - last_).count(); last_ = now_; }
#else
#define PROF_MARK(i)
#endif

using at::Tensor;

namespace {

// One quantized linear layer in the VNNI layouts of cpu_kernels.h. int8: w = packed int8 [N/16, K/4, 64],
// a = wsum int32 [K/G, N], b = scales float32 [N]. int4: w = packed uint8 [N/16, Kp/8, 64], a = scales bf16
// [Kp/G, N], b = zeros bf16 [Kp/G, N].
struct Linear {
  bool int4 = false;
  Tensor w, a, b;
  int64_t N = 0, K = 0, Kp = 0, G = 0;
};

struct Layer {
  Tensor input_norm, post_norm, q_norm, k_norm;
  Linear qkv, o, gate_up, down;
};

// per-thread activation buffers, quantized for one linear
struct Quantized {
  std::vector<int8_t> s8;
  std::vector<uint8_t> u8;
  std::vector<float> xs;
  std::vector<int32_t> xsum;
};

void quantize(const Linear& l, const float* x, int64_t M, Quantized& q) {
  const int64_t NG = l.Kp / l.G;
  if (q.xs.size() < (size_t)(M * NG)) q.xs.resize(M * NG), q.xsum.resize(M * NG);
  if (l.int4) {
    if (q.s8.size() < (size_t)(M * l.Kp)) q.s8.resize(M * l.Kp);
    quantize_s8(x, M, l.K, l.Kp, l.G, q.s8.data(), q.xs.data(), q.xsum.data());
  } else {
    if (q.u8.size() < (size_t)(M * l.K)) q.u8.resize(M * l.K);
    quantize_u8(x, M, l.K, l.G, q.u8.data(), q.xs.data());
  }
}

// thread t of T: its share of the weight blocks of l, out [M, N] (+= when add)
void matmul(const Linear& l, const Quantized& q, int64_t M, float* out, bool add, int t, int T) {
  const int64_t blocks = l.N / 16, b0 = blocks * t / T, b1 = blocks * (t + 1) / T;
  const int64_t NG = l.Kp / l.G;
  for (int64_t rb = b0; rb < b1; ++rb) {
    int64_t m = 0;
    if (l.int4) {
      const uint8_t* wb = l.w.data_ptr<uint8_t>() + rb * (l.Kp / 8) * 64;
      const auto* sp = l.a.data_ptr<at::BFloat16>();
      const auto* zp = l.b.data_ptr<at::BFloat16>();
      for (; m + 4 <= M; m += 4)
        int4_rows<4>(wb, q.s8.data(), q.xs.data(), q.xsum.data(), sp, zp, out, m, rb, l.N, l.Kp, NG, l.G / 8, add);
      for (; m < M; ++m)
        int4_rows<1>(wb, q.s8.data(), q.xs.data(), q.xsum.data(), sp, zp, out, m, rb, l.N, l.Kp, NG, l.G / 8, add);
    } else {
      const int8_t* wb = l.w.data_ptr<int8_t>() + rb * (l.K / 4) * 64;
      const int32_t* ws = l.a.data_ptr<int32_t>();
      const float* sp = l.b.data_ptr<float>();
      for (; m + 4 <= M; m += 4) int8_rows<4>(wb, q.u8.data(), q.xs.data(), ws, sp, out, m, rb, l.N, l.K, NG, l.G / 4, add);
      for (; m < M; ++m) int8_rows<1>(wb, q.u8.data(), q.xs.data(), ws, sp, out, m, rb, l.N, l.K, NG, l.G / 4, add);
    }
  }
}

// y = x / rms(x) * w, rows of n
void rms_norm(const float* x, const float* w, float* y, int64_t M, int64_t n, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    using Vec = at::vec::Vectorized<float>;
    const float* xm = x + m * n;
    Vec acc(0.f);
    int64_t i = 0;
    for (; i + Vec::size() <= n; i += Vec::size()) acc = at::vec::fmadd(Vec::loadu(xm + i), Vec::loadu(xm + i), acc);
    float ss = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
    for (; i < n; ++i) ss += xm[i] * xm[i];
    const float r = 1.f / std::sqrt(ss / n + eps);
    for (int64_t i = 0; i < n; ++i) y[m * n + i] = x[m * n + i] * r * w[i];
  }
}

// out = silu(gate) * up, n floats
void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  using Vec = at::vec::Vectorized<float>;
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec g = Vec::loadu(gate + i);
    (g / (Vec(1.f) + g.neg().exp()) * Vec::loadu(up + i)).store(out + i);
  }
  for (; i < n; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

// rotate-half RoPE of one head in place; cos, sin: the position's rows [hd]
void rope(float* x, const float* cos, const float* sin, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// A run of consecutive cache slots holding consecutive key positions: (first slot, length)
using Run = std::pair<int64_t, int64_t>;

// key positions [k0, k1) of a sequence whose block table is `table` (block ids) -> runs of consecutive slots
void slot_runs(const int64_t* table, int64_t bs, int64_t k0, int64_t k1, std::vector<Run>& runs) {
  runs.clear();
  for (int64_t t = k0; t < k1;) {
    const int64_t slot = table[t / bs] * bs + t % bs, len = std::min(bs - t % bs, k1 - t);
    if (!runs.empty() && runs.back().first + runs.back().second == slot) runs.back().second += len;
    else runs.emplace_back(slot, len);
    t += len;
  }
}

// Split-K attention: each thread takes a share of a sequence's keys for all heads, so every key and value row is
// read once, front to back, by one thread. The H query heads q [H, hd] (head h reads KV group h / (H / KVH))
// against the key/value rows of the runs (rows of `row` floats: KVH heads of hd) -> per head the partial softmax
// state: the unnormalized sum acc [hd], max m and sum l (part: H rows of hd + 2 floats). n (the runs' total
// length) may be 0. sc: H * n floats.
void attend_part(const float* q, int64_t H, int64_t KVH, const float* kbase, const float* vbase,
                 const std::vector<Run>& runs, int64_t n, int64_t row, int64_t hd, float* sc, float* part) {
  const int64_t rep = H / KVH, nv = hd / 16;
  const float scale = 1.0f / std::sqrt((float)hd);
  int64_t t = 0;
  for (const Run& run : runs)
  for (int64_t i = 0; i < run.second; ++i, ++t) {  // scores
    const float* kt = kbase + (run.first + i) * row;
    for (int64_t h = 0; h < H; ++h) {
      const float* qh = q + h * hd;
      const float* kh = kt + (h / rep) * hd;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qh), _mm512_loadu_ps(kh));
      for (int64_t i = 1; i < nv; ++i) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * i), _mm512_loadu_ps(kh + 16 * i), acc);
      sc[h * n + t] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
  for (int64_t h = 0; h < H; ++h) {  // softmax numerators, max and sum
    float* s = sc + h * n;
    float m = -INFINITY, sum = 0.f;
    for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
    using Vec = at::vec::Vectorized<float>;
    const Vec vm(m);
    Vec vsum(0.f);
    int64_t t = 0;
    for (; t + Vec::size() <= n; t += Vec::size()) {
      const Vec e = (Vec::loadu(s + t) - vm).exp_u20();
      e.store(s + t);
      vsum = vsum + e;
    }
    sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, vsum);
    for (; t < n; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    float* out = part + h * (hd + 2);
    for (int64_t i = 0; i < hd; ++i) out[i] = 0.f;
    out[hd] = m, out[hd + 1] = sum;
  }
  t = 0;
  for (const Run& run : runs)
  for (int64_t i = 0; i < run.second; ++i, ++t) {  // weighted values
    const float* vt = vbase + (run.first + i) * row;
    for (int64_t h = 0; h < H; ++h) {
      const float* vh = vt + (h / rep) * hd;
      float* out = part + h * (hd + 2);
      const __m512 p = _mm512_set1_ps(sc[h * n + t]);
      for (int64_t i = 0; i < nv; ++i)
        _mm512_storeu_ps(out + 16 * i, _mm512_fmadd_ps(p, _mm512_loadu_ps(vh + 16 * i), _mm512_loadu_ps(out + 16 * i)));
    }
  }
}

// the threads' partial states of one head (parts of stride `stride` floats) -> its attention output [hd]
void merge_parts(const float* part, int64_t nparts, int64_t stride, int64_t hd, float* out) {
  float M = -INFINITY;
  for (int64_t p = 0; p < nparts; ++p) M = std::max(M, part[p * stride + hd]);
  float l = 0.f;
  for (int64_t i = 0; i < hd; ++i) out[i] = 0.f;
  for (int64_t p = 0; p < nparts; ++p) {
    const float* pp = part + p * stride;
    if (pp[hd + 1] == 0.f) continue;  // no keys in this share
    const float w = std::exp(pp[hd] - M);
    l += w * pp[hd + 1];
    for (int64_t i = 0; i < hd; ++i) out[i] += w * pp[i];
  }
  const float inv = 1.f / l;
  for (int64_t i = 0; i < hd; ++i) out[i] *= inv;
}

}  // namespace

// The model's weights (references to the module tensors: no copy), built once by cpu_step.py.
struct DecodeModel : torch::CustomClassHolder {
  std::vector<Layer> layers;
  Linear lm_head;
  Tensor embed, norm;
  int64_t H, KVH, hd, D, I, V;
  double eps;

  // tensors: embed, norm, per layer [input_norm, post_norm, q_norm, k_norm (empty when none), then 3 per linear
  // for qkv, o, gate_up, down], then 3 for the LM head. ints: H, KVH, hd, then per linear (layers', then the
  // head's) [int4, N, K, Kp, G].
  DecodeModel(std::vector<Tensor> t, std::vector<int64_t> ints, double eps_) : eps(eps_) {
    H = ints[0], KVH = ints[1], hd = ints[2];
    embed = t[0], norm = t[1];
    D = embed.size(1), V = embed.size(0);
    size_t ti = 2, ii = 3;
    auto linear = [&]() {
      Linear l;
      l.w = t[ti], l.a = t[ti + 1], l.b = t[ti + 2];
      ti += 3;
      l.int4 = ints[ii], l.N = ints[ii + 1], l.K = ints[ii + 2], l.Kp = ints[ii + 3], l.G = ints[ii + 4];
      ii += 5;
      return l;
    };
    const size_t per_layer = 4 + 4 * 3;
    const size_t L = (t.size() - 2 - 3) / per_layer;
    TORCH_CHECK(t.size() == 2 + L * per_layer + 3, "DecodeModel: bad tensor list");
    for (size_t i = 0; i < L; ++i) {
      Layer l;
      l.input_norm = t[ti], l.post_norm = t[ti + 1], l.q_norm = t[ti + 2], l.k_norm = t[ti + 3];
      ti += 4;
      l.qkv = linear(), l.o = linear(), l.gate_up = linear(), l.down = linear();
      layers.push_back(l);
    }
    lm_head = linear();
    I = layers.empty() ? 0 : layers[0].down.K;
    TORCH_CHECK(hd % 16 == 0 && hd <= 256, "head_dim must be a multiple of 16 and <= 256");
  }

  // ids, positions, slots: [B] int64; tables: [B, blocks] int64, the block ids holding each sequence's keys
  // (block_size slots each; a sequence's new token is at `position` and is written to `slot`); cos, sin:
  // [max_len, hd] float32; kv_cache [L, 2, S, KVH, hd] float32 -> logits [B, V] float32. threads: how many
  // (at most torch's thread count; <= 0: all of them).
  Tensor step(Tensor ids, Tensor positions, Tensor slots, Tensor tables, int64_t block_size, Tensor cos, Tensor sin,
              Tensor kv_cache, int64_t threads) {
    TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.scalar_type() == at::kFloat, "kv_cache: contiguous float32");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat, "rope tables");
    const int64_t B = ids.size(0), S = kv_cache.size(2), row = KVH * hd, QKV = (H + 2 * KVH) * hd;
    const int64_t* idp = ids.data_ptr<int64_t>();
    const int64_t* ps = positions.data_ptr<int64_t>();
    const int64_t* sl = slots.data_ptr<int64_t>();
    int64_t maxlen = 0;
    TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && tables.is_contiguous() && tables.scalar_type() == at::kLong &&
                block_size > 0, "step: tables must be int64 [B, blocks]");
    const int64_t nb = tables.size(1);
    const int64_t* tb = tables.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(sl[b] >= 0 && sl[b] < S && idp[b] >= 0 && idp[b] < V && ps[b] / block_size < nb,
                  "step: slot, id or position out of range");
      for (int64_t j = 0; j <= ps[b] / block_size; ++j)
        TORCH_CHECK(tb[b * nb + j] >= 0 && (tb[b * nb + j] + 1) * block_size <= S, "step: block out of range");
      maxlen = std::max(maxlen, ps[b] + 1);
    }
    auto logits = at::empty({B, V}, embed.options().dtype(at::kFloat));
    std::vector<float> x(B * D), qkv(B * QKV), gu(B * 2 * I);
    const float* E = embed.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) std::memcpy(&x[b * D], E + idp[b] * D, D * sizeof(float));
    float* kv = kv_cache.data_ptr<float>();
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    const int all = std::max(1, std::min<int>(at::get_num_threads(), 64));
    const int T = threads > 0 ? std::min<int>(threads, all) : all;
    const int64_t rep = H / KVH;
    std::vector<float> parts(T * B * H * (hd + 2));  // split-K attention: each thread's partial states
#pragma omp parallel num_threads(T)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      Quantized q;
#ifdef O3_PROFILE
      auto last_ = std::chrono::steady_clock::now();
#endif
      std::vector<float> h(B * std::max({D, I, H * hd})), sc(H * (maxlen / nt + 2));
      std::vector<std::vector<Run>> runs(B);  // this thread's share of each sequence's keys
      for (int64_t b = 0; b < B; ++b) {
        const int64_t n = ps[b] + 1;
        slot_runs(tb + b * nb, block_size, n * t / nt, n * (t + 1) / nt, runs[b]);
      }
      for (size_t li = 0; li < layers.size(); ++li) {
        const Layer& L = layers[li];
        float* kbase = kv + li * 2 * S * row;
        float* vbase = kbase + S * row;
        // qkv = W_qkv . norm(x)
        rms_norm(x.data(), L.input_norm.data_ptr<float>(), h.data(), B, D, eps);
        quantize(L.qkv, h.data(), B, q);
        matmul(L.qkv, q, B, qkv.data(), false, t, nt);
#pragma omp barrier
        PROF_MARK(0)
        // q/k norms, RoPE, and the new keys and values into the cache: heads split over the threads
        for (int64_t j = t; j < B * (H + KVH); j += nt) {
          const int64_t b = j / (H + KVH), hh = j % (H + KVH);
          float* xh = &qkv[b * QKV + hh * hd];
          const Tensor& qn = hh < H ? L.q_norm : L.k_norm;
          if (qn.defined() && qn.numel()) rms_norm(xh, qn.data_ptr<float>(), xh, 1, hd, eps);
          rope(xh, cp + ps[b] * hd, sp + ps[b] * hd, hd);
          if (hh >= H) {
            const int64_t g = hh - H;
            std::memcpy(kbase + sl[b] * row + g * hd, xh, hd * sizeof(float));
            std::memcpy(vbase + sl[b] * row + g * hd, &qkv[b * QKV + (H + KVH + g) * hd], hd * sizeof(float));
          }
        }
#pragma omp barrier
        PROF_MARK(1)
        for (int64_t b = 0; b < B; ++b) {  // attention over each sequence's live prefix, keys split over the threads
          const int64_t n = ps[b] + 1;
          attend_part(&qkv[b * QKV], H, KVH, kbase, vbase, runs[b], n * (t + 1) / nt - n * t / nt, row, hd, sc.data(),
                      &parts[(t * B + b) * H * (hd + 2)]);
        }
#pragma omp barrier
        PROF_MARK(2)
        // x += W_o . att (every thread merges the threads' partial attention states for itself)
        for (int64_t j = 0; j < B * H; ++j) merge_parts(&parts[j * (hd + 2)], nt, B * H * (hd + 2), hd, &h[j * hd]);
        quantize(L.o, h.data(), B, q);
        matmul(L.o, q, B, x.data(), true, t, nt);
#pragma omp barrier
        PROF_MARK(3)
        // gate, up = W_gate_up . norm(x)
        rms_norm(x.data(), L.post_norm.data_ptr<float>(), h.data(), B, D, eps);
        quantize(L.gate_up, h.data(), B, q);
        matmul(L.gate_up, q, B, gu.data(), false, t, nt);
#pragma omp barrier
        PROF_MARK(4)
        // x += W_down . (silu(gate) * up)
        for (int64_t b = 0; b < B; ++b) silu_mul(&gu[b * 2 * I], &gu[b * 2 * I + I], &h[b * I], I);
        quantize(L.down, h.data(), B, q);
        matmul(L.down, q, B, x.data(), true, t, nt);
#pragma omp barrier
        PROF_MARK(5)
      }
      rms_norm(x.data(), norm.data_ptr<float>(), h.data(), B, D, eps);
      quantize(lm_head, h.data(), B, q);
      matmul(lm_head, q, B, logits.data_ptr<float>(), false, t, nt);
        PROF_MARK(6)
    }
#ifdef O3_PROFILE
    if (++g_steps % 200 == 0) {
      std::fprintf(stderr, "native step phases (ms/step, thread 0): qkv %.3f rope+kv %.3f attn %.3f o %.3f gate_up %.3f down %.3f head %.3f\n",
                   g_prof[0] * 1e3 / 200, g_prof[1] * 1e3 / 200, g_prof[2] * 1e3 / 200, g_prof[3] * 1e3 / 200, g_prof[4] * 1e3 / 200,
                   g_prof[5] * 1e3 / 200, g_prof[6] * 1e3 / 200);
      for (double& v : g_prof) v = 0;
    }
#endif
    return logits;
  }
};

TORCH_LIBRARY_FRAGMENT(o3edge_cpu, m) {
  m.class_<DecodeModel>("DecodeModel")
      .def(torch::init<std::vector<Tensor>, std::vector<int64_t>, double>())
      .def("step", &DecodeModel::step);
}
