// The two ends of decode_step.cpp's step, around its blocks: the tokens embedded as gptlab/generation/fast_decode.py's
// `embed` does it (`front`: wte, wpe, ln_emb's weight and bias, the embeddings' token-shift mix; `embed_scale`
// Gemma's sqrt(C) in the model's dtype), and the LM head's logits (`head`: its packed, qparams, bias) of rows
// `head_rows` (None: all), in the model's dtype. In the call, because for a small model the Python around one step
// (an embedding lookup, a token-shift mix, the head's forward: ~20 small ops) cost more than its blocks. And greedy
// steps (`greedy_steps`, rows at one position): that many steps in one call, each fed the argmax of the one before,
// returning those tokens (B, steps): a draft model's guesses, without Python between them.
#pragma once

#include <ATen/ATen.h>

#include "linear_avx2.h"
#include "step_math.h"
#include "team.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace GPTLAB_NS::step_ends {

using Tensors = c10::List<c10::optional<at::Tensor>>;
using step_math::round_to;
using step_math::widen;

// what the step embeds with: `w` holds wte, wpe, ln_emb's weight and bias, the embeddings' token-shift mix (None
// where absent); `tokens` (B); `scale`: Gemma's sqrt(C) in the model's dtype (0: none); `norm`: an ln_emb
struct Front {
  const Tensors& w;
  const int64_t* tokens;
  float scale;
  bool norm;
};

// the tables checked against the model (dtype, width, wpe's rows against the step's positions), the tokens against
// wte's rows, before the parallel region (where nothing may throw); the tokens (B) as int64 in `kept`
inline const int64_t* checked_tokens(const at::Tensor& tokens, const Tensors& front, int64_t C, bool bf16,
                                     int64_t end, bool shifts, at::Tensor& kept) {
  TORCH_CHECK(front.size() == 5 && front.get(0).has_value(), "decode_step: front is wte, wpe, ln_emb (2), mix");
  for (int64_t i : {0, 1}) {
    const auto table = front.get(i);
    if (!table.has_value() || !table->defined()) continue;
    TORCH_CHECK(table->scalar_type() == (bf16 ? at::kBFloat16 : at::kFloat) && table->dim() == 2 &&
                table->size(1) == C && table->is_contiguous(),
                "decode_step: wte and wpe (rows, C) contiguous in the model's dtype");
  }
  if (const auto wpe = front.get(1); wpe.has_value() && wpe->defined())
    TORCH_CHECK(end <= wpe->size(0), "decode_step: a position past wpe's ", wpe->size(0), " rows");
  TORCH_CHECK(!shifts || front.get(4).has_value(), "decode_step: the embeddings' token-shift mix is missing");
  kept = tokens.reshape({-1}).to(at::kLong).contiguous();
  const int64_t* t = kept.data_ptr<int64_t>();
  const int64_t V = front.get(0)->size(0);
  for (int64_t b = 0; b < kept.numel(); ++b)
    TORCH_CHECK(t[b] >= 0 && t[b] < V, "decode_step: token ", t[b], " is outside wte's ", V, " rows");
  return t;
}

// the first block's input x (B, C): wte[token] (times the scale, rounded to the model's dtype), token shift's point
// 0 (`shift(x)`, in place; nothing without token shift), + wpe[position(b)], then ln_emb (a norm of kind `norm_kind`)
template <typename Position, typename Shift>
void embed(const Front& f, int64_t B, int64_t C, int norm_kind, float eps, bool bf16, const Position& position,
           const Shift& shift, float* x) {
  const at::Tensor& wte = *f.w.get(0);
  for (int64_t b = 0; b < B; ++b) {
    if (bf16) {
      const at::BFloat16* row = wte.data_ptr<at::BFloat16>() + f.tokens[b] * C;
      for (int64_t c = 0; c < C; ++c) x[b * C + c] = widen(row[c]);
    } else {
      std::copy_n(wte.data_ptr<float>() + f.tokens[b] * C, C, x + b * C);
    }
  }
  if (f.scale > 0.0f)
    for (int64_t i = 0; i < B * C; ++i) x[i] = round_to(x[i] * f.scale, bf16);
  shift(x);
  if (const auto wpe = f.w.get(1); wpe.has_value() && wpe->defined())
    for (int64_t b = 0; b < B; ++b)
      for (int64_t c = 0; c < C; ++c) {
        const int64_t i = position(b) * C + c;
        const float p = bf16 ? widen(wpe->data_ptr<at::BFloat16>()[i]) : wpe->data_ptr<float>()[i];
        x[b * C + c] = round_to(x[b * C + c] + p, bf16);
      }
  if (f.norm) step_math::norm_rows(x, x, B, C, norm_kind, f.w.get(2), f.w.get(3), eps, bf16);
}

