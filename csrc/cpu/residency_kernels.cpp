// CPU kernels of the residency family: kvoffload::residency_update and kvoffload::lightning_indexer_manage.
//
// Two passes over the rows, both parallel. Pass 1 validates every row, finds its hits and partitions its
// LRU order without writing any argument (into scratch: the top-k entry -> slot array [R, K + 1], the
// hit and non-hit slots in LRU order [R, C + 8] each, and per-row counts); an error is recorded per row
// and the one of the lowest row is raised after the pass, so the state is untouched on error and the
// message deterministic. Pass 2 rewrites the state and outputs from the scratch.
// A row costs O(K + C) with no sort and no hashing: positions are looked up in a per-thread
// direct-address table, and the loops have no data-dependent branches (hits and misses are about equally
// likely, so branches would mispredict). On x86-64 the row functions are also compiled for AVX2: the
// resident matching uses gathers there, and the order partition and slot assignment pack with lane
// permutations. TORCH_KVOFFLOAD_RESIDENCY_SIMD=0 selects the portable code (the tests run both).

#include "common.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVO_RESIDENCY_AVX2 1
#else
#define KVO_RESIDENCY_AVX2 0
#endif

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace kvoffload {

namespace {

enum class Policy { kLru, kScore };

constexpr int64_t kSlotsPerTask = 1 << 15;

// Scratch marks in the per-row hit array of pass 1.
constexpr int32_t kPadding = -2;
constexpr int32_t kMiss = -1;

enum class ErrorCode : int32_t {
  kNone = 0,
  kNegativeStable,
  kLruNotPermutation,
  kBadSlotToken,
  kDuplicateTopk,
  kDuplicateResident,
};

struct RowError {
  ErrorCode code = ErrorCode::kNone;
  int64_t a = 0;
  int64_t b = 0;
};

void check_tensor(
    const char* op, const char* arg, const at::Tensor& t, at::ScalarType dtype,
    std::optional<std::vector<int64_t>> shape, const char* what) {
  check_cpu_tensor(op, arg, t, dtype);
  if (shape) {
    TORCH_CHECK_VALUE(
        t.sizes() == at::IntArrayRef(*shape), "kvoffload::", op, ": argument '", arg,
        "' must have shape ", what, " = ", c10::str(at::IntArrayRef(*shape)), ", got ", shape_str(t));
  }
}

void check_contiguous(const char* op, const char* arg, const at::Tensor& t) {
  TORCH_CHECK_VALUE(
      t.is_contiguous(), "kvoffload::", op, ": argument '", arg,
      "' must be contiguous (it is written in place), got strides ", c10::str(t.strides()));
}

Policy parse_policy(const char* op, c10::string_view policy) {
  if (policy == "lru") {
    return Policy::kLru;
  }
  if (policy == "score") {
    return Policy::kScore;
  }
  TORCH_CHECK_VALUE(
      false, "kvoffload::", op, ": argument 'policy' must be one of ['lru', 'score'], got '",
      std::string(policy), "'");
}

// Structural checks shared by both ops (messages match torch_kvoffload/ops/residency.py).
void check_residency_args(
    const char* op, const at::Tensor& stt, const at::Tensor& lru, const at::Tensor& row_request,
    const at::Tensor& topk, const at::Tensor& request_ids, const at::Tensor& stable_len,
    const std::optional<at::Tensor>& scores, Policy policy, const at::Tensor& slots,
    const at::Tensor& miss_tokens, const at::Tensor& miss_slots, const at::Tensor& miss_count,
    const at::Tensor& evictions, bool topk_is_output) {
  check_tensor(op, "slot_to_token", stt, at::kInt, std::nullopt, "");
  TORCH_CHECK_VALUE(
      stt.dim() == 2, "kvoffload::", op,
      ": argument 'slot_to_token' must have exactly 2 dimensions, got shape ", shape_str(stt));
  const int64_t R = stt.size(0), C = stt.size(1);
  check_tensor(op, "lru_order", lru, at::kInt, std::vector<int64_t>{R, C}, "[R, C]");
  check_tensor(op, "row_request", row_request, at::kLong, std::vector<int64_t>{R}, "[R]");
  check_tensor(op, "topk", topk, at::kInt, std::nullopt, "");
  TORCH_CHECK_VALUE(
      topk.dim() == 2, "kvoffload::", op, ": argument 'topk' must have exactly 2 dimensions, got shape ",
      shape_str(topk));
  TORCH_CHECK_VALUE(
      topk.size(0) == R, "kvoffload::", op, ": argument 'topk' must have R = ", R, " rows, got shape ",
      shape_str(topk));
  const int64_t K = topk.size(1);
  TORCH_CHECK_VALUE(
      K <= C, "kvoffload::", op, ": argument 'topk' has K = ", K,
      " entries per row, more than the capacity C = ", C);
  check_tensor(op, "request_ids", request_ids, at::kLong, std::vector<int64_t>{R}, "[R]");
  check_tensor(op, "stable_len", stable_len, at::kLong, std::vector<int64_t>{R}, "[R]");
  if (scores) {
    check_tensor(op, "scores", *scores, at::kFloat, std::nullopt, "");
    TORCH_CHECK_VALUE(
        scores->dim() == 2, "kvoffload::", op,
        ": argument 'scores' must have exactly 2 dimensions, got shape ", shape_str(*scores));
    TORCH_CHECK_VALUE(
        scores->size(0) == R, "kvoffload::", op, ": argument 'scores' must have R = ", R,
        " rows, got shape ", shape_str(*scores));
  } else {
    TORCH_CHECK_VALUE(
        policy != Policy::kScore, "kvoffload::", op,
        ": argument 'scores' is required with policy 'score', got None");
  }
  const std::vector<int64_t> rk{R, K}, r1{R};
  if (topk_is_output) {
    check_tensor(op, "topk", topk, at::kInt, rk, "[R, K]");
  }
  check_tensor(op, "slots", slots, at::kInt, rk, "[R, K]");
  check_tensor(op, "miss_tokens", miss_tokens, at::kInt, rk, "[R, K]");
  check_tensor(op, "miss_slots", miss_slots, at::kInt, rk, "[R, K]");
  check_tensor(op, "miss_count", miss_count, at::kInt, r1, "[R]");
  check_tensor(op, "evictions", evictions, at::kInt, r1, "[R]");
  check_contiguous(op, "slot_to_token", stt);
  check_contiguous(op, "lru_order", lru);
  check_contiguous(op, "row_request", row_request);
  if (topk_is_output) {
    check_contiguous(op, "topk", topk);
  }
  check_contiguous(op, "slots", slots);
  check_contiguous(op, "miss_tokens", miss_tokens);
  check_contiguous(op, "miss_slots", miss_slots);
  check_contiguous(op, "miss_count", miss_count);
  check_contiguous(op, "evictions", evictions);
}

// Open-addressing hash from a row's valid top-k positions to their index in the row.
class TopkHash {
 public:
  void reset(int64_t k) {
    int64_t size = 16;
    bits_ = 4;
    while (size < 2 * k) {
      size <<= 1;
      ++bits_;
    }
    mask_ = static_cast<uint32_t>(size - 1);
    keys_.assign(static_cast<size_t>(size), -1);
    if (vals_.size() < static_cast<size_t>(size)) {
      vals_.resize(static_cast<size_t>(size));
    }
  }
  // Inserts key -> val; returns false when key is already present.
  bool insert(int32_t key, int32_t val) {
    uint32_t h = slot_of(key);
    while (true) {
      const int32_t k = keys_[h];
      if (k == -1) {
        keys_[h] = key;
        vals_[h] = val;
        return true;
      }
      if (k == key) {
        return false;
      }
      h = (h + 1) & mask_;
    }
  }
  int32_t find(int32_t key) const {
    uint32_t h = slot_of(key);
    while (true) {
      const int32_t k = keys_[h];
      if (k == key) {
        return vals_[h];
      }
      if (k == -1) {
        return -1;
      }
      h = (h + 1) & mask_;
    }
  }

 private:
  uint32_t slot_of(int32_t key) const {
    return (static_cast<uint32_t>(key) * 2654435769u) >> (32 - bits_);
  }
  std::vector<int32_t> keys_;
  std::vector<int32_t> vals_;
  uint32_t mask_ = 0;
  int bits_ = 4;
};

// Row stride of the slot lists in scratch: 8 entries of slack, since vector stores write up to 7 entries
// past a list's end and victims are read up to 7 past the last miss.
constexpr int64_t list_stride(int64_t C) {
  return C + 8;
}

struct Views {
  int64_t R, C, K;
  int32_t* stt;
  int32_t* lru;
  int64_t* row_request;
  const int32_t* topk;
  const int64_t* request_ids;
  const int64_t* stable_len;
  const float* scores;  // nullptr unless the score policy needs it
  int64_t scores_len, scores_stride0, scores_stride1;
  int32_t* slots;
  int32_t* miss_tokens;
  int32_t* miss_slots;
  int32_t* miss_count;
  int32_t* evictions;
  int32_t* hit;          // scratch [R, K + 1]: top-k entry -> slot, or kMiss / kPadding; entry K a sink
  int64_t* row_counts;   // scratch [R, 2]: hits, misses
  int32_t* nonhit;       // scratch [R, list_stride(C)]: the non-hit slots in LRU order
  int32_t* hits;         // scratch [R, list_stride(C)]: the hit slots in LRU order
  Policy policy;
  bool simd;
};

// Positions below this bound use a direct-address table (per thread, 2 or 4 bytes per position) instead of
// the hash; larger positions (or K > 2^20) fall back to the hash.
constexpr int32_t kDirectLimit = 1 << 21;

// The row functions are inlined into two callers, a baseline one and (x86-64) an AVX2 one, so that the
// loops the compiler vectorises use 256-bit vectors where the CPU has them.
#define KVO_ALWAYS_INLINE inline __attribute__((always_inline))

// Per-thread direct-address table position -> tagged top-k index: an entry is (tag << kIndexBits) | k,
// and it belongs to the row being matched iff it carries that row's tag. Every row takes a new tag, so no
// row clears what it wrote (a scattered store per top-k entry saved); when the tags run out the table is
// zeroed (tag 0 marks an entry no row owns). 16-bit entries while K <= 2048 (31 tags between zeroings),
// halving the (L2-resident) table, 32-bit ones while K <= 2^20 (4095 tags); two entries of slack for
// 4-byte gathers.
template <typename Index>
constexpr int kIndexBits = sizeof(Index) == 2 ? 11 : 20;
template <typename Index>
constexpr uint32_t kIndexMask = (uint32_t{1} << kIndexBits<Index>) - 1;
template <typename Index>
constexpr int64_t kMaxDirectK = int64_t{1} << kIndexBits<Index>;

template <typename Index>
class DirectTable {
 public:
  static DirectTable& of_this_thread() {
    thread_local DirectTable table;
    return table;
  }
  // The table covering positions [0, positions), and the tag of a new row.
  Index* begin_row(int64_t positions, uint32_t& tag) {
    const auto used = static_cast<size_t>(positions + 2);
    if (entries_.size() < used) {
      entries_.resize(used, 0);
    }
    if (tag_ == kMaxTag) {
      // only the entries below dirty_ were written since the last zeroing
      std::fill(entries_.begin(), entries_.begin() + static_cast<std::ptrdiff_t>(dirty_), Index{0});
      tag_ = 0;
      dirty_ = 0;
    }
    dirty_ = std::max(dirty_, used);
    tag = ++tag_;
    return entries_.data();
  }

 private:
  static constexpr uint32_t kMaxTag = (uint32_t{1} << (8 * sizeof(Index) - kIndexBits<Index>)) - 1;
  std::vector<Index> entries_;
  uint32_t tag_ = 0;
  size_t dirty_ = 0;
};

// Writes the row's entries, table[position] = (tag, top-k index) (padding entries write the sink entry),
// and hit[k] = kMiss / kPadding. Returns whether a position occurs twice.
template <typename Index>
KVO_ALWAYS_INLINE bool fill_table(
    Index* table, uint32_t tag, const int32_t* tk, int64_t K, int64_t sink, int32_t* hit, int64_t& n_valid) {
  const uint32_t tagged = tag << kIndexBits<Index>;
  uint32_t dup = 0;
  int64_t valid = 0;
  for (int64_t k = 0; k < K; ++k) {
    const int32_t t = tk[k];
    const bool pad = t < 0;
    const int64_t at = pad ? sink : t;
    dup |= static_cast<uint32_t>(!pad) & static_cast<uint32_t>((table[at] >> kIndexBits<Index>) == tag);
    table[at] = static_cast<Index>(tagged | static_cast<uint32_t>(k));
    hit[k] = pad ? kPadding : kMiss;
    valid += !pad;
  }
  n_valid = valid;
  return dup != 0;
}

bool simd_enabled() {
#if KVO_RESIDENCY_AVX2
  static const bool cpu = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
  const char* env = std::getenv("TORCH_KVOFFLOAD_RESIDENCY_SIMD");
  return cpu && !(env != nullptr && std::strcmp(env, "0") == 0);
#else
  return false;
#endif
}

// Matches a row's residents against the top-k (portable loop): a resident slot s holding a visible
// position t < limit that is in the top-k at entry k (its table entry carries the row's tag) gets
// hit[k] = s and flags[s] = 1; every other slot writes the sink hit[K] and flags[s] = 0. No
// data-dependent branch: a selected resident is about as likely as not. Also ORs "a token below -1" into
// bad_token. Returns the number of selected residents.
template <typename Index>
KVO_ALWAYS_INLINE int64_t match_residents(
    const int32_t* stt, int64_t C, uint32_t limit, const Index* index, uint32_t tag, int64_t K, int32_t* hit,
    uint8_t* flags, uint32_t& bad_token, int64_t from = 0) {
  const auto uK = static_cast<uint32_t>(K);
  int64_t n_selected = 0;
  uint32_t bad = 0;
  for (int64_t s = from; s < C; ++s) {
    const int32_t t = stt[s];
    bad |= static_cast<uint32_t>(t < -1);
    const uint32_t in = static_cast<uint32_t>(t) < limit;
    const uint32_t e = index[static_cast<uint32_t>(t) & (0u - in)];
    const uint32_t sel = in & static_cast<uint32_t>((e >> kIndexBits<Index>) == tag);
    const uint32_t k = e & kIndexMask<Index>;
    hit[uK ^ ((k ^ uK) & (0u - sel))] = static_cast<int32_t>(s);
    flags[s] = static_cast<uint8_t>(sel);
    n_selected += sel;
  }
  bad_token |= bad;
  return n_selected;
}

// Whether every entry of an LRU order row lies in [0, C).
KVO_ALWAYS_INLINE bool order_in_range(const int32_t* order, int64_t C) {
  const auto uC = static_cast<uint32_t>(C);
  uint32_t out_of_range = 0;
  for (int64_t i = 0; i < C; ++i) {
    out_of_range |= static_cast<uint32_t>(static_cast<uint32_t>(order[i]) >= uC);
  }
  return out_of_range == 0;
}

// Partition loop over order[from, C), continuing with b hits so far; see partition_order.
KVO_ALWAYS_INLINE bool partition_order_loop(
    const int32_t* order, int64_t C, uint8_t* flags, int32_t* hits, int32_t* nonhit, int64_t from, int64_t b,
    uint32_t seen_twice) {
  for (int64_t i = from; i < C; ++i) {
    const int32_t s = order[i];
    const uint32_t f = flags[s];
    flags[s] = static_cast<uint8_t>(f | 2);
    seen_twice |= f;
    hits[b] = s;
    nonhit[i - b] = s;
    b += f & 1;
  }
  return (seen_twice & 2) == 0;
}

// Partitions the LRU order into hit and non-hit slots, each keeping its order, and checks that the order
// is a permutation of 0..C-1 (C values in [0, C), none twice). flags[s] is 1 for a hit slot and 0
// otherwise on entry; each visit sets bit 1, so a second visit of a slot finds it set.
KVO_ALWAYS_INLINE bool partition_order(
    const int32_t* order, int64_t C, uint8_t* flags, int32_t* hits, int32_t* nonhit) {
  return order_in_range(order, C) && partition_order_loop(order, C, flags, hits, nonhit, 0, 0, 0);
}

#if KVO_RESIDENCY_AVX2
// kMaskBytes.bytes[m]: byte i is bit i of the 8-bit mask m.
struct MaskBytes {
  uint64_t bytes[256];
  MaskBytes() {
    for (int m = 0; m < 256; ++m) {
      bytes[m] = 0;
      for (int i = 0; i < 8; ++i) {
        bytes[m] |= static_cast<uint64_t>((m >> i) & 1) << (8 * i);
      }
    }
  }
};
const MaskBytes kMaskBytes;

// kLanes.pack[m]: the set lanes of the 8-bit mask m in increasing order (a vpermd control that
// left-packs them); kLanes.expand[m]: lane l of m takes source lane popcount(m & ((1 << l) - 1)) (the
// inverse, spreading consecutive values over the set lanes).
struct LaneTables {
  uint64_t pack[256];
  uint64_t expand[256];
  LaneTables() {
    for (int m = 0; m < 256; ++m) {
      pack[m] = 0;
      expand[m] = 0;
      int n = 0;
      for (int lane = 0; lane < 8; ++lane) {
        if ((m >> lane) & 1) {
          pack[m] |= static_cast<uint64_t>(lane) << (8 * n);
          expand[m] |= static_cast<uint64_t>(n) << (8 * lane);
          ++n;
        }
      }
    }
  }
};
const LaneTables kLanes;

inline __attribute__((target("avx2"))) __m256i lane_control(uint64_t bytes) {
  return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(bytes)));
}

