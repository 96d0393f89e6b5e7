// o3edge's native CPU step (cpu_core.h): B rows of a quantized llama-family model (decode tokens of many
// sequences, or a prompt chunk of one) in one OpenMP parallel region. Every matmul splits its 16-row weight
// blocks over the threads, attention splits each row's keys, and the threads meet at a barrier between
// phases; activations are normed and quantized by every thread for itself (a few hundred floats a row),
// residual adds are fused into the matmul that produces them. No ATen: torch (cpu_step.cpp) and torch-free
// processes (native_lib.py) run this same code.
#include "cpu_core.h"

#include <omp.h>

#include <cstdarg>
#include <cstdio>
#include <utility>
#include <vector>

#include "cpu_kernels.h"

#ifdef O3_PROFILE
#include <chrono>
static double g_prof[8];
static int64_t g_steps;
#define PROF_MARK(i)                                                              \
  if (t == 0) {                                                                   \
    auto now_ = std::chrono::steady_clock::now();                                 \
    g_prof[i] += std::chrono::duration<double>(now_ - last_).count();             \
    last_ = now_;                                                                 \
  }
#else
#define PROF_MARK(i)
#endif

namespace {

// ---- vector math: ATen's AVX-512 algorithms, reproduced so the step's numbers are the ones it had on ATen ----
// (16 lanes of cpu_vec.h: the AVX-VNNI and AVX2 builds compute them lane for lane alike)

// the sum of the 16 lanes in at::vec::vec_reduce_all's order (halves, then quarters, pairs, neighbours)
#ifndef O3_AVXVNNI
inline float reduce_add(vf16 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
  v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0x4E));
  v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0xB1));
  return _mm512_cvtss_f32(v);
}
#else
inline float reduce_add(vf16 v) { return vreduce_add(v); }  // cpu_vec.h's: the same order, lanes i + 8, 4, 2, 1
#endif

inline vf16 pow2i(vi16 q) {  // 2^q for q in the normal range
  return vasf(vslli32<23>(vadd(q, vseti(0x7f))));
}

// e^d within 1 ulp: SLEEF's expf (Sleef_expf16_u10, what Vectorized<float>::exp calls), its AVX-512 FMA build
inline vf16 exp_u10(vf16 d) {
  const vi16 q = vcvti(vmul(d, vsetf(1.442695040888963407359924681001892137f)));
  const vf16 qf = vcvtf(q);
  vf16 s = vfmadd(qf, vsetf(-0.693145751953125f), d);  // d - q ln2, ln2 in two parts
  s = vfmadd(qf, vsetf(-1.428606765330187045e-06f), s);
  vf16 u = vsetf(0.000198527617612853646278381f);
  u = vfmadd(u, s, vsetf(0.00139304355252534151077271f));
  u = vfmadd(u, s, vsetf(0.00833336077630519866943359f));
  u = vfmadd(u, s, vsetf(0.0416664853692054748535156f));
  u = vfmadd(u, s, vsetf(0.166666671633720397949219f));
  u = vfmadd(u, s, vsetf(0.5f));
  u = vadd(vsetf(1.f), vfmadd(vmul(s, s), u, s));
  const vi16 q1 = vsrai32<1>(q);  // 2^q as two factors: q may pass the exponent's range
  u = vmul(vmul(u, pow2i(q1)), pow2i(vsub(q, q1)));
  u = vselect(vcmp<_CMP_NLT_UQ>(d, vsetf(-104.f)), u, vzerof());  // 0 below -104
  return vselect(vcmp<_CMP_LT_OQ>(vsetf(100.f), d), vsetf(INFINITY), u);
}

// e^x within 20 ulp: ATen's Vectorized<float>::exp_u20 (softmax numerators, where x <= 0)
inline vf16 exp_u20(vf16 x) {
  const vf16 lo = vasf(vseti((int32_t)0xc2aeac50));  // ln(FLT_MIN)
  const vf16 hi = vasf(vseti(0x42b17218));  // ln(FLT_MAX)
  const vm16 tiny = vcmp<_CMP_LT_OS>(x, lo);
  x = vmax(vmin(x, hi), lo);
  vf16 fx = vfmadd(x, vasf(vseti(0x3fb8aa3b)), vsetf(0.5f));
  fx = vfloor(fx);
  const vf16 r = vfnmadd(fx, vasf(vseti(0x3f317218)), x);
  vf16 p = vfmadd(r, vsetf(0.00828929059f), vsetf(0.0418978221f));
  p = vfmadd(r, p, vsetf(0.166676521f));
  p = vfmadd(r, p, vsetf(0.499991506f));
  p = vfmadd(r, p, vsetf(0.999999701f));
  p = vfmadd(r, p, vsetf(1.f));
  vf16 two_n = pow2i(vcvti(vsub(fx, vsetf(1.f))));  // 2^(n-1): n may be 128
  two_n = vselect(tiny, vzerof(), two_n);
  return vmul(vmul(p, two_n), vsetf(2.f));
}

