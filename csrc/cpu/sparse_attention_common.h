// What the CPU kernels of the sparse MLA attention family share (sparse_attention_kernels.cpp:
// sparse_mla_attention, Copy-SFA; fp8_attention_kernels.cpp: fp8_sparse_mla_attention): the attention core
// and the argument checks that replicate the Python validators of torch_kvoffload/ops/sparse_attention.py.
//
// Per (query token, group of heads) work item: the selected rows are loaded as fp32 (a row source converts
// or dequantizes each row once) in chunks that stay in cache; each chunk is used once for the scores of all
// heads of the group (register tiles of 4 heads x 2 rows, the row loads shared by the heads) and once for
// p . kv_c (tiles of 4 heads x 16 columns), with an online softmax (running maximum and sum, vectorised
// exp) in between. Everything accumulates in fp32. The hot loops are compiled twice (x86-64-v3 (AVX2, FMA)
// and baseline x86-64) and picked at load time.
//
// A row source is a type with
//   const int32_t* idx; int64_t K;                    // the token's K selected rows, -1 = skip
//   void load(int64_t row, float* dst, int64_t Dc, int64_t Dr) const;
//                                                       // dst[0 .. Dc) = latent, dst[Dc .. Dc + Dr) = RoPE
// whose load is always_inline (it is then compiled into each clone of attend_heads). Kernel files define
// their row sources in an anonymous namespace, so every instantiation of the templates below stays local to
// its file (as the target_clones resolvers need).
#pragma once

#include "common.h"
#include "cpu/vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

namespace kvoffload::attention {

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

// Scratch reused across the work items one thread runs.
struct Scratch {
  std::vector<float> q, scores, chunk, acc;
  std::vector<int32_t> valid;
};

// Attention of heads [h0, h1) of one token over the rows of `src`. q_nope / q_pe point at the token's
// [H, Dc] / [H, Dr] rows (contiguous), out at its [H, Dc] output row (contiguous), lse at its [H] row.
template <typename T, typename Source>
KVO_TARGET_CLONES void attend_heads(
    const T* q_nope, const T* q_pe, Source src, int64_t Dc, int64_t Dr, int64_t h0, int64_t h1, float scale,
    T* out, float* lse, Scratch& sc) {
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
  // One pass, online softmax: each chunk of rows is loaded once and used for both products.
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t m = std::min(kChunk, n - c0);
    for (int64_t j = 0; j < m; ++j) {
      src.load(rows[c0 + j], chunk + j * D, Dc, Dr);
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

// Runs attend_heads over all (token, head group) items in parallel. source(t) gives token t's row source.
// q_nope / q_pe contiguous [T, H, Dc] / [T, H, Dr] of dtype T; out [T, H, Dc] and lse fp32 [T, H] contiguous.
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
          qn + t * H * Dc, qp + t * H * Dr, source(t), Dc, Dr, h0, h1, scale, o + t * H * Dc, l + t * H, sc);
    }
  });
}

// ------------------------------------------------------------------------------------------ checks
// The messages and exception types of torch_kvoffload/ops/_checks.py and ops/sparse_attention.py.

inline void check_float(const char* op, const char* arg, const at::Tensor& t) {
  TORCH_CHECK_TYPE(
      t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "kvoffload::", op, ": argument '", arg,
      "' must have dtype torch.float32 or torch.bfloat16, got ", dtype_str(t.scalar_type()));
}

inline void check_dtype(const char* op, const char* arg, const at::Tensor& t, at::ScalarType dtype) {
  TORCH_CHECK_TYPE(
      t.scalar_type() == dtype, "kvoffload::", op, ": argument '", arg, "' must have dtype ", dtype_str(dtype),
      ", got ", dtype_str(t.scalar_type()));
}

inline void check_dim(const char* op, const char* arg, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK_VALUE(
      t.dim() == dim, "kvoffload::", op, ": argument '", arg, "' must have exactly ", dim,
      " dimensions, got shape ", shape_str(t));
}

