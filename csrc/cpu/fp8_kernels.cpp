// CPU kernels of the FP8 row family: kvoffload::quantize_kv_fp8, kvoffload::dequantize_kv_fp8,
// kvoffload::quantize_index_k_fp8 and kvoffload::dequantize_index_k_fp8 (row formats in
// torch_kvoffload/ops/fp8.py).
//
// Bit-identical to the reference kernels: every step is the same single fp32 operation the reference
// performs (no reciprocal, no fused multiply-add), and every conversion is the c10 one torch's .to() uses.
// Only NaN payloads may differ: torch's vectorized fp32 -> bf16 / fp16 casts write other NaN bit patterns
// than its scalar (c10) ones, so the reference's own NaN bits depend on layout and CPU.
// Each row is read once: a 128-value tile is converted to fp32 into a stack buffer, its scale computed,
// then encoded from the buffer.

#include "common.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>

namespace kvoffload {

namespace {

using namespace fp8;  // tile helpers shared with fp8_indexer_kernels.cpp (common.h)

// Bytes read and written per parallel task.
constexpr int64_t kBytesPerTask = int64_t{1} << 16;

// ------------------------------------------------------------------------------------------ checks

// Python's list(t.shape) format: "[2, 3]".
std::string list_str(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) {
    s += (d ? ", " : "") + std::to_string(t.size(d));
  }
  return s + "]";
}

void check_dim2(const char* op, const char* arg, const at::Tensor& t) {
  TORCH_CHECK_VALUE(
      t.dim() == 2, "kvoffload::", op, ": argument '", arg, "' must have exactly 2 dimensions, got shape ",
      list_str(t));
}

bool is_float_rows_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

void check_float_rows(const char* op, const char* arg, const at::Tensor& t) {
  check_dim2(op, arg, t);
  TORCH_CHECK_TYPE(
      is_float_rows_dtype(t.scalar_type()), "kvoffload::", op, ": argument '", arg,
      "' must have dtype torch.float32 or torch.bfloat16 or torch.float16, got ", dtype_str(t.scalar_type()));
}

void check_byte_rows(const char* op, const at::Tensor& rows) {
  check_dim2(op, "rows", rows);
  TORCH_CHECK_TYPE(
      rows.scalar_type() == at::kByte, "kvoffload::", op, ": argument 'rows' must have dtype torch.uint8, got ",
      dtype_str(rows.scalar_type()));
}

// Last: the dispatcher only routes CPU tensors here.
void check_cpu(const char* op, const char* arg, const at::Tensor& t) {
  TORCH_CHECK_VALUE(
      t.device().is_cpu(), "kvoffload::", op, ": argument '", arg, "' must be a CPU tensor, got ", t.device());
}

void check_out_dtype(const char* op, at::ScalarType dtype) {
  TORCH_CHECK_TYPE(
      is_float_rows_dtype(dtype), "kvoffload::", op,
      ": 'dtype' must be one of ['torch.float32', 'torch.bfloat16', 'torch.float16'], got ", dtype_str(dtype));
}

void check_width(const char* op, const char* arg, int64_t width, const char* what) {
  TORCH_CHECK_VALUE(
      width > 0 && width % kTile == 0, "kvoffload::", op, ": the ", what, " of '", arg,
      "' must be a positive multiple of 128 (one fp32 scale per 128 values), got ", width);
}

int64_t grain_for(int64_t row_bytes) {
  return std::max<int64_t>(1, kBytesPerTask / std::max<int64_t>(1, row_bytes));
}

// Byte rows read with unit inner stride (any row stride); others are made so, as the reference does.
at::Tensor unit_inner_stride(const at::Tensor& rows) {
  return rows.size(1) <= 1 || rows.stride(1) == 1 ? rows : rows.contiguous();
}

// ------------------------------------------------------------------------------------- tile helpers

template <typename T>
inline void load_tile(const T* p, int64_t stride, float* buf) {
  if (stride == 1) {
    for (int64_t j = 0; j < kTile; ++j) {
      buf[j] = static_cast<float>(p[j]);
    }
  } else {
    for (int64_t j = 0; j < kTile; ++j) {
      buf[j] = static_cast<float>(p[j * stride]);
    }
  }
}

inline float load_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename T>
inline T from_float(float v) {
  return static_cast<T>(v);  // c10's round-to-nearest-even conversions for bf16 / fp16
}

// A tile of codes times its scale in fp32, converted to T.
template <typename T>
KVO_TARGET_CLONES void decode_tile(const uint8_t* codes, float scale, const float* table, T* out) {
  for (int64_t j = 0; j < kTile; ++j) {
    out[j] = from_float<T>(table[codes[j]] * scale);
  }
}

// --------------------------------------------------------------------------------------- RoPE part

// n values at p (element stride `stride`) stored as bf16 bytes, as .to(torch.bfloat16).
using RopeEncode = void (*)(const void* p, int64_t stride, int64_t n, uint8_t* out);

template <typename T>
void rope_to_bf16(const void* p, int64_t stride, int64_t n, uint8_t* out) {
  const T* x = static_cast<const T*>(p);
  for (int64_t j = 0; j < n; ++j) {
    uint16_t bits;
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      bits = x[j * stride].x;  // .to() of a bf16 tensor keeps its bits
    } else {
      bits = c10::BFloat16(static_cast<float>(x[j * stride])).x;
    }
    std::memcpy(out + 2 * j, &bits, 2);
  }
}

