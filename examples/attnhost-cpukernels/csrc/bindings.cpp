// The Python face of the kernel. Once per batch, a plan checks the batch's metadata and copies out every
// req_to_token entry the batch will read; per layer, attend() checks the layer's tensors against that plan in a
// few comparisons, splits the batch into units of work, runs them on torch's intra-op threads (at::parallel_for,
// so torch.set_num_threads governs it) and merges split contexts. Whatever the arguments, the kernel reads and
// writes only inside the tensors it was given: a mismatch is refused with one sentence, never read past.
//
// Two faces of the same code: pybind functions (plan() returns an opaque Plan, attend() takes it), and torch
// custom operators (attnhost_cpukernels::plan_into / attend, registered below) whose plan lives in tensors the
// caller allocates once, so torch.compile traces a layer's call as one operator and a captured step reads the
// same plan storage at every replay. plan_into reads the batch's lengths and request rows from their tensors, not
// from host lists: the lengths a graph step has on the host are only bounds.
#include <torch/extension.h>
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
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

// A cache may also be FP8, read as stored.to(float32) * scale (docs/kv-cache.md).
DType cache_dtype_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat8_e4m3fn: return DType::kFp8E4M3;
    case at::kFloat8_e5m2: return DType::kFp8E5M2;
    case at::kFloat: case at::kBFloat16: case at::kHalf: return dtype_of(t, "the KV cache");
    default: TORCH_CHECK(false, "attnhost-cpukernels: the KV cache must be float32, bfloat16, float16, "
                         "float8_e4m3fn or float8_e5m2, got ", t.scalar_type());
  }
}

constexpr int64_t kMinChunk = 256;  // the fewest keys worth a split of one request's context

// One request's entries copied in one pass that also finds the smallest and the largest (and where that is).
template <typename T>
void copy_entries(const T* from, int64_t stride, int64_t count, int64_t* to, int64_t* lo, int64_t* hi,
                  int64_t* hi_pos) {
  int64_t low = *lo, high = *hi, where = -1;
  for (int64_t j = 0; j < count; ++j) {
    const int64_t slot = static_cast<int64_t>(from[j * stride]);
    to[j] = slot;
    low = std::min(low, slot);
    if (slot > high) high = slot, where = j;
  }
  *lo = low, *hi = high, *hi_pos = where;
}

// The facts about a planned batch that attend() checks a layer against, kept beside its slots and mask.
struct PlanHeader {
  int64_t batch = 0, tokens = 0;
  int64_t page_size = 1;  // > 1: the slots are each request's pages, not its token slots
  int64_t max_slot = -1;  // the largest slot the batch reads: every K/V buffer must hold more slots than this
  int64_t max_request = -1, max_row = -1, max_pos = -1;  // where it is named, for the refusal
  int64_t has_mask = 0;
};
constexpr int64_t kHeaderFields = 8;  // a plan tensor's header: the fields above, in that order

// One batch's metadata, checked: the kernel's only source of slots and mask. It owns copies, not views, so
// nothing written into req_to_token or the mask after planning (a stale table, a resized tensor) can steer a
// read; Python can obtain one only from plan(), never build or change one.
struct Plan {
  std::vector<int64_t> meta;  // kMetaFields per request (kernel.h); field 0 indexes slots
  std::vector<int64_t> slots;  // request r's entries at [r * width, r * width + its count)
  std::vector<uint8_t> mask;  // the tree mask's blocks, 0 or 1
  PlanHeader h;
};

// What attend() reads of a plan, wherever it is stored (a Plan's vectors, or a plan's tensors).
struct PlanView {
  const int64_t* slots;
  const int64_t* meta;
  const uint8_t* mask;  // nullptr: no tree mask
  PlanHeader h;
};

// Where a plan is written: capacities checked before anything is copied. With `packed` (a Plan's vectors), the
// requests' entries follow each other and the vectors are sized once the batch is checked; else request r's
// entries start at r * width of a buffer of fixed size (a plan's tensors).
struct PlanOut {
  int64_t* slots;
  int64_t width;  // entries per request the slots hold (fixed layout)
  int64_t* meta;
  uint8_t* mask;
  int64_t mask_cells;
  PlanHeader* h;
  Plan* packed = nullptr;
};

