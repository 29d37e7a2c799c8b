// One token per row of a decoding step's logits, drawn from softmax(logits / temperature), optionally among the tokens
// a bitmask allows (structured outputs): `sample_rows(logits, rows, scale, u, bits)`. The same draw as
// gptlab/generation/sampling.py's ATen path (`filtered_probs` without filters, then `inverse_cdf`): the token where
// u, times the row's total weight, falls in its running sums over blocks of kSumBlock tokens. That path costs ~17 ATen
// ops and several passes over the (rows, V) probabilities (softmax, block sums, and for a masked row a gather, a
// product by the mask, a check): 0.7 ms a step at 16 rows of GPT-2's 50,257 tokens on a Zen 3 core, a tenth of a
// small model's decode step; here each row is read once and its weights kept in a per-thread row that stays in the
// cache.
//
// Row r of the result is drawn from logits[rows[r]] * scale[r] with uniform u[r] in [0, 1): the weights
// exp((x - max) * scale) of the allowed tokens (bit t % 32 of bits[r][t / 32], little-endian as llguidance and numpy
// write them; every token where `bits` is empty), the max taken over the allowed tokens (a masked row's weights never
// all underflow: its most likely token weighs 1). Its token is -1 where an allowed logit is NaN or +inf, or none is
// allowed or finite: the caller draws those rows on its ATen path, which has rules for them. A row of scale 0
// (temperature 0: greedy) takes its first allowed token of the largest logit, as torch.argmax does (which took 0.46 ms
// over 16 rows of 50,257 here).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "exp_fast.h"
#include "linear_avx2.h"
#include "simd.h"
#include "token_mask.h"

#include <cstdint>
#include <limits>
#include <vector>

namespace GPTLAB_NS {
namespace {

using namespace simd;
using namespace token_mask;
constexpr int64_t kSumBlock = 256;  // tokens per block of the running sums (sampling.py's _BLOCK): a multiple of kLanes

// the first allowed token whose logit is `top`
template <typename T>
int64_t first_of(const T* row, int64_t V, float top, const uint32_t* bits) {
  for (int64_t i = 0; i < V; ++i)
    if (static_cast<float>(row[i]) == top && allowed(bits, i)) return i;
  return -1;  // (not reached: top is an allowed logit)
}

// e[i] = exp((x_i - top) * scale) for the allowed tokens, 0 for the others; ends[b] the running sum (fp64) of the
// weights up to the end of block b, each block's an fp32 sum of its lanes. (Not x_i * scale - top * scale: the
// compiler fuses that into one FMA, whose unrounded product differs from the rounded top by far more than 88 where
// logits are huge (an overflowing penalty's 1e30), and then even the top token's weight is 0.)
template <typename T>
void block_weights(const T* row, int64_t V, float scale, float top, const uint32_t* bits, float* e, double* ends) {
  double total = 0.0;
  for (int64_t b = 0, k = 0; b < V; b += kSumBlock, ++k) {
    const int64_t end = std::min(b + kSumBlock, V);
    Vec lanes = {};
    int64_t i = b;
    for (; i + kLanes <= end; i += kLanes) {
      if (none_allowed(bits, i)) {
        store(e + i, splat(0.0f));
        continue;
      }
      const IVec on = allowed_lanes(bits, i);
      const Vec x = on != 0 ? exp_vec((load(row + i) - top) * scale) : splat(0.0f);
      store(e + i, x);
      lanes += x;
    }
    float sum = lane_sum(lanes);
    for (; i < end; ++i) sum += (e[i] = allowed(bits, i) ? exp_fast((static_cast<float>(row[i]) - top) * scale) : 0.0f);
    ends[k] = total += sum;
  }
}

// the token whose running weight first exceeds u times the total; a target rounded to the total or past it takes the
// last token of positive weight (never one of weight 0)
int64_t bracket(const float* e, const double* ends, int64_t V, double u) {
  const int64_t blocks = (V + kSumBlock - 1) / kSumBlock;
  const double target = u * ends[blocks - 1];
  int64_t k = 0;
  while (k < blocks && !(ends[k] > target)) ++k;
  if (k < blocks) {
    double before = k > 0 ? ends[k - 1] : 0.0;
    const int64_t end = std::min((k + 1) * kSumBlock, V);
    for (int64_t i = k * kSumBlock; i < end; ++i)
      if (e[i] > 0.0f && (before += e[i]) > target) return i;
  }
  for (int64_t i = V - 1; i >= 0; --i)  // rounded past the end: the last token of positive weight
    if (e[i] > 0.0f) return i;
  return V - 1;
}

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& rows, const at::Tensor& scale, const at::Tensor& u,
                       const at::Tensor& bits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.device().is_cpu() &&
                  float_or_bf16(logits.scalar_type()),
              "sample_rows: logits must be a contiguous 2-D float32 or bfloat16 CPU tensor");
  const int64_t n = logits.size(0), V = logits.size(1), m = rows.numel();
  TORCH_CHECK(V > 0, "sample_rows: logits have no columns");
  TORCH_CHECK(rows.scalar_type() == at::kLong && scale.scalar_type() == at::kFloat && u.scalar_type() == at::kDouble &&
                  scale.numel() == m && u.numel() == m,
              "sample_rows: rows (m,) int64, scale (m,) float32 and u (m,) float64");
  const bool masked = bits.numel() > 0;
  TORCH_CHECK(!masked || (bits.scalar_type() == at::kInt && bits.dim() == 2 && bits.size(0) == m &&
                          bits.size(1) * 32 >= V && bits.is_contiguous()),
              "sample_rows: bits must be empty or (m, words) int32 covering the vocabulary");
  const at::Tensor r = rows.contiguous(), s = scale.contiguous(), uu = u.contiguous();
  const int64_t* row_ids = r.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i) TORCH_CHECK(0 <= row_ids[i] && row_ids[i] < n, "sample_rows: a row is out of range");
  at::Tensor tokens = at::empty({m}, rows.options());
  int64_t* out = tokens.data_ptr<int64_t>();
  const float* scales = s.data_ptr<float>();
  const double* us = uu.data_ptr<double>();
  const uint32_t* mask = masked ? reinterpret_cast<const uint32_t*>(bits.data_ptr<int32_t>()) : nullptr;
  const int64_t words = masked ? bits.size(1) : 0;
  on_type(logits.scalar_type(), [&](auto type) {
    using T = decltype(type);
    const T* x = static_cast<const T*>(logits.data_ptr());
    at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> e(V);
      std::vector<double> ends((V + kSumBlock - 1) / kSumBlock);
      for (int64_t i = begin; i < end; ++i) {
        const T* row = x + row_ids[i] * V;
        const uint32_t* b = mask == nullptr ? nullptr : mask + i * words;
        bool finite = true;
        const float top = allowed_max(row, V, b, finite);
        if (!finite) {
          out[i] = -1;
          continue;
        }
        if (scales[i] == 0.0f) {  // greedy
          out[i] = first_of(row, V, top, b);
          continue;
        }
        block_weights(row, V, scales[i], top, b, e.data(), ends.data());
        out[i] = bracket(e.data(), ends.data(), V, us[i]);
      }
    });
  });
  return tokens;
}

}  // namespace
}  // namespace GPTLAB_NS

GPTLAB_LIBRARY_FRAGMENT(GPTLAB_NS, m) {
  m.def("sample_rows(Tensor logits, Tensor rows, Tensor scale, Tensor u, Tensor bits) -> Tensor");
  m.impl("sample_rows", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(GPTLAB_NS::sample_rows)));
}
