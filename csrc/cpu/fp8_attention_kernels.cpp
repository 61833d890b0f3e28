// CPU kernels of kvoffload::fp8_sparse_mla_attention (torch_kvoffload/ops/fp8_attention.py): sparse MLA
// attention over FP8 latent rows (uint8 [N, Dc + 4 * Dc / 128 + 2 * Dr], the format of ops/fp8.py), and
// of kvoffload::fp8_scatter_copy_sparse_mla_attention (ops/fp8_copy_attention.py): Copy-SFA over such rows.
//
// The attention core of sparse_mla_attention (sparse_attention_common.h: rows in fp32 chunks,
// register-tiled products, online softmax, same work split), with each selected row dequantized once per
// work item into the chunk: a latent value is float(e4m3fn code) * its tile's fp32 scale (one fp32 multiply,
// the reference's operation, so the fp32 row is the reference's bit for bit), a RoPE value is its bf16 bits
// widened to fp32. Only the selected rows are read, as bytes. The codes are decoded 8 at a time from their
// bit fields (decode8: the values of fp8::fp8_table(), bit for bit, NaNs included), twice as fast as table
// look-ups, which the compiler leaves scalar.

#include "common.h"
#include "cpu/sparse_attention_common.h"
#include "cpu/vec.h"

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <tuple>
#include <utility>

