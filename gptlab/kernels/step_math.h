// decode_step.cpp's arithmetic on a few rows: bf16 rounding where the lean step holds bf16 tensors, the norms,
// rotary embeddings, the attention's dot product and the MLP's activations, each written so that the compiler
// vectorizes it (see decode_step.cpp for how closely they follow ATen's).
#pragma once

#include <ATen/ATen.h>

#include "exp_fast.h"
#include "linear_avx2.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace GPTLAB_NS::step_math {

using GPTLAB_NS::exp_fast;

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
inline void round_all(float* p, int64_t n, bool bf16) {
  if (bf16)
    for (int64_t i = 0; i < n; ++i) p[i] = round_to(p[i], true);
}
// a norm's weight or bias (bf16 or fp32) read as fp32; empty where absent
struct Vec {
  const float* f = nullptr;
  const at::BFloat16* h = nullptr;
  explicit Vec(const c10::optional<at::Tensor>& t) {
    if (!t.has_value() || !t->defined()) return;
    if (t->scalar_type() == at::kBFloat16) h = t->data_ptr<at::BFloat16>();
    else f = t->data_ptr<float>();
  }
  bool present() const { return f || h; }
  float operator[](int64_t i) const { return f ? f[i] : static_cast<float>(h[i]); }
};

// rows of width n, normalized (LayerNorm, RMSNorm, or Gemma's RMSNorm scaled by 1 + weight): out = norm(in)
inline void norm_rows(const float* in, float* out, int64_t rows, int64_t n, int kind,
                      const c10::optional<at::Tensor>& w, const c10::optional<at::Tensor>& b, float eps, bool bf16) {
  const Vec weight(w), bias(b);
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = in + r * n;
    float* y = out + r * n;
    double mean = 0.0, sq = 0.0;
    if (kind == kLayerNorm) {
      for (int64_t i = 0; i < n; ++i) mean += x[i];
      mean /= n;
    }
    for (int64_t i = 0; i < n; ++i) sq += (x[i] - mean) * (x[i] - mean);
    const float inv = 1.0f / std::sqrt(static_cast<float>(sq / n) + eps), m = static_cast<float>(mean);
    for (int64_t i = 0; i < n; ++i) {
      float v = (x[i] - m) * inv;
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
  for (int64_t i = 0; i < half; ++i) {
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

// q . k over n values in 16 independent lanes (summed at the end), so that the compiler vectorizes it: a plain
// running sum is one dependent chain (and the attention's scores were scalar)
template <typename KV>
inline float dot(const float* a, const KV* b, int64_t n) {
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += a[i + j] * widen(b[i + j]);
  float sum = 0.0f;
  for (; i < n; ++i) sum += a[i] * widen(b[i]);
  for (int j = 0; j < 16; ++j) sum += lanes[j];
  return sum;
}

// The MLP's activations in fp32, as ATen computes them (silu x / (1 + e^-x); GELU 0.5 x (1 + tanh(...)) or
// 0.5 x (1 + erf(x / sqrt 2))), within ~1e-7 relative of its vectorized results
inline float silu(float v) { return v / (1.0f + exp_fast(-v)); }
inline float gelu_tanh(float v) {
  const float u = 0.7978845608f * (v + 0.044715f * v * v * v);
  const float t = 1.0f - 2.0f / (exp_fast(2.0f * std::fabs(u)) + 1.0f);  // tanh |u|: 1 + tanh within ~1e-7
  return 0.5f * v * (1.0f + (u < 0.0f ? -t : t));
}
// erfc(z) for z >= 0 in the form t exp(-z^2 + P(t)), t = 1 / (1 + z / 2) (fractional error < 1.2e-7 everywhere,
// Numerical Recipes' erfcc), so that 1 + erf(x / sqrt 2) keeps its relative accuracy in the negative tail too
inline float gelu_erf(float v) {
  const float z = std::fabs(v) * 0.70710678f, t = 1.0f / (1.0f + 0.5f * z);
  float p = 0.17087277f;
  p = p * t - 0.82215223f, p = p * t + 1.48851587f, p = p * t - 1.13520398f, p = p * t + 0.27886807f;
  p = p * t - 0.18628806f, p = p * t + 0.09678418f, p = p * t + 0.37409196f, p = p * t + 1.00002368f;
  const float erfc = t * exp_fast(-z * z - 1.26551223f + t * p);
  return 0.5f * v * (v < 0.0f ? erfc : 2.0f - erfc);
}

}  // namespace GPTLAB_NS::step_math
