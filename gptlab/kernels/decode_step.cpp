// One decode step of any gptlab model (one new token per row) in one C++ call, over weights packed for this
// library's `linear`: the loop of gptlab/generation/fast_decode.py's lean step without a Python round trip per op.
// Rows may also be tokens at positions of their own in cache rows of their own (`rows`, `pos`): several rows of
// one cache row at successive positions are a prompt's next tokens, each attending to those before it (a layer's
// keys are all in the cache before any row attends), so prompts are prefilled in the same call as the running
// rows' next tokens (`gptlab.generation.fast_decode.decode_rows`).
// Norms, rotary embeddings, q/k norms, grouped-query attention over the KV cache, soft-caps and the MLP's
// activation are plain loops over a few rows (written so that the compiler vectorizes them); the Linear products go
// to the kernel over raw rows (`linear_part`). Its buffers are made once per call: no ATen op runs inside a step.
//
// Threads: one parallel region for the whole step (team.h). Each product's panels and the attention's heads are
// split between the threads, a spin barrier after each such phase; the small ops between them (adds, norms) are
// done by every thread on its own copy of the residual stream and the norm's output, which costs no more time than
// one thread doing them while the others wait, and saves the barrier after each. Work that needs only the columns
// of a product one thread made (an ungated MLP's activation; a layer's keys and values into the cache where no
// q/k norm or rotation needs whole heads) runs in that product's phase (`project`'s `then`): a GPT-2 layer has 5
// barriers, not 7.
//
// Values are kept in fp32 and rounded to a bf16 model's dtype wherever the lean step holds a bf16 tensor (after
// each norm, product, activation, rotation and residual add; a norm once, as ATen's bf16 norms round), so a bf16
// model's step follows the lean one but for the odd rounding where an fp32 sum ran in another order (attention,
// a norm's statistics) or an fp32 exp/tanh/erf differs from ATen's in its last bits (`exp_fast`'s ~1e-7).
//
// Per layer, `weights` holds kPerLayer tensors (None where absent): ln_1 weight, bias; c_attn (packed, qparams,
// bias); attn c_proj (3); ln_2 weight, bias; c_fc (3); mlp c_proj (3); ln_attn_out weight, bias; ln_mlp_out weight,
// bias (sandwich blocks); q_norm weight, k_norm weight; the MLP input's token-shift mix. `shape`: n_head,
// n_kv_head, head_size, hidden, layout, shared_norm, norm kind, mlp kind, gelu tanh, qk norm, rope interleaved,
// rotary dim, then one sliding flag per layer.
// After the layers' tensors come the final norm's weight and bias, applied where `final_norm` is set.
// A token-shift model passes its cache's kept vectors, `shifted` (L + 1, rows, max_len, C): token_shift.h.
// The first block's input is `x`, or the step embeds `tokens` itself (`front`); with `head` it returns logits, and
// with `greedy_steps` the argmax tokens of that many steps, each fed the one before's: step_ends.h.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "linear_avx2.h"
#include "step_args.h"
#include "step_ends.h"
#include "step_math.h"
#include "team.h"
#include "token_shift.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

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
    for (int64_t i = t.begin(B * nh); i < t.end(B * nh); ++i) attend(me, i / nh, i % nh, kp, vp, mask, mask_rows);
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

