// decode_step.cpp's arithmetic on a few rows: bf16 rounding where the lean step holds bf16 tensors, the norms,
// rotary embeddings, the attention's dot product and the MLP's activations, each written so that the compiler
// vectorizes it (see decode_step.cpp for how closely they follow ATen's).
#pragma once

#include <ATen/ATen.h>

#include "exp_fast.h"
#include "linear_avx2.h"
#include "simd.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace GPTLAB_NS::step_math {

using GPTLAB_NS::exp_fast;
using simd::kLanes;
using simd::lane_sum;
using simd::Vec;

enum Norm { kLayerNorm = 0, kRMSNorm = 1, kUnitOffset = 2 };

// v rounded to the nearest bf16 (ties to even; any NaN to the quiet NaN): c10::BFloat16's conversion in integer
// operations with its NaN branch as a select, so that a loop over many values vectorizes
inline float round_to(float v, bool bf16) {
  if (!bf16) return v;
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits = std::isnan(v) ? 0x7FC00000u : (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
// the same on a whole vector, lane by lane
inline Vec round_to(Vec v, bool bf16) {
  if (!bf16) return v;
  simd::UVec bits;
  std::memcpy(&bits, &v, sizeof bits);
  const simd::UVec nan = simd::UVec{} + 0x7FC00000u;
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  bits = v != v ? nan : bits;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// n < kLanes values as a vector (zeros after them) and back: a loop's tail computed by the same vector arithmetic as
// its body, so a value's bits do not depend on where a thread's share of the loop began
inline Vec load_n(const float* p, int64_t n) {
  Vec v{};
  std::memcpy(&v, p, n * sizeof(float));
  return v;
}
inline void store_n(float* p, Vec v, int64_t n) { std::memcpy(p, &v, n * sizeof(float)); }

// f(i, n) for i = i0, i0 + kLanes, ... over [i0, i1): n = kLanes but at the tail
template <typename F>
inline void for_lanes(int64_t i0, int64_t i1, const F& f) {
  int64_t i = i0;
  for (; i + kLanes <= i1; i += kLanes) f(i, kLanes);
  if (i < i1) f(i, i1 - i);
}

inline void round_all(float* p, int64_t n, bool bf16) {
  if (bf16)
    for_lanes(0, n, [&](int64_t i, int64_t k) { store_n(p + i, round_to(load_n(p + i, k), true), k); });
}

// a norm's weight or bias (bf16 or fp32) read as fp32; empty where absent
struct Param {
  const float* f = nullptr;
  const at::BFloat16* h = nullptr;
  explicit Param(const c10::optional<at::Tensor>& t) {
    if (!t.has_value() || !t->defined()) return;
    if (t->scalar_type() == at::kBFloat16) h = t->data_ptr<at::BFloat16>();
    else f = t->data_ptr<float>();
  }
  bool present() const { return f || h; }
  float operator[](int64_t i) const { return f ? f[i] : static_cast<float>(h[i]); }
  Vec lanes(int64_t i) const { return f ? simd::load(f + i) : simd::load(h + i); }  // kLanes of them from i
};

// rows of width n, normalized (LayerNorm, RMSNorm, or Gemma's RMSNorm scaled by 1 + weight): out = norm(in). The
// statistics are summed in fp32 lanes (a row is always one thread's whole, so its bits do not depend on the threads)
inline void norm_rows(const float* in, float* out, int64_t rows, int64_t n, int kind,
                      const c10::optional<at::Tensor>& w, const c10::optional<at::Tensor>& b, float eps, bool bf16) {
  const Param weight(w), bias(b);
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = in + r * n;
    float* y = out + r * n;
    float mean = 0.0f;
    if (kind == kLayerNorm) {
      simd::Vec lanes{};
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) lanes += simd::load(x + i);
      float tail = 0.0f;
      for (; i < n; ++i) tail += x[i];
      mean = (lane_sum(lanes) + tail) / static_cast<float>(n);
    }
    simd::Vec lanes{};
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      const simd::Vec d = simd::load(x + i) - mean;
      lanes += d * d;
    }
    float tail = 0.0f;
    for (; i < n; ++i) tail += (x[i] - mean) * (x[i] - mean);
    const float inv = 1.0f / std::sqrt((lane_sum(lanes) + tail) / static_cast<float>(n) + eps);
    for (i = 0; i + kLanes <= n; i += kLanes) {  // the same arithmetic as the scalar tail, lane by lane
      Vec v = (simd::load(x + i) - mean) * inv;
      if (kind == kUnitOffset) v *= 1.0f + weight.lanes(i);
      else if (weight.present()) v *= weight.lanes(i);
      if (bias.present()) v += bias.lanes(i);
      simd::store(y + i, round_to(v, bf16));
    }
    for (; i < n; ++i) {
      float v = (x[i] - mean) * inv;
      if (kind == kUnitOffset) v *= 1.0f + weight[i];
      else if (weight.present()) v *= weight[i];
      if (bias.present()) v += bias[i];
      y[i] = round_to(v, bf16);
    }
  }
}

