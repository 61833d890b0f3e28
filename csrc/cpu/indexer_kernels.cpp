// CPU kernels of the lightning indexer family: kvoffload::lightning_indexer_scores,
// kvoffload::lightning_indexer, kvoffload::hadamard_quant_int8 and kvoffload::quant_lightning_indexer.
//
// Scores are computed per (query token, key block) work item: the block's keys are read once (converted
// to fp32 for bf16), all heads of the token are scored against them with a register-tiled kernel
// (4 heads x 2 keys per tile), and relu / head weights are applied in fp32. Top-k runs per token with
// nth_element + sort under the total order (score descending, NaN first, ties by lower position). The hot
// loops are compiled twice (x86-64-v3 (AVX2, FMA) and baseline x86-64) and picked at load time.

#include "common.h"
#include "cpu/vec.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace kvoffload {

namespace {

using namespace vec;      // the kernels are written in its vocabulary
using namespace indexer;  // layout, checks, score loop and top-k shared with fp8_indexer_kernels.cpp

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ------------------------------------------------------------------------------------ score kernels

// Float path: scores of token t against keys [s0, s0 + n) (one block). q_t [H, D] / w_t [H] already in
// fp32; keys [n, D] at `keys` with row stride ks (elements).
template <typename T>
KVO_TARGET_CLONES void score_block_float(
    const float* qf, const float* wf, int64_t H, int64_t D, const T* keys, int64_t ks, int64_t n,
    std::vector<float>& kbuf, std::vector<float>& logits, float* out) {
  kbuf.resize(n * D);
  logits.resize(H * n);
  for (int64_t j = 0; j < n; ++j) {
    to_float(keys + j * ks, kbuf.data() + j * D, D);
  }
  const float* k = kbuf.data();
  float* lg = logits.data();
  dot_block(qf, H, k, n, D, lg, n);
  for (int64_t j = 0; j < n; ++j) {
    out[j] = 0.0f;
  }
  for (int64_t hh = 0; hh < H; ++hh) {
    const float w = wf[hh];
    const float* row = lg + hh * n;
    for (int64_t j = 0; j < n; ++j) {
      out[j] += w * std::max(row[j], 0.0f);
    }
  }
}

// Int8 path: integer dot products, then (dot * q_scale[h]) * k_scale[s], relu, times w[h]. While
// D * 128^2 <= 2^24 every product and partial sum of an int8 dot product is an integer that fp32 holds
// exactly, so the dots run on the fp32 register tiles (same result as int32 arithmetic); larger D falls
// back to an int32 loop.
KVO_TARGET_CLONES void score_block_int8(
    const int8_t* q, const float* qs, const float* wf, int64_t H, int64_t D, const int8_t* keys, int64_t ks,
    const float* kscale, int64_t n, const float* qf, std::vector<float>& kbuf, std::vector<float>& logits,
    float* out) {
  logits.resize(H * n);
  float* lg = logits.data();
  if (D * 128 * 128 <= (int64_t{1} << 24)) {
    kbuf.resize(n * D);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t d = 0; d < D; ++d) {
        kbuf[j * D + d] = static_cast<float>(keys[j * ks + d]);
      }
    }
    const float* k = kbuf.data();
    dot_block(qf, H, k, n, D, lg, n);
  } else {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t j = 0; j < n; ++j) {
        const int8_t* qh = q + h * D;
        const int8_t* k = keys + j * ks;
        int32_t dot = 0;
        for (int64_t d = 0; d < D; ++d) {
          dot += static_cast<int32_t>(qh[d]) * static_cast<int32_t>(k[d]);
        }
        lg[h * n + j] = static_cast<float>(dot);
      }
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    out[j] = 0.0f;
  }
  for (int64_t h = 0; h < H; ++h) {
    const float w = wf[h], sq = qs[h];
    const float* row = lg + h * n;
    for (int64_t j = 0; j < n; ++j) {
      const float logit = row[j] * sq * kscale[j];
      out[j] += w * std::max(logit, 0.0f);
    }
  }
}

// ------------------------------------------------------------------------------------ float indexer

struct FloatArgs {
  at::Tensor q, w, k;
  Layout layout;
  at::Tensor table, cu, lens;  // contiguous copies kept alive
};