// AVX2 version of partition_order, 8 order entries per step: the flags are read and marked with scalar
// accesses (an AVX2 gather is slower than eight loads here, and the marks are scattered stores anyway),
// and each list takes the step's slots with one lane permutation and one vector store instead of a
// store per slot. Writes up to 7 entries past the end of either list (the scratch rows have that slack).
__attribute__((target("avx2,popcnt"))) bool partition_order_avx2(
    const int32_t* order, int64_t C, uint8_t* flags, int32_t* hits, int32_t* nonhit) {
  if (!order_in_range(order, C)) {
    return false;
  }
  uint32_t seen_twice = 0;
  int64_t b = 0, i = 0;
  for (; i + 8 <= C; i += 8) {
    uint32_t m = 0;
#pragma GCC unroll 8
    for (int lane = 0; lane < 8; ++lane) {
      const int32_t s = order[i + lane];
      const uint32_t f = flags[s];
      flags[s] = static_cast<uint8_t>(f | 2);
      seen_twice |= f;
      m |= (f & 1) << lane;
    }
    const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(order + i));
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(hits + b), _mm256_permutevar8x32_epi32(o, lane_control(kLanes.pack[m])));
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(nonhit + (i - b)),
        _mm256_permutevar8x32_epi32(o, lane_control(kLanes.pack[~m & 0xffu])));
    b += _mm_popcnt_u32(m);
  }
  return partition_order_loop(order, C, flags, hits, nonhit, i, b, seen_twice);
}

