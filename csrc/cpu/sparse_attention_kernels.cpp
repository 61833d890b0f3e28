// CPU kernels of the sparse MLA attention family: kvoffload::sparse_mla_attention and
// kvoffload::scatter_copy_sparse_mla_attention (Copy-SFA).
//
// The attention core (fp32 rows in cache-sized chunks, register-tiled products, online softmax; see
// sparse_attention_common.h) runs over rows of kv_c / k_pe in the query dtype, each selected row converted
// to fp32 once per work item.

#include "common.h"
#include "cpu/sparse_attention_common.h"
#include "cpu/vec.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <unordered_set>
#include <vector>

namespace kvoffload {

namespace {

using namespace attention;  // the attention core and the argument checks shared with fp8_attention_kernels.cpp

// Where one query token's rows live: row i of the selection is kv_c[idx[i]] / k_pe[idx[i]] with the
// given row strides (elements); the last dim of both is contiguous.
template <typename T>
struct RowSource {
  const T* kv_c;
  int64_t kv_c_stride;
  const T* k_pe;
  int64_t k_pe_stride;
  const int32_t* idx;  // K entries, -1 = skip
  int64_t K;

  // The row converted to fp32: dst[0 .. Dc) latent, dst[Dc .. Dc + Dr) RoPE.
  inline __attribute__((always_inline)) void load(int64_t r, float* dst, int64_t Dc, int64_t Dr) const {
    to_float(kv_c + r * kv_c_stride, dst, Dc);
    to_float(k_pe + r * k_pe_stride, dst + Dc, Dr);
  }
};

// ------------------------------------------------------------------------------------------ checks

void check_rows(
    const char* op, const at::Tensor& q_nope, const at::Tensor& q_pe, const char* kv_name,
    const at::Tensor& kv, const char* pe_name, const at::Tensor& pe, int64_t dims) {
  check_dim(op, kv_name, kv, dims + 1);
  check_dim(op, pe_name, pe, dims + 1);
  check_same_dtype(op, "q_nope", q_nope, kv_name, kv);
  check_same_dtype(op, "q_nope", q_nope, pe_name, pe);
  TORCH_CHECK_VALUE(
      kv.size(-1) == q_nope.size(-1), "kvoffload::", op, ": argument '", kv_name, "' must have last dim ",
      q_nope.size(-1), " (Dc of 'q_nope'), got shape ", shape_str(kv));
  TORCH_CHECK_VALUE(
      pe.size(-1) == q_pe.size(-1), "kvoffload::", op, ": argument '", pe_name, "' must have last dim ",
      q_pe.size(-1), " (Dr of 'q_pe'), got shape ", shape_str(pe));
  TORCH_CHECK_VALUE(
      kv.sizes().slice(0, dims) == pe.sizes().slice(0, dims), "kvoffload::", op, ": '", kv_name, "' and '",
      pe_name, "' must have the same leading shape, got ", shape_str(kv), " and ", shape_str(pe));
}

// ------------------------------------------------------------------------------- sparse_mla_attention

std::tuple<at::Tensor, at::Tensor> sparse_mla_attention_cpu(
    const at::Tensor& q_nope_in, const at::Tensor& q_pe_in, const at::Tensor& kv_c_in,
    const at::Tensor& k_pe_in, const at::Tensor& indices, double scale) {
  constexpr const char* op = "sparse_mla_attention";
  check_queries(op, q_nope_in, q_pe_in);
  check_rows(op, q_nope_in, q_pe_in, "kv_c", kv_c_in, "k_pe", k_pe_in, 1);
  check_int32(op, "indices", indices, 2);
  TORCH_CHECK_VALUE(
      indices.size(0) == q_nope_in.size(0), "kvoffload::", op, ": argument 'indices' must have ",
      q_nope_in.size(0), " rows (T of 'q_nope'), got shape ", shape_str(indices));
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"q_nope", &q_nope_in}, {"q_pe", &q_pe_in},
                         {"kv_c", &kv_c_in}, {"k_pe", &k_pe_in}, {"indices", &indices}}) {
    check_cpu(op, name, *t);
  }
  const at::Tensor idx = indices.contiguous();
  const int64_t T_ = idx.size(0), K = idx.size(1), N = kv_c_in.size(0);
  check_index_range(op, "indices", idx.const_data_ptr<int32_t>(), T_, K, N);

  const at::Tensor q_nope = q_nope_in.contiguous();
  const at::Tensor q_pe = q_pe_in.contiguous();
  const at::Tensor kv_c = rows_contiguous(kv_c_in);
  const at::Tensor k_pe = rows_contiguous(k_pe_in);
  at::Tensor out = at::empty(q_nope.sizes(), q_nope.options());
  at::Tensor lse = at::empty({q_nope.size(0), q_nope.size(1)}, q_nope.options().dtype(at::kFloat));

  GilRelease no_gil;
  const int32_t* ip = idx.const_data_ptr<int32_t>();
  KVO_DISPATCH_FLOAT_BF16(q_nope.scalar_type(), "sparse_mla_attention", [&] {
    const scalar_t* c = kv_c.const_data_ptr<scalar_t>();
    const scalar_t* p = k_pe.const_data_ptr<scalar_t>();
    const int64_t cs = kv_c.stride(0), ps = k_pe.stride(0);
    attend_all<scalar_t>(
        q_nope, q_pe, [&](int64_t t) { return RowSource<scalar_t>{c, cs, p, ps, ip + t * K, K}; },
        static_cast<float>(scale), out, lse);
  });
  return {out, lse};
}

