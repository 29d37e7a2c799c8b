// Token shift in decode_step.cpp (gptlab/token_shift.py): each shift point's input (point 0: the embeddings, where
// the step embeds the tokens itself; point l + 1: layer l's MLP input) mixed with the previous position's, which is
// an earlier row of the same call (a prompt's previous token), else the vector the cache keeps for it, else zeros
// at position 0; every row's own kept for later steps.
#pragma once

#include <ATen/ATen.h>

#include "step_math.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace GPTLAB_NS::token_shift {

// A call's token shift, made before its parallel region (where nothing may throw): point p's kept vector of cache
// row r at position t is at base + p * point + r * row + t * position; `mix` (L + 1, C) is each point's, rounded to
// the model's dtype as the lean step uses it (point 0's only where the step embeds); `before[b]` the row of this
// call that holds row b's previous position, or -1. `base` null: no token shift.
template <typename KV>
struct Shifted {
  KV* base = nullptr;
  int64_t point = 0, row = 0, position = 0;
  std::vector<float> mix;
  std::vector<int64_t> before;
};

// `kept` (L + 1, cache rows, max_len, C) in the cache's dtype; mix_of(p): point p's mix (p = 0 asked for only where
// `embeds`); rows and pos (B) where each row is a cache row's token at a position of its own, else null
template <typename KV, typename MixOf>
Shifted<KV> plan(const at::Tensor& kept, const at::Tensor& k_cache, int64_t L, int64_t B, int64_t C,
                 at::ScalarType dtype, bool embeds, const MixOf& mix_of, const int64_t* rows, const int64_t* pos) {
  TORCH_CHECK(kept.scalar_type() == k_cache.scalar_type() && kept.dim() == 4 && kept.size(0) == L + 1 &&
              kept.size(1) == k_cache.size(1) && kept.size(2) == k_cache.size(3) && kept.size(3) == C &&
              kept.stride(3) == 1, "decode_step: shifted (L + 1, rows, max_len, C) in the cache's dtype");
  Shifted<KV> s{static_cast<KV*>(kept.data_ptr()), kept.stride(0), kept.stride(1), kept.stride(2),
                std::vector<float>((L + 1) * C), std::vector<int64_t>(B, -1)};
  for (int64_t p = embeds ? 0 : 1; p <= L; ++p) {
    const c10::optional<at::Tensor> mix = mix_of(p);
    TORCH_CHECK(mix.has_value() && mix->numel() == C, "decode_step: shift point ", p, " lacks its mix");
    float* to = s.mix.data() + p * C;
    if (mix->scalar_type() == at::kFloat && mix->is_contiguous()) {  // (no ATen op: this runs every step)
      const float* from = mix->data_ptr<float>();
      for (int64_t c = 0; c < C; ++c) to[c] = step_math::round_to(from[c], dtype == at::kBFloat16);
    } else {
      const auto rounded = mix->to(dtype).to(at::kFloat).contiguous();
      std::copy_n(rounded.data_ptr<float>(), C, to);
    }
  }
  if (rows != nullptr)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t e = 0; e < B; ++e)
        if (rows[e] == rows[b] && pos[e] == pos[b] - 1) s.before[b] = e;
  return s;
}

// shift point p's inputs h (B, C) mixed into out; row b is cache row slot[b]'s token at at[b]. Every thread mixes
// its own copy of h; `keep` (one thread) writes h to the cache: the positions written are never the ones read, which
// are earlier rows' of this call or earlier steps'. `previous`: C floats of scratch.
template <typename KV, typename Slot, typename At>
void mix_rows(const Shifted<KV>& s, int64_t p, const float* h, int64_t B, int64_t C, const Slot& slot,
              const At& at, bool keep, bool bf16, float* out, float* previous) {
  KV* point = s.base + p * s.point;
  const float* mix = s.mix.data() + p * C;
  for (int64_t b = 0; b < B; ++b) {
    const float* before = previous;
    if (s.before[b] >= 0) before = h + s.before[b] * C;
    else if (at(b) == 0) std::fill_n(previous, C, 0.0f);
    else for (int64_t c = 0; c < C; ++c)
      previous[c] = static_cast<float>(point[slot(b) * s.row + (at(b) - 1) * s.position + c]);
    step_math::lerp_row(h + b * C, before, mix, out + b * C, C, bf16);
  }
  if (keep)
    for (int64_t b = 0; b < B; ++b) {
      KV* dst = point + slot(b) * s.row + at(b) * s.position;
      for (int64_t c = 0; c < C; ++c) dst[c] = static_cast<KV>(h[b * C + c]);
    }
}

}  // namespace GPTLAB_NS::token_shift