// AVX2 version of match_residents, 8 slots per step: one gather of table entries replaces the dependent
// loads, and the hit flags come from the comparison mask.
template <typename Index>
__attribute__((target("avx2,popcnt"))) int64_t match_residents_avx2(
    const int32_t* stt, int64_t C, uint32_t limit, const Index* index, uint32_t tag, int64_t K, int32_t* hit,
    uint8_t* flags, uint32_t& bad_token) {
  static_assert(sizeof(Index) == 2 || sizeof(Index) == 4);
  const __m256i v_limit = _mm256_set1_epi32(static_cast<int32_t>(limit));
  const __m256i v_minus1 = _mm256_set1_epi32(-1);
  const __m256i v_sink = _mm256_set1_epi32(static_cast<int32_t>(K));
  const __m256i v_tag = _mm256_set1_epi32(static_cast<int32_t>(tag));
  const __m256i v_index_mask = _mm256_set1_epi32(static_cast<int32_t>(kIndexMask<Index>));
  int64_t n_selected = 0;
  __m256i bad = _mm256_setzero_si256();
  int64_t s = 0;
  for (; s + 8 <= C; s += 8) {
    const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(stt + s));
    bad = _mm256_or_si256(bad, _mm256_cmpgt_epi32(v_minus1, t));
    const __m256i in = _mm256_and_si256(_mm256_cmpgt_epi32(t, v_minus1), _mm256_cmpgt_epi32(v_limit, t));
    const __m256i tt = _mm256_and_si256(t, in);
    __m256i e;
    if constexpr (sizeof(Index) == 2) {
      e = _mm256_and_si256(
          _mm256_i32gather_epi32(reinterpret_cast<const int*>(index), tt, 2), _mm256_set1_epi32(0xffff));
    } else {
      e = _mm256_i32gather_epi32(reinterpret_cast<const int*>(index), tt, 4);
    }
    const __m256i sel =
        _mm256_and_si256(_mm256_cmpeq_epi32(_mm256_srli_epi32(e, kIndexBits<Index>), v_tag), in);
    const __m256i k = _mm256_and_si256(e, v_index_mask);
    const int mask = _mm256_movemask_ps(_mm256_castsi256_ps(sel));
    std::memcpy(flags + s, &kMaskBytes.bytes[mask], 8);
    n_selected += _mm_popcnt_u32(static_cast<unsigned>(mask));
    // every lane stores: the selected ones their entry, the others the sink
    const __m256i d = _mm256_blendv_epi8(v_sink, k, sel);
    const __m128i lo = _mm256_castsi256_si128(d), hi = _mm256_extracti128_si256(d, 1);
    const auto d0 = static_cast<uint64_t>(_mm_cvtsi128_si64(lo));
    const auto d1 = static_cast<uint64_t>(_mm_extract_epi64(lo, 1));
    const auto d2 = static_cast<uint64_t>(_mm_cvtsi128_si64(hi));
    const auto d3 = static_cast<uint64_t>(_mm_extract_epi64(hi, 1));
    const auto s32 = static_cast<int32_t>(s);
    hit[static_cast<uint32_t>(d0)] = s32;
    hit[d0 >> 32] = s32 + 1;
    hit[static_cast<uint32_t>(d1)] = s32 + 2;
    hit[d1 >> 32] = s32 + 3;
    hit[static_cast<uint32_t>(d2)] = s32 + 4;
    hit[d2 >> 32] = s32 + 5;
    hit[static_cast<uint32_t>(d3)] = s32 + 6;
    hit[d3 >> 32] = s32 + 7;
  }
  bad_token |= static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(bad)) != 0);
  return n_selected + match_residents(stt, C, limit, index, tag, K, hit, flags, bad_token, s);
}