namespace kvoffload {

namespace {

using namespace attention;  // the attention core and the argument checks shared with sparse_mla_attention
using fp8::kTile;

// Bytes of a latent row: Dc e4m3fn codes, Dc / 128 fp32 scales, Dr bf16 RoPE values (kv_row_bytes).
inline int64_t kv_row_bytes(int64_t dc, int64_t dr) {
  return dc + 4 * (dc / kTile) + 2 * dr;
}

// The latent width Dc of checked queries: a positive multiple of the tile (check_fp8_queries).
int64_t fp8_latent_width(const char* op, const at::Tensor& q_nope) {
  const int64_t Dc = q_nope.size(2);
  TORCH_CHECK_VALUE(
      Dc % kTile == 0 && Dc != 0, "kvoffload::", op,
      ": argument 'q_nope' must have a latent width (Dc) that is a positive multiple of ", kTile,
      " (one fp32 scale per ", kTile, " values of an FP8 row), got shape ", shape_str(q_nope));
  return Dc;
}

// FP8 latent rows of `dims` dims, each kv_row_bytes(Dc, Dr) bytes (check_fp8_rows).
void check_fp8_rows(const char* op, const char* name, const at::Tensor& t, int64_t dims, int64_t Dc, int64_t Dr) {
  check_dtype(op, name, t, at::kByte);
  check_dim(op, name, t, dims);
  const int64_t want = kv_row_bytes(Dc, Dr);
  TORCH_CHECK_VALUE(
      t.size(dims - 1) == want, "kvoffload::", op, ": argument '", name, "' must have ", want,
      " bytes per row (Dc ", Dc, " fp8 values, ", Dc / kTile, " fp32 scales, Dr ", Dr,
      " bf16 RoPE values), got shape ", shape_str(t));
}

typedef uint32_t u32x8 __attribute__((vector_size(32)));
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "decode8 reads the codes as little-endian words");

// fp32 values of the 8 e4m3fn bytes at p, bit for bit those of fp8::fp8_table() (c10's decoding): exponent
// field e > 0 gives 2^(e - 7) * (1 + m / 8), i.e. fp32 exponent e + 120 and mantissa m << 20; e = 0 gives
// m * 2^-9 (a normal fp32); magnitude 0x7F is NaN (0x7FF00000 with the sign, as c10 makes it). The bytes are
// spread over the lanes by shifts of two 32-bit words (AVX2 compiles this to a broadcast and a variable
// shift; a byte-vector conversion would be scalarised).
inline __attribute__((always_inline)) f8 decode8(const uint8_t* p) {
  uint32_t w[2];
  std::memcpy(w, p, sizeof w);
  const u32x8 words = {w[0], w[0], w[0], w[0], w[1], w[1], w[1], w[1]};
  const i8v x = reinterpret_cast<i8v>((words >> u32x8{0, 8, 16, 24, 0, 8, 16, 24}) & 0xFFu);
  const i8v mag = x & 0x7F;
  const i8v normal = (mag << 20) + (120 << 23);
  const f8 sub = __builtin_convertvector(mag, f8) * splat(1.0f / 512.0f);
  i8v sub_bits;
  std::memcpy(&sub_bits, &sub, sizeof sub);
  i8v bits = mag < 8 ? sub_bits : normal;
  bits = mag == 0x7F ? (normal | 0x7F800000) : bits;
  bits |= (x & 0x80) << 24;
  f8 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// One query token's rows: row i of the selection is the byte row rows + idx[i] * stride (its bytes
// contiguous, at any alignment).
struct Fp8RowSource {
  const uint8_t* rows;
  int64_t stride;      // bytes between rows
  const int32_t* idx;  // K entries, -1 = skip
  int64_t K;

  // The row dequantized to fp32: dst[0 .. Dc) latent, dst[Dc .. Dc + Dr) RoPE.
  inline __attribute__((always_inline)) void load(int64_t r, float* dst, int64_t Dc, int64_t Dr) const {
    const uint8_t* row = rows + r * stride;
    const uint8_t* scales = row + Dc;
    for (int64_t t = 0; t < Dc / kTile; ++t) {
      float s;
      std::memcpy(&s, scales + 4 * t, sizeof s);
      const f8 vs = splat(s);
      for (int64_t j = t * kTile; j < (t + 1) * kTile; j += 8) {
        store8(dst + j, decode8(row + j) * vs);
      }
    }
    const uint8_t* rope = scales + 4 * (Dc / kTile);
    for (int64_t i = 0; i < Dr; ++i) {
      uint16_t b;
      std::memcpy(&b, rope + 2 * i, sizeof b);
      const uint32_t bits = static_cast<uint32_t>(b) << 16;
      std::memcpy(dst + Dc + i, &bits, sizeof bits);
    }
  }
};

std::tuple<at::Tensor, at::Tensor> fp8_sparse_mla_attention_cpu(
    const at::Tensor& q_nope_in, const at::Tensor& q_pe_in, const at::Tensor& kv_rows_in,
    const at::Tensor& indices, double scale) {
  constexpr const char* op = "fp8_sparse_mla_attention";
  // validate_fp8_sparse_mla_attention: the structure, in its order, then the indices' range.
  check_queries(op, q_nope_in, q_pe_in);
  const int64_t Dc = fp8_latent_width(op, q_nope_in), Dr = q_pe_in.size(2);
  check_fp8_rows(op, "kv_rows", kv_rows_in, 2, Dc, Dr);
  check_int32(op, "indices", indices, 2);
  TORCH_CHECK_VALUE(
      indices.size(0) == q_nope_in.size(0), "kvoffload::", op, ": argument 'indices' must have ",
      q_nope_in.size(0), " rows (T of 'q_nope'), got shape ", shape_str(indices));
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"q_nope", &q_nope_in}, {"q_pe", &q_pe_in},
                         {"kv_rows", &kv_rows_in}, {"indices", &indices}}) {
    check_cpu(op, name, *t);
  }
  const at::Tensor idx = indices.contiguous();
  const int64_t T_ = idx.size(0), K = idx.size(1), N = kv_rows_in.size(0);
  check_index_range(op, "indices", idx.const_data_ptr<int32_t>(), T_, K, N);

  const at::Tensor q_nope = q_nope_in.contiguous();
  const at::Tensor q_pe = q_pe_in.contiguous();
  const at::Tensor kv_rows = rows_contiguous(kv_rows_in);
  at::Tensor out = at::empty(q_nope.sizes(), q_nope.options());
  at::Tensor lse = at::empty({q_nope.size(0), q_nope.size(1)}, q_nope.options().dtype(at::kFloat));

  GilRelease no_gil;
  const int32_t* ip = idx.const_data_ptr<int32_t>();
  const auto* rows = static_cast<const uint8_t*>(kv_rows.const_data_ptr());
  const int64_t stride = kv_rows.stride(0);
  KVO_DISPATCH_FLOAT_BF16(q_nope.scalar_type(), "fp8_sparse_mla_attention", [&] {
    attend_all<scalar_t>(
        q_nope, q_pe, [&](int64_t t) { return Fp8RowSource{rows, stride, ip + t * K, K}; },
        static_cast<float>(scale), out, lse);
  });
  return {out, lse};
}