int64_t read_index(const torch::Tensor& t, int64_t i) {
  const int64_t at = i * t.stride(0);
  return t.scalar_type() == at::kLong ? t.data_ptr<int64_t>()[at] : static_cast<int64_t>(t.data_ptr<int32_t>()[at]);
}

void check_index_tensor(const torch::Tensor& t, int64_t size, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), "attnhost-cpukernels runs on the CPU only; pick another backend for other devices");
  TORCH_CHECK(t.dim() == 1 && t.size(0) >= size && (t.scalar_type() == at::kInt || t.scalar_type() == at::kLong),
              "attnhost-cpukernels: ", what, " must be a 1-D int32 or int64 tensor of at least ", size,
              " entries, got ", t.scalar_type(), " ", t.sizes());
}

// The batch as the kernel will run it: table rows, lengths and tree mask checked against each other and the
// table; every entry it reads copied and checked to be a slot (>= 0), the largest recorded for attend().
// With page_size > 1 each request's entries are its pages: one per page_size tokens, each checked to be a page
// (>= 0), the largest page's last slot recorded. `column_step` is how far apart a request's entries lie in its
// table row (1 in a page_table; page_size in a token-level req_to_token, whose every page_size-th entry is a page's
// first slot, which must then be page-aligned). row_at(r) and prefix_at(r) give request r's table row and prefix.
template <typename RowAt, typename PrefixAt>
void plan_batch(const torch::Tensor& table, int64_t batch, RowAt row_at, PrefixAt prefix_at,
                const std::vector<int64_t>& extend, const c10::optional<torch::Tensor>& tree_mask, int64_t page_size,
                int64_t column_step, const char* table_name, PlanOut out) {
  TORCH_CHECK(page_size >= 1, "attnhost-cpukernels: page_size must be >= 1, got ", page_size);
  const bool paged = page_size > 1;
  TORCH_CHECK(table.device().is_cpu() && (!tree_mask.has_value() || tree_mask->device().is_cpu()),
              "attnhost-cpukernels runs on the CPU only; pick another backend for other devices");
  TORCH_CHECK(table.dim() == 2 && (table.scalar_type() == at::kInt || table.scalar_type() == at::kLong),
              "attnhost-cpukernels: ", table_name, " must be a 2-D int32 or int64 tensor, got ", table.scalar_type(),
              " ", table.sizes());
  TORCH_CHECK(static_cast<int64_t>(extend.size()) == batch, "attnhost-cpukernels: the batch has ", batch,
              " requests but ", extend.size(), " extend lengths; pass one per request");
  PlanHeader& h = *out.h;
  h = PlanHeader{};
  h.batch = batch;
  h.page_size = page_size;
  const int64_t table_rows = table.size(0), columns = table.size(1);
  int64_t cells = 0, tokens = 0, entries = 0;
  auto entries_of = [&](int64_t seq) { return paged ? seq / page_size + (seq % page_size != 0) : seq; };
  for (int64_t r = 0; r < batch; ++r) {
    const int64_t row = row_at(r), pre = prefix_at(r), ext = extend[r];
    TORCH_CHECK(row >= 0 && row < table_rows, "attnhost-cpukernels: request ", r, " of the batch names ", table_name,
                " row ", row, ", outside the table's ", table_rows, " rows");
    TORCH_CHECK(pre >= 0 && ext >= 1, "attnhost-cpukernels: request ", r, " of the batch has prefix_len ", pre,
                " and extend_len ", ext, "; they must be >= 0 and >= 1");
    TORCH_CHECK(pre <= INT64_MAX - ext && (out.packed || entries_of(pre + ext) <= out.width) &&
                    (entries_of(pre + ext) - 1) * column_step < columns,
                "attnhost-cpukernels: request ", r, " of the batch reads ", pre, " + ", ext, " positions ",
                paged ? "(in pages of " + std::to_string(page_size) + " tokens) " : std::string(), "of ", table_name,
                " row ", row, ", which has ", columns, " columns",
                !out.packed && out.width * column_step < columns
                    ? " (the plan holds " + std::to_string(out.width) + (paged ? " pages" : " entries") + " a request)"
                    : std::string());
    if (out.packed) out.packed->meta.resize(static_cast<size_t>(r + 1) * kMetaFields), out.meta = out.packed->meta.data();
    int64_t* m = out.meta + r * kMetaFields;
    m[0] = out.packed ? entries : r * out.width, m[1] = pre, m[2] = ext, m[3] = tokens, m[4] = cells;
    int64_t square = 0;  // a table may be a view as wide as int64 allows (an expanded one owns no memory)
    TORCH_CHECK(!__builtin_add_overflow(entries, entries_of(pre + ext), &entries) &&
                    !__builtin_add_overflow(tokens, ext, &tokens) && !__builtin_mul_overflow(ext, ext, &square) &&
                    !__builtin_add_overflow(cells, square, &cells),
                "attnhost-cpukernels: the batch's lengths overflow int64 at request ", r);
  }
  h.tokens = tokens;
  if (out.packed) {  // checked: now the copies' room
    out.packed->slots.resize(static_cast<size_t>(entries));
    out.slots = out.packed->slots.data();
  }
  const bool int32 = table.scalar_type() == at::kInt;
  const int64_t step = table.stride(1) * column_step;
  for (int64_t r = 0; r < batch; ++r) {
    const int64_t* m = out.meta + r * kMetaFields;
    const int64_t row = row_at(r), count = entries_of(m[1] + m[2]);
    int64_t lo = 0, hi = -1, hi_pos = -1;
    int64_t* to = out.slots + m[0];
    if (int32)
      copy_entries(table.data_ptr<int32_t>() + row * table.stride(0), step, count, to, &lo, &hi, &hi_pos);
    else
      copy_entries(table.data_ptr<int64_t>() + row * table.stride(0), step, count, to, &lo, &hi, &hi_pos);
    if (lo < 0) {
      const int64_t j = std::find_if(to, to + count, [](int64_t s) { return s < 0; }) - to;
      TORCH_CHECK(false, "attnhost-cpukernels: ", table_name, "[", row, ", ", j * column_step, "] = ", to[j],
                  " (request ", r, " of the batch, which reads its first ", count, " entries) is not a ",
                  column_step > 1 ? "slot" : paged ? "page" : "slot", "; the table must name a ",
                  paged ? "page" : "slot", " of the KV cache for every token the batch reads");
    }
    if (column_step > 1) {  // a token-level table read by pages: each page's first slot, page-aligned, as a page
      const int64_t seq = m[1] + m[2];
      for (int64_t j = 0; j < count; ++j) {
        TORCH_CHECK(to[j] % page_size == 0, "attnhost-cpukernels: ", table_name, "[", row, ", ", j * column_step,
                    "] = ", to[j], " (request ", r, " of the batch) is not the first slot of a page of ", page_size,
                    " tokens; a paged cache's table must hold whole pages, page-aligned");
        // the kernel reads the page's slots in a run: the table's other entries of the page must be that run
        for (int64_t o = 1; o < page_size && j * page_size + o < seq; ++o) {
          const int64_t at = (j * page_size + o) * table.stride(1);
          const int64_t slot = int32 ? static_cast<int64_t>(table.data_ptr<int32_t>()[row * table.stride(0) + at])
                                     : table.data_ptr<int64_t>()[row * table.stride(0) + at];
          TORCH_CHECK(slot == to[j] + o, "attnhost-cpukernels: ", table_name, "[", row, ", ", j * page_size + o,
                      "] = ", slot, " (request ", r, " of the batch) is not slot ", to[j] + o, " of the page that "
                      "starts at slot ", to[j], "; a paged cache's table must hold whole pages, in order");
        }
        to[j] /= page_size;
      }
      hi /= page_size;
    }
    if (hi > h.max_slot) h.max_slot = hi, h.max_request = r, h.max_row = row, h.max_pos = hi_pos;
  }
  if (paged && h.max_slot >= 0) {  // a page's slots all: the buffers must hold the largest page whole
    TORCH_CHECK(h.max_slot <= (INT64_MAX - page_size + 1) / page_size, "attnhost-cpukernels: ", table_name, "[",
                h.max_row, ", ", h.max_pos, "] = ", h.max_slot, " is not a page of any KV cache");
    h.max_slot = h.max_slot * page_size + page_size - 1;
  }
  if (tree_mask.has_value()) {
    const torch::Tensor& mask = *tree_mask;
    TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 1 && mask.size(0) == cells,
                "attnhost-cpukernels: the tree mask must be a 1-D bool tensor of ", cells,
                " entries (one extend_len x extend_len block per request), got ", mask.scalar_type(), " ",
                mask.sizes());
    if (out.packed) out.packed->mask.resize(static_cast<size_t>(cells)), out.mask = out.packed->mask.data();
    TORCH_CHECK(out.packed || cells <= out.mask_cells, "attnhost-cpukernels: the plan holds ", out.mask_cells,
                " tree-mask entries, the batch has ", cells);
    const torch::Tensor dense = mask.contiguous();
    const uint8_t* bytes = static_cast<const uint8_t*>(dense.data_ptr());
    for (int64_t i = 0; i < cells; ++i) out.mask[i] = bytes[i] != 0;
    h.has_mask = 1;
  }
}