#endif

// The first top-k entry repeating an earlier one (error path only).
int32_t first_duplicate(const int32_t* tk, int64_t K) {
  for (int64_t k = 0; k < K; ++k) {
    if (tk[k] >= 0 && std::find(tk, tk + k, tk[k]) != tk + k) {
      return tk[k];
    }
  }
  TORCH_INTERNAL_ASSERT(false, "residency: duplicate top-k entry not found");
  return -1;
}

// Pass-1 matching through the direct-address table. Also checks the slot tokens (bad_token) when it reads
// them (tokens_read).
template <typename Index>
KVO_ALWAYS_INLINE RowError match_direct(
    const Views& v, int64_t r, bool reset, int64_t stable, int32_t max_t, const int32_t* tk, int32_t* hit,
    uint8_t* flags, uint32_t& bad_token, bool& tokens_read) {
  const int64_t C = v.C, K = v.K;
  const int32_t* stt = v.stt + r * C;
  // entry max_t + 1 is the sink of the padding entries
  const int64_t sink = static_cast<int64_t>(max_t) + 1;
  uint32_t tag = 0;
  Index* index = DirectTable<Index>::of_this_thread().begin_row(sink + 1, tag);
  int64_t n_valid = 0;
  if (fill_table(index, tag, tk, K, sink, hit, n_valid)) {
    return {ErrorCode::kDuplicateTopk, first_duplicate(tk, K), 0};
  }
  v.row_counts[2 * r] = 0;
  v.row_counts[2 * r + 1] = n_valid;
  if (reset || n_valid == 0) {
    return {};
  }
  const auto limit = static_cast<uint32_t>(std::min<int64_t>(stable, sink));
  tokens_read = true;
#if KVO_RESIDENCY_AVX2
  const int64_t n_selected = v.simd ? match_residents_avx2(stt, C, limit, index, tag, K, hit, flags, bad_token)
                                    : match_residents(stt, C, limit, index, tag, K, hit, flags, bad_token);
#else
  const int64_t n_selected = match_residents(stt, C, limit, index, tag, K, hit, flags, bad_token);
#endif
  // a position held by two slots leaves one of them overwritten: fewer hit entries than selections
  int64_t n_hit = 0;
  for (int64_t k = 0; k < K; ++k) {
    n_hit += hit[k] >= 0;
  }
  if (n_hit == n_selected) {
    v.row_counts[2 * r] = n_hit;
    v.row_counts[2 * r + 1] = n_valid - n_hit;
    return {};
  }
  for (int64_t k = 0; k < K; ++k) {
    hit[k] = tk[k] < 0 ? kPadding : kMiss;
  }
  for (int64_t s = 0; s < C; ++s) {
    const int32_t t = stt[s];
    if (t < 0 || static_cast<uint32_t>(t) >= limit || (index[t] >> kIndexBits<Index>) != tag) {
      continue;
    }
    const uint32_t k = index[t] & kIndexMask<Index>;
    if (hit[k] >= 0) {
      return {ErrorCode::kDuplicateResident, t, 0};
    }
    hit[k] = static_cast<int32_t>(s);
  }
  TORCH_INTERNAL_ASSERT(false, "residency: duplicate resident not found on the second pass");
  return {};
}

