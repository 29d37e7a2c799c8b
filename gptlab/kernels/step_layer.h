// One layer of the C++ decode step (decode_step.cpp, whose opening comment says how a step runs): its shape and
// per-layer weight slots, the buffers its phases share and those each thread keeps, and `Step`, every thread's part
// of a layer (the norms, the attention over the KV cache, the MLP, the token-shift mixes) and of the embedding.
#pragma once

#include <ATen/ATen.h>

#include "linear_avx2.h"
#include "step_args.h"
#include "step_ends.h"
#include "step_math.h"
#include "team.h"
#include "token_shift.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace GPTLAB_NS::step_layer {

using namespace GPTLAB_NS::step_math;
using namespace GPTLAB_NS::step_args;

using GPTLAB_NS::Team;
namespace simd = GPTLAB_NS::simd;

constexpr int64_t kPerLayer = 23;
enum Layout { kPre = 0, kParallel = 1, kSandwich = 2, kPost = 3 };
enum Mlp { kGelu = 0, kSwiGLU = 1, kGeGLU = 2, kReLU2 = 3 };

struct Shape {
  int64_t nh, nkv, hs, hidden, layout, shared_norm, norm, mlp, gelu_tanh, qk_norm, interleaved, rot;
};

using Weights = c10::List<c10::optional<at::Tensor>>;

// what a step's phases share, made once per call (none of it is a tensor): the products' outputs, the MLP's
// activation, the attention's heads
struct Buffers {
  std::vector<float> a, m, qkv, y, up, act;
  Buffers(int64_t B, int64_t C, int64_t width, int64_t heads, int64_t fc, int64_t H)
      : a(B * C), m(B * C), qkv(B * width), y(B * heads), up(B * fc), act(B * H) {}
};

// what each thread keeps to itself: the residual stream (in fp32), a norm's output, a product's input as bf16
// values (a bf16 model's), the attention's scores, and a token-shift model's mixed MLP inputs and a kept vector
struct Local {
  std::vector<float> x, h, p, shifted, previous;
  std::vector<at::BFloat16> xb;
  Local(int64_t B, int64_t C, int64_t end, int64_t widest, bool shifts)
      : x(B * C), h(B * C), p(end), shifted(shifts ? B * C : 0), previous(shifts ? C : 0), xb(B * widest) {}
};

// KV: the cache's element type, float or (a bf16 model's, which it holds exactly) at::BFloat16
template <typename KV>
struct Step {
  const Shape& s;
  const Weights& w;
  int64_t B, C, L;
  bool bf16;
  float eps, scale, softcap;
  const at::Tensor &k_cache, &v_cache;  // (L, B, nkv, max_len, hs) of KV
  int64_t where, end;
  const int64_t *rows, *pos;      // where < 0: row b is cache row rows[b]'s token at pos[b]; else row b's at where
  const bool *full, *window;      // (B or 1, end) masks, or null: every key
  int64_t full_rows, window_rows;
  const float *cos, *sin;         // (B or 1, rot / 2), or null
  int64_t rope_rows;
  Buffers& buf;
  const GPTLAB_NS::token_shift::Shifted<KV>& shifted;  // base null: no token shift
  GPTLAB_NS::step_ends::Front front;  // tokens null: the input x was given

  c10::optional<at::Tensor> at(int64_t layer, int64_t i) const { return w.get(kPerLayer * layer + i); }

