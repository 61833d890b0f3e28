// Out-of-line helpers shared by the kernel files (see common.h).

#include "common.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <utility>
#include <vector>

namespace kvoffload {

namespace {

std::pair<uintptr_t, uintptr_t> byte_span(const at::Tensor& t) {
  auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    last += (t.size(d) - 1) * t.stride(d);
  }
  return {begin, begin + static_cast<uintptr_t>((last + 1) * t.element_size())};
}

bool units_self_overlap(const at::Tensor& t, int64_t lead_dims) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the unit dims
  for (int64_t d = lead_dims; d < t.dim(); ++d) {
    if (t.size(d) == 0) {
      return false;
    }
    if (t.size(d) > 1) {
      dims.emplace_back(std::abs(t.stride(d)), t.size(d));
    }
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;
  for (const auto& [stride, size] : dims) {
    if (stride <= reach) {
      return true;
    }
    reach += (size - 1) * stride;
  }
  return false;
}

}  // namespace

void check_destination(const char* op, const char* arg, const at::Tensor& t, int64_t lead_dims) {
  TORCH_CHECK_VALUE(
      at::has_internal_overlap(t) != at::MemOverlap::Yes && !units_self_overlap(t, lead_dims),
      "kvoffload::", op, ": argument '", arg,
      "' has internal overlap: more than one of its elements refers to the same memory location (shape ",
      t.sizes(), ", strides ", t.strides(), "), so writes into it would overwrite each other; clone() it first");
  TORCH_CHECK_VALUE(
      !(t.requires_grad() && at::GradMode::is_enabled()), "kvoffload::", op, ": argument '", arg, "' ",
      t.is_leaf() ? "is a leaf tensor that requires grad" : "requires grad",
      "; the op writes it in place and has no derivative: write under torch.no_grad() or into a tensor "
      "that does not require grad");
}

bool may_overlap(const at::Tensor& src, const at::Tensor& dst) {
  if (src.numel() == 0 || dst.numel() == 0 || !src.storage().is_alias_of(dst.storage())) {
    return false;
  }
  const auto [s_begin, s_end] = byte_span(src);
  const auto [d_begin, d_end] = byte_span(dst);
  return s_begin < d_end && d_begin < s_end;
}

at::Tensor unaliased_source(const at::Tensor& src, const at::Tensor& dst) {
  return may_overlap(src, dst) ? src.clone() : src;
}

// ------------------------------------------------------------------------------------------ FP8 values

namespace fp8 {

namespace {

template <bool kClamp>
inline __attribute__((always_inline)) void encode_tile_body(const float* x, float scale, uint8_t* out) {
  for (int64_t j = 0; j < kTile; ++j) {
    float q = x[j] / scale;
    if (kClamp) {
      q = q < -kFp8Max ? -kFp8Max : q;
      q = q > kFp8Max ? kFp8Max : q;
    }
    out[j] = c10::Float8_e4m3fn(q).x;
  }
}

struct Fp8Table {
  std::array<float, 256> v;
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      v[b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
    }
  }
};

}  // namespace

// Magnitudes compare as their bit patterns do, and every NaN pattern lies above inf's: an integer max, which
// vectorizes.
KVO_TARGET_CLONES float tile_amax(const float* x) {
  uint32_t m = 0;
  for (int64_t j = 0; j < kTile; ++j) {
    uint32_t b;
    std::memcpy(&b, x + j, 4);
    b &= UINT32_C(0x7FFFFFFF);
    m = b > m ? b : m;
  }
  float r;
  std::memcpy(&r, &m, 4);
  return r;
}

KVO_TARGET_CLONES void encode_tile(const float* x, float scale, uint8_t* out) {
  encode_tile_body<false>(x, scale, out);
}

KVO_TARGET_CLONES void encode_tile_clamped(const float* x, float scale, uint8_t* out) {
  encode_tile_body<true>(x, scale, out);
}

float quantize_index_group(const float* x, uint8_t* codes) {
  // act_quant order: floor the amax, then multiply by the fp32 constant 1/448 (not divide).
  const float scale = pow2_ceil(floor_at(tile_amax(x), kAmaxFloor) * kInvFp8Max);
  encode_tile_clamped(x, scale, codes);
  return scale;
}

const float* fp8_table() {
  static const Fp8Table table;
  return table.v.data();
}

}  // namespace fp8

// ------------------------------------------------------------------------------ lightning-indexer family