// Pass-1 matching through the hash (positions past kDirectLimit; rare, so plain branches).
RowError match_hashed(
    const Views& v, int64_t r, bool reset, int64_t stable, const int32_t* tk, int32_t* hit, uint8_t* flags,
    TopkHash& hash) {
  const int64_t C = v.C, K = v.K;
  const int32_t* stt = v.stt + r * C;
  std::memset(flags, 0, static_cast<size_t>(C));
  hash.reset(K);
  int64_t n_valid = 0;
  for (int64_t k = 0; k < K; ++k) {
    const int32_t t = tk[k];
    if (t < 0) {
      hit[k] = kPadding;
      continue;
    }
    if (!hash.insert(t, static_cast<int32_t>(k))) {
      return {ErrorCode::kDuplicateTopk, t, 0};
    }
    hit[k] = kMiss;
    ++n_valid;
  }
  int64_t n_hit = 0;
  if (!reset && n_valid > 0) {
    for (int64_t s = 0; s < C; ++s) {
      const int32_t t = stt[s];
      if (t < 0 || t >= stable) {
        continue;
      }
      const int32_t k = hash.find(t);
      if (k >= 0) {
        if (hit[k] >= 0) {
          return {ErrorCode::kDuplicateResident, t, 0};
        }
        hit[k] = static_cast<int32_t>(s);
        flags[s] = 1;
        ++n_hit;
      }
    }
  }
  v.row_counts[2 * r] = n_hit;
  v.row_counts[2 * r + 1] = n_valid - n_hit;
  return {};
}

// Pass 1 for one row: validate, find hits, partition the LRU order (scratch only). A row with several
// problems reports the first of: stable length, LRU order, slot tokens, top-k duplicates, resident
// duplicates.
KVO_ALWAYS_INLINE RowError plan_row(const Views& v, int64_t r, TopkHash& hash, std::vector<uint8_t>& flags_buf) {
  const int64_t C = v.C, K = v.K;
  const int64_t stable = v.stable_len[r];
  if (stable < 0) {
    return {ErrorCode::kNegativeStable, stable, 0};
  }
  const bool reset = v.row_request[r] != v.request_ids[r];
  const int32_t* stt = v.stt + r * C;
  uint8_t* flags = flags_buf.data();  // per slot: 1 = hit (the matching writes it)
  const int32_t* tk = v.topk + r * K;
  int32_t* hit = v.hit + r * (K + 1);
  int32_t max_t = -1;
  for (int64_t k = 0; k < K; ++k) {
    max_t = std::max(max_t, tk[k]);
  }
  uint32_t bad_token = 0;
  bool tokens_read = false;
  RowError match_error;
  if (max_t < kDirectLimit && K <= kMaxDirectK<uint32_t>) {
    match_error = K <= kMaxDirectK<uint16_t>
        ? match_direct<uint16_t>(v, r, reset, stable, max_t, tk, hit, flags, bad_token, tokens_read)
        : match_direct<uint32_t>(v, r, reset, stable, max_t, tk, hit, flags, bad_token, tokens_read);
    if (!tokens_read) {
      std::memset(flags, 0, static_cast<size_t>(C));
    }
  } else {
    match_error = match_hashed(v, r, reset, stable, tk, hit, flags, hash);
  }
  int32_t* nonhit = v.nonhit + r * list_stride(C);
  int32_t* hits = v.hits + r * list_stride(C);
  if (reset) {
    for (int64_t i = 0; i < C; ++i) {
      nonhit[i] = static_cast<int32_t>(i);
    }
    return match_error;
  }
#if KVO_RESIDENCY_AVX2
  const bool permutation = v.simd ? partition_order_avx2(v.lru + r * C, C, flags, hits, nonhit)
                                  : partition_order(v.lru + r * C, C, flags, hits, nonhit);
#else
  const bool permutation = partition_order(v.lru + r * C, C, flags, hits, nonhit);
#endif
  if (!permutation) {
    return {ErrorCode::kLruNotPermutation, 0, 0};
  }
  if (!tokens_read) {
    for (int64_t s = 0; s < C; ++s) {
      bad_token |= static_cast<uint32_t>(stt[s] < -1);
    }
  }
  if (bad_token) {
    for (int64_t s = 0; s < C; ++s) {
      if (stt[s] < -1) {
        return {ErrorCode::kBadSlotToken, s, stt[s]};
      }
    }
  }
  return match_error;
}

[[noreturn]] void raise_row_error(const char* op, int64_t r, const RowError& e, int64_t C) {
  switch (e.code) {
    case ErrorCode::kNegativeStable:
      TORCH_CHECK_VALUE(
          false, "kvoffload::", op, ": argument 'stable_len' entry ", r, " is ", e.a,
          ", expected a value >= 0");
    case ErrorCode::kLruNotPermutation:
      TORCH_CHECK_VALUE(
          false, "kvoffload::", op, ": argument 'lru_order' row ", r, " is not a permutation of 0..",
          C - 1);
    case ErrorCode::kBadSlotToken:
      TORCH_CHECK_VALUE(
          false, "kvoffload::", op, ": argument 'slot_to_token' row ", r, " slot ", e.a, " holds ", e.b,
          ", expected >= -1");
    case ErrorCode::kDuplicateTopk:
      TORCH_CHECK_VALUE(
          false, "kvoffload::", op, ": argument 'topk' row ", r, " holds position ", e.a,
          " more than once");
    case ErrorCode::kDuplicateResident:
      TORCH_CHECK_VALUE(
          false, "kvoffload::", op, ": argument 'slot_to_token' row ", r, " holds top-k position ", e.a,
          " in two slots");
    case ErrorCode::kNone:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "raise_row_error without an error");
}

// Order-preserving map of a float to uint32 (NaN handled by the caller).
inline uint32_t sortable(float f) {
  f += 0.0f;  // -0.0 -> +0.0: the two compare equal and must tie
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Top-k of indexer scores, in the order of kvoffload::lightning_indexer: score descending (NaN first),
// ties by lower position; positions at or past the token's visible length become -1; -1 padded.
at::Tensor topk_from_scores(
    const at::Tensor& scores, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens_k, int64_t K) {
  const int64_t T = scores.size(0), W = scores.size(1);
  at::Tensor out = at::empty({T, K}, at::kInt);
  const at::Tensor cu = cu_seqlens_q.to(at::kLong).contiguous();
  const at::Tensor lens = seq_lens_k.to(at::kLong).contiguous();
  const int64_t B = lens.numel();
  const int64_t* cu_p = cu.const_data_ptr<int64_t>();
  const int64_t* len_p = lens.const_data_ptr<int64_t>();
  std::vector<int64_t> visible(static_cast<size_t>(T), 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = cu_p[b + 1] - cu_p[b];
    for (int64_t j = 0; j < q_len; ++j) {
      visible[cu_p[b] + j] = len_p[b] - (q_len - 1 - j);
    }
  }
  const float* sc = scores.const_data_ptr<float>();
  int32_t* o = out.data_ptr<int32_t>();
  const int64_t k = std::min(K, W);
  GilRelease no_gil;
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint64_t> keys(static_cast<size_t>(W));
    for (int64_t t = begin; t < end; ++t) {
      const float* row = sc + t * W;
      for (int64_t p = 0; p < W; ++p) {
        const uint32_t u = std::isnan(row[p]) ? 0xffffffffu : sortable(row[p]);
        keys[p] = (static_cast<uint64_t>(~u) << 32) | static_cast<uint64_t>(p);
      }
      if (k > 0 && k < W) {
        std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end());
      }
      std::sort(keys.begin(), keys.begin() + k);
      int32_t* dst = o + t * K;
      for (int64_t i = 0; i < k; ++i) {
        const int64_t p = static_cast<int64_t>(keys[i] & 0xffffffffu);
        dst[i] = p < visible[t] ? static_cast<int32_t>(p) : -1;
      }
      std::fill(dst + k, dst + K, -1);
    }
  });
  return out;
}

