// o3edge's native CPU decode step under torch (see o3edge/engine/cpu_step.py): the DecodeModel class holds
// the module tensors and runs the step of cpu_core.cpp (the same code native_lib.py runs without torch) over
// pointers to them: one OpenMP region per step, no torch operator inside.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <vector>

#include "cpu_core.h"

using at::Tensor;

namespace {

const void* ptr(const Tensor& t, at::ScalarType dtype, int64_t numel, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == dtype && t.numel() == numel,
              "DecodeModel: ", what, ": expected contiguous CPU ", dtype, " of ", numel, " elements, got ",
              t.scalar_type(), " ", t.sizes());
  return t.data_ptr();
}

}  // namespace

// The model's weights (references to the module tensors: no copy), built once by cpu_step.py.
struct DecodeModel : torch::CustomClassHolder {
  std::vector<Tensor> tensors;  // keep the weights alive: `model` points into them
  std::vector<o3_layer> layers;
  o3_model model{};

  // tensors: embed, norm, per layer [input_norm, post_norm, q_norm, k_norm (empty when none), then 3 per linear
  // for qkv, o, gate_up, down], then 3 for the LM head. ints: H, KVH, hd, then per linear (layers', then the
  // head's) [int4, N, K, Kp, G].
  DecodeModel(std::vector<Tensor> t, std::vector<int64_t> ints, double eps) : tensors(std::move(t)) {
    const auto& T = tensors;
    const size_t per_layer = 4 + 4 * 3;
    TORCH_CHECK(T.size() >= 5 && (T.size() - 5) % per_layer == 0, "DecodeModel: bad tensor list");
    const size_t L = (T.size() - 5) / per_layer;
    TORCH_CHECK(ints.size() == 3 + 5 * (4 * L + 1), "DecodeModel: bad int list");
    TORCH_CHECK(T[0].dim() == 2, "DecodeModel: embed must be [V, D]");
    model.L = L, model.H = ints[0], model.KVH = ints[1], model.hd = ints[2], model.eps = eps;
    model.V = T[0].size(0), model.D = T[0].size(1);
    model.I = L ? ints[3 + 5 * 3 + 2] : 1;  // the first layer's down projection: K = I
    model.embed = static_cast<const float*>(ptr(T[0], at::kFloat, model.V * model.D, "embed"));
    model.norm = static_cast<const float*>(ptr(T[1], at::kFloat, model.D, "norm"));
    size_t ti = 2, ii = 3;
    auto linear = [&]() {
      o3_linear l{};
      l.int4 = (int32_t)ints[ii], l.N = ints[ii + 1], l.K = ints[ii + 2], l.Kp = ints[ii + 3], l.G = ints[ii + 4];
      ii += 5;
      TORCH_CHECK(l.N > 0 && l.Kp > 0 && l.G > 0 && l.Kp % l.G == 0, "DecodeModel: bad linear shape");
      const int64_t NG = l.Kp / l.G;
      l.w = ptr(T[ti], l.int4 ? at::kByte : at::kChar, l.int4 ? l.N * l.Kp / 2 : l.N * l.K, "packed weight");
      l.a = ptr(T[ti + 1], l.int4 ? at::kBFloat16 : at::kInt, NG * l.N, l.int4 ? "scales" : "wsum");
      l.b = l.int4 ? ptr(T[ti + 2], at::kBFloat16, NG * l.N, "zeros") : ptr(T[ti + 2], at::kFloat, l.N, "scales");
      ti += 3;
      return l;
    };
    auto norm = [&](const Tensor& w, int64_t n) -> const float* {  // empty: the model has none
      return w.numel() ? static_cast<const float*>(ptr(w, at::kFloat, n, "norm")) : nullptr;
    };
    layers.resize(L);
    for (o3_layer& l : layers) {
      l.input_norm = norm(T[ti], model.D), l.post_norm = norm(T[ti + 1], model.D);
      l.q_norm = norm(T[ti + 2], model.hd), l.k_norm = norm(T[ti + 3], model.hd);
      ti += 4;
      l.qkv = linear(), l.o = linear(), l.gate_up = linear(), l.down = linear();
    }
    model.lm_head = linear();
    model.layers = layers.data();
    char err[512];
    TORCH_CHECK(o3_check_model(&model, err, sizeof err) == 0, "DecodeModel: ", err);
  }

  // ids, positions, slots: [B] int64; tables: [B, blocks] int64, the block ids holding each sequence's keys
  // (block_size slots each; a sequence's new token is at `position` and is written to `slot`); cos, sin:
  // [max_len, hd] float32; kv_cache [L, 2, S, KVH, hd] float32 -> logits [B, V] float32. threads: how many
  // (at most torch's thread count; <= 0: all of them).
  Tensor step(Tensor ids, Tensor positions, Tensor slots, Tensor tables, int64_t block_size, Tensor cos, Tensor sin,
              Tensor kv_cache, int64_t threads) {
    const auto& m = model;
    TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.scalar_type() == at::kFloat && kv_cache.dim() == 5 &&
                kv_cache.size(0) == m.L && kv_cache.size(1) == 2 && kv_cache.size(3) == m.KVH &&
                kv_cache.size(4) == m.hd, "kv_cache: contiguous float32 [L, 2, S, KVH, hd]");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                sin.scalar_type() == at::kFloat && cos.dim() == 2 && cos.size(1) == m.hd &&
                sin.sizes() == cos.sizes(), "rope tables: contiguous float32 [max_len, hd]");
    const int64_t B = ids.size(0);
    ids = ids.contiguous(), positions = positions.contiguous(), slots = slots.contiguous();
    TORCH_CHECK(ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                slots.scalar_type() == at::kLong && ids.dim() == 1 && positions.numel() == B && slots.numel() == B,
                "step: ids, positions and slots must be int64 [B]");
    TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && tables.is_contiguous() &&
                tables.scalar_type() == at::kLong && block_size > 0, "step: tables must be int64 [B, blocks]");
    auto logits = at::empty({B, m.V}, cos.options());
    const int all = at::get_num_threads();
    const int T = threads > 0 ? std::min<int>(threads, all) : all;
    char err[512];
    const int rc = o3_step(&m, B, ids.data_ptr<int64_t>(), positions.data_ptr<int64_t>(), slots.data_ptr<int64_t>(),
                           tables.data_ptr<int64_t>(), tables.size(1), block_size, cos.data_ptr<float>(),
                           sin.data_ptr<float>(), cos.size(0), kv_cache.data_ptr<float>(), kv_cache.size(2), B,
                           nullptr, logits.data_ptr<float>(), T, err, sizeof err);
    TORCH_CHECK(rc == 0, err);
    return logits;
  }
};

TORCH_LIBRARY_FRAGMENT(o3edge_cpu, m) {
  m.class_<DecodeModel>("DecodeModel")
      .def(torch::init<std::vector<Tensor>, std::vector<int64_t>, double>())
      .def("step", &DecodeModel::step);
}
