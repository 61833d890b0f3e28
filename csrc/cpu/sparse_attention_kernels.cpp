// CPU kernels of the sparse MLA attention family: kvoffload::sparse_mla_attention and
// kvoffload::scatter_copy_sparse_mla_attention (Copy-SFA).
//
// Per (query token, group of heads) work item: the selected latent rows are gathered and converted to
// fp32 in chunks that stay in cache; each chunk is used once for the scores of all heads of the group
// (register tiles of 4 heads x 2 rows, the row loads shared by the heads) and once for p . kv_c (tiles of
// 4 heads x 16 columns), with an online softmax (running maximum and sum, vectorised exp) in between. Everything
// accumulates in fp32. The hot loops are compiled twice (x86-64-v3 (AVX2, FMA) and baseline x86-64) and picked at
// load time.

#include "common.h"
#include "cpu/vec.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <unordered_set>
#include <vector>

namespace kvoffload {

namespace {

using namespace vec;  // the kernels are written in its vocabulary

// Rows converted to fp32 per chunk: 32 x 576 floats = 72 KiB stays in L2 between the two products.
constexpr int64_t kChunk = 32;

// exp(x) for x <= 0 (scores minus their maximum): range reduction x = n ln2 + r, |r| <= ln2/2, then a
// degree-6 Taylor polynomial (relative error < 2e-7). Inputs below -87 give ~1e-38 instead of a smaller
// number, which cannot move a softmax whose largest term is 1.
inline __attribute__((always_inline)) f8 exp8(f8 x) {
  const f8 lo = splat(-87.0f);
  x = x < lo ? lo : x;
  const f8 magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const f8 n = (x * splat(1.44269504088896341f) + magic) - magic;
  f8 r = x - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  f8 p = splat(1.0f / 720.0f);
  p = p * r + splat(1.0f / 120.0f);
  p = p * r + splat(1.0f / 24.0f);
  p = p * r + splat(1.0f / 6.0f);
  p = p * r + splat(0.5f);
  p = p * r + splat(1.0f);
  p = p * r + splat(1.0f);
  i8v e = __builtin_convertvector(n, i8v);
  e = (e + 127) << 23;
  f8 two_n;
  std::memcpy(&two_n, &e, sizeof(e));
  return p * two_n;
}

// acc[g][d0 .. d0+16) += sum_j p[g * ps + j] * v[j * vs + d0 ..] for GH heads.
template <int GH>
inline __attribute__((always_inline)) void pv_tile(
    const float* p, int64_t ps, const float* v, int64_t vs, int64_t n, float* acc, int64_t as) {
  f8 a[GH][2];
  for (int g = 0; g < GH; ++g) {
    a[g][0] = load8(acc + g * as);
    a[g][1] = load8(acc + g * as + 8);
  }
  for (int64_t j = 0; j < n; ++j) {
    const f8 v0 = load8(v + j * vs);
    const f8 v1 = load8(v + j * vs + 8);
    for (int g = 0; g < GH; ++g) {
      const f8 pb = splat(p[g * ps + j]);
      a[g][0] += pb * v0;
      a[g][1] += pb * v1;
    }
  }
  for (int g = 0; g < GH; ++g) {
    store8(acc + g * as, a[g][0]);
    store8(acc + g * as + 8, a[g][1]);
  }
}

// acc[g][0 .. Dc) += sum_j p[g * ps + j] * rows[j][0 .. Dc) (rows stride D).
inline __attribute__((always_inline)) void pv_block(
    const float* p, int64_t ps, int64_t G, const float* rows, int64_t n, int64_t D, int64_t Dc, float* acc) {
  const int64_t dv = Dc / 16 * 16;
  int64_t g = 0;
  for (; g + 4 <= G; g += 4) {
    for (int64_t d = 0; d < dv; d += 16) {
      pv_tile<4>(p + g * ps, ps, rows + d, D, n, acc + g * Dc + d, Dc);
    }
  }
  for (; g < G; ++g) {
    for (int64_t d = 0; d < dv; d += 16) {
      pv_tile<1>(p + g * ps, ps, rows + d, D, n, acc + g * Dc + d, Dc);
    }
  }
  for (int64_t h = 0; h < G; ++h) {
    for (int64_t j = 0; j < n; ++j) {
      const float w = p[h * ps + j];
      for (int64_t d = dv; d < Dc; ++d) {
        acc[h * Dc + d] += w * rows[j * D + d];
      }
    }
  }
}

// ------------------------------------------------------------------------------------- attention core

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
};

// Scratch reused across the work items one thread runs.
struct Scratch {
  std::vector<float> q, scores, chunk, acc;
  std::vector<int32_t> valid;
};

// Attention of heads [h0, h1) of one token. q_nope / q_pe point at the token's [H, Dc] / [H, Dr] rows
// (contiguous), out at its [H, Dc] output row (contiguous), lse at its [H] row.
template <typename T>
KVO_TARGET_CLONES void attend_heads(
    const T* q_nope, const T* q_pe, RowSource<T> src, int64_t Dc, int64_t Dr, int64_t h0, int64_t h1,
    float scale, T* out, float* lse, Scratch& sc) {
  const int64_t G = h1 - h0;
  const int64_t D = Dc + Dr;
  sc.valid.clear();
  for (int64_t i = 0; i < src.K; ++i) {
    if (src.idx[i] >= 0) {
      sc.valid.push_back(src.idx[i]);
    }
  }
  const int64_t n = static_cast<int64_t>(sc.valid.size());
  if (n == 0) {
    std::fill(out + h0 * Dc, out + h1 * Dc, T(0));
    std::fill(lse + h0, lse + h1, -std::numeric_limits<float>::infinity());
    return;
  }
  sc.q.resize(G * D);
  sc.chunk.resize(kChunk * D);
  sc.acc.assign(G * Dc, 0.0f);
  float* qf = sc.q.data();
  for (int64_t g = 0; g < G; ++g) {
    to_float(q_nope + (h0 + g) * Dc, qf + g * D, Dc);
    to_float(q_pe + (h0 + g) * Dr, qf + g * D + Dc, Dr);
  }
  sc.scores.resize(G * kChunk);
  float* s = sc.scores.data();
  float* chunk = sc.chunk.data();
  float* acc = sc.acc.data();
  const int32_t* rows = sc.valid.data();
  std::vector<float> mx(G, -std::numeric_limits<float>::infinity()), sum(G, 0.0f), inv_sum(G);
  // One pass, online softmax: each chunk of rows is converted once and used for both products.
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t m = std::min(kChunk, n - c0);
    for (int64_t j = 0; j < m; ++j) {
      const int64_t r = rows[c0 + j];
      to_float(src.kv_c + r * src.kv_c_stride, chunk + j * D, Dc);
      to_float(src.k_pe + r * src.k_pe_stride, chunk + j * D + Dc, Dr);
    }
    dot_block(qf, G, chunk, m, D, s, kChunk);
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s + g * kChunk;
      float cmax = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < m; ++j) {
        sg[j] *= scale;
        cmax = std::max(cmax, sg[j]);
      }
      if (cmax > mx[g]) {
        // Rescale what was accumulated under the old maximum (nothing on the first chunk).
        const float f = mx[g] == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(mx[g] - cmax);
        if (f != 1.0f) {
          float* ag = acc + g * Dc;
          for (int64_t d = 0; d < Dc; ++d) {
            ag[d] *= f;
          }
          sum[g] *= f;
        }
        mx[g] = cmax;
      }
      const f8 vmx = splat(mx[g]);
      f8 vsum = {};
      int64_t j = 0;
      for (; j + 8 <= m; j += 8) {
        const f8 e = exp8(load8(sg + j) - vmx);
        store8(sg + j, e);
        vsum += e;
      }
      float part = hsum(vsum);
      for (; j < m; ++j) {
        sg[j] = exp8(splat(sg[j] - mx[g]))[0];
        part += sg[j];
      }
      sum[g] += part;
    }
    pv_block(s, kChunk, G, chunk, m, D, Dc, acc);
  }
  for (int64_t g = 0; g < G; ++g) {
    lse[h0 + g] = mx[g] + std::log(sum[g]);
    inv_sum[g] = 1.0f / sum[g];
  }
  for (int64_t g = 0; g < G; ++g) {
    T* o = out + (h0 + g) * Dc;
    const float* a = acc + g * Dc;
    for (int64_t d = 0; d < Dc; ++d) {
      o[d] = static_cast<T>(a[d] * inv_sum[g]);
    }
  }
}