// plan(): the pybind face, for host lists of rows and prefix lengths; the Plan owns its copies.
std::shared_ptr<Plan> plan(const torch::Tensor& table, const std::vector<int64_t>& rows,
                           const std::vector<int64_t>& prefix, const std::vector<int64_t>& extend,
                           const c10::optional<torch::Tensor>& tree_mask, int64_t page_size) {
  const int64_t batch = static_cast<int64_t>(rows.size());
  TORCH_CHECK(static_cast<int64_t>(prefix.size()) == batch && static_cast<int64_t>(extend.size()) == batch,
              "attnhost-cpukernels: the batch has ", batch, " table rows but ", prefix.size(), " prefix lengths and ",
              extend.size(), " extend lengths; pass one of each per request");
  TORCH_CHECK(page_size >= 1, "attnhost-cpukernels: page_size must be >= 1, got ", page_size);
  auto p = std::make_shared<Plan>();
  plan_batch(table, batch, [&](int64_t r) { return rows[r]; }, [&](int64_t r) { return prefix[r]; }, extend,
             tree_mask, page_size, 1, page_size > 1 ? "page_table" : "req_to_token",
             PlanOut{nullptr, 0, nullptr, nullptr, 0, &p->h, p.get()});
  return p;
}

// attnhost_cpukernels::plan_into: the custom operator's plan, into tensors the caller allocated once (their
// storage kept across batches). Rows and prefixes come from tensors (a graph step's exact lengths are there, its
// host ones only bounds): prefix = seq_lens[r] - extend[r]. The table is always req_to_token; with pages, every
// page_size-th entry is read as a page's first slot.
void plan_into(const torch::Tensor& req_to_token, const torch::Tensor& rows, const torch::Tensor& seq_lens,
               c10::IntArrayRef extend_lens, const c10::optional<torch::Tensor>& tree_mask, int64_t page_size,
               torch::Tensor slots, torch::Tensor meta, torch::Tensor mask, torch::Tensor header) {
  const int64_t batch = static_cast<int64_t>(extend_lens.size());
  check_index_tensor(rows, batch, "req_pool_indices");
  check_index_tensor(seq_lens, batch, "seq_lens");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 2 && slots.size(0) >= batch && slots.is_contiguous() &&
                  meta.scalar_type() == at::kLong && meta.is_contiguous() && meta.numel() >= batch * kMetaFields &&
                  mask.scalar_type() == at::kByte && mask.is_contiguous() && header.scalar_type() == at::kLong &&
                  header.is_contiguous() && header.numel() == kHeaderFields,
              "attnhost-cpukernels: plan_into needs contiguous int64 slots [batch, width], meta [batch, ",
              kMetaFields, "], uint8 mask and int64 header [", kHeaderFields, "] tensors");
  const std::vector<int64_t> extend(extend_lens.begin(), extend_lens.end());
  PlanHeader h;
  plan_batch(req_to_token, batch, [&](int64_t r) { return read_index(rows, r); },
             [&](int64_t r) { return read_index(seq_lens, r) - extend[r]; }, extend, tree_mask, page_size,
             page_size, "req_to_token",
             PlanOut{slots.data_ptr<int64_t>(), slots.size(1), meta.data_ptr<int64_t>(), mask.data_ptr<uint8_t>(),
                     mask.numel(), &h});
  int64_t* out = header.data_ptr<int64_t>();
  const int64_t fields[kHeaderFields] = {h.batch, h.tokens, h.page_size, h.max_slot, h.max_request, h.max_row,
                                         h.max_pos, h.has_mask};
  std::copy(fields, fields + kHeaderFields, out);
}

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
// plan: the batch's, from plan(). With new_k, new_v and loc, the new tokens' K/V are first written at slots loc
// (see write_new_kv). Every check here is O(1) (no scan of the batch): the plan did those once per batch.
torch::Tensor attend_view(const torch::Tensor& q_in, const torch::Tensor& k, const torch::Tensor& v,
                          const PlanView& view, int64_t heads, int64_t kv_heads, int64_t dim, double scale,
                     const c10::optional<torch::Tensor>& new_k, const c10::optional<torch::Tensor>& new_v,
                     const c10::optional<torch::Tensor>& loc, double k_scale, double v_scale) {
  const PlanHeader& plan = view.h;
  TORCH_CHECK(new_k.has_value() == new_v.has_value() && new_k.has_value() == loc.has_value(),
              "attnhost-cpukernels: pass new_k, new_v and loc together, or none of them");
  const bool new_on_cpu = !new_k.has_value() || (new_k->is_cpu() && new_v->is_cpu() && loc->is_cpu());
  TORCH_CHECK(q_in.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && new_on_cpu,
              "attnhost-cpukernels runs on the CPU only; pick another backend for other devices");
  TORCH_CHECK(heads >= 1 && kv_heads >= 1 && dim >= 1 && heads <= INT_MAX && dim <= INT_MAX && heads % kv_heads == 0,
              "attnhost-cpukernels: the layer's num_heads=", heads, ", num_kv_heads=", kv_heads, ", head_dim=", dim,
              " are not a layer: all must be positive and num_heads a multiple of num_kv_heads");
  const bool flat = q_in.dim() == 2;
  TORCH_CHECK((flat || q_in.dim() == 3) && q_in.size(0) == plan.tokens &&
                  (flat ? q_in.size(1) == heads * dim : q_in.size(1) == heads && q_in.size(2) == dim),
              "attnhost-cpukernels: q must be [", plan.tokens, ", ", heads, ", ", dim, "] (or flat [", plan.tokens,
              ", ", heads * dim, "]) for this batch's ", plan.tokens, " new tokens and the layer's ", heads,
              " heads of ", dim, ", got ", q_in.sizes());
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.size(1) == kv_heads && k.size(2) == dim && v.size(1) == kv_heads &&
                  v.size(2) == dim,
              "attnhost-cpukernels: the K/V buffers must be [slots, ", kv_heads, ", ", dim, "], got ", k.sizes(),
              " and ", v.sizes());
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "attnhost-cpukernels: the K/V buffers' head_dim must be dense");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "attnhost-cpukernels: K and V buffers differ in dtype");
  const int64_t slots = std::min(k.size(0), v.size(0));
  if (plan.page_size == 1) {
    TORCH_CHECK(plan.max_slot < slots, "attnhost-cpukernels: req_to_token[", plan.max_row, ", ", plan.max_pos,
                "] = ", plan.max_slot, " (request ", plan.max_request, " of the batch) is not a slot of this layer's "
                "K/V buffers (", slots, " slots); the table must name a slot of the KV cache for every token the "
                "batch reads");
  } else {
    TORCH_CHECK(plan.max_slot < slots, "attnhost-cpukernels: page_table[", plan.max_request, ", ", plan.max_pos,
                "] = ", plan.max_slot / plan.page_size, " (request ", plan.max_request, " of the batch, pages of ",
                plan.page_size, " tokens) is not a page of this layer's K/V buffers (", slots, " slots); the table "
                "must name a page of the KV cache for every token the batch reads");
  }
  const DType q_dtype = dtype_of(q_in, "q"), kv_dtype = cache_dtype_of(k);
  const bool fp8 = kv_dtype == DType::kFp8E4M3 || kv_dtype == DType::kFp8E5M2;
  TORCH_CHECK(!fp8 || (std::isfinite(k_scale) && std::isfinite(v_scale) && k_scale > 0 && v_scale > 0),
              "attnhost-cpukernels: an FP8 cache's k_scale and v_scale must be positive and finite, got ", k_scale,
              " and ", v_scale, "; set the layer's scales");
  torch::Tensor q = q_in.stride(-1) == 1 ? q_in : q_in.contiguous();
  if (new_k.has_value()) write_new_kv(k, v, *new_k, *new_v, *loc);
  auto out = torch::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t batch = plan.batch;
  if (batch == 0) return out;

  Problem p{};
  p.q = q.data_ptr();
  p.q_tok = q.stride(0);
  p.q_head = flat ? dim : q.stride(1);
  p.out = out.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.k_slot = k.stride(0);
  p.k_head = k.stride(1);
  p.v_slot = v.stride(0);
  p.v_head = v.stride(1);
  p.slots = view.slots;
  p.meta = view.meta;
  p.tree_mask = plan.has_mask ? view.mask : nullptr;
  p.q_dtype = q_dtype;
  p.kv_dtype = kv_dtype;
  p.heads = static_cast<int>(heads);
  p.kv_heads = static_cast<int>(kv_heads);
  p.dim = static_cast<int>(dim);
  p.scale = static_cast<float>(scale);
  p.k_scale = fp8 ? static_cast<float>(k_scale) : 1.f;  // a float cache ignores the scales
  p.v_scale = fp8 ? static_cast<float>(v_scale) : 1.f;
  p.page_size = plan.page_size;

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
  // New tokens per extend unit: about 128 query rows, which share each K/V row read and each block's transposed
  // keys; fewer (down to 32) while that leaves under four units per thread.
  auto extend_units = [&](int64_t rows) {
    int64_t count = 0;
    for (int64_t r = 0; r < batch; ++r) {
      const int64_t extend = m[r * kMetaFields + 2], tokens = std::max<int64_t>(1, rows / group);
      if (extend > 1) count += kv_heads * ((extend + tokens - 1) / tokens);
    }
    return count;
  };
  int64_t tile_rows = 128;
  while (tile_rows > 32 && extend_units(tile_rows) < 4 * threads) tile_rows /= 2;
  const int64_t tile = std::max<int64_t>(1, tile_rows / group);
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
    std::optional<pybind11::gil_scoped_release> no_gil;  // called through pybind (GIL held) or the dispatcher
    if (PyGILState_Check()) no_gil.emplace();
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
        const float inv = std::isnan(total) ? total : total > 0.f ? 1.f / total : 0.f;  // NaN stays NaN
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

