// CPU kernels of the FP8 lightning indexer (torch_kvoffload/ops/fp8_indexer.py):
// kvoffload::hadamard_quant_fp8 and kvoffload::fp8_lightning_indexer.
//
// hadamard_quant_fp8 is bit-identical to its reference: the fast Walsh-Hadamard transform of
// hadamard_quant_int8 (same additions in the same order), one fp32 multiply by the rounded 1/sqrt(D), then
// each 128-value group quantised as quantize_index_k_fp8 does (both shared through common.h).
//
// fp8_lightning_indexer scores per (query token, key block) work item as the other indexer kernels do
// (indexer::topk_all): the block's e4m3fn key codes are decoded to fp32 once (exact), all heads of the
// token are scored against them group by group with the register-tiled fp32 dot kernel (the products of
// two e4m3 values are exact in fp32; only the order of a dot product's additions differs from the
// reference), then each head's logit is (dot * q_scale) * k_scale summed over the groups, relu, times the
// head weight. The decoded query of a token is kept per thread while its key blocks are scored.

#include "common.h"
#include "cpu/vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace kvoffload {

namespace {

using namespace vec;      // dot_block, to_float
using namespace indexer;  // layout, checks, score loop and top-k shared with indexer_kernels.cpp
using namespace fp8;      // the 128-value group quantiser and the e4m3fn decoding table

// Bytes of an indexer row of D values: D e4m3fn codes, then D / 128 fp32 scales.
constexpr int64_t kGroupBytes = kTile + 4;

inline float load_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// ------------------------------------------------------------------------------- hadamard_quant_fp8

at::Tensor hadamard_quant_fp8_cpu(const at::Tensor& x_in) {
  constexpr const char* op = "hadamard_quant_fp8";
  const int64_t d = check_hadamard_input(
      op, x_in, kTile,
      "a power-of-two last dim of at least 128 (the Hadamard rotation, one fp32 scale per 128 values)");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.numel() / d, groups = d / kTile, width = d + 4 * groups;
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = width;
  at::Tensor out = at::empty(sizes, x.options().dtype(at::kByte));
  if (rows == 0) {
    return out;
  }
  const float norm = hadamard_norm(d);
  uint8_t* dst = out.data_ptr<uint8_t>();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.const_data_ptr<T>();
    GilRelease no_gil;
    at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / d), [&](int64_t begin, int64_t end) {
      std::vector<float> y(d);
      for (int64_t r = begin; r < end; ++r) {
        to_float(xp + r * d, y.data(), d);
        fwht(y.data(), d);
        for (int64_t i = 0; i < d; ++i) {
          y[i] = y[i] * norm;
        }
        uint8_t* o = dst + r * width;
        for (int64_t g = 0; g < groups; ++g) {
          const float scale = quantize_index_group(y.data() + g * kTile, o + g * kTile);
          std::memcpy(o + d + 4 * g, &scale, 4);
        }
      }
    });
  };
  if (x.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    run(c10::BFloat16{});
  }
  return out;
}

// ---------------------------------------------------------------------------- fp8_lightning_indexer

// A token's query decoded to fp32: codes [G][H][128] (group-major, the layout dot_block reads) and scales
// [H][G]. `call` tells one op call from the next: the cache lives on the pool threads across calls.
struct QueryCache {
  uint64_t call = 0;
  int64_t t = -1;
  std::vector<float> codes, scales;
};

std::atomic<uint64_t> next_call{1};

// Decodes the query rows q [H, R] of one token (R = G * 132 bytes) into `c`.
void decode_query(const uint8_t* q, int64_t H, int64_t G, const float* table, QueryCache& c) {
  const int64_t D = G * kTile, R = G * kGroupBytes;
  c.codes.resize(G * H * kTile);
  c.scales.resize(H * G);
  for (int64_t h = 0; h < H; ++h) {
    const uint8_t* row = q + h * R;
    for (int64_t g = 0; g < G; ++g) {
      float* dst = c.codes.data() + (g * H + h) * kTile;
      for (int64_t i = 0; i < kTile; ++i) {
        dst[i] = table[row[g * kTile + i]];
      }
      c.scales[h * G + g] = load_f32(row + D + 4 * g);
    }
  }
}

// Scores of one token against the n keys of one block (rows of R = G * 132 bytes, row stride ks bytes):
// out[j] = sum_h w[h] * relu(sum_g (dot_g(q[h], k[j]) * q_scale[h, g]) * k_scale[j, g]), in fp32.
KVO_TARGET_CLONES void score_block_fp8(
    const float* qf, const float* qs, const float* wf, int64_t H, int64_t G, const uint8_t* keys, int64_t ks,
    int64_t n, const float* table, std::vector<float>& kbuf, std::vector<float>& kscale,
    std::vector<float>& logits, float* out) {
  const int64_t D = G * kTile;
  kbuf.resize(G * n * kTile);
  kscale.resize(n * G);
  logits.resize(G * H * n);
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* row = keys + j * ks;
    for (int64_t g = 0; g < G; ++g) {
      float* dst = kbuf.data() + (g * n + j) * kTile;
      for (int64_t i = 0; i < kTile; ++i) {
        dst[i] = table[row[g * kTile + i]];
      }
      kscale[j * G + g] = load_f32(row + D + 4 * g);
    }
  }
  float* lg = logits.data();
  for (int64_t g = 0; g < G; ++g) {
    dot_block(qf + g * H * kTile, H, kbuf.data() + g * n * kTile, n, kTile, lg + g * H * n, n);
  }
  for (int64_t j = 0; j < n; ++j) {
    out[j] = 0.0f;
  }
  for (int64_t h = 0; h < H; ++h) {
    const float w = wf[h];
    for (int64_t j = 0; j < n; ++j) {
      float logit = (lg[h * n + j] * qs[h * G]) * kscale[j * G];
      for (int64_t g = 1; g < G; ++g) {
        logit += (lg[(g * H + h) * n + j] * qs[h * G + g]) * kscale[j * G + g];
      }
      out[j] += w * std::max(logit, 0.0f);
    }
  }
}