  // y (B, N) = x (B, K) @ W.T + bias through the packed kernel, this thread's panels of it; the weight's three
  // entries start at weights[i]. A bf16 model's x holds bf16 values: handed over as bf16 too, they go through the
  // kernel's bf16 dot products, as the lean step's bf16 tensors do. `then(b, n0, n1)`: work on row b's columns
  // [n0, n1) that needs no other column (an activation, a copy to the cache), done by the thread that made them
  // before the phase ends, which saves the barrier a phase of its own would take. Ends the phase: y is whole after it
  template <typename Then>
  void project(const Team& t, Local& me, const float* x, int64_t K, int64_t i, int64_t N, float* y,
               const Then& then) const {
    at::BFloat16* xb = nullptr;
    if (bf16) {
      xb = me.xb.data();
      for_lanes(0, B * K, [&](int64_t j, int64_t n) {  // (x holds bf16 values already: exact)
        if (n == kLanes) simd::store(xb + j, simd::load(x + j));
        else for (int64_t e = j; e < j + n; ++e) xb[e] = static_cast<at::BFloat16>(x[e]);
      });
    }
    GPTLAB_NS::linear_part(x, xb, B, K, *w.get(i), w.get(i + 1), w.get(i + 2), N, y, t.part);
    const int64_t panels = (N + GPTLAB_NS::kPanel - 1) / GPTLAB_NS::kPanel;
    const int64_t n0 = t.begin(panels) * GPTLAB_NS::kPanel, n1 = std::min(N, t.end(panels) * GPTLAB_NS::kPanel);
    for (int64_t b = 0; b < B && n0 < n1; ++b) {
      round_all(y + b * N + n0, n1 - n0, bf16);
      then(b, n0, n1);
    }
    t.sync();
  }
  void project(const Team& t, Local& me, const float* x, int64_t K, int64_t i, int64_t N, float* y) const {
    project(t, me, x, K, i, N, y, [](int64_t, int64_t, int64_t) {});
  }

  // row b's cache row and its token's position there
  int64_t slot_of(int64_t b) const { return where >= 0 ? b : rows[b]; }
  int64_t position_of(int64_t b) const { return where >= 0 ? where : pos[b]; }
  // where this token's head j of qkv (a key head or a value head: j >= nh) of row b goes in this layer's cache
  KV* cache_head(int64_t b, int64_t j, KV* kp, KV* vp) const {
    const int64_t nh = s.nh, nkv = s.nkv, slot = slot_of(b), at_t = position_of(b);
    const bool key = j < nh + nkv;
    return (key ? kp : vp) + slot * k_cache.stride(1) + (key ? j - nh : j - nh - nkv) * k_cache.stride(2) +
           at_t * k_cache.stride(3);
  }

  // row b's keys and values among qkv columns [n0, n1) into this layer's cache: what place_heads does for heads
  // that need no norm or rotation, here on the columns the thread made
  void cache_columns(int64_t b, int64_t n0, int64_t n1, KV* kp, KV* vp) const {
    const int64_t nh = s.nh, hs = s.hs, width = (nh + 2 * s.nkv) * hs;
    const float* row = buf.qkv.data() + b * width;
    for (int64_t c = std::max(n0, nh * hs); c < n1;) {  // a run of one head's columns at a time
      const int64_t j = c / hs, run = std::min(n1, (j + 1) * hs) - c;
      store(cache_head(b, j, kp, vp) + c % hs, row + c, run);
      c += run;
    }
  }

  // this thread's heads of every row: q/k norm and rotation, this token's keys and values into the cache
  void place_heads(const Team& t, int64_t layer, KV* kp, KV* vp) const {
    const int64_t nh = s.nh, nkv = s.nkv, hs = s.hs, heads = nh + 2 * nkv, width = heads * hs;
    const auto qn = at(layer, 20), kn = at(layer, 21);
    for (int64_t i = t.begin(B * heads); i < t.end(B * heads); ++i) {
      const int64_t b = i / heads, j = i % heads;
      float* head = buf.qkv.data() + b * width + j * hs;
      if (j < nh + nkv) {  // q heads then k heads: q/k norm, then the rotation
        if (s.qk_norm) norm_rows(head, head, 1, hs, kRMSNorm, j < nh ? qn : kn, c10::nullopt, eps, bf16);
        if (cos) {
          const int64_t r = rope_rows > 1 ? b : 0;
          rotate(head, cos + r * (s.rot / 2), sin + r * (s.rot / 2), s.rot, s.interleaved, bf16);
        }
      }
      if (j >= nh) store(cache_head(b, j, kp, vp), head, hs);
    }
  }

