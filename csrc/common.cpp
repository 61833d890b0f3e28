// Out-of-line helpers shared by the kernel files (see common.h).

#include "common.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cstdlib>
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

}  // namespace kvoffload