// attend() of a Plan (the pybind face).
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const Plan& plan,
                     int64_t heads, int64_t kv_heads, int64_t dim, double scale,
                     const c10::optional<torch::Tensor>& new_k, const c10::optional<torch::Tensor>& new_v,
                     const c10::optional<torch::Tensor>& loc, double k_scale, double v_scale) {
  const PlanView view{plan.slots.data(), plan.meta.data(), plan.mask.data(), plan.h};
  return attend_view(q, k, v, view, heads, kv_heads, dim, scale, new_k, new_v, loc, k_scale, v_scale);
}

// attnhost_cpukernels::attend: attend() of a plan in tensors (plan_into's), the custom operator torch.compile
// traces as one call. Its header is read here, in the kernel, never by the caller.
torch::Tensor attend_op(const torch::Tensor& q, torch::Tensor k_buffer, torch::Tensor v_buffer,
                        const torch::Tensor& slots, const torch::Tensor& meta, const torch::Tensor& mask,
                        const torch::Tensor& header, int64_t heads, int64_t kv_heads, int64_t dim, double scale,
                        const c10::optional<torch::Tensor>& new_k, const c10::optional<torch::Tensor>& new_v,
                        const c10::optional<torch::Tensor>& loc, double k_scale, double v_scale) {
  TORCH_CHECK(header.device().is_cpu() && header.scalar_type() == at::kLong && header.is_contiguous() &&
                  header.numel() == kHeaderFields && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  meta.scalar_type() == at::kLong && meta.is_contiguous() && mask.scalar_type() == at::kByte &&
                  mask.is_contiguous(),
              "attnhost-cpukernels: attend takes a plan from plan_into (int64 slots, meta and header, uint8 mask)");
  const int64_t* f = header.data_ptr<int64_t>();
  const PlanHeader h{f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7]};
  TORCH_CHECK(h.batch >= 0 && meta.numel() >= h.batch * kMetaFields && (!h.has_mask || mask.numel() > 0),
              "attnhost-cpukernels: the plan's tensors do not hold the batch its header describes; plan the batch "
              "with plan_into first");
  const PlanView view{slots.data_ptr<int64_t>(), meta.data_ptr<int64_t>(), mask.data_ptr<uint8_t>(), h};
  return attend_view(q, k_buffer, v_buffer, view, heads, kv_heads, dim, scale, new_k, new_v, loc, k_scale, v_scale);
}

}  // namespace cpukernels

