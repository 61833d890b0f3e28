// CPU kernels of the block / row copy family: kvoffload::copy_blocks and kvoffload::copy_rows.
// Every argument is validated before the first byte of the destination is written.

#include "common.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvoffload {

namespace {

// Bytes moved per parallel task: keeps tasks large enough that thread start-up does not dominate.
constexpr int64_t kBytesPerTask = 1 << 18;
// Rows prefetched ahead of the one being copied. Random rows of a large pool miss in cache and TLB;
// touching the next rows early keeps several memory requests in flight instead of one.
constexpr int64_t kPrefetchRows = 4;
constexpr int64_t kCacheLine = 64;

inline void prefetch_range(const char* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += kCacheLine) {
    __builtin_prefetch(p + off, 0, 0);
  }
}

// Row copies move at least this many bytes before rows are written with streaming stores.
constexpr int64_t kStreamMinBytes = int64_t{8} << 20;
// Streamed blocks prefetch their source this far ahead (the stores bypass the cache; the loads do not).
constexpr int64_t kStreamPrefetchBytes = 1024;

// One side of a row copy: slot -> row address in a paged tensor [num_blocks, block_size, ...].
struct PagedRows {
  const char* base;
  int64_t block_size, block_stride, row_stride;  // strides in bytes

  // A contiguous pair of leading dims (the usual pool layout) needs no division.
  const char* row(int64_t slot) const {
    if (block_stride == block_size * row_stride) {
      return base + slot * row_stride;
    }
    const int64_t block = slot / block_size;
    return base + block * block_stride + (slot - block * block_size) * row_stride;
  }
  bool aligned(int64_t a) const {
    return reinterpret_cast<uintptr_t>(base) % a == 0 && block_stride % a == 0 && row_stride % a == 0;
  }
};

// Where the rows of one copy_rows call live: row i goes from src slot si[i] to dst slot di[i].
struct RowGather {
  PagedRows src, dst;
  const int64_t* si;
  const int64_t* di;
  int64_t row_bytes;
};

// The row loops copy every field into locals first: stores through char pointers may alias anything,
// and the compiler would otherwise reload the addressing state after each one.
void copy_rows_memcpy(const RowGather& g, int64_t begin, int64_t end) {
  const PagedRows src = g.src, dst = g.dst;
  const int64_t *si = g.si, *di = g.di;
  const int64_t bytes = g.row_bytes;
  for (int64_t i = begin; i < end; ++i) {
    if (i + kPrefetchRows < end) {
      prefetch_range(src.row(si[i + kPrefetchRows]), bytes);
    }
    std::memcpy(const_cast<char*>(dst.row(di[i])), src.row(si[i]), bytes);
  }
}

#if defined(__x86_64__)
// Streaming (non-temporal) stores bypass the cache, so a destination line is never read before it is
// overwritten (no read-for-ownership): a random-row gather then moves 2 bytes of memory traffic per byte
// copied instead of 3, as a large contiguous memcpy does. Weakly ordered, hence the closing sfence.
// One body for both vector widths: Store(to, from) streams kWidth bytes.
template <int64_t kWidth, typename Store>
inline __attribute__((always_inline)) void copy_rows_stream(
    const RowGather& g, int64_t begin, int64_t end, Store store) {
  const PagedRows src = g.src, dst = g.dst;
  const int64_t *si = g.si, *di = g.di;
  const int64_t bytes = g.row_bytes;
  for (int64_t i = begin; i < end; ++i) {
    if (i + kPrefetchRows < end) {
      prefetch_range(src.row(si[i + kPrefetchRows]), bytes);
    }
    const char* from = src.row(si[i]);
    char* to = const_cast<char*>(dst.row(di[i]));
    for (int64_t off = 0; off < bytes; off += kWidth) {
      store(to + off, from + off);
    }
  }
  _mm_sfence();
}

__attribute__((target("avx2"))) void copy_rows_stream32(const RowGather& g, int64_t begin, int64_t end) {
  copy_rows_stream<32>(g, begin, end, [](char* to, const char* from) __attribute__((target("avx2"))) {
    _mm256_stream_si256(
        reinterpret_cast<__m256i*>(to), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from)));
  });
}

void copy_rows_stream16(const RowGather& g, int64_t begin, int64_t end) {
  copy_rows_stream<16>(g, begin, end, [](char* to, const char* from) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(to), _mm_loadu_si128(reinterpret_cast<const __m128i*>(from)));
  });
}


// Whole blocks written with streaming stores (copy_blocks with streaming=true): kWidth-byte stores from
// an aligned destination; the source may be unaligned. The caller fences.
template <int64_t kWidth, typename Store>
inline __attribute__((always_inline)) void stream_block(char* to, const char* from, int64_t bytes, Store store) {
  for (int64_t off = 0; off < bytes; off += kWidth) {
    if (off % kStreamPrefetchBytes == 0) {
      prefetch_range(from + off + kStreamPrefetchBytes, kStreamPrefetchBytes);
    }
    store(to + off, from + off);
  }
}