struct RowScratch {
  std::vector<int32_t> victims, rest;  // score policy, [C + 8]: victims are read up to 8 past the last miss
  std::vector<int32_t> miss_t;         // [K + 8], entry K a sink, 8 entries of slack for vector stores
  std::vector<uint64_t> keys;
  std::vector<uint8_t> chosen;
};

// Slots of a row's top-k: hits keep theirs, misses in top-k order take the victims in order, padding -1;
// the miss tokens are compacted into mt (scratch of K + 8 entries, entry K a sink). Portable loop: masks
// instead of conditionals (the compiler would branch, and a miss is about as likely as not).
KVO_ALWAYS_INLINE void assign_slots(
    const int32_t* hit, const int32_t* tk, const int32_t* victims, int64_t K, int32_t* slots, int32_t* mt,
    int64_t from = 0, int64_t j = 0) {
  for (int64_t k = from; k < K; ++k) {
    const int32_t h = hit[k];
    const int32_t m = -static_cast<int32_t>(h == kMiss);
    const int64_t m64 = m;
    mt[(j & m64) | (K & ~m64)] = tk[k];
    slots[k] = (victims[j] & m) | (std::max(h, -1) & ~m);
    j -= m64;
  }
}

#if KVO_RESIDENCY_AVX2
// AVX2 version of assign_slots, 8 entries per step: the next victims are spread over the miss lanes and
// the miss tokens left-packed, both with one lane permutation. Reads up to 7 victims past the last one
// used (the scratch holding them has that slack).
__attribute__((target("avx2,popcnt"))) void assign_slots_avx2(
    const int32_t* hit, const int32_t* tk, const int32_t* victims, int64_t K, int32_t* slots, int32_t* mt) {
  const __m256i v_miss = _mm256_set1_epi32(kMiss);
  int64_t j = 0, k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hit + k));
    const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tk + k));
    const __m256i miss = _mm256_cmpeq_epi32(h, v_miss);
    const int m = _mm256_movemask_ps(_mm256_castsi256_ps(miss));
    const __m256i next = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(victims + j));
    const __m256i spread = _mm256_permutevar8x32_epi32(next, lane_control(kLanes.expand[m]));
    const __m256i kept = _mm256_max_epi32(h, v_miss);  // hits keep their slot, padding -> -1
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(slots + k), _mm256_blendv_epi8(kept, spread, miss));
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(mt + j), _mm256_permutevar8x32_epi32(t, lane_control(kLanes.pack[m])));
    j += _mm_popcnt_u32(static_cast<unsigned>(m));
  }
  assign_slots(hit, tk, victims, K, slots, mt, k, j);
}
#endif

// Score policy: of the n_nonhit non-hit slots (LRU order), the victims are the empty ones first, then the
// lowest-scoring residents (NaN and positions past the scores lowest, ties by LRU order). Returns the
// victims in LRU order in w.victims and the unused slots in w.rest.
void choose_score_victims(
    const Views& v, int64_t r, const int32_t* stt, const int32_t* nonhit, int64_t n_nonhit, int64_t n_miss,
    RowScratch& w) {
  const float* sc = v.scores + r * v.scores_stride0;
  int64_t n_empty = 0;
  for (int64_t i = 0; i < n_nonhit; ++i) {
    n_empty += (stt[nonhit[i]] < 0);
  }
  std::fill(w.chosen.begin(), w.chosen.begin() + n_nonhit, 0);
  if (n_empty >= n_miss) {
    int64_t taken = 0;
    for (int64_t i = 0; i < n_nonhit && taken < n_miss; ++i) {
      if (stt[nonhit[i]] < 0) {
        w.chosen[i] = 1;
        ++taken;
      }
    }
  } else {
    // the residents' scores are random reads over the row's scores (often out of cache): prefetch ahead
    constexpr int64_t kAhead = 32;
    const int64_t last = std::max<int64_t>(v.scores_len - 1, 0);
    int64_t m = 0;
    for (int64_t i = 0; i < n_nonhit; ++i) {
      if (i + kAhead < n_nonhit) {
        const int64_t ahead = std::clamp<int64_t>(stt[nonhit[i + kAhead]], 0, last);
        __builtin_prefetch(sc + ahead * v.scores_stride1);
      }
      const int32_t t = stt[nonhit[i]];
      if (t < 0) {
        w.chosen[i] = 1;
        continue;
      }
      float f = -std::numeric_limits<float>::infinity();
      if (t < v.scores_len) {
        f = sc[t * v.scores_stride1];
        if (std::isnan(f)) {
          f = -std::numeric_limits<float>::infinity();
        }
      }
      w.keys[m++] = (static_cast<uint64_t>(sortable(f)) << 32) | static_cast<uint64_t>(i);
    }
    const int64_t need = n_miss - n_empty;
    std::nth_element(w.keys.begin(), w.keys.begin() + (need - 1), w.keys.begin() + m);
    const uint64_t cut = w.keys[need - 1];
    for (int64_t j = 0; j < m; ++j) {
      if (w.keys[j] <= cut) {
        w.chosen[w.keys[j] & 0xffffffffu] = 1;
      }
    }
  }
  int64_t nv = 0, nr = 0;
  for (int64_t i = 0; i < n_nonhit; ++i) {
    const int32_t s = nonhit[i];
    const bool c = w.chosen[i] != 0;
    w.victims[nv] = s;
    w.rest[nr] = s;
    nv += c;
    nr += !c;
  }
}

