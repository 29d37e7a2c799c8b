// One decode step of a GPT-2-shaped model in one C++ call, over weights packed for linear_avx2.cpp's kernel: the
// loop of gptlab/generation/fast_decode.py's `decode_hidden` without a Python round trip per op, and the attention
// of one new query per row it runs on an fp32 cache. Built with linear_avx2.cpp (gptlab/kernels/__init__.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "linear_avx2.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace {

using GPTLAB_NS::linear;

// Attention of one new query per row over fp32 keys/values (B, nh, T, hs) without a mask (every row the same
// length): per (row, head) the T scores, their softmax and the weighted sum of values, in fp32. SDPA's general CPU
// kernel spends ~70 us per layer on set-up at these sizes (a 2-core Zen 3, T ~ 300); this takes a few. Anything
// else (a mask, another cache dtype) goes to SDPA.
at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                  const c10::optional<at::Tensor>& mask, double scale) {
  if (mask.has_value() || keys.scalar_type() != at::kFloat || values.scalar_type() != at::kFloat ||
      keys.stride(3) != 1 || values.stride(3) != 1)
    return at::scaled_dot_product_attention(q.to(keys.scalar_type()), keys, values, mask, 0.0, false, scale);
  const int64_t B = keys.size(0), H = keys.size(1), T = keys.size(2), D = keys.size(3);
  const auto qf = q.to(at::kFloat).contiguous();  // (B, H, 1, D)
  auto y = at::empty({B, H, 1, D}, qf.options());
  const float *qp = qf.data_ptr<float>(), *kp = keys.data_ptr<float>(), *vp = values.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> p(T);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H, h = i % H;
      const float* qi = qp + i * D;
      const float* K = kp + b * keys.stride(0) + h * keys.stride(1);
      const float* V = vp + b * values.stride(0) + h * values.stride(1);
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < T; ++t) {
        const float* kt = K + t * keys.stride(2);
        __m256 acc = _mm256_setzero_ps();
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qi + d), _mm256_loadu_ps(kt + d), acc);
        __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        r = _mm_add_ps(r, _mm_movehl_ps(r, r));
        float dot = _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
        for (; d < D; ++d) dot += qi[d] * kt[d];
        p[t] = dot * sc;
        top = std::max(top, p[t]);
      }
      float total = 0.0f;
      for (int64_t t = 0; t < T; ++t) total += (p[t] = std::exp(p[t] - top));
      float* yi = yp + i * D;
      std::fill(yi, yi + D, 0.0f);
      for (int64_t t = 0; t < T; ++t) {
        const float w = p[t] / total;
        const float* vt = V + t * values.stride(2);
        for (int64_t d = 0; d < D; ++d) yi[d] += w * vt[d];
      }
    }
  });
  return y;
}

// One decode step of a GPT-2-shaped model (pre-norm LayerNorm blocks, GELU MLP, multi-head attention) over packed
// weights: the loop of gptlab/generation/fast_decode.py's `decode_hidden`, op for op (ATen's layer_norm, SDPA and
// gelu; this file's linear), without a Python round trip per op. x (B, 1, C): the embeddings; per layer 16
// tensors in `weights`: ln_1 weight, bias; then c_attn, attn c_proj as (packed, qparams, bias) each; ln_2 weight,
// bias; c_fc, mlp c_proj likewise (None where absent). Keys/values go to k_cache/v_cache (L, B, nh, max_len,
// hs) at position `where` of every row, or (where < 0) at rows[b], pos[b] (a row's own length); attention then
// reads positions 0..end-1 under `mask` (None: every key). Returns x after the last block (before ln_f).
at::Tensor gpt2_decode(at::Tensor x, const c10::List<c10::optional<at::Tensor>>& weights, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, int64_t where, const c10::optional<at::Tensor>& rows,
                       const c10::optional<at::Tensor>& pos, int64_t end, const c10::optional<at::Tensor>& mask,
                       int64_t n_head, int64_t head_size, int64_t hidden, double eps, double scale,
                       c10::string_view approximate) {
  constexpr int64_t kPerLayer = 16;
  TORCH_CHECK(weights.size() % kPerLayer == 0 && k_cache.dim() == 5, "gpt2_decode: 16 tensors per layer");
  const int64_t L = weights.size() / kPerLayer, B = x.size(0), C = x.size(2), A = n_head * head_size;
  const std::string approx(approximate);
  for (int64_t l = 0; l < L; ++l) {
    const auto w = [&](int64_t i) -> c10::optional<at::Tensor> { return weights.get(kPerLayer * l + i); };
    // the Linear whose (packed, qparams, bias) start at w[i]
    const auto lin = [&](const at::Tensor& in, int i, int64_t n) {
      return linear(in, *w(i), w(i + 1), w(i + 2), n);
    };
    auto h = at::layer_norm(x, {C}, w(0), w(1), eps);
    auto qkv = lin(h, 2, 3 * A).view({B, 3, n_head, 1, head_size});
    auto q = qkv.select(1, 0), k = qkv.select(1, 1), v = qkv.select(1, 2);  // (B, nh, 1, hs)
    auto kl = k_cache.select(0, l), vl = v_cache.select(0, l);             // (B, nh, max_len, hs)
    if (where >= 0) {
      kl.narrow(2, where, 1).copy_(k);
      vl.narrow(2, where, 1).copy_(v);
    } else {  // row b writes at its own length
      kl.index_put_({*rows, at::indexing::Slice(), *pos}, k.transpose(1, 2).to(kl.scalar_type()));
      vl.index_put_({*rows, at::indexing::Slice(), *pos}, v.transpose(1, 2).to(vl.scalar_type()));
    }
    auto keys = kl.narrow(2, 0, end), values = vl.narrow(2, 0, end);
    auto y = attend(q, keys, values, mask, scale);
    x = x + lin(y.to(x.scalar_type()).view({B, 1, A}), 5, C);
    h = at::layer_norm(x, {C}, w(8), w(9), eps);
    x = x + lin(at::gelu(lin(h, 10, hidden), approx), 13, C);
  }
  return x;
}

}  // namespace

GPTLAB_LIBRARY_FRAGMENT(GPTLAB_NS, m) {
  m.def("gpt2_decode(Tensor x, Tensor?[] weights, Tensor k_cache, Tensor v_cache, int where, Tensor? rows, "
        "Tensor? pos, int end, Tensor? mask, int n_head, int head_size, int hidden, float eps, float scale, "
        "str approximate) -> Tensor", &gpt2_decode);
}
