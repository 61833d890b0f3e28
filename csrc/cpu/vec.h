// Vector helpers shared by the CPU kernel files: 8-wide fp32 vectors (GCC/Clang vector extensions, AVX
// registers when a function is compiled for x86-64-v3), bf16 -> fp32 conversion and a register-tiled dot
// product. Everything is always inlined into the callers' hot loops.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

// The helpers are always inlined, so the ABI note about AVX vector arguments does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace kvoffload::vec {

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8v __attribute__((vector_size(32)));

inline __attribute__((always_inline)) f8 load8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline __attribute__((always_inline)) void store8(float* p, f8 v) {
  std::memcpy(p, &v, sizeof(v));
}

inline __attribute__((always_inline)) f8 splat(float x) {
  return f8{x, x, x, x, x, x, x, x};
}

inline __attribute__((always_inline)) float hsum(f8 v) {
  const float a = (v[0] + v[4]) + (v[1] + v[5]);
  const float b = (v[2] + v[6]) + (v[3] + v[7]);
  return a + b;
}

// dst[i] = float(src[i]) for float or bf16 (whose bits are the upper half of an fp32).
template <typename T>
inline __attribute__((always_inline)) void to_float(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    const auto* s = reinterpret_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
      std::memcpy(dst + i, &bits, sizeof(float));
    }
  }
}

// out[g * os + j] = q[g] . k[j] over d in [0, D) for GH heads and NK rows.
template <int GH, int NK>
inline __attribute__((always_inline)) void dot_tile(
    const float* q, int64_t qs, const float* k, int64_t ks, int64_t D, float* out, int64_t os) {
  f8 acc[GH][NK] = {};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    f8 kv[NK];
    for (int j = 0; j < NK; ++j) {
      kv[j] = load8(k + j * ks + d);
    }
    for (int g = 0; g < GH; ++g) {
      const f8 qv = load8(q + g * qs + d);
      for (int j = 0; j < NK; ++j) {
        acc[g][j] += qv * kv[j];
      }
    }
  }
  for (int g = 0; g < GH; ++g) {
    for (int j = 0; j < NK; ++j) {
      float s = hsum(acc[g][j]);
      for (int64_t e = d; e < D; ++e) {
        s += q[g * qs + e] * k[j * ks + e];
      }
      out[g * os + j] = s;
    }
  }
}

// s[g * ss + j] = q[g] . rows[j] for g < G, j < n (rows contiguous with stride D).
inline __attribute__((always_inline)) void dot_block(
    const float* q, int64_t G, const float* rows, int64_t n, int64_t D, float* s, int64_t ss) {
  int64_t g = 0;
  for (; g + 4 <= G; g += 4) {
    int64_t j = 0;
    for (; j + 2 <= n; j += 2) {
      dot_tile<4, 2>(q + g * D, D, rows + j * D, D, D, s + g * ss + j, ss);
    }
    for (; j < n; ++j) {
      dot_tile<4, 1>(q + g * D, D, rows + j * D, D, D, s + g * ss + j, ss);
    }
  }
  for (; g < G; ++g) {
    int64_t j = 0;
    for (; j + 2 <= n; j += 2) {
      dot_tile<1, 2>(q + g * D, D, rows + j * D, D, D, s + g * ss + j, ss);
    }
    for (; j < n; ++j) {
      dot_tile<1, 1>(q + g * D, D, rows + j * D, D, D, s + g * ss + j, ss);
    }
  }
}

}  // namespace kvoffload::vec
