// CPU kernels of the residency family: kvoffload::residency_update and kvoffload::lightning_indexer_manage.
//
// Two passes over the rows, both parallel. Pass 1 validates every row and finds its hits without writing
// any argument (hits go to a scratch [R, K] array); an error is recorded per row and the one of the
// lowest row is raised after the pass, so the state is untouched on error and the message deterministic.
// Pass 2 rewrites the state and outputs. The token -> slot lookup is an open-addressing hash of the
// row's top-k positions (2K..4K entries, cleared per row), so a row costs O(K + C) with no sort.

#include "common.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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
  TORCH_CHECK_VALUE(
      t.device().is_cpu(), "kvoffload::", op, ": argument '", arg, "' must be a CPU tensor, got ",
      t.device());
  TORCH_CHECK_TYPE(
      t.scalar_type() == dtype, "kvoffload::", op, ": argument '", arg, "' must have dtype ",
      dtype_str(dtype), ", got ", dtype_str(t.scalar_type()));
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
  int32_t* hit;  // scratch [R, K]
  Policy policy;
};

// Positions below this bound use a direct-address table (per thread, ~4 bytes per position) instead of
// the hash; larger positions fall back to the hash.
constexpr int32_t kDirectLimit = 1 << 21;

// Per-thread direct-address lookup over positions: a bitmap of the row's top-k positions (8 KiB per 64k
// positions, cache resident) in front of a position -> top-k index table that is read only where a bit is
// set, so the table never needs clearing; a row clears exactly the bits it set.
struct DirectTable {
  std::vector<uint64_t> bits;  // all zero between rows
  std::vector<int32_t> index;
  void reserve(int64_t positions) {
    const auto words = static_cast<size_t>((positions + 63) / 64);
    if (bits.size() < words) {
      bits.resize(words, 0);
    }
    if (index.size() < static_cast<size_t>(positions)) {
      index.resize(static_cast<size_t>(positions));
    }
  }
};

DirectTable& direct_table(int64_t positions) {
  thread_local DirectTable table;
  table.reserve(positions);
  return table;
}

// Pass-1 matching through the direct-address table: O(K + C), no hashing, no sort.
RowError match_direct(
    const Views& v, int64_t r, bool reset, int64_t stable, int32_t max_t, const int32_t* tk, int32_t* hit) {
  const int64_t C = v.C, K = v.K;
  const int32_t* stt = v.stt + r * C;
  DirectTable& table = direct_table(static_cast<int64_t>(max_t) + 1);
  uint64_t* bits = table.bits.data();
  int32_t* index = table.index.data();
  auto clear = [&](int64_t upto) {
    for (int64_t k = 0; k < upto; ++k) {
      const int32_t t = tk[k];
      if (t >= 0) {
        bits[t >> 6] &= ~(uint64_t{1} << (t & 63));
      }
    }
  };
  int64_t n_valid = 0;
  for (int64_t k = 0; k < K; ++k) {
    const int32_t t = tk[k];
    if (t < 0) {
      hit[k] = kPadding;
      continue;
    }
    const uint64_t bit = uint64_t{1} << (t & 63);
    if (bits[t >> 6] & bit) {
      clear(k);
      return {ErrorCode::kDuplicateTopk, t, 0};
    }
    bits[t >> 6] |= bit;
    index[t] = static_cast<int32_t>(k);
    hit[k] = kMiss;
    ++n_valid;
  }
  RowError err;
  if (!reset && n_valid > 0) {
    // the bitmap test filters residents before the (cache-missing) position-table load; every resident
    // writes its slot, the unselected ones into the sink entry hit[K], and duplicates are only flagged
    // here and located by the slow pass below
    const int64_t limit = std::min<int64_t>(stable, static_cast<int64_t>(max_t) + 1);
    const auto K32 = static_cast<int32_t>(K);
    bool dup = false;
    for (int64_t s = 0; s < C; ++s) {
      const int32_t t = stt[s];
      const bool in = t >= 0 && t < limit;
      const int32_t tt = in ? t : 0;
      const bool selected = in && ((bits[tt >> 6] >> (tt & 63)) & 1);
      const int32_t k = selected ? index[tt] : K32;
      dup |= selected && hit[k] >= 0;
      hit[k] = static_cast<int32_t>(s);
    }
    if (dup) {  // rare: find the first position held twice for the message
      for (int64_t k = 0; k < K; ++k) {
        hit[k] = tk[k] < 0 ? kPadding : kMiss;
      }
      for (int64_t s = 0; s < C; ++s) {
        const int32_t t = stt[s];
        if (t < 0 || t >= limit || !((bits[t >> 6] >> (t & 63)) & 1)) {
          continue;
        }
        const int32_t k = index[t];
        if (hit[k] >= 0) {
          err = {ErrorCode::kDuplicateResident, t, 0};
          break;
        }
        hit[k] = static_cast<int32_t>(s);
      }
    }
  }
  clear(K);
  return err;
}

