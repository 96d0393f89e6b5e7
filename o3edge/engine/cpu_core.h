/* o3edge's native CPU step (cpu_core.cpp) as a C ABI: plain structs of pointers and one entry point, so the
   same code runs under torch (cpu_step.cpp, the DecodeModel class) and without it (native_lib.py, ctypes).
   Every array is C-contiguous; nothing is copied or freed: the caller keeps the weights alive. */
#ifndef O3EDGE_CPU_CORE_H
#define O3EDGE_CPU_CORE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One quantized linear layer (out = W x, W [N, K]) in the VNNI layouts of cpu_kernels.h.
   int8 (int4 == 0): w int8 [N/16, K/4, 64] packed, a = wsum int32 [K/G, N], b = scales float32 [N], Kp == K,
                     G = the activation group (columns per int8 activation scale).
   int4 (int4 != 0): w uint8 [N/16, Kp/8, 64] packed rows16, a = scales, b = zeros: bf16 bits (uint16)
                     [Kp/G, N], G = the weight group size (K padded to Kp, a multiple of G). */
typedef struct {
  int32_t int4;
  const void *w, *a, *b;
  int64_t N, K, Kp, G;
} o3_linear;

/* One decoder layer: RMS norm weights float32 (input_norm, post_norm [D]; q_norm, k_norm [hd], NULL when the
   model has none), then the fused projections qkv [(H + 2 KVH) hd, D], o [D, H hd], gate_up [2 I, D],
   down [D, I]. */
typedef struct {
  const float *input_norm, *post_norm, *q_norm, *k_norm;
  o3_linear qkv, o, gate_up, down;
} o3_layer;

/* A bias-free llama-family decoder: L layers, H query heads and KVH key/value heads of hd, hidden size D,
   FFN size I, vocabulary V. embed float32 [V, D], norm float32 [D], lm_head [V, D]. */
typedef struct {
  int64_t L, H, KVH, hd, D, I, V;
  double eps;
  const float* embed;
  const float* norm;
  const o3_layer* layers;
  o3_linear lm_head;
} o3_model;

/* 0 when the model's shapes and layouts are ones o3_step can run, else -1 with a message in err. */
int o3_check_model(const o3_model* m, char* err, int64_t errlen);

/* One step over B rows (tokens). Row b has its own token ids[b], position positions[b], cache slot slots[b]
   and block-table row tables[b] (table_width int64 block ids of block_size slots each). The K/V of all B rows
   are written into kv_cache (float32 [L, 2, S, KVH, hd]) before any row attends, and row b attends to the
   positions [0, positions[b]] of its table: a prompt chunk of one sequence is one call (its rows share the
   table) with exact causal attention, and decode rows of other sequences may ride along. cos, sin: float32
   [rope_len, hd] (rotate-half RoPE). logits: float32 [R, V], the rows logit_rows[0..R) (the LM head runs for
   those rows only; logit_rows NULL: rows 0..R-1). threads <= 0: omp_get_max_threads(); at most 64. Not
   reentrant on one kv_cache; distinct caches may step from distinct threads (the model is only read).
   Returns 0, or -1 with a message in err (errlen bytes, NUL-terminated) for input out of range; then
   kv_cache and logits are untouched. */
int o3_step(const o3_model* m, int64_t B, const int64_t* ids, const int64_t* positions, const int64_t* slots,
            const int64_t* tables, int64_t table_width, int64_t block_size, const float* cos, const float* sin,
            int64_t rope_len, float* kv_cache, int64_t S, int64_t R, const int64_t* logit_rows, float* logits,
            int threads, char* err, int64_t errlen);

#ifdef __cplusplus
}
#endif

#endif /* O3EDGE_CPU_CORE_H */
