// The Python face of the kernel: checks the tensors once per call, splits the batch into units of work, runs them
// on torch's intra-op threads (at::parallel_for, so torch.set_num_threads governs it) and merges split contexts.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "kernel.h"

namespace cpukernels {
namespace {

using RunUnit = void (*)(const Problem&, const Unit&);

struct Isa {
  RunUnit run;
  const char* name;
};

Isa pick_isa() {
#if defined(__x86_64__) && defined(CPUK_X86)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq"))
    return {run_unit_avx512, "avx512"};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return {run_unit_avx2, "avx2"};
#endif
  return {run_unit_base, "baseline"};
}

const Isa kIsa = pick_isa();

DType dtype_of(const torch::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default: TORCH_CHECK(false, "attnhost-cpukernels: ", what, " must be float32, bfloat16 or float16, got ",
                         t.scalar_type());
  }
}

constexpr int64_t kMinChunk = 256;  // the fewest keys worth a split of one request's context

// The batch's new K/V rows written at their slots, in the cache's own dtype: the cache write fused into the
// attention call. As a separate torch op per buffer (index_copy_) it cost more than the attention of a short
// decode whenever the layer's code had gone cold, as a real layer's has after the MLP streamed its weights.
void write_new_kv(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& new_k,
                  const torch::Tensor& new_v, const torch::Tensor& loc) {
  TORCH_CHECK(new_k.scalar_type() == k.scalar_type() && new_v.scalar_type() == v.scalar_type(),
              "attnhost-cpukernels: the new K/V (", new_k.scalar_type(), ") must have the cache's dtype (",
              k.scalar_type(), "); convert them or write them with kv_pool.set_kv");
  TORCH_CHECK(new_k.dim() == 3 && new_k.sizes() == new_v.sizes() && new_k.size(1) == k.size(1) &&
                  new_k.size(2) == k.size(2) && new_k.stride(2) == 1 && new_v.stride(2) == 1,
              "attnhost-cpukernels: the new K/V must be [tokens, ", k.size(1), ", ", k.size(2),
              "] with a dense head_dim, got ", new_k.sizes(), " and ", new_v.sizes());
  TORCH_CHECK(loc.dim() == 1 && loc.size(0) == new_k.size(0) &&
                  (loc.scalar_type() == at::kLong || loc.scalar_type() == at::kInt),
              "attnhost-cpukernels: out_cache_loc must be [", new_k.size(0), "] int64 or int32, got ", loc.sizes(),
              " ", loc.scalar_type());
  const int64_t n = loc.size(0), slots = std::min(k.size(0), v.size(0)), heads = k.size(1);
  const int64_t es = k.element_size(), row = k.size(2) * es;
  std::vector<int64_t> at(n);
  for (int64_t i = 0; i < n; ++i) {  // any stride: a speculative batch's out_cache_loc is often a strided view
    const int64_t li = i * loc.stride(0);
    at[i] = loc.scalar_type() == at::kLong ? loc.data_ptr<int64_t>()[li] : loc.data_ptr<int32_t>()[li];
    TORCH_CHECK(at[i] >= 0 && at[i] < slots, "attnhost-cpukernels: out_cache_loc[", i, "] = ", at[i],
                " is not a slot of this cache (", slots, " slots)");
  }
  char* kd = static_cast<char*>(k.data_ptr());
  char* vd = static_cast<char*>(v.data_ptr());
  const char* ks = static_cast<const char*>(new_k.data_ptr());
  const char* vs = static_cast<const char*>(new_v.data_ptr());
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t kto = at[i] * k.stride(0) + h * k.stride(1), kfrom = i * new_k.stride(0) + h * new_k.stride(1);
      const int64_t vto = at[i] * v.stride(0) + h * v.stride(1), vfrom = i * new_v.stride(0) + h * new_v.stride(1);
      std::memcpy(kd + kto * es, ks + kfrom * es, row);
      std::memcpy(vd + vto * es, vs + vfrom * es, row);
    }
}

}  // namespace