TORCH_LIBRARY(attnhost_cpukernels, m) {
  m.def("plan_into(Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, int[] extend_lens, "
        "Tensor? tree_mask, int page_size, Tensor(a!) slots, Tensor(b!) meta, Tensor(c!) mask, Tensor(d!) header) -> ()");
  m.def("attend(Tensor q, Tensor(a!) k_buffer, Tensor(b!) v_buffer, Tensor slots, Tensor meta, Tensor mask, "
        "Tensor header, int num_heads, int num_kv_heads, int head_dim, float scaling, Tensor? new_k, Tensor? new_v, "
        "Tensor? loc, float k_scale, float v_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnhost_cpukernels, CPU, m) {
  m.impl("plan_into", &cpukernels::plan_into);
  m.impl("attend", &cpukernels::attend_op);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "attnhost-cpukernels: paged attention over a token-slot KV cache, read in place";
  pybind11::class_<cpukernels::Plan, std::shared_ptr<cpukernels::Plan>>(
      m, "Plan", "one batch's checked metadata, from plan(); attend() runs a layer of that batch")
      .def_property_readonly("batch_size", [](const cpukernels::Plan& p) { return p.h.batch; })
      .def_property_readonly("num_tokens", [](const cpukernels::Plan& p) { return p.h.tokens; })
      .def_property_readonly("max_slot", [](const cpukernels::Plan& p) { return p.h.max_slot; })
      .def("__repr__", [](const cpukernels::Plan& p) {
        return "<_attnhost_cpukernels.Plan: " + std::to_string(p.h.batch) + " requests, " +
               std::to_string(p.h.tokens) + " new tokens, slots up to " + std::to_string(p.h.max_slot) +
               (p.h.has_mask ? ", tree mask>" : ">");
      });
  m.def("plan", &cpukernels::plan, "check a batch's metadata once and copy the slots it reads",
        pybind11::arg("req_to_token"), pybind11::arg("req_pool_indices"), pybind11::arg("prefix_lens"),
        pybind11::arg("extend_lens"), pybind11::arg("tree_mask") = pybind11::none(), pybind11::arg("page_size") = 1);
  m.def("attend", &cpukernels::attend, "attention of a batch's new tokens over the cache", pybind11::arg("q"),
        pybind11::arg("k_buffer"), pybind11::arg("v_buffer"), pybind11::arg("plan"), pybind11::arg("num_heads"),
        pybind11::arg("num_kv_heads"),
        pybind11::arg("head_dim"), pybind11::arg("scaling"), pybind11::arg("new_k") = pybind11::none(),
        pybind11::arg("new_v") = pybind11::none(), pybind11::arg("loc") = pybind11::none(),
        pybind11::arg("k_scale") = 1.0, pybind11::arg("v_scale") = 1.0);
  m.attr("header_fields") = cpukernels::kHeaderFields;
  m.attr("meta_fields") = cpukernels::kMetaFields;
  m.attr("isa") = cpukernels::kIsa.name;
  m.attr("torch_version") = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
                            std::to_string(TORCH_VERSION_PATCH);
}