FloatArgs check_float_indexer(
    const char* op, const at::Tensor& q, const at::Tensor& weights, const at::Tensor& k_cache,
    const at::Tensor& block_table, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens_k) {
  TORCH_CHECK_TYPE(
      q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "kvoffload::", op,
      ": argument 'q' must have dtype torch.float32 or torch.bfloat16, got ", dtype_str(q.scalar_type()));
  check_dim(op, "q", q, 3);
  check_dim(op, "weights", weights, 2);
  check_dim(op, "k_cache", k_cache, 3);
  TORCH_CHECK_TYPE(
      weights.scalar_type() == q.scalar_type() || weights.scalar_type() == at::kFloat, "kvoffload::", op,
      ": argument 'weights' must have dtype ", dtype_str(q.scalar_type()), " (as 'q') or torch.float32, got ",
      dtype_str(weights.scalar_type()));
  TORCH_CHECK_TYPE(
      k_cache.scalar_type() == q.scalar_type(), "kvoffload::", op,
      ": 'q' and 'k_cache' must have the same dtype, got ", dtype_str(q.scalar_type()), " and ",
      dtype_str(k_cache.scalar_type()));
  TORCH_CHECK_VALUE(
      weights.size(0) == q.size(0) && weights.size(1) == q.size(1), "kvoffload::", op,
      ": argument 'weights' must have shape [", q.size(0), ", ", q.size(1), "] ([T, H] of 'q'), got ",
      shape_str(weights));
  TORCH_CHECK_VALUE(
      k_cache.size(2) == q.size(2), "kvoffload::", op, ": argument 'k_cache' must have head dim ", q.size(2),
      " (as 'q'), got shape ", shape_str(k_cache));
  Layout L = make_layout(op, q.size(0), k_cache.size(0), k_cache.size(1), block_table, cu_seqlens_q, seq_lens_k);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"q", &q}, {"weights", &weights},
                         {"k_cache", &k_cache}, {"block_table", &block_table}, {"cu_seqlens_q", &cu_seqlens_q},
                         {"seq_lens_k", &seq_lens_k}}) {
    check_cpu(op, name, *t, "q");
  }
  FloatArgs a{q.contiguous(), weights.to(at::kFloat).contiguous(),
              (k_cache.size(2) <= 1 || k_cache.stride(2) == 1) ? k_cache : k_cache.contiguous(),
              std::move(L), block_table.contiguous(), cu_seqlens_q.contiguous(), seq_lens_k.contiguous()};
  fill_layout_values(op, a.layout, k_cache.size(0), a.table, a.cu, a.lens);
  return a;
}

// Runs the float score kernel for the given token range / blocks (dispatching on the dtype).
template <typename Consumer>
void with_float_block_fn(const FloatArgs& a, Consumer consume) {
  const int64_t H = a.q.size(1), D = a.q.size(2);
  const Layout& L = a.layout;
  const int64_t k0 = a.k.stride(0), k1 = a.k.stride(1);
  const float* w = a.w.const_data_ptr<float>();
  AT_DISPATCH_SWITCH(a.q.scalar_type(), "lightning_indexer",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      using T = float;
      const T* q = a.q.const_data_ptr<T>();
      const T* k = a.k.const_data_ptr<T>();
      consume([&](int64_t t, int64_t j, int64_t, int64_t n, float* out) {
        thread_local std::vector<float> kbuf, logits;
        const T* keys = k + L.table[L.token_req[t] * L.max_blocks + j] * k0;
        score_block_float<T>(q + t * H * D, w + t * H, H, D, keys, k1, n, kbuf, logits, out);
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using T = c10::BFloat16;
      const T* k = a.k.const_data_ptr<T>();
      // Queries converted once (every key block of a token reuses them).
      const at::Tensor qf_t = a.q.to(at::kFloat);
      const float* qf = qf_t.const_data_ptr<float>();
      consume([&](int64_t t, int64_t j, int64_t, int64_t n, float* out) {
        thread_local std::vector<float> kbuf, logits;
        const T* keys = k + L.table[L.token_req[t] * L.max_blocks + j] * k0;
        score_block_float<T>(qf + t * H * D, w + t * H, H, D, keys, k1, n, kbuf, logits, out);
      });
    }));
}