inline void check_same_dtype(
    const char* op, const char* a, const at::Tensor& ta, const char* b, const at::Tensor& tb) {
  TORCH_CHECK_TYPE(
      ta.scalar_type() == tb.scalar_type(), "kvoffload::", op, ": '", a, "' and '", b,
      "' must have the same dtype, got ", dtype_str(ta.scalar_type()), " and ", dtype_str(tb.scalar_type()));
}

// The device check of the Python validators ("must be on <q_nope's device> (as 'q_nope')"); q_nope is on the
// CPU in a CPU kernel.
inline void check_cpu(const char* op, const char* arg, const at::Tensor& t) {
  TORCH_CHECK_VALUE(
      t.device().is_cpu(), "kvoffload::", op, ": argument '", arg, "' must be on cpu (as 'q_nope'), got ",
      t.device());
}

// _check_queries: q_nope fp32 / bf16 [T, H, Dc], q_pe [T, H, Dr] of its dtype.
inline void check_queries(const char* op, const at::Tensor& q_nope, const at::Tensor& q_pe) {
  check_float(op, "q_nope", q_nope);
  check_dim(op, "q_nope", q_nope, 3);
  check_dim(op, "q_pe", q_pe, 3);
  check_same_dtype(op, "q_nope", q_nope, "q_pe", q_pe);
  TORCH_CHECK_VALUE(
      q_pe.size(0) == q_nope.size(0) && q_pe.size(1) == q_nope.size(1), "kvoffload::", op,
      ": argument 'q_pe' must have shape [", q_nope.size(0), ", ", q_nope.size(1),
      ", Dr] ([T, H] of 'q_nope'), got ", shape_str(q_pe));
}

inline void check_int32(const char* op, const char* arg, const at::Tensor& t, int64_t dim) {
  check_dtype(op, arg, t, at::kInt);
  check_dim(op, arg, t, dim);
}

inline std::string sizes_str(at::IntArrayRef s) {
  return c10::str(s);
}

// _check_index_range: entries are -1 or in [0, limit); reports [row, col] of the first bad one.
inline void check_index_range(
    const char* op, const char* arg, const int32_t* idx, int64_t rows, int64_t cols, int64_t limit) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t v = idx[r * cols + c];
      TORCH_CHECK_INDEX(
          v >= -1 && v < limit, "kvoffload::", op, ": argument '", arg, "' entry [", r, ", ", c, "] is ", v,
          ", expected -1 or a value in [0, ", limit, ")");
    }
  }
}

// check_copy_sfa_lists: the structure of a Copy-SFA op's index tensors (int32, R rows), of its hot buffer's
// rows (hot_name) and of out / lse, with the Python validator's messages (the floating and FP8 Copy-SFA).
inline void check_copy_sfa_lists(
    const char* op, const at::Tensor& q_nope, const char* hot_name, const at::Tensor& hot,
    const at::Tensor& block_table, const at::Tensor& miss_tokens, const at::Tensor& miss_slots,
    const at::Tensor& miss_count, const at::Tensor& slots, const at::Tensor& out, const at::Tensor& lse) {
  const int64_t R = q_nope.size(0);
  for (auto [name, t, dim] : {std::tuple<const char*, const at::Tensor*, int64_t>{"block_table", &block_table, 2},
                              {"miss_tokens", &miss_tokens, 2}, {"miss_slots", &miss_slots, 2},
                              {"miss_count", &miss_count, 1}, {"slots", &slots, 2}}) {
    check_int32(op, name, *t, dim);
    TORCH_CHECK_VALUE(
        t->size(0) == R, "kvoffload::", op, ": argument '", name, "' must have ", R,
        " rows (R of 'q_nope'), got shape ", shape_str(*t));
  }
  TORCH_CHECK_VALUE(
      hot.size(0) == R, "kvoffload::", op, ": argument '", hot_name, "' must have ", R,
      " rows (R of 'q_nope'), got shape ", shape_str(hot));
  TORCH_CHECK_VALUE(
      miss_slots.sizes() == miss_tokens.sizes(), "kvoffload::", op,
      ": argument 'miss_slots' must have the shape of 'miss_tokens' ", shape_str(miss_tokens), ", got ",
      shape_str(miss_slots));
  check_same_dtype(op, "q_nope", q_nope, "out", out);
  TORCH_CHECK_VALUE(
      out.sizes() == q_nope.sizes(), "kvoffload::", op, ": argument 'out' must have shape ", shape_str(q_nope),
      " (as 'q_nope'), got ", shape_str(out));
  TORCH_CHECK_TYPE(
      lse.scalar_type() == at::kFloat, "kvoffload::", op, ": argument 'lse' must have dtype torch.float32, got ",
      dtype_str(lse.scalar_type()));
  TORCH_CHECK_VALUE(
      lse.dim() == 2 && lse.size(0) == R && lse.size(1) == q_nope.size(1), "kvoffload::", op,
      ": argument 'lse' must have shape ", sizes_str(q_nope.sizes().slice(0, 2)), " ([R, H]), got ",
      shape_str(lse));
}

