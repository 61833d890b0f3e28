// Out-of-line helpers shared by the kernel files (see common.h).

#include "common.h"

#include <utility>

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

}  // namespace

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