// Pass 2 for one row: apply the plan. Every loop is sequential over a row or branch-free.
KVO_ALWAYS_INLINE void apply_row(const Views& v, int64_t r, RowScratch& w) {
  const int64_t C = v.C, K = v.K;
  int32_t* stt = v.stt + r * C;
  int32_t* order = v.lru + r * C;
  const int32_t* tk = v.topk + r * K;
  const int32_t* hit = v.hit + r * (K + 1);
  int32_t* slots = v.slots + r * K;
  const int64_t n_hit = v.row_counts[2 * r], n_miss = v.row_counts[2 * r + 1];
  const bool reset = v.row_request[r] != v.request_ids[r];
  if (reset) {
    std::fill(stt, stt + C, -1);
    for (int64_t i = 0; i < C; ++i) {
      order[i] = static_cast<int32_t>(i);
    }
    v.row_request[r] = v.request_ids[r];
  } else {
    // tokens at or past the stable prefix may have been rewritten: empty their slots (hits never are)
    const auto bound =
        static_cast<int32_t>(std::min<int64_t>(v.stable_len[r], std::numeric_limits<int32_t>::max()));
    for (int64_t s = 0; s < C; ++s) {
      stt[s] = stt[s] >= bound ? -1 : stt[s];
    }
  }
  // the order partitioned by pass 1
  const int64_t n_nonhit = C - n_hit;
  const int32_t* nonhit = v.nonhit + r * list_stride(C);
  const int32_t* hits = v.hits + r * list_stride(C);
  // LRU: the victims are the least recently used non-hit slots, the rest keep their order
  const int32_t* victims = nonhit;
  const int32_t* rest = nonhit + n_miss;
  if (v.policy == Policy::kScore && n_miss > 0 && n_miss < n_nonhit) {
    choose_score_victims(v, r, stt, nonhit, n_nonhit, n_miss, w);
    victims = w.victims.data();
    rest = w.rest.data();
  }
  // slots: hits keep theirs, misses in top-k order take the victims in order, padding -1 (the miss
  // tokens are compacted branch-free into a scratch row whose entry K is a sink)
  int32_t* mt = w.miss_t.data();
#if KVO_RESIDENCY_AVX2
  if (v.simd) {
    assign_slots_avx2(hit, tk, victims, K, slots, mt);
  } else {
    assign_slots(hit, tk, victims, K, slots, mt);
  }
#else
  assign_slots(hit, tk, victims, K, slots, mt);
#endif
  int32_t evictions = 0;
  for (int64_t j = 0; j < n_miss; ++j) {
    const int32_t s = victims[j];
    evictions += stt[s] >= 0;
    stt[s] = mt[j];
  }
  int32_t* out_mt = v.miss_tokens + r * K;
  int32_t* out_ms = v.miss_slots + r * K;
  std::memcpy(out_mt, mt, n_miss * sizeof(int32_t));
  std::memcpy(out_ms, victims, n_miss * sizeof(int32_t));
  std::fill(out_mt + n_miss, out_mt + K, -1);
  std::fill(out_ms + n_miss, out_ms + K, -1);
  v.miss_count[r] = static_cast<int32_t>(n_miss);
  v.evictions[r] = evictions;
  // new order = rest + victims + hits (victims and rest live in scratch)
  const int64_t n_rest = n_nonhit - n_miss;
  std::memcpy(order, rest, n_rest * sizeof(int32_t));
  std::memcpy(order + n_rest, victims, n_miss * sizeof(int32_t));
  std::memcpy(order + n_nonhit, hits, n_hit * sizeof(int32_t));
}

KVO_ALWAYS_INLINE void plan_rows_body(const Views& v, int64_t begin, int64_t end, RowError* errors) {
  TopkHash hash;
  std::vector<uint8_t> flags(static_cast<size_t>(v.C));
  for (int64_t r = begin; r < end; ++r) {
    errors[r] = plan_row(v, r, hash, flags);
  }
}

RowScratch new_row_scratch(const Views& v) {
  RowScratch w;
  const auto C = static_cast<size_t>(v.C);
  w.miss_t.resize(static_cast<size_t>(v.K) + 8);
  if (v.policy == Policy::kScore) {
    w.victims.resize(C + 8);
    w.rest.resize(C + 8);
    w.keys.resize(C);
    w.chosen.resize(C);
  }
  return w;
}

KVO_ALWAYS_INLINE void apply_rows_body(const Views& v, int64_t begin, int64_t end) {
  RowScratch w = new_row_scratch(v);
  for (int64_t r = begin; r < end; ++r) {
    apply_row(v, r, w);
  }
}

// The two compilations of each pass (see KVO_ALWAYS_INLINE).
void plan_rows(const Views& v, int64_t begin, int64_t end, RowError* errors) {
  plan_rows_body(v, begin, end, errors);
}

void apply_rows(const Views& v, int64_t begin, int64_t end) {
  apply_rows_body(v, begin, end);
}

#if KVO_RESIDENCY_AVX2
__attribute__((target("avx2,popcnt"))) void plan_rows_avx2(
    const Views& v, int64_t begin, int64_t end, RowError* errors) {
  plan_rows_body(v, begin, end, errors);
}

__attribute__((target("avx2,popcnt"))) void apply_rows_avx2(const Views& v, int64_t begin, int64_t end) {
  apply_rows_body(v, begin, end);
}
#endif

// Runs both passes; raises (state untouched) if any row is invalid.
void run_residency(const char* op, Views& v) {
  if (v.R == 0) {
    return;
  }
  v.simd = simd_enabled();
  // scratch of the calling thread, kept between calls (fresh pages every call would cost page faults)
  thread_local std::vector<int32_t> hit_buf;
  thread_local std::vector<int64_t> counts_buf;
  thread_local std::vector<int32_t> lists_buf;
  hit_buf.resize(std::max(hit_buf.size(), static_cast<size_t>(v.R * (v.K + 1))));
  counts_buf.resize(std::max(counts_buf.size(), static_cast<size_t>(2 * v.R)));
  // nonhit rows then hits rows
  lists_buf.resize(std::max(lists_buf.size(), static_cast<size_t>(2 * v.R * list_stride(v.C))));
  v.hit = hit_buf.data();
  v.row_counts = counts_buf.data();
  v.nonhit = lists_buf.data();
  v.hits = lists_buf.data() + v.R * list_stride(v.C);
  std::vector<RowError> errors(static_cast<size_t>(v.R));
  // rows per task: enough slot work that a task outweighs waking a thread
  const int64_t grain = std::max<int64_t>(1, kSlotsPerTask / std::max<int64_t>(1, v.C + v.K));
  {
    GilRelease no_gil;
    at::parallel_for(0, v.R, grain, [&](int64_t begin, int64_t end) {
#if KVO_RESIDENCY_AVX2
      if (v.simd) {
        plan_rows_avx2(v, begin, end, errors.data());
        return;
      }
#endif
      plan_rows(v, begin, end, errors.data());
    });
  }
  for (int64_t r = 0; r < v.R; ++r) {
    if (errors[r].code != ErrorCode::kNone) {
      raise_row_error(op, r, errors[r], v.C);
    }
  }
  GilRelease no_gil;
  at::parallel_for(0, v.R, grain, [&](int64_t begin, int64_t end) {
#if KVO_RESIDENCY_AVX2
    if (v.simd) {
      apply_rows_avx2(v, begin, end);
      return;
    }
#endif
    apply_rows(v, begin, end);
  });
}