// check_copy_sfa_misses: the miss list of a Copy-SFA op (R rows of M entries, int32, contiguous) against
// a host pool of num_blocks x bs rows, the block table (max_blocks columns) and C hot slots a row. Raises
// for the first bad row, in row order, with the Python validator's messages; nothing is written.
inline void check_copy_sfa_misses(
    const char* op, const int32_t* tb, int64_t max_blocks, const int32_t* mt, const int32_t* ms,
    const int32_t* mc, int64_t R, int64_t M, int64_t num_blocks, int64_t bs, int64_t C) {
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
}

// A Copy-SFA op's miss list and slots (R rows), contiguous and value-checked before anything is written:
// check_copy_sfa_misses against a host pool of num_blocks x bs rows and C hot slots a row, then the slots'
// range. copy() makes the host -> hot copies of the misses.
struct CopySfaLists {
  at::Tensor table, miss_tokens, miss_slots, miss_count, slots;
  int64_t R, M, max_blocks, K, bs;
  const int32_t *tb, *mt, *ms, *mc, *sp;

  CopySfaLists(
      const char* op, const at::Tensor& block_table, const at::Tensor& miss_tokens_in,
      const at::Tensor& miss_slots_in, const at::Tensor& miss_count_in, const at::Tensor& slots_in,
      int64_t num_blocks, int64_t block_size, int64_t C)
      : table(block_table.contiguous()), miss_tokens(miss_tokens_in.contiguous()),
        miss_slots(miss_slots_in.contiguous()), miss_count(miss_count_in.contiguous()),
        slots(slots_in.contiguous()), R(slots.size(0)), M(miss_tokens.size(1)), max_blocks(table.size(1)),
        K(slots.size(1)), bs(block_size), tb(table.const_data_ptr<int32_t>()),
        mt(miss_tokens.const_data_ptr<int32_t>()), ms(miss_slots.const_data_ptr<int32_t>()),
        mc(miss_count.const_data_ptr<int32_t>()), sp(slots.const_data_ptr<int32_t>()) {
    check_copy_sfa_misses(op, tb, max_blocks, mt, ms, mc, R, M, num_blocks, bs, C);
    check_index_range(op, "slots", sp, R, K, C);
  }

  // Row r's miss i copies `bytes` bytes from src + blk * s0 + off * s1 to dst + r * d0 + slot * d1 (strides
  // in bytes), parallel over rows (each row writes only its own slots).
  void copy(const char* src, int64_t s0, int64_t s1, char* dst, int64_t d0, int64_t d1, int64_t bytes) const {
    at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t i = 0; i < mc[r]; ++i) {
          const int64_t tok = mt[r * M + i], slot = ms[r * M + i];
          const int64_t blk = tb[r * max_blocks + tok / bs], off = tok % bs;
          std::memcpy(dst + r * d0 + slot * d1, src + blk * s0 + off * s1, bytes);
        }
      }
    });
  }
};

// A tensor whose last dim is contiguous (row reads are contiguous), copying only when it is not.
inline at::Tensor rows_contiguous(const at::Tensor& t) {
  return (t.size(-1) <= 1 || t.stride(-1) == 1) ? t : t.contiguous();
}

}  // namespace kvoffload::attention