// ---------------------------------------------------------------------- scatter_copy_sparse_mla_attention

void scatter_copy_sparse_mla_attention_cpu(
    const at::Tensor& q_nope_in, const at::Tensor& q_pe_in, const at::Tensor& host_kv_c_in,
    const at::Tensor& host_k_pe_in, const at::Tensor& block_table_in, const at::Tensor& hot_kv_c,
    const at::Tensor& hot_k_pe, const at::Tensor& miss_tokens_in, const at::Tensor& miss_slots_in,
    const at::Tensor& miss_count_in, const at::Tensor& slots_in, double scale, const at::Tensor& out,
    const at::Tensor& lse) {
  constexpr const char* op = "scatter_copy_sparse_mla_attention";
  check_queries(op, q_nope_in, q_pe_in);
  check_rows(op, q_nope_in, q_pe_in, "host_kv_c", host_kv_c_in, "host_k_pe", host_k_pe_in, 2);
  check_rows(op, q_nope_in, q_pe_in, "hot_kv_c", hot_kv_c, "hot_k_pe", hot_k_pe, 2);
  check_copy_sfa_lists(
      op, q_nope_in, "hot_kv_c", hot_kv_c, block_table_in, miss_tokens_in, miss_slots_in, miss_count_in, slots_in,
      out, lse);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"q_nope", &q_nope_in}, {"q_pe", &q_pe_in},
                         {"host_kv_c", &host_kv_c_in}, {"host_k_pe", &host_k_pe_in},
                         {"block_table", &block_table_in}, {"hot_kv_c", &hot_kv_c}, {"hot_k_pe", &hot_k_pe},
                         {"miss_tokens", &miss_tokens_in}, {"miss_slots", &miss_slots_in},
                         {"miss_count", &miss_count_in}, {"slots", &slots_in}, {"out", &out}, {"lse", &lse}}) {
    check_cpu(op, name, *t);
  }
  // Value checks, all before the first write.
  const CopySfaLists lists(
      op, block_table_in, miss_tokens_in, miss_slots_in, miss_count_in, slots_in, host_kv_c_in.size(0),
      host_kv_c_in.size(1), hot_kv_c.size(1));

  // The op reads its inputs as they were before the call, even where they share memory with an output.
  const at::Tensor host_kv_c = rows_contiguous(unaliased_source(host_kv_c_in, hot_kv_c));
  const at::Tensor host_k_pe = rows_contiguous(unaliased_source(host_k_pe_in, hot_k_pe));
  const at::Tensor q_nope = unaliased_source(unaliased_source(q_nope_in, out), lse).contiguous();
  const at::Tensor q_pe = unaliased_source(unaliased_source(q_pe_in, out), lse).contiguous();
  // Hot buffers whose rows are not contiguous are worked on in a contiguous copy, written back at the end.
  const at::Tensor hot_c = rows_contiguous(hot_kv_c);
  const at::Tensor hot_p = rows_contiguous(hot_k_pe);
  const bool direct = out.is_contiguous() && lse.is_contiguous();
  at::Tensor o = direct ? out : at::empty(out.sizes(), out.options());
  at::Tensor l = direct ? lse : at::empty(lse.sizes(), lse.options());

  GilRelease no_gil;
  const int64_t K = lists.K;
  const int32_t* sp = lists.sp;
  const int64_t Dc = hot_c.size(2), Dr = hot_p.size(2);
  const int64_t esz = hot_c.element_size();
  // Phase 1: host -> hot copies of the missed rows (parallel over decode rows: destinations are per row).
  lists.copy(
      static_cast<const char*>(host_kv_c.const_data_ptr()), host_kv_c.stride(0) * esz, host_kv_c.stride(1) * esz,
      static_cast<char*>(hot_c.data_ptr()), hot_c.stride(0) * esz, hot_c.stride(1) * esz, Dc * esz);
  lists.copy(
      static_cast<const char*>(host_k_pe.const_data_ptr()), host_k_pe.stride(0) * esz, host_k_pe.stride(1) * esz,
      static_cast<char*>(hot_p.data_ptr()), hot_p.stride(0) * esz, hot_p.stride(1) * esz, Dr * esz);
  // Phase 2: attention over hot[r, slots[r]].
  KVO_DISPATCH_FLOAT_BF16(q_nope.scalar_type(), "scatter_copy_sparse_mla_attention", [&] {
    const scalar_t* c = hot_c.const_data_ptr<scalar_t>();
    const scalar_t* p = hot_p.const_data_ptr<scalar_t>();
    const int64_t c0 = hot_c.stride(0), c1 = hot_c.stride(1);
    const int64_t p0 = hot_p.stride(0), p1 = hot_p.stride(1);
    attend_all<scalar_t>(
        q_nope, q_pe,
        [&](int64_t r) { return RowSource<scalar_t>{c + r * c0, c1, p + r * p0, p1, sp + r * K, K}; },
        static_cast<float>(scale), o, l);
  });
  if (!hot_c.is_same(hot_kv_c)) {
    hot_kv_c.copy_(hot_c);
  }
  if (!hot_p.is_same(hot_k_pe)) {
    hot_k_pe.copy_(hot_p);
  }
  if (!direct) {
    out.copy_(o);
    lse.copy_(l);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(kvoffload, CPU, m) {
  m.impl("sparse_mla_attention", &sparse_mla_attention_cpu);
  m.impl("scatter_copy_sparse_mla_attention", &scatter_copy_sparse_mla_attention_cpu);
}

}  // namespace kvoffload
