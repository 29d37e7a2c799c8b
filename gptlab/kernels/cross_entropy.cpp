// Softmax cross-entropy of (N, V) logits (fp32 or bf16; each row contiguous, the rows maybe padded apart) against (N,)
// targets (-1: ignored), row by row in one parallel loop: `softmax_xent(logits, targets, grad)` returns each row's
// loss (fp32: log-sum-exp minus the target's logit, 0 where ignored) and, with `grad`, d(loss_i)/d(logits_i) =
// softmax_i - onehot_i in the logits' dtype, its rows as far apart as the logits' (zeros on an ignored row; an empty
// tensor without `grad`).
// gptlab/ops.py's `_CrossEntropy` does the same over row chunks in ~10 ATen ops per chunk (a
// cast, max, subtract, exp, sum, scale, scatter, cast back: ~1,000 op calls per step over GPT-2's 50,257-wide rows);
// here each row is read once from memory and its exponentials kept in a per-thread fp32 row that stays in the
// cache, a vector register of lanes at a time (`Vec`). In fp32 throughout: the exponentials by `exp_fast` (~1e-7
// relative of ATen's), the gradient rounded once.
// A row holding a NaN (or +inf) logit gets a NaN loss and gradient, as torch's does, so a non-finite step is seen.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "exp_fast.h"
#include "linear_avx2.h"
#include "simd.h"
#include "token_mask.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace GPTLAB_NS {
namespace {

using namespace simd;

// e[i] = exp(row[i] - top); returns their sum, in blocks whose fp32 lane sums are added in double (as accurate as
// ATen's cascade sum: a running fp32 sum over 50,257 terms drifts by ~1e-6 of the total)
template <typename T>
float exp_row(const T* row, int64_t V, float top, float* e) {
  constexpr int64_t kBlock = 1024;  // a multiple of kLanes: only the row's end has a scalar tail
  double total = 0.0;
  for (int64_t b = 0; b < V; b += kBlock) {
    const int64_t end = std::min(b + kBlock, V);
    Vec lanes = {};
    int64_t i = b;
    for (; i + kLanes <= end; i += kLanes) {
      const Vec x = exp_vec(load(row + i) - top);
      store(e + i, x);
      lanes += x;
    }
    float sum = 0.0f;
    for (; i < end; ++i) sum += (e[i] = exp_fast(static_cast<float>(row[i]) - top));
    for (int j = 0; j < kLanes; ++j) sum += lanes[j];
    total += sum;
  }
  return static_cast<float>(total);
}

// g[i] = e[i] * inv in the logits' dtype
template <typename T>
void scale_row(const float* e, int64_t V, float inv, T* g) {
  int64_t i = 0;
  for (; i + kLanes <= V; i += kLanes) store(g + i, load(e + i) * inv);
  for (; i < V; ++i) g[i] = T(e[i] * inv);
}

template <typename T>
void xent_rows(const T* logits, int64_t stride, const int64_t* targets, int64_t N, int64_t V, float* losses,
               T* grad, int64_t grad_stride) {
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> e(V);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (int64_t r = begin; r < end; ++r) {
      const T* row = logits + r * stride;
      T* g = grad == nullptr ? nullptr : grad + r * grad_stride;
      const int64_t t = targets[r];
      if (t < 0) {  // ignored: no loss, no gradient
        losses[r] = 0.0f;
        if (g != nullptr) std::fill_n(g, V, T(0.0f));
        continue;
      }
      bool finite = true;
      const float top = token_mask::allowed_max(row, V, nullptr, finite);
      if (!finite) {
        losses[r] = nan;
        if (g != nullptr) std::fill_n(g, V, T(nan));
        continue;
      }
      const float sum = exp_row(row, V, top, e.data());
      losses[r] = std::log(sum) + top - static_cast<float>(row[t]);
      if (g == nullptr) continue;
      const float inv = 1.0f / sum;  // as ATen's softmax: a product by the reciprocal of the sum
      scale_row(e.data(), V, inv, g);
      g[t] = T(e[t] * inv - 1.0f);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> softmax_xent(const at::Tensor& logits, const at::Tensor& targets, bool grad) {
  // rows padded apart (ops.split_product's logits) are read in place, and the gradient's rows are laid out alike
  // (its products in the head's backward read it faster so), unless the logits are a few columns of wider rows
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu() && (logits.size(1) <= 1 || logits.stride(1) == 1) &&
                  (logits.size(0) <= 1 || logits.stride(0) >= logits.size(1)),
              "softmax_xent: logits must be a 2-D CPU tensor of contiguous rows");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "softmax_xent: logits must be float32 or bfloat16");
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0) && targets.scalar_type() == at::kLong,
              "softmax_xent: targets must be (N,) int64");
  const int64_t N = logits.size(0), V = logits.size(1);
  const at::Tensor t = targets.contiguous();
  // read from memory, not through an ATen op: a training step makes no host read of a tensor (tests/test_host_sync)
  const int64_t* ids = t.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(ids, ids + N, [V](int64_t id) { return id < V; }),
              "softmax_xent: a target is outside the vocabulary");
  at::Tensor losses = at::empty({N}, logits.options().dtype(at::kFloat));
  const int64_t stride = N <= 1 ? V : logits.stride(0), grad_stride = stride - V < 128 ? stride : V;
  at::Tensor g = grad ? at::empty_strided({N, V}, {grad_stride, 1}, logits.options())
                      : at::empty({0}, logits.options());
  if (logits.scalar_type() == at::kFloat)
    xent_rows(logits.data_ptr<float>(), stride, t.data_ptr<int64_t>(), N, V, losses.data_ptr<float>(),
              grad ? g.data_ptr<float>() : nullptr, grad_stride);
  else
    xent_rows(logits.data_ptr<at::BFloat16>(), stride, t.data_ptr<int64_t>(), N, V, losses.data_ptr<float>(),
              grad ? g.data_ptr<at::BFloat16>() : nullptr, grad_stride);
  return {losses, g};
}

}  // namespace
}  // namespace GPTLAB_NS

GPTLAB_LIBRARY_FRAGMENT(GPTLAB_NS, m) {
  m.def("softmax_xent(Tensor logits, Tensor targets, bool grad) -> (Tensor, Tensor)");
  m.impl("softmax_xent", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(GPTLAB_NS::softmax_xent)));
}