__attribute__((target("avx2"))) void stream_block32(char* to, const char* from, int64_t bytes) {
  stream_block<32>(to, from, bytes, [](char* t, const char* f) __attribute__((target("avx2"))) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(t), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(f)));
  });
}

void stream_block16(char* to, const char* from, int64_t bytes) {
  stream_block<16>(to, from, bytes, [](char* t, const char* f) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(t), _mm_loadu_si128(reinterpret_cast<const __m128i*>(f)));
  });
}
#endif

// Copies one block; with `streaming`, a destination aligned for streaming stores (and a block size that
// is a multiple of their width) is written with them, any other block with memcpy.
inline void copy_one_block(char* to, const char* from, int64_t bytes, bool streaming, bool avx2) {
#if defined(__x86_64__)
  if (streaming) {
    const auto addr = reinterpret_cast<uintptr_t>(to);
    if (avx2 && addr % 32 == 0 && bytes % 32 == 0) {
      stream_block32(to, from, bytes);
      return;
    }
    if (addr % 16 == 0 && bytes % 16 == 0) {
      stream_block16(to, from, bytes);
      return;
    }
  }
#else
  (void)streaming;
  (void)avx2;
#endif
  std::memcpy(to, from, bytes);
}

using RowRangeCopy = void (*)(const RowGather&, int64_t, int64_t);

// Streaming stores for copies far larger than the cache (their destination would not stay cached for a
// later reader anyway) when every destination row is aligned for them; memcpy otherwise.
RowRangeCopy pick_row_copy(const RowGather& g, int64_t n) {
#if defined(__x86_64__)
  if (n * g.row_bytes >= kStreamMinBytes) {
    if (g.dst.aligned(32) && g.row_bytes % 32 == 0 && __builtin_cpu_supports("avx2")) {
      return copy_rows_stream32;
    }
    if (g.dst.aligned(16) && g.row_bytes % 16 == 0) {
      return copy_rows_stream16;
    }
  }
#endif
  return copy_rows_memcpy;
}

bool trailing_contiguous(const at::Tensor& t, int64_t first_dim) {
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= first_dim; --d) {
    if (t.size(d) != 1 && t.stride(d) != expected) {
      return false;
    }
    expected *= t.size(d);
  }
  return true;
}

void check_pair(const char* op, int64_t lead_dims, const at::Tensor& src, const at::Tensor& dst) {
  TORCH_CHECK_VALUE(
      src.device().is_cpu() && dst.device().is_cpu(), "kvoffload::", op,
      ": the CPU kernel needs 'src' and 'dst' on the CPU, got ", src.device(), " and ", dst.device());
  TORCH_CHECK_VALUE(
      src.dim() >= lead_dims, "kvoffload::", op, ": argument 'src' must have at least ", lead_dims,
      " dimensions, got shape ", shape_str(src));
  TORCH_CHECK_VALUE(
      dst.dim() >= lead_dims, "kvoffload::", op, ": argument 'dst' must have at least ", lead_dims,
      " dimensions, got shape ", shape_str(dst));
  TORCH_CHECK_VALUE(
      src.sizes().slice(lead_dims) == dst.sizes().slice(lead_dims), "kvoffload::", op,
      ": 'src' and 'dst' must have equal trailing shapes after dim ", lead_dims - 1, ", got ",
      shape_str(src), " and ", shape_str(dst));
  TORCH_CHECK_TYPE(
      src.scalar_type() == dst.scalar_type(), "kvoffload::", op,
      ": 'src' and 'dst' must have the same dtype, got ", dtype_str(src.scalar_type()), " and ",
      dtype_str(dst.scalar_type()));
  check_destination(op, "dst", dst, lead_dims);
}

// Checks 0 <= idx[i * step] < limit for every i.
void check_range(
    const char* op, const char* arg, const int64_t* idx, int64_t n, int64_t step, int64_t limit) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = idx[i * step];
    TORCH_CHECK_INDEX(
        v >= 0 && v < limit, "kvoffload::", op, ": argument '", arg, "' entry ", i, " is ", v,
        ", expected a value in [0, ", limit, ")");
  }
}

// Checks that idx[i * step] are pairwise distinct (all already known to lie in [0, limit)).
void check_unique(
    const char* op, const char* arg, const int64_t* idx, int64_t n, int64_t step, int64_t limit) {
  if (n < 2) {
    return;
  }
  if (limit <= 64 * n || limit <= (int64_t{1} << 24)) {
    std::vector<bool> seen(static_cast<size_t>(limit), false);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t v = idx[i * step];
      TORCH_CHECK_VALUE(
          !seen[v], "kvoffload::", op, ": argument '", arg, "' holds destination ", v,
          " more than once (entry ", i, "); destinations must be distinct");
      seen[v] = true;
    }
    return;
  }
  std::vector<int64_t> sorted(n);
  for (int64_t i = 0; i < n; ++i) {
    sorted[i] = idx[i * step];
  }
  std::sort(sorted.begin(), sorted.end());
  auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  TORCH_CHECK_VALUE(
      dup == sorted.end(), "kvoffload::", op, ": argument '", arg, "' holds destination ", *dup,
      " more than once; destinations must be distinct");
}

