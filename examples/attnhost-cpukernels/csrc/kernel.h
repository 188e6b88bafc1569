// The attention kernel's problem description: plain C++ (no torch), so the same code can be compiled once per
// instruction set (kernel_base.cpp, kernel_avx2.cpp, kernel_avx512.cpp) and picked at run time (bindings.cpp).
#pragma once

#include <cstdint>

namespace cpukernels {

// The FP8 formats are cache dtypes only: each read is stored.to(float32) * scale (docs/kv-cache.md).
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kFp8E4M3 = 3, kFp8E5M2 = 4 };

// One forward call's tensors, by pointer and stride (in elements); the cache is read where it lies.
struct Problem {
  const void* q;  // [tokens, heads, dim]: strides q_tok, q_head, 1
  int64_t q_tok, q_head;
  void* out;  // [tokens, heads, dim], contiguous
  const void* k;  // cache [slots, kv_heads, dim]: strides k_slot, k_head, 1
  const void* v;
  int64_t k_slot, k_head, v_slot, v_head;
  const int64_t* slots;  // the plan's copy of the entries the batch reads, checked against the cache: with
                         // page_size 1 its req_to_token entries (token slots), else its page_table entries (pages)
  int64_t page_size;  // token p of a request lies at slot pages[p / page_size] * page_size + p % page_size
  const int64_t* meta;  // per request: its first entry in slots, prefix_len, extend_len, first query token,
                        // tree-mask offset
  const uint8_t* tree_mask;  // nullptr: causal among the new tokens; else 0 or 1 per (new token, new token)
  float* partials;  // per split-context unit: rows x (dim + 2) floats (acc, max, sum)
  DType q_dtype, kv_dtype;
  int heads, kv_heads, dim;
  float scale;
  float k_scale, v_scale;  // an FP8 cache's dequantisation scales (1 for a float cache, which ignores them)
};

// A piece of work one thread does alone: some KV heads of one request, some of its new tokens, some of its keys.
struct Unit {
  int64_t request;
  int32_t h0, h1;  // KV heads [h0, h1)
  int64_t q0, q1;  // new tokens [q0, q1) of the request
  int64_t k0, k1;  // key positions [k0, k1)
  int64_t partial;  // -1: write the output; else the index of this unit's partial state
};

constexpr int kMetaFields = 5;

void run_unit_base(const Problem& p, const Unit& u);
void run_unit_avx2(const Problem& p, const Unit& u);
void run_unit_avx512(const Problem& p, const Unit& u);

}  // namespace cpukernels