// ---- the step's pieces -----------------------------------------------------------------------------------

// per-thread activation buffers, quantized for one linear
struct Quantized {
  std::vector<int8_t> s8;
  std::vector<uint8_t> u8;
  std::vector<float> xs;
  std::vector<int32_t> xsum;
};

void quantize(const o3_linear& l, const float* x, int64_t M, Quantized& q) {
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
void matmul(const o3_linear& l, const Quantized& q, int64_t M, float* out, bool add, int t, int T) {
  const int64_t blocks = l.N / 16, b0 = blocks * t / T, b1 = blocks * (t + 1) / T;
  const int64_t NG = l.Kp / l.G;
  for (int64_t rb = b0; rb < b1; ++rb) {
    int64_t m = 0;
    if (l.int4) {
      const uint8_t* wb = static_cast<const uint8_t*>(l.w) + rb * (l.Kp / 8) * 64;
      const auto* sp = static_cast<const uint16_t*>(l.a);
      const auto* zp = static_cast<const uint16_t*>(l.b);
      for (; m + 4 <= M; m += 4)
        int4_rows<4>(wb, q.s8.data(), q.xs.data(), q.xsum.data(), sp, zp, out, m, rb, l.N, l.Kp, NG, l.G / 8, add);
      for (; m < M; ++m)
        int4_rows<1>(wb, q.s8.data(), q.xs.data(), q.xsum.data(), sp, zp, out, m, rb, l.N, l.Kp, NG, l.G / 8, add);
    } else {
      const int8_t* wb = static_cast<const int8_t*>(l.w) + rb * (l.K / 4) * 64;
      const auto* ws = static_cast<const int32_t*>(l.a);
      const auto* sp = static_cast<const float*>(l.b);
      for (; m + 4 <= M; m += 4)
        int8_rows<4>(wb, q.u8.data(), q.xs.data(), ws, sp, out, m, rb, l.N, l.K, NG, l.G / 4, add);
      for (; m < M; ++m) int8_rows<1>(wb, q.u8.data(), q.xs.data(), ws, sp, out, m, rb, l.N, l.K, NG, l.G / 4, add);
    }
  }
}

// y = x / rms(x) * w, rows of n
void rms_norm(const float* x, const float* w, float* y, int64_t M, int64_t n, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * n;
    vf16 acc = vzerof();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc = vfmadd(vloadf(xm + i), vloadf(xm + i), acc);
    float ss = reduce_add(acc);
    for (; i < n; ++i) ss += xm[i] * xm[i];
    const float r = 1.f / std::sqrt(ss / n + eps);
    for (int64_t i = 0; i < n; ++i) y[m * n + i] = x[m * n + i] * r * w[i];
  }
}

// out = silu(gate) * up, n floats
void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const vf16 g = vloadf(gate + i);
    const vf16 e = exp_u10(vneg(g));
    vstore(out + i, vmul(vdiv(g, vadd(vsetf(1.f), e)), vloadf(up + i)));
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

// key positions [k0, k1) of a sequence whose block table is `table` (block ids) -> runs of consecutive slots,
// appended to runs (merged with the runs from index `first` on)
void slot_runs(const int64_t* table, int64_t bs, int64_t k0, int64_t k1, std::vector<Run>& runs, size_t first) {
  for (int64_t t = k0; t < k1;) {
    const int64_t slot = table[t / bs] * bs + t % bs, len = std::min(bs - t % bs, k1 - t);
    if (runs.size() > first && runs.back().first + runs.back().second == slot) runs.back().second += len;
    else runs.emplace_back(slot, len);
    t += len;
  }
}

