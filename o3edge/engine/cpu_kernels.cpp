// o3edge CPU row kernels on AVX-512 VNNI, AVX-VNNI or AVX2 (cpu_vec.h): the INT8 and INT4 linears (see
// o3edge/engine/cpu_ext.py; the decode attention is cpu_span.cpp and cpu_router.cpp, a library of its own)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <torch/library.h>
#include <cmath>
#include <vector>

#include "cpu_kernels.h"

using at::Tensor;

Tensor int4_linear(const Tensor& x_in, const Tensor& packed, const Tensor& scales, const Tensor& zeros,
                   int64_t group_size, int64_t out_features) {
  const int64_t K = x_in.size(-1), N = out_features, G = group_size;
  const int64_t Kp = packed.size(1) * 8, NG = Kp / G;
  TORCH_CHECK(packed.dim() == 3 && packed.size(0) * 16 == N && packed.size(2) == 64, "int4_linear: bad packed shape");
  TORCH_CHECK(G % 8 == 0 && Kp % G == 0 && K <= Kp, "int4_linear: bad group size");
  auto x = x_in.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  std::vector<int8_t> xq(M * Kp);
  std::vector<float> xs(M * NG);
  std::vector<int32_t> xsum(M * NG);
  quantize_s8(x.data_ptr<float>(), M, K, Kp, G, xq.data(), xs.data(), xsum.data());
  auto out = at::empty({M, N}, x.options());
  float* op = out.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());  // the bf16 bits
  const auto* zp = reinterpret_cast<const uint16_t*>(zeros.data_ptr<at::BFloat16>());
  const int64_t blocks = N / 16, octets = Kp / 8, per_group = G / 8;
  const int64_t grain = std::max<int64_t>(1, (int64_t)(16384 / std::max<int64_t>(1, Kp)));  // ~16 KB of weights per task
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t rb = b0; rb < b1; ++rb) {
      const uint8_t* wb = wp + rb * octets * 64;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) int4_rows<4>(wb, xq.data(), xs.data(), xsum.data(), sp, zp, op, m, rb, N, Kp, NG, per_group);
      for (; m < M; ++m) int4_rows<1>(wb, xq.data(), xs.data(), xsum.data(), sp, zp, op, m, rb, N, Kp, NG, per_group);
    }
  });
  auto shape = x_in.sizes().vec();
  shape.back() = N;
  return out.view(shape);
}

// qweight uint8 [N, Kp/2] (column 2i high nibble, 2i+1 low) -> rows16 packed [N/16, Kp/8, 64]
Tensor int4_pack_rows16(const Tensor& qweight) {
  const int64_t N = qweight.size(0), Kp = qweight.size(1) * 2;
  TORCH_CHECK(N % 16 == 0 && Kp % 8 == 0, "int4_pack_rows16: N % 16 and Kp % 8 must be 0");
  auto q = qweight.contiguous();
  const uint8_t* src = q.data_ptr<uint8_t>();
  auto out = at::empty({N / 16, Kp / 8, 64}, q.options());
  uint8_t* dst = out.data_ptr<uint8_t>();
  auto nib = [&](int64_t n, int64_t k) -> uint8_t {
    const uint8_t b = src[n * (Kp / 2) + k / 2];
    return (k % 2 == 0) ? (b >> 4) : (b & 0x0F);
  };
  for (int64_t rb = 0; rb < N / 16; ++rb)
    for (int64_t o = 0; o < Kp / 8; ++o)
      for (int64_t r = 0; r < 16; ++r)
        for (int64_t j = 0; j < 4; ++j) {
          const int64_t n = rb * 16 + r;
          dst[(rb * (Kp / 8) + o) * 64 + r * 4 + j] = nib(n, 8 * o + j) | (nib(n, 8 * o + 4 + j) << 4);
        }
  return out;
}

Tensor int8_linear(const Tensor& x_in, const Tensor& packed, const Tensor& wsum, const Tensor& scales,
                   int64_t group_size) {
  const int64_t K = x_in.size(-1), N = packed.size(0) * 16, G = group_size, NG = K / G;
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) * 4 == K && packed.size(2) == 64, "int8_linear: bad packed shape");
  TORCH_CHECK(G % 4 == 0 && K % G == 0 && wsum.size(0) == NG, "int8_linear: bad group size");
  auto x = x_in.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  std::vector<uint8_t> xu(M * K);
  std::vector<float> xs(M * NG);
  quantize_u8(x.data_ptr<float>(), M, K, G, xu.data(), xs.data());
  auto out = at::empty({M, N}, x.options());
  float* op = out.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int32_t* ws = wsum.data_ptr<int32_t>();
  const float* sp = scales.data_ptr<float>();
  const int64_t blocks = N / 16, quads = K / 4, per_group = G / 4;
  const int64_t grain = std::max<int64_t>(1, (int64_t)(16384 / std::max<int64_t>(1, K)));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t rb = b0; rb < b1; ++rb) {
      const int8_t* wb = wp + rb * quads * 64;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) int8_rows<4>(wb, xu.data(), xs.data(), ws, sp, op, m, rb, N, K, NG, per_group);
      for (; m < M; ++m) int8_rows<1>(wb, xu.data(), xs.data(), ws, sp, op, m, rb, N, K, NG, per_group);
    }
  });
  auto shape = x_in.sizes().vec();
  shape.back() = N;
  return out.view(shape);
}

// q int8 [N, K] -> packed int8 [N/16, K/4, 64] for int8_linear
Tensor int8_pack_rows16(const Tensor& q) {
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(N % 16 == 0 && K % 4 == 0, "int8_pack_rows16: N % 16 and K % 4 must be 0");
  return q.contiguous().view({N / 16, 16, K / 4, 4}).permute({0, 2, 1, 3}).contiguous().view({N / 16, K / 4, 64});
}

TORCH_LIBRARY_FRAGMENT(o3edge_cpu, m) {  // fragments: cpu_span.cpp and cpu_router.cpp add theirs
  m.def("int8_linear(Tensor x, Tensor packed, Tensor wsum, Tensor scales, int group_size) -> Tensor");
  m.def("int8_pack_rows16(Tensor q) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales, Tensor zeros, int group_size, int out_features) -> Tensor");
  m.def("int4_pack_rows16(Tensor qweight) -> Tensor");
}

TORCH_LIBRARY_IMPL(o3edge_cpu, CPU, m) {
  m.impl("int4_linear", int4_linear);
  m.impl("int4_pack_rows16", int4_pack_rows16);
  m.impl("int8_linear", int8_linear);
  m.impl("int8_pack_rows16", int8_pack_rows16);
}