Views make_views(
    const at::Tensor& stt, const at::Tensor& lru, const at::Tensor& row_request, const at::Tensor& topk,
    const at::Tensor& request_ids, const at::Tensor& stable_len, const std::optional<at::Tensor>& scores,
    Policy policy, const at::Tensor& slots, const at::Tensor& miss_tokens, const at::Tensor& miss_slots,
    const at::Tensor& miss_count, const at::Tensor& evictions) {
  Views v{};
  v.R = stt.size(0);
  v.C = stt.size(1);
  v.K = topk.size(1);
  v.stt = stt.data_ptr<int32_t>();
  v.lru = lru.data_ptr<int32_t>();
  v.row_request = row_request.data_ptr<int64_t>();
  v.topk = topk.const_data_ptr<int32_t>();
  v.request_ids = request_ids.const_data_ptr<int64_t>();
  v.stable_len = stable_len.const_data_ptr<int64_t>();
  v.scores = nullptr;
  if (policy == Policy::kScore && scores) {
    v.scores = scores->const_data_ptr<float>();
    v.scores_len = scores->size(1);
    v.scores_stride0 = scores->stride(0);
    v.scores_stride1 = scores->stride(1);
  }
  v.slots = slots.data_ptr<int32_t>();
  v.miss_tokens = miss_tokens.data_ptr<int32_t>();
  v.miss_slots = miss_slots.data_ptr<int32_t>();
  v.miss_count = miss_count.data_ptr<int32_t>();
  v.evictions = evictions.data_ptr<int32_t>();
  v.policy = policy;
  return v;
}

// Inputs read while outputs are written are snapshotted when they share memory with any output.
at::Tensor unaliased_input(const at::Tensor& in, std::initializer_list<const at::Tensor*> outs) {
  for (const at::Tensor* o : outs) {
    if (may_overlap(in, *o)) {
      return in.clone();
    }
  }
  return in.contiguous();
}

void residency_update_cpu(
    const at::Tensor& stt, const at::Tensor& lru, const at::Tensor& row_request, const at::Tensor& topk_in,
    const at::Tensor& request_ids_in, const at::Tensor& stable_len_in,
    const std::optional<at::Tensor>& scores, c10::string_view policy_name, const at::Tensor& slots,
    const at::Tensor& miss_tokens, const at::Tensor& miss_slots, const at::Tensor& miss_count,
    const at::Tensor& evictions) {
  constexpr const char* op = "residency_update";
  const Policy policy = parse_policy(op, policy_name);
  check_residency_args(
      op, stt, lru, row_request, topk_in, request_ids_in, stable_len_in, scores, policy, slots,
      miss_tokens, miss_slots, miss_count, evictions, false);
  std::initializer_list<const at::Tensor*> outs{
      &stt, &lru, &row_request, &slots, &miss_tokens, &miss_slots, &miss_count, &evictions};
  const at::Tensor topk = unaliased_input(topk_in, outs);
  const at::Tensor request_ids = unaliased_input(request_ids_in, outs);
  const at::Tensor stable_len = unaliased_input(stable_len_in, outs);
  std::optional<at::Tensor> sc;
  if (scores && policy == Policy::kScore) {
    sc = unaliased_input(*scores, outs);
  }
  Views v = make_views(
      stt, lru, row_request, topk, request_ids, stable_len, sc, policy, slots, miss_tokens, miss_slots,
      miss_count, evictions);
  run_residency(op, v);
}

void lightning_indexer_manage_cpu(
    const at::Tensor& q, const at::Tensor& weights, const at::Tensor& k_cache,
    const at::Tensor& block_table, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens_k,
    const at::Tensor& stt, const at::Tensor& lru, const at::Tensor& row_request,
    const at::Tensor& request_ids_in, const at::Tensor& stable_len_in, c10::string_view policy_name,
    const at::Tensor& topk_out, const at::Tensor& slots, const at::Tensor& miss_tokens,
    const at::Tensor& miss_slots, const at::Tensor& miss_count, const at::Tensor& evictions) {
  constexpr const char* op = "lightning_indexer_manage";
  const Policy policy = parse_policy(op, policy_name);
  // the structural checks need no scores: they are produced below
  check_residency_args(
      op, stt, lru, row_request, topk_out, request_ids_in, stable_len_in, std::nullopt, Policy::kLru,
      slots, miss_tokens, miss_slots, miss_count, evictions, true);
  TORCH_CHECK_VALUE(
      q.dim() == 3, "kvoffload::", op, ": argument 'q' must have exactly 3 dimensions, got shape ",
      shape_str(q));
  TORCH_CHECK_VALUE(
      q.size(0) == stt.size(0), "kvoffload::", op,
      ": argument 'slot_to_token' must have one row per query token (T = ", q.size(0), "), got shape ",
      shape_str(stt));
  const int64_t K = topk_out.size(1);
  // Indexer through the dispatcher (it validates its own arguments and writes nothing of ours). With
  // "lru" the indexer op selects the top-k itself; with "score" the scores are computed once and the top-k
  // is selected here from them (same order: score descending, ties by lower position, invisible -> -1).
  at::Tensor topk;
  std::optional<at::Tensor> scores;
  if (policy == Policy::kLru) {
    static auto indexer = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("kvoffload::lightning_indexer", "")
                              .typed<at::Tensor(
                                  const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>();
    topk = indexer.call(q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k, K);
  } else {
    static auto scorer = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kvoffload::lightning_indexer_scores", "")
                             .typed<at::Tensor(
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
    scores = scorer.call(q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k).contiguous();
    topk = topk_from_scores(*scores, cu_seqlens_q, seq_lens_k, K);
  }
  TORCH_INTERNAL_ASSERT(topk.sizes() == topk_out.sizes() && topk.scalar_type() == at::kInt);
  std::initializer_list<const at::Tensor*> outs{
      &stt, &lru, &row_request, &topk_out, &slots, &miss_tokens, &miss_slots, &miss_count, &evictions};
  const at::Tensor request_ids = unaliased_input(request_ids_in, outs);
  const at::Tensor stable_len = unaliased_input(stable_len_in, outs);
  const at::Tensor topk_c = topk.contiguous();
  Views v = make_views(
      stt, lru, row_request, topk_c, request_ids, stable_len, scores, policy, slots, miss_tokens,
      miss_slots, miss_count, evictions);
  run_residency(op, v);
  topk_out.copy_(topk_c);
}

}  // namespace

TORCH_LIBRARY_IMPL(kvoffload, CPU, m) {
  m.impl("residency_update", &residency_update_cpu);
  m.impl("lightning_indexer_manage", &lightning_indexer_manage_cpu);
}

}  // namespace kvoffload
