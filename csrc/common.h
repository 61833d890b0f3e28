// Shared helpers for the CPU kernels: argument checks with the op's name in every message, and a
// guard that releases the Python GIL while a kernel runs so copies overlap Python-side compute.
#pragma once

#include <Python.h>

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <string>

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

}  // namespace kvoffload