// q: [T, heads, dim] or [T, heads * dim]; k_buffer/v_buffer: [slots, kv_heads, dim] (any strides, the last 1);
// table: req_to_token (int32 or int64, any strides); meta: [B, 5] int64 on the CPU (see kernel.h). With new_k,
// new_v and loc, the new tokens' K/V are first written at slots loc (see write_new_kv).
torch::Tensor attend(const torch::Tensor& q_in, const torch::Tensor& k, const torch::Tensor& v,
                     const torch::Tensor& table, const torch::Tensor& meta, const c10::optional<torch::Tensor>& mask,
                     int64_t heads, int64_t kv_heads, int64_t dim, double scale,
                     const c10::optional<torch::Tensor>& new_k, const c10::optional<torch::Tensor>& new_v,
                     const c10::optional<torch::Tensor>& loc) {
  TORCH_CHECK(new_k.has_value() == new_v.has_value() && new_k.has_value() == loc.has_value(),
              "attnhost-cpukernels: pass new_k, new_v and loc together, or none of them");
  const bool new_on_cpu = !new_k.has_value() || (new_k->is_cpu() && new_v->is_cpu() && loc->is_cpu());
  TORCH_CHECK(q_in.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && table.device().is_cpu() &&
                  new_on_cpu,
              "attnhost-cpukernels runs on the CPU only; pick another backend for other devices");
  torch::Tensor q = q_in.stride(-1) == 1 ? q_in : q_in.contiguous();
  const int64_t tokens = q.size(0);
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.size(1) == kv_heads && k.size(2) == dim && v.size(1) == kv_heads &&
                  v.size(2) == dim,
              "attnhost-cpukernels: the K/V buffers must be [slots, ", kv_heads, ", ", dim, "], got ", k.sizes(),
              " and ", v.sizes());
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "attnhost-cpukernels: the K/V buffers' head_dim must be dense");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "attnhost-cpukernels: K and V buffers differ in dtype");
  TORCH_CHECK(table.dim() == 2 && (table.scalar_type() == at::kInt || table.scalar_type() == at::kLong),
              "attnhost-cpukernels: req_to_token must be a 2-D int32 or int64 tensor");
  TORCH_CHECK(meta.is_contiguous() && meta.scalar_type() == at::kLong && meta.dim() == 2 && meta.size(1) == kMetaFields,
              "attnhost-cpukernels: bad batch metadata");
  if (new_k.has_value()) write_new_kv(k, v, *new_k, *new_v, *loc);
  auto out = torch::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t batch = meta.size(0);
  if (batch == 0 || tokens == 0) return out;

  Problem p{};
  p.q = q.data_ptr();
  p.q_tok = q.stride(0);
  p.q_head = q.dim() == 2 ? dim : q.stride(1);
  p.out = out.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.k_slot = k.stride(0);
  p.k_head = k.stride(1);
  p.v_slot = v.stride(0);
  p.v_head = v.stride(1);
  p.table = table.data_ptr();
  p.t_row = table.stride(0);
  p.t_col = table.stride(1);
  p.table_int32 = table.scalar_type() == at::kInt;
  p.meta = meta.data_ptr<int64_t>();
  p.tree_mask = nullptr;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->is_contiguous(), "attnhost-cpukernels: bad tree mask");
    p.tree_mask = mask->data_ptr<bool>();
  }
  p.q_dtype = dtype_of(q, "q");
  p.kv_dtype = dtype_of(k, "the KV cache");
  p.heads = static_cast<int>(heads);
  p.kv_heads = static_cast<int>(kv_heads);
  p.dim = static_cast<int>(dim);
  p.scale = static_cast<float>(scale);

  const int64_t threads = at::get_num_threads();
  const int64_t group = heads / kv_heads;
  const bool many = threads == 1 || batch >= 2 * threads;  // whole requests keep each slot's row in one thread
  std::vector<Unit> units;
  units.reserve(batch * kv_heads);
  struct Split {
    int64_t request, first, count;
  };
  std::vector<Split> splits;
  int64_t partials = 0;
  const int64_t* m = p.meta;
  for (int64_t r = 0; r < batch; ++r) {
    const int64_t prefix = m[r * kMetaFields + 1], extend = m[r * kMetaFields + 2], seq = prefix + extend;
    if (extend == 1) {  // one new token: every key visible; the work is reading the context
      const int64_t per = many ? kv_heads : 1;
      const int64_t pieces = batch * (kv_heads / per);
      int64_t chunks = 1;
      if (threads > 1 && pieces < 2 * threads)
        chunks = std::max<int64_t>(1, std::min((2 * threads + pieces - 1) / pieces, seq / kMinChunk));
      if (chunks > 1) {
        // A lone long request: its context split in chunks, all KV heads each, merged after
        splits.push_back({r, partials, chunks});
        const int64_t step = (seq + chunks - 1) / chunks;
        for (int64_t c = 0; c < chunks; ++c)
          units.push_back({r, 0, static_cast<int32_t>(kv_heads), 0, 1, c * step, std::min(seq, (c + 1) * step),
                           partials++});
        continue;
      }
      for (int64_t h = 0; h < kv_heads; h += per)
        units.push_back({r, static_cast<int32_t>(h), static_cast<int32_t>(h + per), 0, 1, 0, seq, -1});
      continue;
    }
    const int64_t tile = std::max<int64_t>(1, 32 / group);  // new tokens per unit: about 32 query rows
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t t = 0; t < extend; t += tile) {
        const int64_t t1 = std::min(extend, t + tile);
        units.push_back({r, static_cast<int32_t>(h), static_cast<int32_t>(h + 1), t, t1, 0,
                         p.tree_mask ? seq : prefix + t1, -1});
      }
  }
  std::vector<float> partial_state;
  if (partials) {
    partial_state.resize(static_cast<size_t>(partials) * heads * (dim + 2));
    p.partials = partial_state.data();
  }

  {
    pybind11::gil_scoped_release no_gil;
    const RunUnit run = kIsa.run;
    const int64_t n = static_cast<int64_t>(units.size());
    if (threads == 1 || n == 1) {
      for (const Unit& u : units) run(p, u);
    } else {
      // The biggest units first, taken one at a time by whichever thread is free: lengths differ per request.
      std::stable_sort(units.begin(), units.end(), [](const Unit& a, const Unit& b) {
        return (a.k1 - a.k0) * (a.q1 - a.q0) * (a.h1 - a.h0) > (b.k1 - b.k0) * (b.q1 - b.q0) * (b.h1 - b.h0);
      });
      std::atomic<int64_t> next{0};
      at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
        for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) run(p, units[i]);
      });
    }
    // Merge the pieces of split contexts: rescale each piece's sums to the common maximum.
    for (const Split& s : splits) {
      const int64_t q_first = m[s.request * kMetaFields + 3];
      for (int64_t h = 0; h < heads; ++h) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < s.count; ++c)
          mx = std::max(mx, partial_state[((s.first + c) * heads + h) * (dim + 2) + dim]);
        std::vector<float> acc(dim, 0.f);
        float total = 0.f;
        for (int64_t c = 0; c < s.count; ++c) {
          const float* st = partial_state.data() + ((s.first + c) * heads + h) * (dim + 2);
          if (st[dim + 1] == 0.f) continue;
          const float w = std::exp(st[dim] - mx);
          total += st[dim + 1] * w;
          for (int64_t d = 0; d < dim; ++d) acc[d] += st[d] * w;
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        const int64_t base = (q_first * heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d) {
          const float x = acc[d] * inv;
          switch (p.q_dtype) {
            case DType::kFloat32: static_cast<float*>(p.out)[base + d] = x; break;
            case DType::kBFloat16: static_cast<at::BFloat16*>(p.out)[base + d] = at::BFloat16(x); break;
            default: static_cast<at::Half*>(p.out)[base + d] = at::Half(x); break;
          }
        }
      }
    }
  }
  return out;
}

}  // namespace cpukernels

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "attnhost-cpukernels: paged attention over a token-slot KV cache, read in place";
  m.def("attend", &cpukernels::attend, "attention of a batch's new tokens over the cache", pybind11::arg("q"),
        pybind11::arg("k_buffer"), pybind11::arg("v_buffer"), pybind11::arg("req_to_token"), pybind11::arg("meta"),
        pybind11::arg("tree_mask"), pybind11::arg("num_heads"), pybind11::arg("num_kv_heads"),
        pybind11::arg("head_dim"), pybind11::arg("scaling"), pybind11::arg("new_k") = pybind11::none(),
        pybind11::arg("new_v") = pybind11::none(), pybind11::arg("loc") = pybind11::none());
  m.attr("isa") = cpukernels::kIsa.name;
  m.attr("torch_version") = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
                            std::to_string(TORCH_VERSION_PATCH);
}