at::Tensor fp8_lightning_indexer_cpu(
    const at::Tensor& q_rows, const at::Tensor& weights, const at::Tensor& k_rows, const at::Tensor& block_table,
    const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens_k, int64_t top_k) {
  constexpr const char* op = "fp8_lightning_indexer";
  // The checks of validate_fp8_lightning_indexer, in its order: top_k, structure, then the values.
  TORCH_CHECK_VALUE(top_k >= 0, "kvoffload::", op, ": argument 'top_k' must be >= 0, got ", top_k);
  check_dtype(op, "q_rows", q_rows, at::kByte);
  check_dim(op, "q_rows", q_rows, 3);
  TORCH_CHECK_TYPE(
      weights.scalar_type() == at::kFloat || weights.scalar_type() == at::kBFloat16, "kvoffload::", op,
      ": argument 'weights' must have dtype torch.float32 or torch.bfloat16, got ", dtype_str(weights.scalar_type()));
  check_dim(op, "weights", weights, 2);
  check_dtype(op, "k_rows", k_rows, at::kByte);
  check_dim(op, "k_rows", k_rows, 3);
  const int64_t R = q_rows.size(2);
  TORCH_CHECK_VALUE(
      R > 0 && R % kGroupBytes == 0, "kvoffload::", op,
      ": argument 'q_rows' must hold 132 bytes per 128 indexer values (128 fp8 values and an fp32 scale) in its "
      "last dim, got ",
      R);
  TORCH_CHECK_VALUE(
      weights.size(0) == q_rows.size(0) && weights.size(1) == q_rows.size(1), "kvoffload::", op,
      ": argument 'weights' must have shape [", q_rows.size(0), ", ", q_rows.size(1), "] ([T, H] of 'q_rows'), got ",
      shape_str(weights));
  TORCH_CHECK_VALUE(
      k_rows.size(2) == R, "kvoffload::", op, ": argument 'k_rows' must have ", R,
      " bytes per row (as 'q_rows'), got shape ", shape_str(k_rows));
  Layout L = make_layout(op, q_rows.size(0), k_rows.size(0), k_rows.size(1), block_table, cu_seqlens_q, seq_lens_k);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"q_rows", &q_rows}, {"weights", &weights},
                         {"k_rows", &k_rows}, {"block_table", &block_table}, {"cu_seqlens_q", &cu_seqlens_q},
                         {"seq_lens_k", &seq_lens_k}}) {
    check_cpu(op, name, *t, "q_rows");
  }
  const at::Tensor table = block_table.contiguous(), cu = cu_seqlens_q.contiguous(), lens = seq_lens_k.contiguous();
  fill_layout_values(op, L, k_rows.size(0), table, cu, lens);

  const at::Tensor q = q_rows.contiguous(), w = weights.to(at::kFloat).contiguous();
  const at::Tensor k = (k_rows.size(2) <= 1 || k_rows.stride(2) == 1) ? k_rows : k_rows.contiguous();
  at::Tensor result = at::empty({L.T, top_k}, q_rows.options().dtype(at::kInt));
  const int64_t H = q.size(1), G = R / kGroupBytes;
  const uint8_t* qp = q.const_data_ptr<uint8_t>();
  const float* wp = w.const_data_ptr<float>();
  const uint8_t* kp = k.const_data_ptr<uint8_t>();
  const int64_t k0 = k.stride(0), k1 = k.stride(1);
  const float* dec = fp8_table();
  const uint64_t call = next_call.fetch_add(1);
  GilRelease no_gil;
  topk_all(L, top_k, result, [&](int64_t t, int64_t j, int64_t, int64_t n, float* out) {
    thread_local QueryCache qc;
    thread_local std::vector<float> kbuf, kscale, logits;
    if (qc.call != call || qc.t != t) {  // a thread's work items run token by token: decode each once
      decode_query(qp + t * H * R, H, G, dec, qc);
      qc.call = call;
      qc.t = t;
    }
    const int64_t blk = L.table[L.token_req[t] * L.max_blocks + j];
    score_block_fp8(
        qc.codes.data(), qc.scales.data(), wp + t * H, H, G, kp + blk * k0, k1, n, dec, kbuf, kscale, logits, out);
  });
  return result;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvoffload, CPU, m) {
  m.impl("hadamard_quant_fp8", &hadamard_quant_fp8_cpu);
  m.impl("fp8_lightning_indexer", &fp8_lightning_indexer_cpu);
}

}  // namespace kvoffload