namespace indexer {

namespace {

// Score rows buffered for top-k at once: bounds the scratch to 64 MiB whatever T and the context are.
constexpr int64_t kScoreBufferFloats = int64_t{1} << 24;

// Ordering of top-k: higher score first (NaN above everything, like torch.sort), then lower position.
inline bool ranks_before(float sa, int32_t a, float sb, int32_t b) {
  const bool na = std::isnan(sa), nb = std::isnan(sb);
  if (na || nb) {
    return na && nb ? a < b : na;
  }
  if (sa != sb) {
    return sa > sb;
  }
  return a < b;
}

void topk_row(const float* s, int64_t visible, int64_t k, int32_t* out, std::vector<int32_t>& pos) {
  const int64_t take = std::min(k, visible);
  pos.resize(visible);
  std::iota(pos.begin(), pos.end(), 0);
  auto cmp = [s](int32_t a, int32_t b) { return ranks_before(s[a], a, s[b], b); };
  if (take < visible) {
    std::nth_element(pos.begin(), pos.begin() + take, pos.end(), cmp);
  }
  std::sort(pos.begin(), pos.begin() + take, cmp);
  std::copy(pos.begin(), pos.begin() + take, out);
  std::fill(out + take, out + k, -1);
}

}  // namespace

void check_dim(const char* op, const char* arg, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK_VALUE(
      t.dim() == dim, "kvoffload::", op, ": argument '", arg, "' must have exactly ", dim,
      " dimensions, got shape ", shape_str(t));
}

void check_dtype(const char* op, const char* arg, const at::Tensor& t, at::ScalarType dtype) {
  TORCH_CHECK_TYPE(
      t.scalar_type() == dtype, "kvoffload::", op, ": argument '", arg, "' must have dtype ", dtype_str(dtype),
      ", got ", dtype_str(t.scalar_type()));
}

void check_cpu(const char* op, const char* arg, const at::Tensor& t, const char* first) {
  TORCH_CHECK_VALUE(
      t.device().is_cpu(), "kvoffload::", op, ": argument '", arg, "' must be on cpu (as '", first, "'), got ",
      t.device());
}

int64_t check_hadamard_input(const char* op, const at::Tensor& x, int64_t min_d, const char* requirement) {
  TORCH_CHECK_TYPE(
      x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "kvoffload::", op,
      ": argument 'x' must have dtype torch.float32 or torch.bfloat16, got ", dtype_str(x.scalar_type()));
  TORCH_CHECK_VALUE(
      x.dim() >= 1, "kvoffload::", op, ": argument 'x' must have at least 1 dimensions, got shape ", shape_str(x));
  const int64_t d = x.size(-1);
  TORCH_CHECK_VALUE(
      d >= min_d && (d & (d - 1)) == 0, "kvoffload::", op, ": argument 'x' must have ", requirement,
      ", got shape ", shape_str(x));
  check_cpu(op, "x", x, "x");
  return d;
}

Layout make_layout(
    const char* op, int64_t T, int64_t num_blocks, int64_t block_size, const at::Tensor& table,
    const at::Tensor& cu_in, const at::Tensor& lens_in) {
  check_dtype(op, "block_table", table, at::kInt);
  check_dim(op, "block_table", table, 2);
  check_dtype(op, "cu_seqlens_q", cu_in, at::kInt);
  check_dim(op, "cu_seqlens_q", cu_in, 1);
  check_dtype(op, "seq_lens_k", lens_in, at::kInt);
  check_dim(op, "seq_lens_k", lens_in, 1);
  const int64_t B = table.size(0);
  TORCH_CHECK_VALUE(
      cu_in.size(0) == B + 1, "kvoffload::", op, ": argument 'cu_seqlens_q' must have shape [", B + 1,
      "] (batch + 1 from 'block_table'), got ", shape_str(cu_in));
  TORCH_CHECK_VALUE(
      lens_in.size(0) == B, "kvoffload::", op, ": argument 'seq_lens_k' must have shape [", B,
      "] (batch from 'block_table'), got ", shape_str(lens_in));
  return Layout{T, B, table.size(1), block_size, {}, {}, nullptr};
}

void fill_layout_values(
    const char* op, Layout& L, int64_t num_blocks, const at::Tensor& table, const at::Tensor& cu_t,
    const at::Tensor& lens_t) {
  const int32_t* cu = cu_t.const_data_ptr<int32_t>();
  const int32_t* lens = lens_t.const_data_ptr<int32_t>();
  const int32_t* tb = table.const_data_ptr<int32_t>();
  const int64_t B = L.B, bs = L.block_size, mb = L.max_blocks;
  TORCH_CHECK_VALUE(cu[0] == 0, "kvoffload::", op, ": argument 'cu_seqlens_q' entry 0 must be 0, got ", cu[0]);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(
        cu[b + 1] >= cu[b], "kvoffload::", op, ": argument 'cu_seqlens_q' must be non-decreasing, got entry ",
        b + 1, " = ", cu[b + 1], " < entry ", b, " = ", cu[b]);
  }
  TORCH_CHECK_VALUE(
      cu[B] == L.T, "kvoffload::", op,
      ": argument 'cu_seqlens_q' last entry must equal the number of query tokens ", L.T, ", got ", cu[B]);
  const int64_t capacity = mb * bs;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t s = lens[b];
    TORCH_CHECK_VALUE(
        s >= 0 && s <= capacity, "kvoffload::", op, ": argument 'seq_lens_k' entry ", b, " is ", s,
        ", expected a value in [0, ", capacity, "] (max_blocks ", mb, " x block_size ", bs, ")");
    const int64_t q = cu[b + 1] - cu[b];
    TORCH_CHECK_VALUE(
        q == 0 || s - (q - 1) >= 0, "kvoffload::", op, ": argument 'seq_lens_k' entry ", b, " is ", s,
        ", but request ", b, " has ", q, " query tokens: the first query would see ", s - (q - 1),
        " keys (need seq_len_k >= num_queries - 1)");
    for (int64_t j = 0; j < (s + bs - 1) / bs; ++j) {
      const int64_t blk = tb[b * mb + j];
      TORCH_CHECK_INDEX(
          blk >= 0 && blk < num_blocks, "kvoffload::", op, ": argument 'block_table' entry [", b, ", ", j,
          "] is ", blk, ", expected a value in [0, ", num_blocks, ")");
    }
  }
  L.table = tb;
  L.token_req.resize(L.T);
  L.visible.resize(L.T);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q = cu[b + 1] - cu[b];
    for (int64_t j = 0; j < q; ++j) {
      L.token_req[cu[b] + j] = static_cast<int32_t>(b);
      L.visible[cu[b] + j] = lens[b] - (q - 1 - j);
    }
  }
}