  // one query head of row b over the cached keys, into y
  void attend(Local& me, int64_t b, int64_t h, const KV* kp, const KV* vp, const bool* mask,
              int64_t mask_rows) const {
    const int64_t nh = s.nh, nkv = s.nkv, hs = s.hs, width = (nh + 2 * nkv) * hs, g = h / (nh / nkv);
    const int64_t sb = k_cache.stride(1), sh = k_cache.stride(2), st = k_cache.stride(3);
    float* p = me.p.data();
    const float* q = buf.qkv.data() + b * width + h * hs;
    const KV *keys = kp + slot_of(b) * sb + g * sh, *vals = vp + slot_of(b) * sb + g * sh;
    const bool* m = mask ? mask + (mask_rows > 1 ? b : 0) * end : nullptr;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < end; ++t) {
      if (m && !m[t]) { p[t] = -std::numeric_limits<float>::infinity(); continue; }
      float d = dot(q, keys + t * st, hs) * scale;
      if (softcap > 0.0f) d = softcap * std::tanh(d / softcap);
      p[t] = d;
      top = std::max(top, d);
    }
    Vec sums{};  // a masked key's -inf gives 0
    for_lanes(0, end, [&](int64_t t, int64_t n) {
      const Vec e = simd::exp_vec(load_n(p + t, n) - top);
      store_n(p + t, e, n);
      sums += n == kLanes ? e : load_n(p + t, n);  // (the tail's padding lanes: exp(-top), not 0)
    });
    const float total = lane_sum(sums);
    float* yi = buf.y.data() + b * nh * hs + h * hs;
    std::fill_n(yi, hs, 0.0f);
    for (int64_t t = 0; t < end; ++t) {
      if (p[t] == 0.0f) continue;
      const float pw = p[t] / total;
      for (int64_t e = 0; e < hs; ++e) yi[e] += pw * widen(vals[t * st + e]);
    }
    for (int64_t e = 0; e < hs; ++e) yi[e] = round_to(yi[e], bf16);
  }

  // the attention branch for input h (B, C) -> out (B, C), writing this token's keys and values to the cache
  void attention(const Team& t, Local& me, int64_t layer, bool sliding, const float* h, float* out) const {
    const int64_t nh = s.nh, width = (nh + 2 * s.nkv) * s.hs;
    // this layer's (B, nkv, max_len, hs) keys and values
    KV *kp = static_cast<KV*>(k_cache.data_ptr()) + layer * k_cache.stride(0),
       *vp = static_cast<KV*>(v_cache.data_ptr()) + layer * v_cache.stride(0);
    if (s.qk_norm || cos) {  // heads normed or rotated whole: a phase of their own after the product
      project(t, me, h, C, kPerLayer * layer + 2, width, buf.qkv.data());
      place_heads(t, layer, kp, vp);
      t.sync();
    } else {
      project(t, me, h, C, kPerLayer * layer + 2, width, buf.qkv.data(),
              [&](int64_t b, int64_t n0, int64_t n1) { cache_columns(b, n0, n1, kp, vp); });
    }
    const bool* mask = sliding ? window : full;
    const int64_t mask_rows = sliding ? window_rows : full_rows;
    // head by head, each over every row: rows of one cache row (a prompt's part, a verify's guesses) then read a
    // head's keys and values from memory once, the other rows from this core's cache
    for (int64_t i = t.begin(B * nh); i < t.end(B * nh); ++i) attend(me, i % B, i / B, kp, vp, mask, mask_rows);
    t.sync();
    project(t, me, buf.y.data(), nh * s.hs, kPerLayer * layer + 5, C, out);
  }

  // the activation rounded where the lean step's bf16 tensors round (the activation, then the gate's product). An
  // ungated one needs only the columns a thread made: it runs in the product's phase; a gated one pairs columns
  // i and H + i, which two threads may have made: a phase of its own, each thread taking its share of the columns
  void mlp(const Team& t, Local& me, int64_t layer, const float* h, float* out) const {
    const bool gated = s.mlp == kSwiGLU || s.mlp == kGeGLU;
    const int64_t H = s.hidden, fc = gated ? 2 * H : H;
    float *a = buf.up.data(), *act = buf.act.data();  // (B, fc), (B, H)
    if (gated) {
      project(t, me, h, C, kPerLayer * layer + 10, fc, a);
      for (int64_t b = 0; b < B; ++b) activate(a + b * fc, H, act + b * H, t.begin(H), t.end(H));
      t.sync();
    } else {
      project(t, me, h, C, kPerLayer * layer + 10, fc, a,
              [&](int64_t b, int64_t n0, int64_t n1) { activate(a + b * fc, H, act + b * H, n0, n1); });
    }
    project(t, me, act, H, kPerLayer * layer + 13, C, out);
  }

  // o[i] for i in [i0, i1) from one row of the up projection g (a gated MLP's up half at g + H), a vector of lanes
  // at a time (the tail's too: a column's bits do not depend on which thread's share it fell in)
  void activate(const float* g, int64_t H, float* o, int64_t i0, int64_t i1) const {
    const float* u = g + H;
    const bool gated = s.mlp == kSwiGLU || s.mlp == kGeGLU;
    for_lanes(i0, i1, [&](int64_t i, int64_t n) {
      const Vec x = load_n(g + i, n);
      Vec a;
      if (s.mlp == kSwiGLU) a = silu(x);
      else if (s.mlp == kReLU2) a = x < 0.0f ? simd::splat(0.0f) : x, a = a * a;
      else a = s.gelu_tanh ? gelu_tanh(x) : gelu_erf(x);
      a = round_to(a, bf16);
      if (gated) a = round_to(a * load_n(u + i, n), bf16);
      store_n(o + i, a, n);
    });
  }

  // the MLP's input h (B, C) mixed with each row's previous position's (token shift; h itself without it)
  const float* shift(const Team& t, Local& me, int64_t layer, const float* h) const {
    return shifted.base == nullptr ? h : mixed(t, me, layer + 1, h);
  }

  // shift point p's inputs h (B, C) mixed with the previous positions' (token_shift.h), in this thread's buffer
  const float* mixed(const Team& t, Local& me, int64_t p, const float* h) const {
    GPTLAB_NS::token_shift::mix_rows(
        shifted, p, h, B, C, [&](int64_t b) { return slot_of(b); }, [&](int64_t b) { return position_of(b); },
        t.part.index == 0, bf16, me.shifted.data(), me.previous.data());
    return me.shifted.data();
  }

  // the first block's input into x from the tokens (step_ends.h), token shift's point 0 as the layers' points
  void embed(const Team& t, Local& me, float* x) const {
    GPTLAB_NS::step_ends::embed(front, B, C, s.norm, eps, bf16, [&](int64_t b) { return position_of(b); },
                                [&](float* h) {
                                  if (shifted.base != nullptr) std::copy_n(mixed(t, me, 0, h), B * C, h);
                                }, x);
  }

  void add(float* x, const float* y) const {
    for (int64_t i = 0; i < B * C; ++i) x[i] = round_to(x[i] + y[i], bf16);
  }

  void norm(int64_t layer, int64_t i, const float* in, float* out) const {
    norm_rows(in, out, B, C, s.norm, at(layer, i), at(layer, i + 1), eps, bf16);
  }

  void layer(const Team& t, Local& me, int64_t l, bool sliding) const {
    float *x = me.x.data(), *h = me.h.data(), *a = buf.a.data(), *m = buf.m.data();
    switch (s.layout) {
      case kPre:
        norm(l, 0, x, h), attention(t, me, l, sliding, h, a), add(x, a);
        norm(l, 8, x, h), mlp(t, me, l, shift(t, me, l, h), m), add(x, m);
        break;
      case kParallel:
        norm(l, 0, x, h), attention(t, me, l, sliding, h, a);
        if (!s.shared_norm) norm(l, 8, x, h);
        mlp(t, me, l, shift(t, me, l, h), m), add(x, a), add(x, m);
        break;
      case kSandwich:
        norm(l, 0, x, h), attention(t, me, l, sliding, h, a), norm(l, 16, a, h), add(x, h);
        norm(l, 8, x, h), mlp(t, me, l, shift(t, me, l, h), m), norm(l, 18, m, h), add(x, h);
        break;
      default:  // post
        attention(t, me, l, sliding, x, a), add(x, a), norm(l, 0, x, x);
        mlp(t, me, l, shift(t, me, l, x), m), add(x, m), norm(l, 8, x, x);
    }
  }
};

}  // namespace GPTLAB_NS::step_layer
