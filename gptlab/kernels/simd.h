// Whole vector registers of fp32 lanes as GCC vectors, for loops the compiler leaves scalar when written over
// arrays (bf16 conversions, NaN checks, the exp's integer steps): cross_entropy.cpp's softmax and
// activations.cpp's GELU. One source for every build: 16 lanes in the AVX-512 builds, 8 in the AVX2 ones. Also what
// the kernels share besides: bf16 to fp32 and back, one value or a row at a time, and a blocked transpose.
#pragma once

#include <ATen/ATen.h>

#include "linear_avx2.h"

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace GPTLAB_NS::simd {

// lanes per vector: one register of the build (a 16-lane vector split over two AVX2 registers ran slower than
// scalar code; the emulated AVX-512 builds, for tests, have 16 lanes on AVX2 all the same)
#if defined(GPTLAB_AVX512)
#define GPTLAB_SIMD16 1
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
using Vec = float __attribute__((vector_size(4 * kLanes)));
using IVec = int32_t __attribute__((vector_size(4 * kLanes)));
using UVec = uint32_t __attribute__((vector_size(4 * kLanes)));
using HVec = uint16_t __attribute__((vector_size(2 * kLanes)));
constexpr float kInf = std::numeric_limits<float>::infinity();

// v in every lane (v - 0 is v exactly, so the compiler emits one broadcast; 0 + v would be an add first: -0 + 0 = +0)
inline Vec splat(float v) { return v - Vec{}; }
inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline Vec load(const at::BFloat16* p) {  // bf16 to fp32: the 16 bits on top, exactly
  HVec h;
  std::memcpy(&h, p, sizeof h);
  const UVec u = __builtin_convertvector(h, UVec) << 16;
  Vec v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }
inline void store(at::BFloat16* p, Vec v) {  // rounded to the nearest bf16, ties to even (finite values)
  UVec u;
  std::memcpy(&u, &v, sizeof u);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const HVec h = __builtin_convertvector(u, HVec);
  std::memcpy(p, &h, sizeof h);
}
// one bf16 value's bits to fp32 (exactly) and one fp32 value to bf16's bits (rounded to nearest, ties to even;
// finite values)
inline float from_bf16_bits(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
inline uint16_t bf16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
// a row of n values to fp32 and back, as loops the compiler vectorizes (any n: for rows whose length is no multiple
// of the lanes)
inline void widen(const float* p, float* out, int64_t n) { std::memcpy(out, p, n * sizeof(float)); }
inline void widen(const at::BFloat16* p, float* out, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(p);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = from_bf16_bits(bits[i]);
}
inline void narrow(const float* x, float* out, int64_t n) { std::memcpy(out, x, n * sizeof(float)); }
inline void narrow(const float* x, at::BFloat16* out, int64_t n) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(out);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) bits[i] = bf16_bits(x[i]);
}