// rotate a head's first `rot` dims by (cos, sin) (rot / 2 each): pairs (i, i + rot / 2), or (2i, 2i + 1)
inline void rotate(float* h, const float* cos, const float* sin, int64_t rot, bool interleaved, bool bf16) {
  const int64_t half = rot / 2;
  int64_t i = 0;
  if (!interleaved)  // pairs (i, i + half): both halves run in lanes
    for (; i + kLanes <= half; i += kLanes) {
      const Vec a = simd::load(h + i), b = simd::load(h + i + half), c = simd::load(cos + i), s = simd::load(sin + i);
      simd::store(h + i, round_to(round_to(a * c, bf16) - round_to(b * s, bf16), bf16));
      simd::store(h + i + half, round_to(round_to(b * c, bf16) + round_to(a * s, bf16), bf16));
    }
  for (; i < half; ++i) {
    const int64_t ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + half;
    const float a = h[ia], b = h[ib];
    // each product rounded, then the sum, as apply_rope's ops on a bf16 tensor do
    h[ia] = round_to(round_to(a * cos[i], bf16) - round_to(b * sin[i], bf16), bf16);
    h[ib] = round_to(round_to(b * cos[i], bf16) + round_to(a * sin[i], bf16), bf16);
  }
}

// A cached key or value as fp32. A bf16 cache holds a bf16 model's keys and values exactly (the step has rounded
// them to bf16 already), so attention over it computes what it computes over an fp32 cache, from half the bytes.
inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
// n values into the cache (rounded to bf16 there: exact for a bf16 model's values)
inline void store(float* to, const float* from, int64_t n) { std::memcpy(to, from, n * sizeof(float)); }
inline void store(at::BFloat16* to, const float* from, int64_t n) {
  for (int64_t i = 0; i < n; ++i) to[i] = static_cast<at::BFloat16>(from[i]);
}

// q . k over n values in vector lanes, summed by halving (a plain running sum is one dependent chain)
template <typename KV>
inline float dot(const float* a, const KV* b, int64_t n) {
  Vec lanes{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) lanes += simd::load(a + i) * simd::load(b + i);
  float sum = lane_sum(lanes);
  for (; i < n; ++i) sum += a[i] * widen(b[i]);
  return sum;
}

// The MLP's activations in fp32, as ATen computes them (silu x / (1 + e^-x); GELU 0.5 x (1 + tanh(...)) or
// 0.5 x (1 + erf(x / sqrt 2))), within ~1e-7 relative of its vectorized results; on a vector of lanes
inline Vec abs_of(Vec v) { return v < 0.0f ? -v : v; }
inline Vec silu(Vec v) { return v / (1.0f + simd::exp_vec(-v)); }
inline Vec gelu_tanh(Vec v) {
  const Vec u = 0.7978845608f * (v + 0.044715f * v * v * v);
  const Vec t = 1.0f - 2.0f / (simd::exp_vec(2.0f * abs_of(u)) + 1.0f);  // tanh |u|: 1 + tanh within ~1e-7
  return 0.5f * v * (1.0f + (u < 0.0f ? -t : t));
}
// erfc(z) for z >= 0 in the form t exp(-z^2 + P(t)), t = 1 / (1 + z / 2) (fractional error < 1.2e-7 everywhere,
// Numerical Recipes' erfcc), so that 1 + erf(x / sqrt 2) keeps its relative accuracy in the negative tail too
inline Vec gelu_erf(Vec v) {
  const Vec z = abs_of(v) * 0.70710678f, t = 1.0f / (1.0f + 0.5f * z);
  Vec p = simd::splat(0.17087277f);
  p = p * t - 0.82215223f, p = p * t + 1.48851587f, p = p * t - 1.13520398f, p = p * t + 0.27886807f;
  p = p * t - 0.18628806f, p = p * t + 0.09678418f, p = p * t + 0.37409196f, p = p * t + 1.00002368f;
  const Vec erfc = t * simd::exp_vec(-z * z - 1.26551223f + t * p);
  return 0.5f * v * (v < 0.0f ? erfc : 2.0f - erfc);
}

// out = torch.lerp(h, previous, mix) over n values, ATen's form: the weight's side nearer to the result's end taken
// as the base (h + mix (previous - h) for |mix| < 1/2, else previous + (mix - 1)(previous - h)), one fused
// multiply-add as ATen's, rounded to bf16
inline void lerp_row(const float* h, const float* previous, const float* mix, float* out, int64_t n, bool bf16) {
  for_lanes(0, n, [&](int64_t i, int64_t k) {
    const Vec start = load_n(h + i, k), end = load_n(previous + i, k), weight = load_n(mix + i, k);
    const auto small = abs_of(weight) < 0.5f;
    const Vec coeff = small ? weight : weight - 1.0f, base = small ? start : end;
    store_n(out + i, round_to(simd::fma(coeff, end - start, base), bf16), k);
  });
}

}  // namespace GPTLAB_NS::step_math