// every thread's part of the step: the layers, then the final norm, and x (thread 0) or the logits (every thread
// its share of the head's panels) into out
template <typename KV>
void run(const Step<KV>& first, const at::Tensor& x, at::Tensor& out, int64_t widest, at::IntArrayRef shape,
         bool final_norm, const GPTLAB_NS::step_ends::Head* head, GPTLAB_NS::step_ends::Greedy* greedy) {
  const int64_t B = first.B, C = first.C, L = first.L, steps = greedy ? greedy->steps : 1;
  const bool bf16 = first.bf16;
  const int threads = at::in_parallel_region() ? 1 : std::max(1, at::get_num_threads());
  int team = 1;
  std::optional<GPTLAB_NS::SpinBarrier> barrier;
  if (greedy) greedy->ready(threads);
#pragma omp parallel num_threads(threads)
  {
#pragma omp single
    {  // the team the runtime gave (it may give fewer threads than asked), known to all after single's barrier
      team = omp_get_num_threads();
      barrier.emplace(team);
    }
    const Team t{{omp_get_thread_num(), team}, &*barrier};
    Local me(B, C, first.end + steps - 1, widest, first.shifted.base != nullptr);
    std::vector<int64_t> picked(greedy ? B : 0);  // greedy steps: the tokens the last step picked
    for (int64_t i = 0; i < steps; ++i) {
      Step<KV> step = first;  // greedy steps: step i feeds step i - 1's picks, one position on
      if (i > 0) step.where += i, step.end += i, step.front.tokens = picked.data();
      if (greedy && step.cos) step.cos += i * (step.s.rot / 2), step.sin += i * (step.s.rot / 2);
      if (step.front.tokens != nullptr) step.embed(t, me, me.x.data());
      else if (bf16) std::copy_n(x.data_ptr<at::BFloat16>(), B * C, me.x.begin());
      else std::copy_n(x.data_ptr<float>(), B * C, me.x.begin());
      for (int64_t l = 0; l < L; ++l) step.layer(t, me, l, shape[12 + l] != 0);
      if (head != nullptr || t.part.index == 0) {
        if (final_norm)  // ln_f (a post-norm model ends in its last block's norm)
          norm_rows(me.x.data(), me.x.data(), B, C, step.s.norm, step.w.get(kPerLayer * L),
                    step.w.get(kPerLayer * L + 1), step.eps, bf16);
      }
      if (head == nullptr) {
        if (t.part.index == 0) {
          if (bf16) std::copy_n(me.x.begin(), B * C, out.data_ptr<at::BFloat16>());  // values already bf16: exact
          else std::copy_n(me.x.begin(), B * C, out.data_ptr<float>());
        }
      } else {
        GPTLAB_NS::step_ends::logits(*head, t, me.x.data(), C, bf16, me.h.data(), me.xb.data(), out);
        if (greedy) greedy->pick(*head, t, bf16 ? head->wide : out.data_ptr<float>(), i, picked.data());
      }
    }
  }
}