// an 8 x 8 block of floats (rows ld apart) transposed into out (rows ldo apart) in registers: pairs of rows
// interleaved, then pairs of pairs, then the 128-bit halves swapped (AVX's unpack, shuffle and permute)
inline void transpose8x8(const float* x, int64_t ld, float* out, int64_t ldo) {
  using V8 = float __attribute__((vector_size(32)));
  V8 r[8], t[8], u[8];  // (unrolled: each array stays in registers)
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) std::memcpy(&r[i], x + i * ld, sizeof(V8));
#pragma GCC unroll 4
  for (int i = 0; i < 8; i += 2) {
    t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
#pragma GCC unroll 2
  for (int i = 0; i < 8; i += 4)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      u[i + 2 * h] = __builtin_shufflevector(t[i + h], t[i + 2 + h], 0, 1, 8, 9, 4, 5, 12, 13);
      u[i + 2 * h + 1] = __builtin_shufflevector(t[i + h], t[i + 2 + h], 2, 3, 10, 11, 6, 7, 14, 15);
    }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {  // u[c] holds columns c and c + 4 of rows 0-3, u[c + 4] of rows 4-7
    const V8 lo = __builtin_shufflevector(u[c], u[c + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    const V8 hi = __builtin_shufflevector(u[c], u[c + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    std::memcpy(out + c * ldo, &lo, sizeof(V8));
    std::memcpy(out + (c + 4) * ldo, &hi, sizeof(V8));
  }
}

// x (rows of cols values, ld apart) transposed into out (cols rows of `rows` values, ldo apart), through 32 x 32
// blocks that stay in the cache: each block's rows are read whole and its output rows written whole; floats in
// whole 8 x 8 blocks through registers
template <typename T>
void transpose(const T* x, int64_t ld, int64_t rows, int64_t cols, T* out, int64_t ldo) {
  constexpr int64_t kTile = 32;
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    const int64_t r1 = r0 + kTile < rows ? r0 + kTile : rows;
    for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
      const int64_t c1 = c0 + kTile < cols ? c0 + kTile : cols;
      int64_t r8 = r0, c8 = c0;  // the whole 8 x 8 blocks end at (r8, c8)
      if constexpr (std::is_same_v<T, float>) {
        r8 = r0 + (r1 - r0) / 8 * 8, c8 = c0 + (c1 - c0) / 8 * 8;
        for (int64_t r = r0; r < r8; r += 8)
          for (int64_t c = c0; c < c8; c += 8) transpose8x8(x + r * ld + c, ld, out + c * ldo + r, ldo);
      }
      for (int64_t c = c0; c < c1; ++c)  // the rest: columns past c8 of every row, rows past r8 of every column
        for (int64_t r = c < c8 ? r8 : r0; r < r1; ++r) out[c * ldo + r] = x[r * ld + c];
    }
  }
}

// the element types `on_type` hands over
inline bool float_or_bf16(at::ScalarType type) { return type == at::kFloat || type == at::kBFloat16; }

// f(float{}) or f(at::BFloat16{}): a generic lambda's argument names the element type
template <typename F>
void on_type(at::ScalarType type, const F& f) {
  if (type == at::kFloat) f(float{});
  else f(at::BFloat16{});
}
// f(a, b) for two such types (an input's and an output's)
template <typename F>
void on_types(at::ScalarType a, at::ScalarType b, const F& f) {
  on_type(a, [&](auto x) { on_type(b, [&](auto y) { f(x, y); }); });
}

// the sum of a vector's lanes, halving it (a tree: a running sum over the lanes is one dependent chain)
inline float lane_sum(Vec v) {
  using V8 = float __attribute__((vector_size(32)));
  using V4 = float __attribute__((vector_size(16)));
#ifdef GPTLAB_SIMD16
  const V8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const V8 h8 = v;
#endif
  const V4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

inline Vec sqrt(Vec v) {  // correctly rounded, as std::sqrt
#if defined(GPTLAB_AVX512)
  return reinterpret_cast<Vec>(_mm512_sqrt_ps(reinterpret_cast<__m512>(v)));
#else
  return reinterpret_cast<Vec>(_mm256_sqrt_ps(reinterpret_cast<__m256>(v)));
#endif
}

// a * b + c rounded once, where ATen's vectorized code calls fmadd (lerp): the same bits whether or not the compiler
// would have contracted a * b + c itself
inline Vec fma(Vec a, Vec b, Vec c) {
#if defined(GPTLAB_AVX512)
  return reinterpret_cast<Vec>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                               reinterpret_cast<__m512>(c)));
#else
  return reinterpret_cast<Vec>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                               reinterpret_cast<__m256>(c)));
#endif
}

inline float lane_max(Vec v) {
  float m = v[0];
  for (int j = 1; j < kLanes; ++j) m = v[j] > m ? v[j] : m;
  return m;
}

// the lanes' own indices, 0 to kLanes - 1
inline Vec lane_index() {
  Vec lane;
  for (int j = 0; j < kLanes; ++j) lane[j] = static_cast<float>(j);
  return lane;
}

// causal attention's mask of the key vector starting at key c for query t: 1 in the lanes of keys at or before t,
// else 0 (`lanes`: lane_index())
inline Vec causal_lanes(Vec lanes, int64_t c, int64_t t) {
  return lanes + static_cast<float>(c) <= static_cast<float>(t) ? splat(1.0f) : splat(0.0f);
}

// exp_fast (exp_fast.h) on kLanes lanes at once: the same steps, so the same values
inline Vec exp_vec(Vec x) {
  const IVec underflows = x < -87.0f;
  x = x < -87.0f ? splat(-87.0f) : x;
  x = x > 88.0f ? splat(88.0f) : x;
  const Vec t = x * 1.44269504f + 0.5f;
  Vec n = __builtin_convertvector(__builtin_convertvector(t, IVec), Vec);  // truncated toward 0, then floor
  n = n > t ? n - 1.0f : n;
  const Vec r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  Vec p = splat(1.0f / 5040);
  p = p * r + 1.0f / 720, p = p * r + 1.0f / 120, p = p * r + 1.0f / 24, p = p * r + 1.0f / 6, p = p * r + 0.5f;
  p = p * r + 1.0f, p = p * r + 1.0f;
  const IVec bits = (__builtin_convertvector(n, IVec) + 127) << 23;
  Vec scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return underflows ? splat(0.0f) : p * scale;
}

}  // namespace GPTLAB_NS::simd
