// Small-batch Linear products for CPUs with AVX2 + FMA but no native bf16 matmul (AMD Zen 2/3, pre-Sapphire-Rapids
// Xeons), where torch's own bf16 matmul is several times slower than fp32 and oneDNN refuses to prepack bf16.
//
// Decoding multiplies a few activation rows (M = the batch) by every weight matrix once per token, so the work is
// reading the weights: the kernel must stream them at memory speed and do its arithmetic in fp32 on the way.
//
// * `pack(W)`: W (N, K), bf16 or fp32, re-laid out once per model as panels of 16 output rows: (ceil(N/16), K, 16),
//   zero-padded. One panel's column k is 16 consecutive values, i.e. two 8-float AVX registers after conversion
//   (bf16 ones interleaved so that the conversion is a shift and a mask: see load16).
// * `linear(x, packed, bias, N)`: y = x @ W.T + bias for x (M, K) in bf16 or fp32, out in x's dtype. A micro-kernel
//   takes up to 6 rows of x and one panel: per k it converts the panel's 16 weights (bf16 -> fp32 is a 16-bit left
//   shift or a mask), broadcasts x[r, k] and does 2 FMAs per row into 12 fp32 accumulators (the classic 6x16 sgemm tile), so
//   each weight converted serves 6 rows. One row (batch 1) instead unrolls k by 4 to keep 8 FMA chains in flight.
//   Threads (torch's pool, at::parallel_for) split the panels; rows go in blocks of 96 so a block of x stays in L2.
//   Accumulation is fp32 and the result is rounded once: the numbers of a native bf16 matmul.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kPanel = 16;   // output rows per panel
constexpr int kTile = 6;         // x rows per micro-kernel call
constexpr int64_t kRowBlock = 96;

// one panel column: 16 weights as two 8-float registers (outputs 0-7, 8-15)
inline void load16(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}
// bf16 columns are packed interleaved (outputs 0, 8, 1, 9, ... 7, 15), so one 32-byte load splits into both halves
// with a shift (the even 16-bit lanes become floats) and a mask (the odd ones): 3 instructions for 16 weights
inline void load16(const at::BFloat16* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// out[r][0..16) = x[r] . panel columns, for R rows of x (fp32, row stride ldx). The accumulators are named
// variables, not an array: GCC keeps an array of them on the stack, storing all 12 every k (3x slower).
#define GPTLAB_ROW(r)                                                  \
  if constexpr (R > r) {                                               \
    const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);            \
    a##r##0 = _mm256_fmadd_ps(w0, xb, a##r##0);                        \
    a##r##1 = _mm256_fmadd_ps(w1, xb, a##r##1);                        \
  }
#define GPTLAB_STORE(r)                                                \
  if constexpr (R > r) {                                               \
    _mm256_storeu_ps(out[r], a##r##0);                                 \
    _mm256_storeu_ps(out[r] + 8, a##r##1);                             \
  }
template <int R, typename W>
inline void tile(const float* x, int64_t ldx, const W* panel, int64_t K, float out[][kPanel]) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00,
         a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  for (int64_t k = 0; k < K; ++k) {
    __m256 w0, w1;
    load16(panel + k * kPanel, w0, w1);
    GPTLAB_ROW(0) GPTLAB_ROW(1) GPTLAB_ROW(2) GPTLAB_ROW(3) GPTLAB_ROW(4) GPTLAB_ROW(5)
  }
  GPTLAB_STORE(0) GPTLAB_STORE(1) GPTLAB_STORE(2) GPTLAB_STORE(3) GPTLAB_STORE(4) GPTLAB_STORE(5)
}
#undef GPTLAB_ROW
#undef GPTLAB_STORE

// one row: k unrolled by 4 into separate accumulators, so the FMAs do not wait on each other
template <typename W>
inline void tile1(const float* x, const W* panel, int64_t K, float out[][kPanel]) {
  __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
  int64_t k = 0;
  // x[k + u] times column k + u into accumulators (lo, hi)
  const auto step = [&](int64_t u, __m256& lo, __m256& hi) {
    __m256 w0, w1;
    load16(panel + (k + u) * kPanel, w0, w1);
    const __m256 xb = _mm256_broadcast_ss(x + k + u);
    lo = _mm256_fmadd_ps(w0, xb, lo);
    hi = _mm256_fmadd_ps(w1, xb, hi);
  };
  for (; k + 4 <= K; k += 4) {
    step(0, a0, b0);
    step(1, a1, b1);
    step(2, a2, b2);
    step(3, a3, b3);
  }
  for (; k < K; ++k) step(0, a0, b0);
  _mm256_storeu_ps(out[0], _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  _mm256_storeu_ps(out[0] + 8, _mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3)));
}