int64_t grain_for(int64_t item_bytes) {
  return std::max<int64_t>(1, kBytesPerTask / std::max<int64_t>(1, item_bytes));
}

void copy_blocks_cpu(
    const at::Tensor& src_in, const at::Tensor& dst, const at::Tensor& mapping, bool streaming) {
  constexpr const char* op = "copy_blocks";
  check_pair(op, 1, src_in, dst);
  check_index_tensor(op, "mapping", mapping, at::kLong, 2);
  TORCH_CHECK_VALUE(
      mapping.size(1) == 2, "kvoffload::", op,
      ": argument 'mapping' must have shape [n, 2] of (src_block, dst_block), got ", shape_str(mapping));
  const at::Tensor map = mapping.contiguous();
  const int64_t n = map.size(0);
  const int64_t* m = map.const_data_ptr<int64_t>();
  check_range(op, "mapping[:, 0]", m, n, 2, src_in.size(0));
  check_range(op, "mapping[:, 1]", m + 1, n, 2, dst.size(0));
  check_unique(op, "mapping[:, 1]", m + 1, n, 2, dst.size(0));
  if (n == 0 || src_in.numel() == 0) {
    return;
  }
  const at::Tensor src = unaliased_source(src_in, dst);

  GilRelease no_gil;
  if (trailing_contiguous(src, 1) && trailing_contiguous(dst, 1)) {
    const int64_t block_bytes = src.numel() / src.size(0) * src.element_size();
    const auto* s = static_cast<const char*>(src.const_data_ptr());
    auto* d = static_cast<char*>(dst.data_ptr());
    const int64_t s_stride = src.stride(0) * src.element_size();
    const int64_t d_stride = dst.stride(0) * dst.element_size();
#if defined(__x86_64__)
    const bool avx2 = streaming && __builtin_cpu_supports("avx2");
#else
    const bool avx2 = false;
#endif
    at::parallel_for(0, n, grain_for(block_bytes), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        copy_one_block(d + m[2 * i + 1] * d_stride, s + m[2 * i] * s_stride, block_bytes, streaming, avx2);
      }
#if defined(__x86_64__)
      if (streaming) {
        _mm_sfence();  // streaming stores are weakly ordered: visible before the copy returns
      }
#endif
    });
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    dst.select(0, m[2 * i + 1]).copy_(src.select(0, m[2 * i]));
  }
}

void copy_rows_cpu(
    const at::Tensor& src_in, const at::Tensor& dst, const at::Tensor& src_slots,
    const at::Tensor& dst_slots) {
  constexpr const char* op = "copy_rows";
  check_pair(op, 2, src_in, dst);
  check_index_tensor(op, "src_slots", src_slots, at::kLong, 1);
  check_index_tensor(op, "dst_slots", dst_slots, at::kLong, 1);
  TORCH_CHECK_VALUE(
      src_slots.numel() == dst_slots.numel(), "kvoffload::", op,
      ": 'src_slots' and 'dst_slots' must have the same length, got ", src_slots.numel(), " and ",
      dst_slots.numel());
  const at::Tensor ss = src_slots.contiguous();
  const at::Tensor ds = dst_slots.contiguous();
  const int64_t n = ss.numel();
  const int64_t* si = ss.const_data_ptr<int64_t>();
  const int64_t* di = ds.const_data_ptr<int64_t>();
  const int64_t src_bs = src_in.size(1);
  const int64_t dst_bs = dst.size(1);
  check_range(op, "src_slots", si, n, 1, src_in.size(0) * src_bs);
  check_range(op, "dst_slots", di, n, 1, dst.size(0) * dst_bs);
  check_unique(op, "dst_slots", di, n, 1, dst.size(0) * dst_bs);
  if (n == 0 || src_in.numel() == 0) {
    return;
  }
  const at::Tensor src = unaliased_source(src_in, dst);

  GilRelease no_gil;
  if (trailing_contiguous(src, 2) && trailing_contiguous(dst, 2)) {
    const int64_t esz = src.element_size();
    const int64_t row_bytes = src.numel() / (src.size(0) * src_bs) * esz;
    const RowGather g{
        {static_cast<const char*>(src.const_data_ptr()), src_bs, src.stride(0) * esz, src.stride(1) * esz},
        {static_cast<const char*>(dst.data_ptr()), dst_bs, dst.stride(0) * esz, dst.stride(1) * esz},
        si,
        di,
        row_bytes};
    const RowRangeCopy copy_range = pick_row_copy(g, n);
    at::parallel_for(0, n, grain_for(row_bytes), [&](int64_t begin, int64_t end) {
      copy_range(g, begin, end);
    });
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    dst.select(0, di[i] / dst_bs)
        .select(0, di[i] % dst_bs)
        .copy_(src.select(0, si[i] / src_bs).select(0, si[i] % src_bs));
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(kvoffload, CPU, m) {
  m.impl("copy_blocks", &copy_blocks_cpu);
  m.impl("copy_rows", &copy_rows_cpu);
}

}  // namespace kvoffload