// Pass 1 for one row: validate, find hits (scratch only).
RowError plan_row(const Views& v, int64_t r, TopkHash& hash, std::vector<uint8_t>& seen) {
  const int64_t C = v.C, K = v.K;
  const int64_t stable = v.stable_len[r];
  if (stable < 0) {
    return {ErrorCode::kNegativeStable, stable, 0};
  }
  const bool reset = v.row_request[r] != v.request_ids[r];
  const int32_t* stt = v.stt + r * C;
  if (!reset) {
    // one branch-light pass over both state rows; the details of a failure are found afterwards
    const int32_t* order = v.lru + r * C;
    std::fill(seen.begin(), seen.begin() + C, 0);
    bool bad_order = false, bad_token = false;
    for (int64_t i = 0; i < C; ++i) {
      const auto s = static_cast<uint32_t>(order[i]);
      if (s >= static_cast<uint64_t>(C)) {
        bad_order = true;
        break;
      }
      bad_order |= seen[s] != 0;
      seen[s] = 1;
      bad_token |= stt[i] < -1;
    }
    if (bad_order) {
      return {ErrorCode::kLruNotPermutation, 0, 0};
    }
    if (bad_token) {
      for (int64_t s = 0; s < C; ++s) {
        if (stt[s] < -1) {
          return {ErrorCode::kBadSlotToken, s, stt[s]};
        }
      }
    }
  }
  const int32_t* tk = v.topk + r * K;
  int32_t* hit = v.hit + r * (K + 1);  // entry K: a sink for branch-free writes
  int32_t max_t = -1;
  for (int64_t k = 0; k < K; ++k) {
    max_t = std::max(max_t, tk[k]);
  }
  if (max_t < kDirectLimit) {
    return match_direct(v, r, reset, stable, max_t, tk, hit);
  }
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
      }
    }
  }
  return {};
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
  std::vector<uint8_t> is_hit;
  std::vector<int32_t> nonhit, hits, victims, rest;
  std::vector<uint64_t> keys;
  std::vector<uint8_t> chosen;
};