template <typename W>
void run_tile(int rows, const float* x, int64_t ldx, const W* panel, int64_t K, float out[][kPanel]) {
  switch (rows) {
    case 1: return tile1<W>(x, panel, K, out);
    case 2: return tile<2, W>(x, ldx, panel, K, out);
    case 3: return tile<3, W>(x, ldx, panel, K, out);
    case 4: return tile<4, W>(x, ldx, panel, K, out);
    case 5: return tile<5, W>(x, ldx, panel, K, out);
    default: return tile<6, W>(x, ldx, panel, K, out);
  }
}

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

template <typename W, typename O, typename B>
void linear_impl(const float* x, int64_t M, int64_t K, const W* packed, const B* bias, int64_t N, O* y) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  // grain: enough panels per task that a thread reads at least ~64 KB of weights per hand-off
  const int64_t grain = std::max<int64_t>(1, 2048 / std::max<int64_t>(K, 1));
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
    float out[kTile][kPanel];
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const int64_t m1 = std::min(M, m0 + kRowBlock);
      for (int64_t p = p0; p < p1; ++p) {
        const W* panel = packed + p * K * kPanel;
        const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
        for (int64_t m = m0; m < m1; m += kTile) {
          const int rows = static_cast<int>(std::min<int64_t>(kTile, m1 - m));
          run_tile<W>(rows, x + m * K, K, panel, K, out);
          for (int r = 0; r < rows; ++r) {
            O* dst = y + (m + r) * N + n0;
            for (int64_t c = 0; c < cols; ++c)
              dst[c] = static_cast<O>(out[r][c] + (bias ? to_float(bias[n0 + c]) : 0.0f));
          }
        }
      }
    }
  });
}

// the output and bias dtypes (each bf16 or fp32) picked at run time; the input already fp32
template <typename W>
void dispatch(const float* x, int64_t M, int64_t K, const W* w, const at::Tensor& bias, int64_t N, at::Tensor& y) {
  const bool bf16_out = y.scalar_type() == at::kBFloat16;
  if (!bias.defined()) {
    const float* none = nullptr;
    if (bf16_out) linear_impl(x, M, K, w, none, N, y.data_ptr<at::BFloat16>());
    else linear_impl(x, M, K, w, none, N, y.data_ptr<float>());
  } else if (bias.scalar_type() == at::kBFloat16) {
    const auto* b = bias.data_ptr<at::BFloat16>();
    if (bf16_out) linear_impl(x, M, K, w, b, N, y.data_ptr<at::BFloat16>());
    else linear_impl(x, M, K, w, b, N, y.data_ptr<float>());
  } else {
    const auto* b = bias.data_ptr<float>();
    if (bf16_out) linear_impl(x, M, K, w, b, N, y.data_ptr<at::BFloat16>());
    else linear_impl(x, M, K, w, b, N, y.data_ptr<float>());
  }
}

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack: the weight must be 2-D, got ", weight.dim(), "-D");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat,
              "pack: bf16 or fp32 weights only, got ", weight.scalar_type());
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kPanel - 1) / kPanel;
  auto padded = at::zeros({panels * kPanel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  auto rows = padded.view({panels, kPanel, K});
  if (weight.scalar_type() == at::kBFloat16)  // interleave the halves: outputs 0, 8, 1, 9, ... (see load16)
    rows = rows.view({panels, 2, kPanel / 2, K}).transpose(1, 2).reshape({panels, kPanel, K});
  // (panels, 16, K) -> (panels, K, 16): column k of a panel is 16 consecutive values
  return rows.transpose(1, 2).contiguous();
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(), "linear: not a packed weight");
  const int64_t K = packed.size(1);
  TORCH_CHECK(x.size(-1) == K, "linear: input has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(packed.size(0) * kPanel >= N && N > (packed.size(0) - 1) * kPanel, "linear: N does not fit the panels");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "linear: bf16 or fp32 input only");
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  const auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  // the input in fp32, converted once here (a few rows: no tensor, no dispatcher round trip)
  std::vector<float> xbuf;
  const float* xp;
  if (x2.scalar_type() == at::kFloat) {
    xp = x2.data_ptr<float>();
  } else {
    xbuf.resize(M * K);
    const auto* src = x2.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < M * K; ++i) xbuf[i] = static_cast<float>(src[i]);
    xp = xbuf.data();
  }
  auto y = at::empty({M, N}, x.options());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous(), "linear: bias must be contiguous with ", N, " values");
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 || bias->scalar_type() == at::kFloat, "linear: bias dtype");
    b = *bias;
  }
  if (packed.scalar_type() == at::kBFloat16) dispatch(xp, M, K, packed.data_ptr<at::BFloat16>(), b, N, y);
  else dispatch(xp, M, K, packed.data_ptr<float>(), b, N, y);
  return y.view(sizes);
}

