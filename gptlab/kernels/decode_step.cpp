// One decode step of any gptlab model (one new token per row) in one C++ call, over weights packed for this
// library's `linear`: the loop of gptlab/generation/fast_decode.py's lean step without a Python round trip per op.
// Norms, rotary embeddings, q/k norms, grouped-query attention over the fp32 KV cache, soft-caps and the MLP's
// activation are plain loops over a few rows (written so that the compiler vectorizes them); the Linear products go
// to the kernel over raw rows (`linear_into`). Its buffers are made once per call: no ATen op runs inside a step.
//
// Values are kept in fp32 and rounded to a bf16 model's dtype wherever the lean step holds a bf16 tensor (after
// each norm, product, activation, rotation and residual add; a norm once, as ATen's bf16 norms round), so a bf16
// model's step follows the lean one but for the odd rounding where an fp32 sum ran in another order (attention,
// a norm's statistics) or an fp32 exp/tanh/erf differs from ATen's in its last bits (`exp_fast`'s ~1e-7).
//
// Per layer, `weights` holds kPerLayer tensors (None where absent): ln_1 weight, bias; c_attn (packed, qparams,
// bias); attn c_proj (3); ln_2 weight, bias; c_fc (3); mlp c_proj (3); ln_attn_out weight, bias; ln_mlp_out weight,
// bias (sandwich blocks); q_norm weight, k_norm weight. `shape`: n_head, n_kv_head, head_size, hidden, layout,
// shared_norm, norm kind, mlp kind, gelu tanh, qk norm, rope interleaved, rotary dim, then one sliding flag per layer.
// After the layers' tensors come the final norm's weight and bias, applied where `final_norm` is set.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "exp_fast.h"
#include "linear_avx2.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using GPTLAB_NS::exp_fast;

using GPTLAB_NS::linear;

constexpr int64_t kPerLayer = 22;
enum Layout { kPre = 0, kParallel = 1, kSandwich = 2, kPost = 3 };
enum Norm { kLayerNorm = 0, kRMSNorm = 1, kUnitOffset = 2 };
enum Mlp { kGelu = 0, kSwiGLU = 1, kGeGLU = 2, kReLU2 = 3 };

struct Shape {
  int64_t nh, nkv, hs, hidden, layout, shared_norm, norm, mlp, gelu_tanh, qk_norm, interleaved, rot;
};

using Weights = c10::List<c10::optional<at::Tensor>>;

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
void norm_rows(const float* in, float* out, int64_t rows, int64_t n, int kind, const c10::optional<at::Tensor>& w,
               const c10::optional<at::Tensor>& b, float eps, bool bf16) {
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
void rotate(float* h, const float* cos, const float* sin, int64_t rot, bool interleaved, bool bf16) {
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + half;
    const float a = h[ia], b = h[ib];
    // each product rounded, then the sum, as apply_rope's ops on a bf16 tensor do
    h[ia] = round_to(round_to(a * cos[i], bf16) - round_to(b * sin[i], bf16), bf16);
    h[ib] = round_to(round_to(b * cos[i], bf16) + round_to(a * sin[i], bf16), bf16);
  }
}

// q . k over n values in 16 independent lanes (summed at the end), so that the compiler vectorizes it: a plain
// running sum is one dependent chain (and the attention's scores were scalar)
inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += a[i + j] * b[i + j];
  float sum = 0.0f;
  for (; i < n; ++i) sum += a[i] * b[i];
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

// what a step writes between its ops, made once per call (none of it is a tensor)
struct Buffers {
  std::vector<float> h, a, m, qkv, y, up, act;
  std::vector<at::BFloat16> xb;  // a product's input as bf16 values (a bf16 model's)
  Buffers(int64_t B, int64_t C, int64_t width, int64_t heads, int64_t fc)
      : h(B * C), a(B * C), m(B * C), qkv(B * width), y(B * heads), up(B * fc), act(B * fc),
        xb(B * std::max({C, heads, fc})) {}
};

struct Step {
  const Shape& s;
  const Weights& w;
  int64_t B, C, L;
  bool bf16;
  float eps, scale, softcap;
  const at::Tensor &k_cache, &v_cache;  // (L, B, nkv, max_len, hs) fp32
  int64_t where, end;
  const int64_t *rows, *pos;      // where < 0: row b writes at rows[b], pos[b]
  const bool *full, *window;      // (B or 1, end) masks, or null: every key
  int64_t full_rows, window_rows;
  const float *cos, *sin;         // (B or 1, rot / 2), or null
  int64_t rope_rows;
  Buffers& buf;