at::Tensor lightning_indexer_scores_cpu(
    const at::Tensor& q, const at::Tensor& weights, const at::Tensor& k_cache, const at::Tensor& block_table,
    const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens_k) {
  constexpr const char* op = "lightning_indexer_scores";
  const FloatArgs a = check_float_indexer(op, q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k);
  const Layout& L = a.layout;
  const int64_t width = L.max_blocks * L.block_size;
  at::Tensor scores = at::full({L.T, width}, kNegInf, q.options().dtype(at::kFloat));
  GilRelease no_gil;
  with_float_block_fn(a, [&](auto block_fn) {
    for_each_block(L, 0, L.T, scores.data_ptr<float>(), width, block_fn);
  });
  return scores;
}

at::Tensor lightning_indexer_cpu(
    const at::Tensor& q, const at::Tensor& weights, const at::Tensor& k_cache, const at::Tensor& block_table,
    const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens_k, int64_t top_k) {
  constexpr const char* op = "lightning_indexer";
  TORCH_CHECK_VALUE(top_k >= 0, "kvoffload::", op, ": argument 'top_k' must be >= 0, got ", top_k);
  const FloatArgs a = check_float_indexer(op, q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k);
  at::Tensor result = at::empty({a.layout.T, top_k}, q.options().dtype(at::kInt));
  GilRelease no_gil;
  with_float_block_fn(a, [&](auto block_fn) { topk_all(a.layout, top_k, result, block_fn); });
  return result;
}

// ------------------------------------------------------------------------------ hadamard_quant_int8

std::tuple<at::Tensor, at::Tensor> hadamard_quant_int8_cpu(const at::Tensor& x_in) {
  constexpr const char* op = "hadamard_quant_int8";
  const int64_t d = check_hadamard_input(op, x_in, 1, "a power-of-two last dim");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.numel() / d;
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  at::Tensor scale = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  const float norm = hadamard_norm(d);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.const_data_ptr<T>();
    bool finite = true;
    {
      GilRelease no_gil;
      for (int64_t i = 0; i < rows * d && finite; ++i) {
        finite = std::isfinite(static_cast<float>(xp[i]));
      }
    }
    TORCH_CHECK_VALUE(finite, "kvoffload::", op, ": argument 'x' must be finite, got NaN or infinity");
    int8_t* qp = q.data_ptr<int8_t>();
    float* sp = scale.data_ptr<float>();
    GilRelease no_gil;
    at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / d), [&](int64_t begin, int64_t end) {
      std::vector<float> y(d);
      for (int64_t r = begin; r < end; ++r) {
        to_float(xp + r * d, y.data(), d);
        fwht(y.data(), d);
        float amax = 0.0f;
        for (int64_t i = 0; i < d; ++i) {
          y[i] = y[i] * norm;
          amax = std::max(amax, std::fabs(y[i]));
        }
        const float s = amax / 127.0f;
        sp[r] = s;
        const float div = s > 0.0f ? s : 1.0f;  // zero row: q = 0 and scale = 0
        for (int64_t i = 0; i < d; ++i) {
          const float v = std::nearbyint(y[i] / div);
          qp[r * d + i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
        }
      }
    });
  };
  if (x.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    run(c10::BFloat16{});
  }
  return {q, scale};
}

// -------------------------------------------------------------------------- quant_lightning_indexer