// Runs attend_heads over all (token, head group) items in parallel. source(t) gives token t's rows.
template <typename T, typename SourceFn>
void attend_all(
    const at::Tensor& q_nope, const at::Tensor& q_pe, SourceFn source, float scale, at::Tensor& out,
    at::Tensor& lse) {
  const int64_t T_ = q_nope.size(0), H = q_nope.size(1), Dc = q_nope.size(2), Dr = q_pe.size(2);
  if (T_ == 0 || H == 0) {
    return;
  }
  // Split heads when there are too few tokens to keep every thread busy; groups of 4 heads keep the
  // register tiles full.
  const int64_t threads = at::get_num_threads();
  int64_t group = H;
  if (T_ < 2 * threads) {
    const int64_t splits = std::min<int64_t>((2 * threads + T_ - 1) / T_, (H + 3) / 4);
    group = ((H + splits - 1) / splits + 3) / 4 * 4;
  }
  const int64_t groups = (H + group - 1) / group;
  const T* qn = q_nope.const_data_ptr<T>();
  const T* qp = q_pe.const_data_ptr<T>();
  T* o = out.data_ptr<T>();
  float* l = lse.data_ptr<float>();
  at::parallel_for(0, T_ * groups, 1, [&](int64_t begin, int64_t end) {
    Scratch sc;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / groups;
      const int64_t h0 = (item % groups) * group;
      const int64_t h1 = std::min(H, h0 + group);
      attend_heads<T>(
          qn + t * H * Dc, qp + t * H * Dr, source(t), Dc, Dr, h0, h1, scale, o + t * H * Dc, l + t * H,
          sc);
    }
  });
}