void for_each_block(const Layout& L, int64_t t0, int64_t t1, float* buf, int64_t width, BlockFn block_fn) {
  const int64_t bs = L.block_size;
  std::vector<int64_t> first(t1 - t0 + 1, 0);
  for (int64_t t = t0; t < t1; ++t) {
    first[t - t0 + 1] = first[t - t0] + (L.visible[t] + bs - 1) / bs;
  }
  at::parallel_for(0, first.back(), 1, [&](int64_t begin, int64_t end) {
    int64_t t = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1 + t0;
    for (int64_t item = begin; item < end; ++item) {
      while (item >= first[t - t0 + 1]) {
        ++t;
      }
      const int64_t j = item - first[t - t0];
      const int64_t s0 = j * bs;
      const int64_t n = std::min(bs, L.visible[t] - s0);
      block_fn(t, j, s0, n, buf + (t - t0) * width + s0);
    }
  });
}

void topk_all(const Layout& L, int64_t top_k, at::Tensor& result, BlockFn block_fn) {
  int32_t* res = result.data_ptr<int32_t>();
  int64_t t0 = 0;
  std::vector<float> buf;
  while (t0 < L.T) {
    // As many tokens as fit the score buffer (at least one).
    int64_t width = 0, t1 = t0;
    while (t1 < L.T) {
      const int64_t w = std::max(width, L.visible[t1]);
      if (t1 > t0 && w * (t1 - t0 + 1) > kScoreBufferFloats) {
        break;
      }
      width = w;
      ++t1;
    }
    buf.resize(std::max<int64_t>(1, width * (t1 - t0)));
    for_each_block(L, t0, t1, buf.data(), width, block_fn);
    at::parallel_for(t0, t1, 1, [&](int64_t begin, int64_t end) {
      std::vector<int32_t> pos;
      for (int64_t t = begin; t < end; ++t) {
        topk_row(buf.data() + (t - t0) * width, L.visible[t], top_k, res + t * top_k, pos);
      }
    });
    t0 = t1;
  }
}

void fwht(float* y, int64_t d) {
  for (int64_t h = 1; h < d; h *= 2) {
    for (int64_t i = 0; i < d; i += 2 * h) {
      for (int64_t j = i; j < i + h; ++j) {
        const float a = y[j], b = y[j + h];
        y[j] = a + b;
        y[j + h] = a - b;
      }
    }
  }
}

}  // namespace indexer

}  // namespace kvoffload