// x (B, 1, C) in the model's dtype, the first block's input, or `tokens` (B) the step embeds (`front`); returns x
// after the last block and the final norm, or with `head` the logits (H, vocab) of rows head_rows (H: all B)
at::Tensor decode_step(const c10::optional<at::Tensor>& x, const Weights& weights, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, int64_t where, const c10::optional<at::Tensor>& rows,
                       const c10::optional<at::Tensor>& pos, int64_t end, const c10::optional<at::Tensor>& full,
                       const c10::optional<at::Tensor>& window, const c10::optional<at::Tensor>& cos,
                       const c10::optional<at::Tensor>& sin, at::IntArrayRef shape, double eps, double scale,
                       double softcap, bool final_norm, const c10::optional<at::Tensor>& shifted,
                       const c10::optional<at::Tensor>& tokens, const Weights& front, double embed_scale,
                       bool embed_norm, const Weights& head, const c10::optional<at::Tensor>& head_rows,
                       int64_t vocab, int64_t greedy_steps) {
  TORCH_CHECK(shape.size() >= 12, "decode_step: shape holds 12 sizes and a sliding flag per layer");
  const Shape s{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5], shape[6], shape[7], shape[8], shape[9],
                shape[10], shape[11]};
  const bool embeds = given(tokens);
  TORCH_CHECK(embeds || given(x), "decode_step: x or tokens");
  const auto dtype = embeds ? front.get(0)->scalar_type() : x->scalar_type();
  const int64_t L = static_cast<int64_t>(shape.size()) - 12, B = embeds ? tokens->numel() : x->size(0);
  const int64_t C = embeds ? front.get(0)->size(1) : x->size(2);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kPerLayer * L + 2, "decode_step: ", kPerLayer,
              " tensors a layer and the final norm's two");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "decode_step: bf16 or fp32");
  const bool bf16 = dtype == at::kBFloat16, bf16_cache = k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK((k_cache.scalar_type() == at::kFloat || (bf16 && bf16_cache)) &&
              v_cache.scalar_type() == k_cache.scalar_type() && k_cache.dim() == 5 && k_cache.stride(4) == 1 &&
              v_cache.strides() == k_cache.strides(), "decode_step: an fp32 cache, or a bf16 one for a bf16 model");
  const int64_t last = end + std::max<int64_t>(greedy_steps, 1) - 1;  // the last step's keys (greedy steps: on)
  TORCH_CHECK(s.nkv > 0 && s.nh % s.nkv == 0 && end > 0 && last <= k_cache.size(3), "decode_step: bad sizes");
  at::Tensor rows_c, pos_c, cos_c, sin_c, tokens_c, head_rows_c;
  if (where < 0) checked_rows(rows, pos, B, k_cache.size(1), end, rows_c, pos_c);
  const int64_t rope_rows = checked_rope(cos, sin, s.rot, cos_c, sin_c);
  TORCH_CHECK(greedy_steps == 0 || (where >= 0 && embeds && !head.empty() && !given(full) && !given(window) &&
                                    !given(head_rows) && (rope_rows == 0 || rope_rows == greedy_steps)),
              "decode_step: greedy steps are rows at one position, embedded, through the head, without masks, "
              "with a cos/sin row each");
  int64_t full_rows = 0, window_rows = 0;
  const bool* full_p = mask_data(full, end, full_rows);
  const bool* window_p = mask_data(window, end, window_rows);
  const int64_t width = (s.nh + 2 * s.nkv) * s.hs, fc = s.mlp == kSwiGLU || s.mlp == kGeGLU ? 2 * s.hidden : s.hidden;
  for (int64_t l = 0; l < L; ++l) {  // every check before the parallel region, where nothing may throw
    const auto check = [&](int64_t i, int64_t K, int64_t N) {
      TORCH_CHECK(weights.get(kPerLayer * l + i).has_value(), "decode_step: layer ", l, " lacks a product");
      GPTLAB_NS::check_linear(*weights.get(kPerLayer * l + i), weights.get(kPerLayer * l + i + 1),
                              weights.get(kPerLayer * l + i + 2), K, N);
    };
    check(2, C, width), check(5, s.nh * s.hs, C), check(10, C, fc), check(13, s.hidden, C);
  }
  const bool shifts = given(shifted);
  const int64_t* token_ids =
      embeds ? GPTLAB_NS::step_ends::checked_tokens(*tokens, front, C, bf16, last, shifts, tokens_c) : nullptr;
  const GPTLAB_NS::step_ends::Front embedding{front, token_ids, static_cast<float>(embed_scale), embed_norm};
  const bool logits = !head.empty();
  auto the_head = GPTLAB_NS::step_ends::checked_head(head, head_rows, B, C, vocab, head_rows_c);
  Buffers buffers(B, C, width, s.nh * s.hs, fc, s.hidden);
  const at::Tensor xc = embeds ? at::Tensor() : x->contiguous();
  const auto options = at::TensorOptions().dtype(dtype);
  auto out = logits ? at::empty({the_head.H, vocab}, options) : at::empty({B, 1, C}, options);
  auto wide = logits && bf16 ? at::empty({the_head.H, vocab}, options.dtype(at::kFloat)) : at::Tensor();
  if (wide.defined()) the_head.wide = wide.data_ptr<float>();
  const int64_t widest = std::max({C, s.nh * s.hs, s.hidden});
  auto picks = greedy_steps ? at::empty({B, greedy_steps}, at::kLong) : at::Tensor();
  GPTLAB_NS::step_ends::Greedy greedy{greedy_steps, B, picks.defined() ? picks.data_ptr<int64_t>() : nullptr};
  const auto go = [&](auto kv) {  // the step over this cache's element type
    using KV = decltype(kv);
    GPTLAB_NS::token_shift::Shifted<KV> kept;
    if (shifts)
      kept = GPTLAB_NS::token_shift::plan<KV>(
          *shifted, k_cache, L, B, C, dtype, embeds,
          [&](int64_t p) { return p == 0 ? front.get(4) : weights.get(kPerLayer * (p - 1) + 22); },
          where < 0 ? rows_c.data_ptr<int64_t>() : nullptr, where < 0 ? pos_c.data_ptr<int64_t>() : nullptr);
    const Step<KV> step{s, weights, B, C, L, bf16, static_cast<float>(eps), static_cast<float>(scale),
                        static_cast<float>(softcap), k_cache, v_cache, where, end,
                        where < 0 ? rows_c.data_ptr<int64_t>() : nullptr,
                        where < 0 ? pos_c.data_ptr<int64_t>() : nullptr, full_p, window_p, full_rows, window_rows,
                        rope_rows ? cos_c.data_ptr<float>() : nullptr, rope_rows ? sin_c.data_ptr<float>() : nullptr,
                        greedy_steps ? 1 : rope_rows, buffers, kept, embedding};  // (greedy: a row a step)
    run(step, xc, out, widest, shape, final_norm, logits ? &the_head : nullptr, greedy_steps ? &greedy : nullptr);
  };
  if (bf16_cache) go(at::BFloat16{});
  else go(float{});
  return greedy_steps ? picks : out;
}

}  // namespace

GPTLAB_LIBRARY_FRAGMENT(GPTLAB_NS, m) {
  m.def("decode_step(Tensor? x, Tensor?[] weights, Tensor k_cache, Tensor v_cache, int where, Tensor? rows, "
        "Tensor? pos, int end, Tensor? full, Tensor? window, Tensor? cos, Tensor? sin, int[] shape, float eps, "
        "float scale, float softcap, bool final_norm, Tensor? shifted, Tensor? tokens, Tensor?[] front, "
        "float embed_scale, bool embed_norm, Tensor?[] head, Tensor? head_rows, int vocab, int greedy_steps) "
        "-> Tensor",
        &decode_step);
}