// ------------------------------------------------------------------------------------------ checks

std::string sizes_str(at::IntArrayRef s) {
  return c10::str(s);
}

void check_float(const char* op, const char* arg, const at::Tensor& t) {
  TORCH_CHECK_TYPE(
      t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "kvoffload::", op,
      ": argument '", arg, "' must have dtype torch.float32 or torch.bfloat16, got ",
      dtype_str(t.scalar_type()));
}

void check_dim(const char* op, const char* arg, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK_VALUE(
      t.dim() == dim, "kvoffload::", op, ": argument '", arg, "' must have exactly ", dim,
      " dimensions, got shape ", shape_str(t));
}

void check_same_dtype(const char* op, const char* a, const at::Tensor& ta, const char* b, const at::Tensor& tb) {
  TORCH_CHECK_TYPE(
      ta.scalar_type() == tb.scalar_type(), "kvoffload::", op, ": '", a, "' and '", b,
      "' must have the same dtype, got ", dtype_str(ta.scalar_type()), " and ", dtype_str(tb.scalar_type()));
}

void check_cpu(const char* op, const char* arg, const at::Tensor& t) {
  TORCH_CHECK_VALUE(
      t.device().is_cpu(), "kvoffload::", op, ": argument '", arg, "' must be on cpu (as 'q_nope'), got ",
      t.device());
}

void check_queries(const char* op, const at::Tensor& q_nope, const at::Tensor& q_pe) {
  check_float(op, "q_nope", q_nope);
  check_dim(op, "q_nope", q_nope, 3);
  check_dim(op, "q_pe", q_pe, 3);
  check_same_dtype(op, "q_nope", q_nope, "q_pe", q_pe);
  TORCH_CHECK_VALUE(
      q_pe.size(0) == q_nope.size(0) && q_pe.size(1) == q_nope.size(1), "kvoffload::", op,
      ": argument 'q_pe' must have shape [", q_nope.size(0), ", ", q_nope.size(1),
      ", Dr] ([T, H] of 'q_nope'), got ", shape_str(q_pe));
}

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