RopeEncode rope_encoder(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return &rope_to_bf16<float>;
    case at::kBFloat16:
      return &rope_to_bf16<c10::BFloat16>;
    default:
      return &rope_to_bf16<c10::Half>;
  }
}

// n bf16 values (bytes at p) converted to T, as .view(torch.bfloat16).to(dtype).
template <typename T>
void rope_from_bf16(const uint8_t* p, int64_t n, T* out) {
  for (int64_t j = 0; j < n; ++j) {
    uint16_t bits;
    std::memcpy(&bits, p + 2 * j, 2);
    const c10::BFloat16 v(bits, c10::BFloat16::from_bits());
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      out[j] = v;  // same dtype: .to() keeps the bits
    } else {
      out[j] = from_float<T>(static_cast<float>(v));
    }
  }
}

// Dispatches a body written in terms of scalar_t over the three value dtypes.
#define KVO_DISPATCH_FP8_VALUES(TYPE, NAME, ...)                                                        \
  AT_DISPATCH_SWITCH(                                                                                  \
      TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                      AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

// ------------------------------------------------------------------------------------- latent rows

at::Tensor quantize_kv_fp8_cpu(const at::Tensor& kv_c, const at::Tensor& k_pe) {
  constexpr const char* op = "quantize_kv_fp8";
  check_float_rows(op, "kv_c", kv_c);
  check_float_rows(op, "k_pe", k_pe);
  check_width(op, "kv_c", kv_c.size(1), "width (kv_lora_rank)");
  TORCH_CHECK_VALUE(
      k_pe.size(0) == kv_c.size(0), "kvoffload::", op, ": 'kv_c' and 'k_pe' must have as many rows, got ",
      kv_c.size(0), " and ", k_pe.size(0));
  TORCH_CHECK_VALUE(
      k_pe.device() == kv_c.device(), "kvoffload::", op, ": 'kv_c' and 'k_pe' must be on one device, got ",
      kv_c.device(), " and ", k_pe.device());
  check_cpu(op, "kv_c", kv_c);

  const int64_t N = kv_c.size(0), Dc = kv_c.size(1), Dr = k_pe.size(1), T = Dc / kTile;
  const int64_t width = Dc + 4 * T + 2 * Dr;
  at::Tensor out = at::empty({N, width}, kv_c.options().dtype(at::kByte));
  if (N == 0) {
    return out;
  }
  const RopeEncode rope = rope_encoder(k_pe.scalar_type());
  const auto* pe = static_cast<const char*>(k_pe.const_data_ptr());
  const int64_t pe_s0 = k_pe.stride(0) * k_pe.element_size(), pe_s1 = k_pe.stride(1);
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t row_bytes = Dc * kv_c.element_size() + Dr * k_pe.element_size() + width;

  GilRelease no_gil;
  KVO_DISPATCH_FP8_VALUES(kv_c.scalar_type(), op, [&] {
    const scalar_t* src = kv_c.const_data_ptr<scalar_t>();
    const int64_t s0 = kv_c.stride(0), s1 = kv_c.stride(1);
    at::parallel_for(0, N, grain_for(row_bytes), [&](int64_t begin, int64_t end) {
      float buf[kTile];
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* x = src + i * s0;
        uint8_t* o = dst + i * width;
        for (int64_t t = 0; t < T; ++t) {
          load_tile(x + t * kTile * s1, s1, buf);
          const float scale = pow2_ceil(floor_at(tile_amax(buf) / kFp8Max, kAmaxFloor));
          encode_tile(buf, scale, o + t * kTile);
          std::memcpy(o + Dc + 4 * t, &scale, 4);
        }
        rope(pe + i * pe_s0, pe_s1, Dr, o + Dc + 4 * T);
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> dequantize_kv_fp8_cpu(
    const at::Tensor& rows_in, int64_t kv_lora_rank, at::ScalarType dtype) {
  constexpr const char* op = "dequantize_kv_fp8";
  check_byte_rows(op, rows_in);
  check_out_dtype(op, dtype);
  check_width(op, "kv_lora_rank", kv_lora_rank, "value");
  const int64_t W = rows_in.size(1), Dc = kv_lora_rank, T = Dc / kTile;
  // Dc > W first: W - Dc - 4T cannot overflow then.
  TORCH_CHECK_VALUE(
      Dc <= W && (W - Dc - 4 * T) >= 0 && (W - Dc - 4 * T) % 2 == 0, "kvoffload::", op, ": 'rows' of ", W,
      " bytes cannot hold ", Dc, " fp8 values, ", T, " fp32 scales and whole bf16 RoPE values");
  check_cpu(op, "rows", rows_in);
  const int64_t N = rows_in.size(0), Dr = (W - Dc - 4 * T) / 2;

  const auto opts = rows_in.options().dtype(dtype);
  at::Tensor kv_c = at::empty({N, Dc}, opts);
  at::Tensor k_pe = at::empty({N, Dr}, opts);
  if (N == 0) {
    return {kv_c, k_pe};
  }
  const at::Tensor rows = unit_inner_stride(rows_in);
  const uint8_t* src = rows.const_data_ptr<uint8_t>();
  const int64_t rs = rows.stride(0);
  const float* table = fp8_table();
  const int64_t row_bytes = W + (Dc + Dr) * kv_c.element_size();

  GilRelease no_gil;
  KVO_DISPATCH_FP8_VALUES(dtype, op, [&] {
    scalar_t* kv = kv_c.data_ptr<scalar_t>();
    scalar_t* pe = k_pe.data_ptr<scalar_t>();
    at::parallel_for(0, N, grain_for(row_bytes), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const uint8_t* r = src + i * rs;
        for (int64_t t = 0; t < T; ++t) {
          decode_tile(r + t * kTile, load_f32(r + Dc + 4 * t), table, kv + i * Dc + t * kTile);
        }
        rope_from_bf16(r + Dc + 4 * T, Dr, pe + i * Dr);
      }
    });
  });
  return {kv_c, k_pe};
}

// ------------------------------------------------------------------------------------ indexer rows

at::Tensor quantize_index_k_fp8_cpu(const at::Tensor& k) {
  constexpr const char* op = "quantize_index_k_fp8";
  check_float_rows(op, "k", k);
  check_width(op, "k", k.size(1), "width (index_head_dim)");
  check_cpu(op, "k", k);

  const int64_t N = k.size(0), D = k.size(1), G = D / kTile;
  const int64_t width = D + 4 * G;
  at::Tensor out = at::empty({N, width}, k.options().dtype(at::kByte));
  if (N == 0) {
    return out;
  }
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t row_bytes = D * k.element_size() + width;

  GilRelease no_gil;
  KVO_DISPATCH_FP8_VALUES(k.scalar_type(), op, [&] {
    const scalar_t* src = k.const_data_ptr<scalar_t>();
    const int64_t s0 = k.stride(0), s1 = k.stride(1);
    at::parallel_for(0, N, grain_for(row_bytes), [&](int64_t begin, int64_t end) {
      float buf[kTile];
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* x = src + i * s0;
        uint8_t* o = dst + i * width;
        for (int64_t g = 0; g < G; ++g) {
          load_tile(x + g * kTile * s1, s1, buf);
          const float scale = quantize_index_group(buf, o + g * kTile);
          std::memcpy(o + D + 4 * g, &scale, 4);
        }
      }
    });
  });
  return out;
}

at::Tensor dequantize_index_k_fp8_cpu(const at::Tensor& rows_in, at::ScalarType dtype) {
  constexpr const char* op = "dequantize_index_k_fp8";
  check_byte_rows(op, rows_in);
  check_out_dtype(op, dtype);
  const int64_t W = rows_in.size(1);
  TORCH_CHECK_VALUE(
      W > 0 && W % (kTile + 4) == 0, "kvoffload::", op,
      ": 'rows' must be 132 bytes per 128 keys (128 fp8 values and an fp32 scale), got ", W, " bytes");
  check_cpu(op, "rows", rows_in);
  const int64_t N = rows_in.size(0), G = W / (kTile + 4), D = G * kTile;

  at::Tensor k = at::empty({N, D}, rows_in.options().dtype(dtype));
  if (N == 0) {
    return k;
  }
  const at::Tensor rows = unit_inner_stride(rows_in);
  const uint8_t* src = rows.const_data_ptr<uint8_t>();
  const int64_t rs = rows.stride(0);
  const float* table = fp8_table();
  const int64_t row_bytes = W + D * k.element_size();

  GilRelease no_gil;
  KVO_DISPATCH_FP8_VALUES(dtype, op, [&] {
    scalar_t* out = k.data_ptr<scalar_t>();
    at::parallel_for(0, N, grain_for(row_bytes), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const uint8_t* r = src + i * rs;
        for (int64_t g = 0; g < G; ++g) {
          decode_tile(r + g * kTile, load_f32(r + D + 4 * g), table, out + i * D + g * kTile);
        }
      }
    });
  });
  return k;
}

#undef KVO_DISPATCH_FP8_VALUES

}  // namespace

TORCH_LIBRARY_IMPL(kvoffload, CPU, m) {
  m.impl("quantize_kv_fp8", &quantize_kv_fp8_cpu);
  m.impl("dequantize_kv_fp8", &dequantize_kv_fp8_cpu);
  m.impl("quantize_index_k_fp8", &quantize_index_k_fp8_cpu);
  m.impl("dequantize_index_k_fp8", &dequantize_index_k_fp8_cpu);
}

}  // namespace kvoffload
