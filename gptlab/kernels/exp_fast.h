// exp_fast: an fp32 exp written so that loops over it vectorize, shared by decode_step.cpp (attention softmax,
// activations) and cross_entropy.cpp (the loss's softmax).
#pragma once

#include "linear_avx2.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace GPTLAB_NS {

// exp(x), branch-free so that a loop over it vectorizes: 2^n by the exponent bits, e^r on |r| <= ln2 / 2 by its
// Taylor polynomial to r^7 (relative error ~1e-7, as std::exp's fp32 result); below -87 the result is 0 (as an fp32
// exp underflows: a masked key's -inf included), above 88 it is e^88 (silu and tanh saturate long before). Always
// inlined: GCC left it a call (through the PLT) inside decode_step.cpp's loops, which then stayed scalar
__attribute__((always_inline)) inline float exp_fast(float x) {
  const bool underflows = x < -87.0f;
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504f + 0.5f);
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720, p = p * r + 1.0f / 120, p = p * r + 1.0f / 24, p = p * r + 1.0f / 6, p = p * r + 0.5f;
  p = p * r + 1.0f, p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // -126 <= n <= 127: a normal power of two
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return underflows ? 0.0f : p * scale;
}

}  // namespace GPTLAB_NS