  c10::optional<at::Tensor> at(int64_t layer, int64_t i) const { return w.get(kPerLayer * layer + i); }

  // y (M, N) = x (M, K) @ W.T + bias through the packed kernel; the weight's three entries start at weights[i]. A
  // bf16 model's x holds bf16 values: handed over as bf16 too, they go through the kernel's bf16 dot products, as
  // the lean step's bf16 tensors do
  void project(const float* x, int64_t M, int64_t K, int64_t i, int64_t N, float* y) const {
    at::BFloat16* xb = nullptr;
    if (bf16) {
      xb = buf.xb.data();
      for (int64_t j = 0; j < M * K; ++j) xb[j] = static_cast<at::BFloat16>(x[j]);
    }
    GPTLAB_NS::linear_into(x, xb, M, K, *w.get(i), w.get(i + 1), w.get(i + 2), N, y);
    round_all(y, M * N, bf16);
  }

  // the attention branch for input h (B, C) -> out (B, C), writing this token's keys and values to the cache
  void attention(int64_t layer, bool sliding, const float* h, float* out) const {
    const int64_t nh = s.nh, nkv = s.nkv, hs = s.hs, width = (nh + 2 * nkv) * hs;
    std::vector<float> &qkv = buf.qkv, &y = buf.y;
    project(h, B, C, kPerLayer * layer + 2, width, qkv.data());
    // this layer's (B, nkv, max_len, hs) keys and values
    float *kp = k_cache.data_ptr<float>() + layer * k_cache.stride(0),
          *vp = v_cache.data_ptr<float>() + layer * v_cache.stride(0);
    const int64_t sb = k_cache.stride(1), sh = k_cache.stride(2), st = k_cache.stride(3);
    const auto qn = at(layer, 20), kn = at(layer, 21);
    for (int64_t b = 0; b < B; ++b) {
      float* row = qkv.data() + b * width;
      for (int64_t j = 0; j < nh + nkv; ++j) {  // q heads then k heads: q/k norm, then the rotation
        float* head = row + j * hs;
        if (s.qk_norm) norm_rows(head, head, 1, hs, kRMSNorm, j < nh ? qn : kn, c10::nullopt, eps, bf16);
        if (cos) {
          const int64_t r = rope_rows > 1 ? b : 0;
          rotate(head, cos + r * (s.rot / 2), sin + r * (s.rot / 2), s.rot, s.interleaved, bf16);
        }
      }
      const int64_t slot = where >= 0 ? b : rows[b], t = where >= 0 ? where : pos[b];
      for (int64_t j = 0; j < nkv; ++j) {
        std::copy_n(row + (nh + j) * hs, hs, kp + slot * sb + j * sh + t * st);
        std::copy_n(row + (nh + nkv + j) * hs, hs, vp + slot * sb + j * sh + t * st);
      }
    }
    const bool* mask = sliding ? window : full;
    const int64_t mask_rows = sliding ? window_rows : full_rows;
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(end * hs, 1));
    at::parallel_for(0, B * nh, grain, [&](int64_t i0, int64_t i1) {
      std::vector<float> p(end);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i / nh, h = i % nh, g = h / (nh / nkv);
        const float* q = qkv.data() + b * width + h * hs;
        const float *keys = kp + b * sb + g * sh, *vals = vp + b * sb + g * sh;
        const bool* m = mask ? mask + (mask_rows > 1 ? b : 0) * end : nullptr;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < end; ++t) {
          if (m && !m[t]) { p[t] = -std::numeric_limits<float>::infinity(); continue; }
          float d = dot(q, keys + t * st, hs) * scale;
          if (softcap > 0.0f) d = softcap * std::tanh(d / softcap);
          p[t] = d;
          top = std::max(top, d);
        }
        for (int64_t t = 0; t < end; ++t) p[t] = exp_fast(p[t] - top);  // a masked key's -inf gives 0
        float total = 0.0f;
        for (int64_t t = 0; t < end; ++t) total += p[t];
        float* yi = y.data() + b * nh * hs + h * hs;
        std::fill_n(yi, hs, 0.0f);
        for (int64_t t = 0; t < end; ++t) {
          if (p[t] == 0.0f) continue;
          const float pw = p[t] / total;
          for (int64_t e = 0; e < hs; ++e) yi[e] += pw * vals[t * st + e];
        }
        for (int64_t e = 0; e < hs; ++e) yi[e] = round_to(yi[e], bf16);
      }
    });
    project(y.data(), B, nh * hs, kPerLayer * layer + 5, C, out);
  }

  // the activation rounded where the lean step's bf16 tensors round (the activation, then the gate's product)
  void mlp(int64_t layer, const float* h, float* out) const {
    const bool gated = s.mlp == kSwiGLU || s.mlp == kGeGLU;
    const int64_t H = s.hidden, fc = gated ? 2 * H : H;
    float *a = buf.up.data(), *act = buf.act.data();  // (B, fc), (B, H)
    project(h, B, C, kPerLayer * layer + 10, fc, a);
    for (int64_t b = 0; b < B; ++b) {
      const float *g = a + b * fc, *u = g + H;
      float* o = act + b * H;
      if (s.mlp == kSwiGLU)
        for (int64_t i = 0; i < H; ++i) o[i] = round_to(round_to(silu(g[i]), bf16) * u[i], bf16);
      else if (s.mlp == kGeGLU && s.gelu_tanh)
        for (int64_t i = 0; i < H; ++i) o[i] = round_to(round_to(gelu_tanh(g[i]), bf16) * u[i], bf16);
      else if (s.mlp == kGeGLU)
        for (int64_t i = 0; i < H; ++i) o[i] = round_to(round_to(gelu_erf(g[i]), bf16) * u[i], bf16);
      else if (s.mlp == kReLU2)
        for (int64_t i = 0; i < H; ++i) o[i] = round_to(std::max(g[i], 0.0f) * std::max(g[i], 0.0f), bf16);
      else if (s.gelu_tanh)
        for (int64_t i = 0; i < H; ++i) o[i] = round_to(gelu_tanh(g[i]), bf16);
      else
        for (int64_t i = 0; i < H; ++i) o[i] = round_to(gelu_erf(g[i]), bf16);
    }
    project(act, B, H, kPerLayer * layer + 13, C, out);
  }

  void add(float* x, const float* y) const {
    for (int64_t i = 0; i < B * C; ++i) x[i] = round_to(x[i] + y[i], bf16);
  }

  void norm(int64_t layer, int64_t i, const float* in, float* out) const {
    norm_rows(in, out, B, C, s.norm, at(layer, i), at(layer, i + 1), eps, bf16);
  }

  void layer(int64_t l, bool sliding, float* x) const {
    std::vector<float> &h = buf.h, &a = buf.a, &m = buf.m;
    switch (s.layout) {
      case kPre:
        norm(l, 0, x, h.data()), attention(l, sliding, h.data(), a.data()), add(x, a.data());
        norm(l, 8, x, h.data()), mlp(l, h.data(), m.data()), add(x, m.data());
        break;
      case kParallel:
        norm(l, 0, x, h.data()), attention(l, sliding, h.data(), a.data());
        if (!s.shared_norm) norm(l, 8, x, h.data());
        mlp(l, h.data(), m.data()), add(x, a.data()), add(x, m.data());
        break;
      case kSandwich:
        norm(l, 0, x, h.data()), attention(l, sliding, h.data(), a.data()), norm(l, 16, a.data(), h.data());
        add(x, h.data());
        norm(l, 8, x, h.data()), mlp(l, h.data(), m.data()), norm(l, 18, m.data(), h.data()), add(x, h.data());
        break;
      default:  // post
        attention(l, sliding, x, a.data()), add(x, a.data()), norm(l, 0, x, x);
        mlp(l, x, m.data()), add(x, m.data()), norm(l, 8, x, x);
    }
  }
};