// Pass 2 for one row: apply the plan.
void apply_row(const Views& v, int64_t r, RowScratch& w) {
  const int64_t C = v.C, K = v.K;
  int32_t* stt = v.stt + r * C;
  int32_t* order = v.lru + r * C;
  const int32_t* tk = v.topk + r * K;
  const int32_t* hit = v.hit + r * (K + 1);
  int32_t* slots = v.slots + r * K;
  int32_t* mt = v.miss_tokens + r * K;
  int32_t* ms = v.miss_slots + r * K;
  const bool reset = v.row_request[r] != v.request_ids[r];
  if (reset) {
    std::fill(stt, stt + C, -1);
    for (int64_t i = 0; i < C; ++i) {
      order[i] = static_cast<int32_t>(i);
    }
    v.row_request[r] = v.request_ids[r];
  }
  std::fill(w.is_hit.begin(), w.is_hit.begin() + C, 0);
  int64_t n_miss = 0;
  for (int64_t k = 0; k < K; ++k) {
    const int32_t h = hit[k];
    if (h >= 0) {
      w.is_hit[h] = 1;
      slots[k] = h;
    } else {
      slots[k] = -1;
      n_miss += (h == kMiss);
    }
  }
  // partition the order into non-hit and hit slots (branch-free), dropping stale tokens on the way
  const int64_t stable = v.stable_len[r];
  int64_t n_nonhit = 0, n_hit = 0;
  int32_t* nonhit = w.nonhit.data();
  int32_t* hits = w.hits.data();
  for (int64_t i = 0; i < C; ++i) {
    const int32_t s = order[i];
    const int32_t t = stt[s];
    stt[s] = t >= stable ? -1 : t;
    const int64_t h = w.is_hit[s];
    hits[n_hit] = s;
    nonhit[n_nonhit] = s;
    n_hit += h;
    n_nonhit += 1 - h;
  }
  // victims (LRU order) and the non-hit slots left unused (old order)
  const int32_t* victims = w.nonhit.data();
  const int32_t* rest = w.nonhit.data() + n_miss;
  if (v.policy == Policy::kScore && n_miss > 0 && n_miss < n_nonhit) {
    const float* sc = v.scores + r * v.scores_stride0;
    int64_t n_empty = 0;
    for (int64_t i = 0; i < n_nonhit; ++i) {
      n_empty += (stt[w.nonhit[i]] < 0);
    }
    std::fill(w.chosen.begin(), w.chosen.begin() + n_nonhit, 0);
    if (n_empty >= n_miss) {
      int64_t taken = 0;
      for (int64_t i = 0; i < n_nonhit && taken < n_miss; ++i) {
        if (stt[w.nonhit[i]] < 0) {
          w.chosen[i] = 1;
          ++taken;
        }
      }
    } else {
      int64_t m = 0;
      for (int64_t i = 0; i < n_nonhit; ++i) {
        const int32_t t = stt[w.nonhit[i]];
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
      if (w.chosen[i]) {
        w.victims[nv++] = w.nonhit[i];
      } else {
        w.rest[nr++] = w.nonhit[i];
      }
    }
    victims = w.victims.data();
    rest = w.rest.data();
  }
  int32_t evictions = 0;
  int64_t j = 0;
  for (int64_t k = 0; k < K; ++k) {
    if (hit[k] != kMiss) {
      continue;
    }
    const int32_t s = victims[j];
    const int32_t t = tk[k];
    evictions += (stt[s] >= 0);
    stt[s] = t;
    slots[k] = s;
    mt[j] = t;
    ms[j] = s;
    ++j;
  }
  std::fill(mt + n_miss, mt + K, -1);
  std::fill(ms + n_miss, ms + K, -1);
  v.miss_count[r] = static_cast<int32_t>(n_miss);
  v.evictions[r] = evictions;
  // new order = rest + victims + hits (victims may alias the front of nonhit: copy it first)
  const int64_t n_rest = n_nonhit - n_miss;
  std::memcpy(order + n_rest, victims, n_miss * sizeof(int32_t));
  std::memcpy(order, rest, n_rest * sizeof(int32_t));
  std::memcpy(order + n_nonhit, w.hits.data(), n_hit * sizeof(int32_t));
}

// Runs both passes; raises (state untouched) if any row is invalid.
void run_residency(const char* op, Views& v) {
  if (v.R == 0) {
    return;
  }
  at::Tensor hit_buf = at::empty({v.R, v.K + 1}, at::kInt);
  v.hit = hit_buf.data_ptr<int32_t>();
  std::vector<RowError> errors(static_cast<size_t>(v.R));
  // rows per task: enough slot work that a task outweighs waking a thread
  const int64_t grain = std::max<int64_t>(1, kSlotsPerTask / std::max<int64_t>(1, v.C + v.K));
  {
    GilRelease no_gil;
    at::parallel_for(0, v.R, grain, [&](int64_t begin, int64_t end) {
      TopkHash hash;
      std::vector<uint8_t> seen(static_cast<size_t>(v.C));
      for (int64_t r = begin; r < end; ++r) {
        errors[r] = plan_row(v, r, hash, seen);
      }
    });
  }
  for (int64_t r = 0; r < v.R; ++r) {
    if (errors[r].code != ErrorCode::kNone) {
      raise_row_error(op, r, errors[r], v.C);
    }
  }
  GilRelease no_gil;
  at::parallel_for(0, v.R, grain, [&](int64_t begin, int64_t end) {
    RowScratch w;
    const auto C = static_cast<size_t>(v.C);
    w.is_hit.resize(C);
    w.nonhit.resize(C);
    w.hits.resize(C);
    if (v.policy == Policy::kScore) {
      w.victims.resize(C);
      w.rest.resize(C);
      w.keys.resize(C);
      w.chosen.resize(C);
    }
    for (int64_t r = begin; r < end; ++r) {
      apply_row(v, r, w);
    }
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