// the LM head: its (packed, qparams, bias), the rows whose logits are wanted (null: all), H of them, V wide; `wide`
// (H, V) fp32 scratch for a bf16 model's logits
struct Head {
  const Tensors& w;
  const int64_t* rows;
  int64_t H, V;
  float* wide;
};

// the head (empty: none; else its packed, qparams, bias) checked against the width C and `vocab`, and the rows
// wanted (`rows`: None for all B, kept as int64 in `kept`), before the parallel region; `wide` is the caller's
inline Head checked_head(const Tensors& head, const c10::optional<at::Tensor>& rows, int64_t B, int64_t C,
                         int64_t vocab, at::Tensor& kept) {
  Head h{head, nullptr, B, vocab, nullptr};
  if (head.empty()) return h;
  TORCH_CHECK(head.size() == 3 && head.get(0).has_value(), "decode_step: head is (packed, qparams, bias)");
  check_linear(*head.get(0), head.get(1), head.get(2), C, vocab);
  if (rows.has_value() && rows->defined()) {
    kept = rows->reshape({-1}).to(at::kLong).contiguous();
    h.H = kept.numel(), h.rows = kept.data_ptr<int64_t>();
    for (int64_t i = 0; i < h.H; ++i)
      TORCH_CHECK(h.rows[i] >= 0 && h.rows[i] < B, "decode_step: head row ", h.rows[i], " of ", B);
  }
  return h;
}

// this thread's panels of the logits of rows head.rows of x (B, C; final-norm hidden states, each thread's own
// copy) into out (H, V) in the model's dtype, rounded as the head's own forward rounds its output. `gathered` (H x C)
// and `xb` (H x C): the thread's scratch
inline void logits(const Head& head, const Team& t, const float* x, int64_t C, bool bf16, float* gathered,
                   at::BFloat16* xb, at::Tensor& out) {
  const int64_t H = head.H, V = head.V;
  if (head.rows != nullptr) {
    for (int64_t i = 0; i < H; ++i) std::copy_n(x + head.rows[i] * C, C, gathered + i * C);
    x = gathered;
  }
  if (bf16)  // a bf16 model's products take its bf16 values (exact) as bf16, as the head's own forward does
    for (int64_t i = 0; i < H * C; ++i) xb[i] = static_cast<at::BFloat16>(x[i]);
  float* y = bf16 ? head.wide : out.data_ptr<float>();
  linear_part(x, bf16 ? xb : nullptr, H, C, *head.w.get(0), head.w.get(1), head.w.get(2), V, y, t.part);
  if (bf16) {  // this thread's columns
    const int64_t panels = (V + kPanel - 1) / kPanel;
    const int64_t n0 = t.begin(panels) * kPanel, n1 = std::min(V, t.end(panels) * kPanel);
    at::BFloat16* o = out.data_ptr<at::BFloat16>();
    for (int64_t r = 0; r < H; ++r)
      for (int64_t c = n0; c < n1; ++c) o[r * V + c] = static_cast<at::BFloat16>(y[r * V + c]);
  }
}

// greedy steps in one call (a draft model's guesses): each step's pick is the argmax of its raw logits (the soft-cap
// keeps their order), found over each thread's columns and then over the threads' bests in column order (ties to
// the lowest token, as torch.argmax), and fed to the next step; the picks (B, steps) into `tokens`
struct Greedy {
  int64_t steps, B;
  int64_t* tokens;
  std::vector<float> best;
  std::vector<int64_t> at;
  void ready(int threads) { best.assign(threads * B, 0.0f), at.assign(threads * B, -1); }
  // step i's picks from the logits y (B, V) in fp32, into `picked` (each thread's own copy)
  void pick(const Head& head, const Team& t, const float* y, int64_t i, int64_t* picked) {
    const int64_t V = head.V, panels = (V + kPanel - 1) / kPanel, me = t.part.index;
    const int64_t n0 = t.begin(panels) * kPanel, n1 = std::min(V, t.end(panels) * kPanel);
    for (int64_t b = 0; b < B; ++b) {
      int64_t top = -1;
      for (int64_t c = n0; c < n1; ++c)
        if (top < 0 || y[b * V + c] > y[b * V + top]) top = c;
      at[me * B + b] = top, best[me * B + b] = top < 0 ? 0.0f : y[b * V + top];
    }
    t.sync();
    for (int64_t b = 0; b < B; ++b) {
      int64_t top = -1;
      for (int64_t j = 0; j < t.part.of; ++j) {
        const int64_t c = at[j * B + b];
        if (c >= 0 && (top < 0 || best[j * B + b] > y[b * V + top])) top = c;
      }
      picked[b] = std::max<int64_t>(top, 0);  // (NaN logits everywhere: token 0; a guess is only checked)
      if (me == 0) tokens[b * steps + i] = picked[b];
    }
  }
};

}  // namespace GPTLAB_NS::step_ends