// Split-K attention: each thread takes a share of a row's keys for all heads, so every key and value row is
// read once, front to back, by one thread. The H query heads q [H, hd] (head h reads KV group h / (H / KVH))
// against the key/value rows of the runs (rows of `row` floats: KVH heads of hd) -> per head the partial softmax
// state: the unnormalized sum acc [hd], max m and sum l (part: H rows of hd + 2 floats). n (the runs' total
// length) may be 0. sc: H * n floats.
void attend_part(const float* q, int64_t H, int64_t KVH, const float* kbase, const float* vbase, const Run* runs,
                 int64_t nruns, int64_t n, int64_t row, int64_t hd, float* sc, float* part) {
  const int64_t rep = H / KVH, nv = hd / 16;
  const float scale = 1.0f / std::sqrt((float)hd);
  int64_t t = 0;
  for (int64_t r = 0; r < nruns; ++r)
  for (int64_t i = 0; i < runs[r].second; ++i, ++t) {  // scores
    const float* kt = kbase + (runs[r].first + i) * row;
    for (int64_t h = 0; h < H; ++h) {
      const float* qh = q + h * hd;
      const float* kh = kt + (h / rep) * hd;
      vf16 acc = vmul(vloadf(qh), vloadf(kh));
      for (int64_t i = 1; i < nv; ++i) acc = vfmadd(vloadf(qh + 16 * i), vloadf(kh + 16 * i), acc);
      sc[h * n + t] = vreduce_add(acc) * scale;
    }
  }
  for (int64_t h = 0; h < H; ++h) {  // softmax numerators, max and sum
    float* s = sc + h * n;
    float m = -INFINITY;
    for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
    const vf16 vm = vsetf(m);
    vf16 vsum = vzerof();
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
      const vf16 e = exp_u20(vsub(vloadf(s + t), vm));
      vstore(s + t, e);
      vsum = vadd(vsum, e);
    }
    float sum = reduce_add(vsum);
    for (; t < n; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    float* out = part + h * (hd + 2);
    for (int64_t i = 0; i < hd; ++i) out[i] = 0.f;
    out[hd] = m, out[hd + 1] = sum;
  }
  t = 0;
  for (int64_t r = 0; r < nruns; ++r)
  for (int64_t i = 0; i < runs[r].second; ++i, ++t) {  // weighted values
    const float* vt = vbase + (runs[r].first + i) * row;
    for (int64_t h = 0; h < H; ++h) {
      const float* vh = vt + (h / rep) * hd;
      float* out = part + h * (hd + 2);
      const vf16 p = vsetf(sc[h * n + t]);
      for (int64_t i = 0; i < nv; ++i) vstore(out + 16 * i, vfmadd(p, vloadf(vh + 16 * i), vloadf(out + 16 * i)));
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

// ---- input checks: a bad call comes back as -1 and a message, never as a read or write out of bounds ------

int fail(char* err, int64_t errlen, const char* fmt, ...) {
  if (err && errlen > 0) {
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(err, (size_t)errlen, fmt, ap);
    va_end(ap);
  }
  return -1;
}

int check_linear(const o3_linear& l, const char* name, int64_t layer, int64_t N, int64_t K, char* err,
                 int64_t errlen) {
  const bool ok = l.w && l.a && l.b && l.N == N && l.K == K && N % 16 == 0 &&
                  (l.int4 ? l.G >= 8 && l.G % 8 == 0 && l.Kp >= K && l.Kp % l.G == 0
                          : l.Kp == K && l.G >= 4 && l.G % 4 == 0 && K % l.G == 0);
  if (ok) return 0;
  return fail(err, errlen, "o3: layer %lld %s: int4=%d N=%lld K=%lld Kp=%lld G=%lld (null pointer or bad shape; "
              "expected N=%lld K=%lld)", (long long)layer, name, (int)l.int4, (long long)l.N, (long long)l.K,
              (long long)l.Kp, (long long)l.G, (long long)N, (long long)K);
}

}  // namespace

extern "C" int o3_check_model(const o3_model* m, char* err, int64_t errlen) {
  if (!m) return fail(err, errlen, "o3: no model");
  if (m->L < 0 || m->H <= 0 || m->KVH <= 0 || m->H % m->KVH || m->hd <= 0 || m->hd % 16 || m->hd > 256 ||
      m->D <= 0 || m->I <= 0 || m->V <= 0 || !(m->eps >= 0))
    return fail(err, errlen, "o3: bad model shape L=%lld H=%lld KVH=%lld hd=%lld D=%lld I=%lld V=%lld (head_dim "
                "must be a multiple of 16 and <= 256, H a multiple of KVH)", (long long)m->L, (long long)m->H,
                (long long)m->KVH, (long long)m->hd, (long long)m->D, (long long)m->I, (long long)m->V);
  if (!m->embed || !m->norm || (m->L > 0 && !m->layers)) return fail(err, errlen, "o3: null embed, norm or layers");
  const int64_t D = m->D, I = m->I, H = m->H, KVH = m->KVH, hd = m->hd;
  for (int64_t i = 0; i < m->L; ++i) {
    const o3_layer& l = m->layers[i];
    if (!l.input_norm || !l.post_norm) return fail(err, errlen, "o3: layer %lld: null norm", (long long)i);
    if (check_linear(l.qkv, "qkv", i, (H + 2 * KVH) * hd, D, err, errlen) ||
        check_linear(l.o, "o", i, D, H * hd, err, errlen) ||
        check_linear(l.gate_up, "gate_up", i, 2 * I, D, err, errlen) ||
        check_linear(l.down, "down", i, D, I, err, errlen))
      return -1;
  }
  return check_linear(m->lm_head, "lm_head", -1, m->V, D, err, errlen);
}

extern "C" int o3_step(const o3_model* m, int64_t B, const int64_t* ids, const int64_t* positions,
                       const int64_t* slots, const int64_t* tables, int64_t table_width, int64_t block_size,
                       const float* cos, const float* sin, int64_t rope_len, float* kv_cache, int64_t S, int64_t R,
                       const int64_t* logit_rows, float* logits, int threads, char* err, int64_t errlen) {
  if (o3_check_model(m, err, errlen)) return -1;
  const int64_t H = m->H, KVH = m->KVH, hd = m->hd, D = m->D, I = m->I, V = m->V;
  const int64_t row = KVH * hd, QKV = (H + 2 * KVH) * hd, nb = table_width, bs = block_size;
  const float eps = (float)m->eps;
  if (B < 0 || R < 0 || S <= 0 || bs <= 0 || (B > 0 && nb <= 0))
    return fail(err, errlen, "o3_step: bad sizes B=%lld R=%lld S=%lld block_size=%lld table_width=%lld",
                (long long)B, (long long)R, (long long)S, (long long)bs, (long long)nb);
  if (B > 0 && (!ids || !positions || !slots || !tables || !cos || !sin || !kv_cache))
    return fail(err, errlen, "o3_step: null input");
  if (R > 0 && !logits) return fail(err, errlen, "o3_step: null logits");
  int64_t maxlen = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t p = positions[b];
    if (ids[b] < 0 || ids[b] >= V || slots[b] < 0 || slots[b] >= S || p < 0 || p >= rope_len || p / bs >= nb)
      return fail(err, errlen, "o3_step: row %lld: id %lld (V=%lld), slot %lld (S=%lld) or position %lld "
                  "(rope_len=%lld, table of %lld blocks of %lld) out of range", (long long)b, (long long)ids[b],
                  (long long)V, (long long)slots[b], (long long)S, (long long)p, (long long)rope_len,
                  (long long)nb, (long long)bs);
    for (int64_t j = 0; j <= p / bs; ++j) {
      const int64_t blk = tables[b * nb + j];
      if (blk < 0 || (blk + 1) * bs > S)
        return fail(err, errlen, "o3_step: row %lld: block %lld (table column %lld) out of range for %lld slots",
                    (long long)b, (long long)blk, (long long)j, (long long)S);
    }
    maxlen = std::max(maxlen, p + 1);
  }
  for (int64_t r = 0; r < R; ++r)
    if (logit_rows && (logit_rows[r] < 0 || logit_rows[r] >= B))
      return fail(err, errlen, "o3_step: logit row %lld out of range [0, %lld)", (long long)logit_rows[r],
                  (long long)B);
  if (!logit_rows && R > B) return fail(err, errlen, "o3_step: %lld logit rows of %lld", (long long)R, (long long)B);
  if (B == 0) return 0;

  std::vector<float> x(B * D), qkv(B * QKV), gu(B * 2 * I);
  for (int64_t b = 0; b < B; ++b) std::memcpy(&x[b * D], m->embed + ids[b] * D, D * sizeof(float));
  const int T = std::max(1, std::min(threads > 0 ? threads : omp_get_max_threads(), 64));
  std::vector<float> parts(T * B * H * (hd + 2));  // split-K attention: each thread's partial states
  const int64_t hrows = std::max(B, R);
#pragma omp parallel num_threads(T)
  {
    // denormals flushed to zero and read as zero in every thread of the step (the torch backend sets the same with
    // torch.set_flush_denormal): x86 runs denormal arithmetic in microcode, and a step slowed up to 4x without it
    _mm_setcsr(_mm_getcsr() | 0x8040);
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    Quantized q;
#ifdef O3_PROFILE
    auto last_ = std::chrono::steady_clock::now();
#endif
    // a thread's key share of a row is at most maxlen / nt + 1 keys (rows of any length: one row's at a time)
    std::vector<float> h(hrows * std::max({D, I, H * hd})), sc(H * (maxlen / nt + 2));
    std::vector<Run> runs;  // this thread's share of each row's keys: runs[run_at[b] .. run_at[b + 1])
    std::vector<int64_t> run_at(B + 1);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = positions[b] + 1;
      run_at[b] = (int64_t)runs.size();
      slot_runs(tables + b * nb, bs, n * t / nt, n * (t + 1) / nt, runs, runs.size());
    }
    run_at[B] = (int64_t)runs.size();
    for (int64_t li = 0; li < m->L; ++li) {
      const o3_layer& L = m->layers[li];
      float* kbase = kv_cache + li * 2 * S * row;
      float* vbase = kbase + S * row;
      // qkv = W_qkv . norm(x)
      rms_norm(x.data(), L.input_norm, h.data(), B, D, eps);
      quantize(L.qkv, h.data(), B, q);
      matmul(L.qkv, q, B, qkv.data(), false, t, nt);
#pragma omp barrier
      PROF_MARK(0)
      // q/k norms, RoPE, and the new keys and values of every row into the cache: heads split over the threads
      for (int64_t j = t; j < B * (H + KVH); j += nt) {
        const int64_t b = j / (H + KVH), hh = j % (H + KVH);
        float* xh = &qkv[b * QKV + hh * hd];
        const float* qn = hh < H ? L.q_norm : L.k_norm;
        if (qn) rms_norm(xh, qn, xh, 1, hd, eps);
        rope(xh, cos + positions[b] * hd, sin + positions[b] * hd, hd);
        if (hh >= H) {
          const int64_t g = hh - H;
          std::memcpy(kbase + slots[b] * row + g * hd, xh, hd * sizeof(float));
          std::memcpy(vbase + slots[b] * row + g * hd, &qkv[b * QKV + (H + KVH + g) * hd], hd * sizeof(float));
        }
      }
#pragma omp barrier
      PROF_MARK(1)
      for (int64_t b = 0; b < B; ++b) {  // attention over each row's prefix, keys split over the threads
        const int64_t n = positions[b] + 1;
        attend_part(&qkv[b * QKV], H, KVH, kbase, vbase, runs.data() + run_at[b], run_at[b + 1] - run_at[b],
                    n * (t + 1) / nt - n * t / nt, row, hd, sc.data(), &parts[(t * B + b) * H * (hd + 2)]);
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
      rms_norm(x.data(), L.post_norm, h.data(), B, D, eps);
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
    // the LM head for the requested rows only: a prompt chunk pays it once, not once a token
    for (int64_t r = 0; r < R; ++r)
      rms_norm(&x[(logit_rows ? logit_rows[r] : r) * D], m->norm, &h[r * D], 1, D, eps);
    quantize(m->lm_head, h.data(), R, q);
    matmul(m->lm_head, q, R, logits, false, t, nt);
    PROF_MARK(6)
  }
#ifdef O3_PROFILE
  if (++g_steps % 200 == 0) {
    std::fprintf(stderr, "native step phases (ms/step, thread 0): qkv %.3f rope+kv %.3f attn %.3f o %.3f gate_up "
                 "%.3f down %.3f head %.3f\n", g_prof[0] * 1e3 / 200, g_prof[1] * 1e3 / 200, g_prof[2] * 1e3 / 200,
                 g_prof[3] * 1e3 / 200, g_prof[4] * 1e3 / 200, g_prof[5] * 1e3 / 200, g_prof[6] * 1e3 / 200);
    for (double& v : g_prof) v = 0;
  }
#endif
  return 0;
}