// ------------------------------------------------------------------ fp8_scatter_copy_sparse_mla_attention
// Copy-SFA over FP8 rows (torch_kvoffload/ops/fp8_copy_attention.py): the missed rows' bytes host -> hot
// buffer, then the attention above over hot_rows[r, slots[r]].

void fp8_scatter_copy_sparse_mla_attention_cpu(
    const at::Tensor& q_nope_in, const at::Tensor& q_pe_in, const at::Tensor& host_rows_in,
    const at::Tensor& block_table_in, const at::Tensor& hot_rows, const at::Tensor& miss_tokens_in,
    const at::Tensor& miss_slots_in, const at::Tensor& miss_count_in, const at::Tensor& slots_in, double scale,
    const at::Tensor& out, const at::Tensor& lse) {
  constexpr const char* op = "fp8_scatter_copy_sparse_mla_attention";
  // validate_fp8_copy_sfa: the structure, in its order, then the miss list and the slots' range.
  check_queries(op, q_nope_in, q_pe_in);
  const int64_t Dc = fp8_latent_width(op, q_nope_in), Dr = q_pe_in.size(2);
  check_fp8_rows(op, "host_rows", host_rows_in, 3, Dc, Dr);
  check_fp8_rows(op, "hot_rows", hot_rows, 3, Dc, Dr);
  check_copy_sfa_lists(
      op, q_nope_in, "hot_rows", hot_rows, block_table_in, miss_tokens_in, miss_slots_in, miss_count_in, slots_in,
      out, lse);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"q_nope", &q_nope_in}, {"q_pe", &q_pe_in},
                         {"host_rows", &host_rows_in}, {"block_table", &block_table_in}, {"hot_rows", &hot_rows},
                         {"miss_tokens", &miss_tokens_in}, {"miss_slots", &miss_slots_in},
                         {"miss_count", &miss_count_in}, {"slots", &slots_in}, {"out", &out}, {"lse", &lse}}) {
    check_cpu(op, name, *t);
  }
  const CopySfaLists lists(
      op, block_table_in, miss_tokens_in, miss_slots_in, miss_count_in, slots_in, host_rows_in.size(0),
      host_rows_in.size(1), hot_rows.size(1));

  // The op reads its inputs as they were before the call, even where they share memory with an output.
  const at::Tensor host_rows = rows_contiguous(unaliased_source(host_rows_in, hot_rows));
  const at::Tensor q_nope = unaliased_source(unaliased_source(q_nope_in, out), lse).contiguous();
  const at::Tensor q_pe = unaliased_source(unaliased_source(q_pe_in, out), lse).contiguous();
  // A hot buffer whose rows are not contiguous is worked on in a contiguous copy, written back at the end.
  const at::Tensor hot = rows_contiguous(hot_rows);
  const bool direct = out.is_contiguous() && lse.is_contiguous();
  at::Tensor o = direct ? out : at::empty(out.sizes(), out.options());
  at::Tensor l = direct ? lse : at::empty(lse.sizes(), lse.options());

  GilRelease no_gil;
  const int64_t K = lists.K;
  const int32_t* sp = lists.sp;
  auto* hp = static_cast<uint8_t*>(hot.data_ptr());
  const int64_t h0 = hot.stride(0), h1 = hot.stride(1);
  lists.copy(
      static_cast<const char*>(host_rows.const_data_ptr()), host_rows.stride(0), host_rows.stride(1),
      reinterpret_cast<char*>(hp), h0, h1, kv_row_bytes(Dc, Dr));
  KVO_DISPATCH_FLOAT_BF16(q_nope.scalar_type(), "fp8_scatter_copy_sparse_mla_attention", [&] {
    attend_all<scalar_t>(
        q_nope, q_pe, [&](int64_t r) { return Fp8RowSource{hp + r * h0, h1, sp + r * K, K}; },
        static_cast<float>(scale), o, l);
  });
  if (!hot.is_same(hot_rows)) {
    hot_rows.copy_(hot);
  }
  if (!direct) {
    out.copy_(o);
    lse.copy_(l);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(kvoffload, CPU, m) {
  m.impl("fp8_sparse_mla_attention", &fp8_sparse_mla_attention_cpu);
  m.impl("fp8_scatter_copy_sparse_mla_attention", &fp8_scatter_copy_sparse_mla_attention_cpu);
}

}  // namespace kvoffload
