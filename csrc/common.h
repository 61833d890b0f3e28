// Shared helpers for the CPU kernels: argument checks with the op's name in every message, and a
// guard that releases the Python GIL while a kernel runs so copies overlap Python-side compute.
#pragma once

#include <Python.h>

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/FunctionRef.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

// Compiles a hot function twice on x86-64 — for AVX2/FMA machines (x86-64-v3) and a baseline — and
// picks the version at load time; elsewhere (e.g. aarch64 hosts of Ascend NPUs) it expands to nothing.
#if defined(__x86_64__) && defined(__GNUC__)
#define KVO_TARGET_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define KVO_TARGET_CLONES
#endif

// Dispatches a kernel body written in terms of scalar_t over the two main-KV dtypes, fp32 and bf16.
#define KVO_DISPATCH_FLOAT_BF16(TYPE, NAME, ...) \
  AT_DISPATCH_SWITCH(                            \
      TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace kvoffload {

// Releases the GIL for the guard's lifetime when the calling thread holds it (a kernel may also be
// reached from C++ without Python, where there is nothing to release).
class GilRelease {
 public:
  GilRelease() {
    if (Py_IsInitialized() && PyGILState_Check()) {
      state_ = PyEval_SaveThread();
    }
  }
  ~GilRelease() {
    if (state_ != nullptr) {
      PyEval_RestoreThread(state_);
    }
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_ = nullptr;
};

inline std::string shape_str(const at::Tensor& t) {
  return c10::str(t.sizes());
}

// "torch.int64" style dtype names, matching the messages of the Python kernels.
inline std::string dtype_str(at::ScalarType dtype) {
  return "torch." + std::string(c10::getDtypeNames(dtype).first);
}

// Checks that a tensor argument is on the CPU and has the expected dtype.
inline void check_cpu_tensor(const char* op, const char* arg, const at::Tensor& t, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(
      t.device().is_cpu(), "kvoffload::", op, ": argument '", arg, "' must be a CPU tensor, got ",
      t.device());
  TORCH_CHECK_TYPE(
      t.scalar_type() == dtype, "kvoffload::", op, ": argument '", arg, "' must have dtype ",
      dtype_str(dtype), ", got ", dtype_str(t.scalar_type()));
}

// Checks an index tensor: CPU, the expected dtype and number of dimensions.
inline void check_index_tensor(
    const char* op, const char* arg, const at::Tensor& t, at::ScalarType dtype, int64_t dim) {
  check_cpu_tensor(op, arg, t, dtype);
  TORCH_CHECK_VALUE(
      t.dim() == dim, "kvoffload::", op, ": argument '", arg, "' must have exactly ", dim,
      " dimensions, got shape ", shape_str(t));
}

// Checks that `t` can be written in place by an op addressing its units (blocks, rows) by the first
// `lead_dims` dims, as the Python kernels check it: no dim of stride 0 (at::has_internal_overlap), no unit
// whose own elements overlap (sorted by stride, each dim steps past what the smaller dims reach), and no
// tensor that requires grad while grad mode is on (the ops have no derivative). Distinct units may
// overlap each other (a byte arena viewed with a row starting at every byte).
void check_destination(const char* op, const char* arg, const at::Tensor& t, int64_t lead_dims);

// Whether src and dst may share bytes (same storage and intersecting byte ranges).
bool may_overlap(const at::Tensor& src, const at::Tensor& dst);

// The tensor a kernel may read while writing dst: src itself, or a snapshot of it when it shares memory
// with dst. An op never reads what it writes: the result is as if src had been cloned before the call,
// which is exactly the program a compiler meant when it dropped such a clone (pytorch#198031).
at::Tensor unaliased_source(const at::Tensor& src, const at::Tensor& dst);

// ------------------------------------------------------------------------------------------ FP8 values
// What the FP8 kernel files share (row formats in torch_kvoffload/ops/fp8.py): every step is the single fp32
// operation the reference kernels perform, so results are bit-identical to them.
namespace fp8 {

constexpr int64_t kTile = 128;  // values per fp32 scale
constexpr float kFp8Max = 448.0f;
// The Python scalar 1e-4 as torch's clamp_min applies it to an fp32 tensor.
constexpr float kAmaxFloor = 1e-4f;
// torch.tensor(1.0 / 448.0, dtype=torch.float32): the double quotient rounded once to fp32.
constexpr float kInvFp8Max = static_cast<float>(1.0 / 448.0);

// 2 ** ceil(log2(v)) for positive fp32 v, exactly as the reference's frexp / where / ldexp (frexp of
// inf or NaN gives exponent 0 there and here: scale 1).
inline float pow2_ceil(float v) {
  int e = 0;
  const float m = std::frexp(v, &e);
  return std::ldexp(1.0f, m == 0.5f ? e - 1 : e);
}

// clamp_min with torch's NaN propagation.
inline float floor_at(float v, float lo) {
  return v < lo ? lo : v;
}

// Largest magnitude of a 128-value tile, NaN when it holds one (torch's amax propagates NaN).
float tile_amax(const float* x);

// A tile divided by `scale` (true division, as the reference) and encoded as e4m3fn (round to nearest
// even); the _clamped variant clamps the quotient to [-448, 448] first (NaN passes through, as torch's clamp).
void encode_tile(const float* x, float scale, uint8_t* out);
void encode_tile_clamped(const float* x, float scale, uint8_t* out);

// One 128-value group of an indexer row (DeepSeek's act_quant, ue8m0 scale): writes its 128 e4m3fn codes
// and returns its fp32 scale 2 ** ceil(log2(max(amax, 1e-4) * (1 / 448))).
float quantize_index_group(const float* x, uint8_t* codes);

// fp32 value of every e4m3fn byte (the c10 decoding torch's .float() uses; NaN bytes decode to NaN).
const float* fp8_table();

}  // namespace fp8

// ------------------------------------------------------------------------------ lightning-indexer family
// What the indexer kernel files share: argument checks, the validated request layout, the per-(token, key
// block) score loop and top-k selection, and the Hadamard transform.
namespace indexer {

void check_dim(const char* op, const char* arg, const at::Tensor& t, int64_t dim);
void check_dtype(const char* op, const char* arg, const at::Tensor& t, at::ScalarType dtype);
// `t` is a CPU tensor ("must be on cpu (as '<first>')", the device check of the Python validators).
void check_cpu(const char* op, const char* arg, const at::Tensor& t, const char* first);

// Validated description of the requests: per query token its request and visible key count.
struct Layout {
  int64_t T = 0, B = 0, max_blocks = 0, block_size = 0;
  std::vector<int32_t> token_req;  // [T]
  std::vector<int64_t> visible;    // [T]
  const int32_t* table = nullptr;  // [B, max_blocks]
};

// Structure of block_table / cu_seqlens_q / seq_lens_k (dtypes, dims, batch sizes).
Layout make_layout(
    const char* op, int64_t T, int64_t num_blocks, int64_t block_size, const at::Tensor& table,
    const at::Tensor& cu_in, const at::Tensor& lens_in);

// Their values (contiguous CPU tensors; `table` must outlive the layout); fills token_req / visible.
void fill_layout_values(
    const char* op, Layout& L, int64_t num_blocks, const at::Tensor& table, const at::Tensor& cu_t,
    const at::Tensor& lens_t);

// block_fn(t, block, s0, n, out): the scores of token t against its keys s0 .. s0+n-1 (logical key block
// `block`) into out[0 .. n).
using BlockFn = c10::function_ref<void(int64_t, int64_t, int64_t, int64_t, float*)>;

// Calls block_fn for every (token in [t0, t1), visible key block), in parallel; out points into row
// `t - t0` of `buf` (row width `width`) at column s0.
void for_each_block(const Layout& L, int64_t t0, int64_t t1, float* buf, int64_t width, BlockFn block_fn);

// Scores all tokens with block_fn and writes the top-k positions of each into `result` (int32 [T, top_k]):
// score descending (NaN first, as torch.sort), ties by lower position, -1 past the visible keys.
void topk_all(const Layout& L, int64_t top_k, at::Tensor& result, BlockFn block_fn);

// The input checks of the Hadamard quantisers: `x` fp32 / bf16 on the CPU, at least 1-D, a power-of-two last
// dim of at least `min_d`; `requirement` names that last-dim rule in the message. Returns the last dim.
int64_t check_hadamard_input(const char* op, const at::Tensor& x, int64_t min_d, const char* requirement);

// In-place unnormalised fast Walsh-Hadamard transform (Sylvester order); stage order and pairing match
// the reference kernel so both round identically.
void fwht(float* y, int64_t d);

// fp32 normalisation 1/sqrt(d), rounded from double exactly as the reference (hadamard_norm) does.
inline float hadamard_norm(int64_t d) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
}

}  // namespace indexer

}  // namespace kvoffload
