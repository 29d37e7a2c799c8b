// A grammar's token bitmask over a row of logits (bit t % 32 of bits[t / 32] allows token t; null: every token),
// and the largest allowed logit: for sampling.cpp's masked draw and, with no mask, cross_entropy.cpp's row maximum.
#pragma once

#include <cstdint>

#include "simd.h"

namespace GPTLAB_NS::token_mask {

using simd::IVec;
using simd::kInf;
using simd::kLanes;
using simd::lane_max;
using simd::load;
using simd::splat;
using simd::Vec;

// which of the kLanes tokens from t (a multiple of kLanes) the mask allows: all lanes set (-1) or clear (0)
inline IVec allowed_lanes(const uint32_t* bits, int64_t t) {
  if (bits == nullptr) return IVec{} - 1;
  IVec lane;
  for (int j = 0; j < kLanes; ++j) lane[j] = j;
  const int32_t chunk = static_cast<int32_t>(bits[t >> 5] >> (t & 31));
  return (((IVec{} + chunk) >> lane) & 1) != 0;
}

inline bool allowed(const uint32_t* bits, int64_t t) { return bits == nullptr || ((bits[t >> 5] >> (t & 31)) & 1u); }

// whether the mask forbids all kLanes tokens from t (a multiple of kLanes): a grammar between values allows a few
// tokens of 50k, and such a row's lanes are skipped, not computed and blended away
inline bool none_allowed(const uint32_t* bits, int64_t t) {
  constexpr uint32_t kAll = kLanes == 32 ? ~0u : (1u << kLanes) - 1;
  return bits != nullptr && ((bits[t >> 5] >> (t & 31)) & kAll) == 0;
}

// the largest allowed logit; `finite` false where an allowed one is NaN or +inf, or none is allowed
template <typename T>
float allowed_max(const T* row, int64_t V, const uint32_t* bits, bool& finite) {
  Vec lanes = splat(-kInf);
  IVec bad = {};
  int64_t i = 0;
  for (; i + kLanes <= V; i += kLanes) {
    if (none_allowed(bits, i)) continue;
    const IVec on = allowed_lanes(bits, i);
    const Vec x = load(row + i);
    bad |= on & ((x != x) | (x == kInf));
    lanes = (on != 0) & (x > lanes) ? x : lanes;
  }
  float top = lane_max(lanes);
  bool any_bad = false;
  for (int j = 0; j < kLanes; ++j) any_bad |= bad[j] != 0;
  for (; i < V; ++i) {
    if (!allowed(bits, i)) continue;
    const float x = static_cast<float>(row[i]);
    any_bad |= x != x || x == kInf;
    top = x > top ? x : top;
  }
  finite = !any_bad && top > -kInf;
  return top;
}

}  // namespace GPTLAB_NS::token_mask
