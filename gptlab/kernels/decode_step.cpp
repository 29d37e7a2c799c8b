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
// A layer's work, every thread's part of it (Step), is in step_layer.h; this file holds the op and its team.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "linear_avx2.h"
#include "step_args.h"
#include "step_ends.h"
#include "step_math.h"
#include "step_layer.h"
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

using namespace GPTLAB_NS::step_layer;  // Shape, Weights, Buffers, Local, Step; step_math, step_args

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