at::Tensor quant_lightning_indexer_cpu(
    const at::Tensor& q_int8, const at::Tensor& q_scale, const at::Tensor& weights, const at::Tensor& k_int8,
    const at::Tensor& k_scale, const at::Tensor& block_table, const at::Tensor& cu_seqlens_q,
    const at::Tensor& seq_lens_k, int64_t top_k) {
  constexpr const char* op = "quant_lightning_indexer";
  check_dtype(op, "q_int8", q_int8, at::kChar);
  check_dim(op, "q_int8", q_int8, 3);
  check_dtype(op, "q_scale", q_scale, at::kFloat);
  TORCH_CHECK_TYPE(
      weights.scalar_type() == at::kFloat || weights.scalar_type() == at::kBFloat16, "kvoffload::", op,
      ": argument 'weights' must have dtype torch.float32 or torch.bfloat16, got ", dtype_str(weights.scalar_type()));
  check_dtype(op, "k_int8_cache", k_int8, at::kChar);
  check_dim(op, "k_int8_cache", k_int8, 3);
  check_dtype(op, "k_scale_cache", k_scale, at::kFloat);
  check_dim(op, "k_scale_cache", k_scale, 2);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"q_scale", &q_scale}, {"weights", &weights}}) {
    TORCH_CHECK_VALUE(
        t->dim() == 2 && t->size(0) == q_int8.size(0) && t->size(1) == q_int8.size(1), "kvoffload::", op,
        ": argument '", name, "' must have shape [", q_int8.size(0), ", ", q_int8.size(1),
        "] ([T, H] of 'q_int8'), got ", shape_str(*t));
  }
  TORCH_CHECK_VALUE(
      k_int8.size(2) == q_int8.size(2), "kvoffload::", op, ": argument 'k_int8_cache' must have head dim ",
      q_int8.size(2), " (as 'q_int8'), got shape ", shape_str(k_int8));
  TORCH_CHECK_VALUE(
      k_scale.size(0) == k_int8.size(0) && k_scale.size(1) == k_int8.size(1), "kvoffload::", op,
      ": argument 'k_scale_cache' must have shape [", k_int8.size(0), ", ", k_int8.size(1),
      "] ([num_blocks, block_size] of 'k_int8_cache'), got ", shape_str(k_scale));
  Layout L = make_layout(op, q_int8.size(0), k_int8.size(0), k_int8.size(1), block_table, cu_seqlens_q, seq_lens_k);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"q_int8", &q_int8}, {"q_scale", &q_scale},
                         {"weights", &weights}, {"k_int8_cache", &k_int8}, {"k_scale_cache", &k_scale},
                         {"block_table", &block_table}, {"cu_seqlens_q", &cu_seqlens_q},
                         {"seq_lens_k", &seq_lens_k}}) {
    check_cpu(op, name, *t, "q_int8");
  }
  TORCH_CHECK_VALUE(top_k >= 0, "kvoffload::", op, ": argument 'top_k' must be >= 0, got ", top_k);
  const at::Tensor table = block_table.contiguous(), cu = cu_seqlens_q.contiguous(), lens = seq_lens_k.contiguous();
  fill_layout_values(op, L, k_int8.size(0), table, cu, lens);
  const at::Tensor q = q_int8.contiguous(), qs = q_scale.contiguous(), w = weights.to(at::kFloat).contiguous();
  const at::Tensor k = (k_int8.size(2) <= 1 || k_int8.stride(2) == 1) ? k_int8 : k_int8.contiguous();
  const at::Tensor ks = (k_scale.size(1) <= 1 || k_scale.stride(1) == 1) ? k_scale : k_scale.contiguous();
  at::Tensor result = at::empty({L.T, top_k}, q_int8.options().dtype(at::kInt));
  const int64_t H = q.size(1), D = q.size(2);
  const int8_t* qp = q.const_data_ptr<int8_t>();
  const float* qsp = qs.const_data_ptr<float>();
  const float* wp = w.const_data_ptr<float>();
  const int8_t* kp = k.const_data_ptr<int8_t>();
  const float* ksp = ks.const_data_ptr<float>();
  const int64_t k0 = k.stride(0), k1 = k.stride(1), ks0 = ks.stride(0);
  GilRelease no_gil;
  // fp32 copies of the int8 queries (exact) for the fp32 tiles, converted once.
  const at::Tensor qf_t = q.to(at::kFloat);
  const float* qf = qf_t.const_data_ptr<float>();
  topk_all(L, top_k, result, [&](int64_t t, int64_t j, int64_t, int64_t n, float* out) {
    const int64_t blk = L.table[L.token_req[t] * L.max_blocks + j];
    thread_local std::vector<float> kbuf, logits;
    score_block_int8(
        qp + t * H * D, qsp + t * H, wp + t * H, H, D, kp + blk * k0, k1, ksp + blk * ks0, n, qf + t * H * D, kbuf,
        logits, out);
  });
  return result;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvoffload, CPU, m) {
  m.impl("lightning_indexer_scores", &lightning_indexer_scores_cpu);
  m.impl("lightning_indexer", &lightning_indexer_cpu);
  m.impl("hadamard_quant_int8", &hadamard_quant_int8_cpu);
  m.impl("quant_lightning_indexer", &quant_lightning_indexer_cpu);
}

}  // namespace kvoffload