void check_int32(const char* op, const char* arg, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK_TYPE(
      t.scalar_type() == at::kInt, "kvoffload::", op, ": argument '", arg,
      "' must have dtype torch.int32, got ", dtype_str(t.scalar_type()));
  check_dim(op, arg, t, dim);
}

// Entries are -1 or in [0, limit); reports [row, col] of the first bad one.
void check_index_range(const char* op, const char* arg, const int32_t* idx, int64_t rows, int64_t cols, int64_t limit) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t v = idx[r * cols + c];
      TORCH_CHECK_INDEX(
          v >= -1 && v < limit, "kvoffload::", op, ": argument '", arg, "' entry [", r, ", ", c, "] is ", v,
          ", expected -1 or a value in [0, ", limit, ")");
    }
  }
}

// A tensor whose last dim is contiguous (row reads are contiguous), copying only when it is not.
at::Tensor rows_contiguous(const at::Tensor& t) {
  return (t.size(-1) <= 1 || t.stride(-1) == 1) ? t : t.contiguous();
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
  const int64_t R = q_nope_in.size(0);
  for (auto [name, t, dim] : {std::tuple<const char*, const at::Tensor*, int64_t>{"block_table", &block_table_in, 2},
                              {"miss_tokens", &miss_tokens_in, 2}, {"miss_slots", &miss_slots_in, 2},
                              {"miss_count", &miss_count_in, 1}, {"slots", &slots_in, 2}}) {
    check_int32(op, name, *t, dim);
    TORCH_CHECK_VALUE(
        t->size(0) == R, "kvoffload::", op, ": argument '", name, "' must have ", R,
        " rows (R of 'q_nope'), got shape ", shape_str(*t));
  }
  TORCH_CHECK_VALUE(
      hot_kv_c.size(0) == R, "kvoffload::", op, ": argument 'hot_kv_c' must have ", R,
      " rows (R of 'q_nope'), got shape ", shape_str(hot_kv_c));
  TORCH_CHECK_VALUE(
      miss_slots_in.sizes() == miss_tokens_in.sizes(), "kvoffload::", op,
      ": argument 'miss_slots' must have the shape of 'miss_tokens' ", shape_str(miss_tokens_in), ", got ",
      shape_str(miss_slots_in));
  check_same_dtype(op, "q_nope", q_nope_in, "out", out);
  TORCH_CHECK_VALUE(
      out.sizes() == q_nope_in.sizes(), "kvoffload::", op, ": argument 'out' must have shape ",
      shape_str(q_nope_in), " (as 'q_nope'), got ", shape_str(out));
  TORCH_CHECK_TYPE(
      lse.scalar_type() == at::kFloat, "kvoffload::", op, ": argument 'lse' must have dtype torch.float32, got ",
      dtype_str(lse.scalar_type()));
  TORCH_CHECK_VALUE(
      lse.dim() == 2 && lse.size(0) == R && lse.size(1) == q_nope_in.size(1), "kvoffload::", op,
      ": argument 'lse' must have shape ", sizes_str(q_nope_in.sizes().slice(0, 2)), " ([R, H]), got ",
      shape_str(lse));
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"q_nope", &q_nope_in}, {"q_pe", &q_pe_in},
                         {"host_kv_c", &host_kv_c_in}, {"host_k_pe", &host_k_pe_in},
                         {"block_table", &block_table_in}, {"hot_kv_c", &hot_kv_c}, {"hot_k_pe", &hot_k_pe},
                         {"miss_tokens", &miss_tokens_in}, {"miss_slots", &miss_slots_in},
                         {"miss_count", &miss_count_in}, {"slots", &slots_in}, {"out", &out}, {"lse", &lse}}) {
    check_cpu(op, name, *t);
  }
  // Value checks, all before the first write.
  const at::Tensor table = block_table_in.contiguous();
  const at::Tensor miss_tokens = miss_tokens_in.contiguous();
  const at::Tensor miss_slots = miss_slots_in.contiguous();
  const at::Tensor miss_count = miss_count_in.contiguous();
  const at::Tensor slots = slots_in.contiguous();
  const int64_t num_blocks = host_kv_c_in.size(0), bs = host_kv_c_in.size(1);
  const int64_t max_blocks = table.size(1), M = miss_tokens.size(1), C = hot_kv_c.size(1);
  const int32_t* tb = table.const_data_ptr<int32_t>();
  const int32_t* mt = miss_tokens.const_data_ptr<int32_t>();
  const int32_t* ms = miss_slots.const_data_ptr<int32_t>();
  const int32_t* mc = miss_count.const_data_ptr<int32_t>();
  std::vector<uint8_t> seen(static_cast<size_t>(C), 0);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = mc[r];
    TORCH_CHECK_VALUE(
        n >= 0 && n <= M, "kvoffload::", op, ": argument 'miss_count' entry ", r, " is ", n,
        ", expected a value in [0, ", M, "]");
    for (int64_t i = 0; i < n; ++i) {
      const int64_t tok = mt[r * M + i], slot = ms[r * M + i];
      TORCH_CHECK_INDEX(
          tok >= 0 && tok < max_blocks * bs, "kvoffload::", op, ": argument 'miss_tokens' entry [", r, ", ", i,
          "] is ", tok, ", expected a value in [0, ", max_blocks * bs, ") (max_blocks x block_size)");
      const int64_t blk = tb[r * max_blocks + tok / bs];
      TORCH_CHECK_INDEX(
          blk >= 0 && blk < num_blocks, "kvoffload::", op, ": argument 'block_table' entry [", r, ", ", tok / bs,
          "] (block of miss token ", tok, ") is ", blk, ", expected a value in [0, ", num_blocks, ")");
      TORCH_CHECK_INDEX(
          slot >= 0 && slot < C, "kvoffload::", op, ": argument 'miss_slots' entry [", r, ", ", i, "] is ", slot,
          ", expected a value in [0, ", C, ")");
      TORCH_CHECK_VALUE(
          !seen[slot], "kvoffload::", op, ": argument 'miss_slots' row ", r, " holds destination ", slot,
          " more than once; destinations must be distinct");
      seen[slot] = 1;
    }
    for (int64_t i = 0; i < n; ++i) {
      seen[ms[r * M + i]] = 0;
    }
  }
  check_index_range(op, "slots", slots.const_data_ptr<int32_t>(), R, slots.size(1), C);

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
  const int64_t K = slots.size(1);
  const int32_t* sp = slots.const_data_ptr<int32_t>();
  const int64_t Dc = hot_c.size(2), Dr = hot_p.size(2);
  const int64_t esz = hot_c.element_size();
  // Phase 1: host -> hot copies of the missed rows (parallel over decode rows: destinations are per row).
  {
    const auto* hc = static_cast<const char*>(host_kv_c.const_data_ptr());
    const auto* hp = static_cast<const char*>(host_k_pe.const_data_ptr());
    auto* dc = static_cast<char*>(hot_c.data_ptr());
    auto* dp = static_cast<char*>(hot_p.data_ptr());
    const int64_t hc0 = host_kv_c.stride(0) * esz, hc1 = host_kv_c.stride(1) * esz;
    const int64_t hp0 = host_k_pe.stride(0) * esz, hp1 = host_k_pe.stride(1) * esz;
    const int64_t dc0 = hot_c.stride(0) * esz, dc1 = hot_c.stride(1) * esz;
    const int64_t dp0 = hot_p.stride(0) * esz, dp1 = hot_p.stride(1) * esz;
    at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t i = 0; i < mc[r]; ++i) {
          const int64_t tok = mt[r * M + i], slot = ms[r * M + i];
          const int64_t blk = tb[r * max_blocks + tok / bs], off = tok % bs;
          std::memcpy(dc + r * dc0 + slot * dc1, hc + blk * hc0 + off * hc1, Dc * esz);
          std::memcpy(dp + r * dp0 + slot * dp1, hp + blk * hp0 + off * hp1, Dr * esz);
        }
      }
    });
  }
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