const bool* mask_data(const c10::optional<at::Tensor>& mask, int64_t end, int64_t& rows) {
  if (!mask.has_value() || !mask->defined()) return nullptr;
  TORCH_CHECK(mask->scalar_type() == at::kBool && mask->is_contiguous() && mask->size(-1) == end,
              "decode_step: masks must be contiguous bool (B or 1, 1, 1, end)");
  rows = mask->size(0);
  return mask->data_ptr<bool>();
}

// x (B, 1, C) in the model's dtype: the first block's input; returns x after the last block and the final norm
at::Tensor decode_step(const at::Tensor& x, const Weights& weights, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, int64_t where, const c10::optional<at::Tensor>& rows,
                       const c10::optional<at::Tensor>& pos, int64_t end, const c10::optional<at::Tensor>& full,
                       const c10::optional<at::Tensor>& window, const c10::optional<at::Tensor>& cos,
                       const c10::optional<at::Tensor>& sin, at::IntArrayRef shape, double eps, double scale,
                       double softcap, bool final_norm) {
  TORCH_CHECK(shape.size() >= 12, "decode_step: shape holds 12 sizes and a sliding flag per layer");
  const Shape s{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5], shape[6], shape[7], shape[8], shape[9],
                shape[10], shape[11]};
  const int64_t L = static_cast<int64_t>(shape.size()) - 12, B = x.size(0), C = x.size(2);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kPerLayer * L + 2, "decode_step: ", kPerLayer,
              " tensors a layer and the final norm's two");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat && k_cache.dim() == 5 &&
              k_cache.stride(4) == 1 && v_cache.strides() == k_cache.strides(), "decode_step: an fp32 cache");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "decode_step: bf16 or fp32");
  TORCH_CHECK(s.nkv > 0 && s.nh % s.nkv == 0 && end > 0 && end <= k_cache.size(3), "decode_step: bad sizes");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::Tensor rows_c, pos_c, cos_c, sin_c;
  if (where < 0) {
    rows_c = rows->reshape({-1}).contiguous(), pos_c = pos->reshape({-1}).contiguous();
    TORCH_CHECK(rows_c.numel() == B && pos_c.numel() == B, "decode_step: a row and position per row");
  }
  int64_t rope_rows = 0;
  if (cos.has_value() && cos->defined()) {
    cos_c = cos->to(at::kFloat).contiguous(), sin_c = sin->to(at::kFloat).contiguous();
    rope_rows = cos_c.size(0);
    TORCH_CHECK(cos_c.numel() == rope_rows * (s.rot / 2), "decode_step: cos/sin (B or 1, rot / 2)");
  }
  int64_t full_rows = 0, window_rows = 0;
  const bool* full_p = mask_data(full, end, full_rows);
  const bool* window_p = mask_data(window, end, window_rows);
  const int64_t width = (s.nh + 2 * s.nkv) * s.hs, fc = s.mlp == kSwiGLU || s.mlp == kGeGLU ? 2 * s.hidden : s.hidden;
  Buffers buffers(B, C, width, s.nh * s.hs, fc);
  Step step{s, weights, B, C, L, bf16, static_cast<float>(eps), static_cast<float>(scale),
            static_cast<float>(softcap), k_cache, v_cache, where, end,
            where < 0 ? rows_c.data_ptr<int64_t>() : nullptr, where < 0 ? pos_c.data_ptr<int64_t>() : nullptr,
            full_p, window_p, full_rows, window_rows,
            rope_rows ? cos_c.data_ptr<float>() : nullptr, rope_rows ? sin_c.data_ptr<float>() : nullptr, rope_rows,
            buffers};
  const auto xc = x.contiguous();
  std::vector<float> state(B * C);  // the residual stream, in fp32
  if (bf16) std::copy_n(xc.data_ptr<at::BFloat16>(), B * C, state.begin());
  else std::copy_n(xc.data_ptr<float>(), B * C, state.begin());
  for (int64_t l = 0; l < L; ++l) step.layer(l, shape[12 + l] != 0, state.data());
  if (final_norm)  // ln_f (a post-norm model ends in its last block's norm)
    norm_rows(state.data(), state.data(), B, C, s.norm, weights.get(kPerLayer * L), weights.get(kPerLayer * L + 1),
              static_cast<float>(eps), bf16);
  auto out = at::empty({B, 1, C}, x.options());
  if (bf16) std::copy_n(state.begin(), B * C, out.data_ptr<at::BFloat16>());  // values already bf16: exact
  else std::copy_n(state.begin(), B * C, out.data_ptr<float>());
  return out;
}

}  // namespace

GPTLAB_LIBRARY_FRAGMENT(GPTLAB_NS, m) {
  m.def("decode_step(Tensor x, Tensor?[] weights, Tensor k_cache, Tensor v_cache, int where, Tensor? rows, "
        "Tensor? pos, int end, Tensor? full, Tensor? window, Tensor? cos, Tensor? sin, int[] shape, float eps, "
        "float scale, float softcap, bool final_norm) -> Tensor", &decode_step);
}