// One decode step of a GPT-2-shaped model (pre-norm LayerNorm blocks, GELU MLP, multi-head attention) over packed
// weights: the loop of gptlab/generation/fast_decode.py's `decode_hidden`, op for op (ATen's layer_norm, SDPA and
// gelu; this file's linear), without a Python round trip per op. x (B, 1, C): the embeddings; per layer 12
// tensors in `weights`: ln_1 weight, bias, c_attn packed, bias, attn c_proj packed, bias, ln_2 weight, bias, c_fc
// packed, bias, mlp c_proj packed, bias (undefined where absent). Keys/values go to k_cache/v_cache (L, B, nh,
// max_len, hs) at position `where` of every row, or (where < 0) at rows[b], pos[b] (a row's own length); attention
// then reads positions 0..end-1 under `mask` (None: every key). Returns x after the last block (before ln_f).
at::Tensor gpt2_decode(at::Tensor x, at::TensorList weights, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       int64_t where, const c10::optional<at::Tensor>& rows, const c10::optional<at::Tensor>& pos,
                       int64_t end, const c10::optional<at::Tensor>& mask, int64_t n_head, int64_t head_size,
                       int64_t hidden, double eps, double scale, c10::string_view approximate) {
  TORCH_CHECK(weights.size() % 12 == 0 && k_cache.dim() == 5, "gpt2_decode: 12 tensors per layer");
  const int64_t L = weights.size() / 12, B = x.size(0), C = x.size(2), A = n_head * head_size;
  const auto opt = [](const at::Tensor& t) { return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt; };
  const std::string approx(approximate);
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + 12 * l;
    auto h = at::layer_norm(x, {C}, opt(w[0]), opt(w[1]), eps);
    auto qkv = linear(h, w[2], opt(w[3]), 3 * A).view({B, 3, n_head, 1, head_size});
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
    auto y = at::scaled_dot_product_attention(q.to(keys.scalar_type()), keys, values, mask, 0.0, false, scale);
    x = x + linear(y.to(x.scalar_type()).view({B, 1, A}), w[4], opt(w[5]), C);
    h = at::layer_norm(x, {C}, opt(w[6]), opt(w[7]), eps);
    x = x + linear(at::gelu(linear(h, w[8], opt(w[9]), hidden), approx), w[10], opt(w[11]), C);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY(gptlab_avx2, m) {
  m.def("pack(Tensor weight) -> Tensor", &pack);
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int N) -> Tensor", &linear);
  m.def("gpt2_decode(Tensor x, Tensor[] weights, Tensor k_cache, Tensor v_cache, int where, Tensor? rows, "
        "Tensor? pos, int end, Tensor? mask, int n_head, int head_size, int hidden, float eps, float scale, "
        "str approximate) -> Tensor", &gpt2_decode);
}
