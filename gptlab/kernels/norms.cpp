// LayerNorm and RMSNorm over the last dim, forward and backward, for training on a CPU (`gptlab.norms`). ATen's
// LayerNorm takes ~70 us forward and ~110 us backward at a small model's bf16 (2,048 x 64) rows, and its RMSNorm
// is a composite of ~5 ops each way; here one pass per row forward (the row's statistics kept for backward) and one pass
// back, in fp32, each output rounded once to its dtype: ATen's values within fp32 rounding. The weight's and
// bias's gradients are summed over fixed blocks of rows, then the blocks in order: the same bits whatever the
// number of threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "linear_avx2.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace GPTLAB_NS {
namespace {

using simd::float_or_bf16;
using simd::kLanes;
using simd::lane_sum;
using simd::load;
using simd::narrow;
using simd::on_type;
using simd::store;
using simd::Vec;
using simd::widen;

constexpr int64_t kBlock = 64;  // rows per block of the weight-gradient sums

struct Rows {
  int64_t n, c;  // rows, values per row
  bool rms;      // RMSNorm: no mean subtracted, no bias
  float eps;
};

// rows are worked on in fp32 buffers padded to whole vectors (`padded`): the lanes past a row's end hold zeros
// (x's hold the row's mean: zero once centred), so they add nothing to a sum
inline int64_t padded(int64_t c) { return (c + kLanes - 1) / kLanes * kLanes; }

// a weight or bias (fp32 or the input's dtype) as padded fp32 values; empty where absent
std::vector<float> as_floats(const std::optional<at::Tensor>& t, int64_t c) {
  if (!t.has_value() || !t->defined()) return {};
  const at::Tensor f = t->to(at::kFloat).contiguous();
  std::vector<float> out(padded(c), 0.0f);
  std::copy(f.data_ptr<float>(), f.data_ptr<float>() + c, out.begin());
  return out;
}

// x's row widened into `row` (padded) and centred on its mean (RMSNorm: on 0); returns 1 / sqrt(variance + eps)
// (RMSNorm's variance: the mean square) and sets `mean`
template <typename T>
inline float centre(const T* x, float* row, const Rows& s, float& mean) {
  const int64_t n = padded(s.c);
  widen(x, row, s.c);
  std::fill(row + s.c, row + n, 0.0f);
  mean = 0.0f;
  if (!s.rms) {
    Vec sum{};
    for (int64_t j = 0; j < n; j += kLanes) sum += load(row + j);
    mean = lane_sum(sum) / static_cast<float>(s.c);
    std::fill(row + s.c, row + n, mean);
  }
  Vec sq{};
  for (int64_t j = 0; j < n; j += kLanes) {
    const Vec d = load(row + j) - mean;
    store(row + j, d);
    sq += d * d;
  }
  return 1.0f / std::sqrt(lane_sum(sq) / static_cast<float>(s.c) + s.eps);
}

template <typename T>
void forward(const T* x, const std::vector<float>& w, const std::vector<float>& b, T* y, float* means,
             float* rstds, const Rows& s) {
  const int64_t n = padded(s.c);
  at::parallel_for(0, s.n, 256, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(n);
    float* row = buffer.data();
    for (int64_t r = begin; r < end; ++r) {
      float mean;
      const float rstd = centre(x + r * s.c, row, s, mean);
      for (int64_t j = 0; j < n; j += kLanes) {
        Vec v = load(row + j) * rstd;
        if (!w.empty()) v *= load(w.data() + j);
        if (!b.empty()) v += load(b.data() + j);
        store(row + j, v);
      }
      narrow(row, y + r * s.c, s.c);
      means[r] = mean, rstds[r] = rstd;
    }
  });
}

// dx = rstd (g w - mean(g w) - xhat mean(g w xhat)) (RMSNorm: without the mean(g w) term), xhat = (x - mean) rstd;
// each block's sums of g xhat (the weight's gradient) and g (the bias's) into its own row of `partial`
template <typename T>
void backward(const T* g, const T* x, const std::vector<float>& w, const float* means, const float* rstds, T* dx,
              float* partial_w, float* partial_b, const Rows& s) {
  const int64_t blocks = (s.n + kBlock - 1) / kBlock, n = padded(s.c);
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    std::vector<float> buffers(4 * n);
    float* grad = buffers.data();
    float* xhat = grad + n;
    float* sum_w = xhat + n;  // the block's sums
    float* sum_b = sum_w + n;
    for (int64_t block = first; block < last; ++block) {
      std::fill(sum_w, sum_w + 2 * n, 0.0f);
      for (int64_t r = block * kBlock; r < std::min(s.n, (block + 1) * kBlock); ++r) {
        const float mean = means[r], rstd = rstds[r];
        widen(g + r * s.c, grad, s.c);
        widen(x + r * s.c, xhat, s.c);
        std::fill(grad + s.c, grad + n, 0.0f);
        std::fill(xhat + s.c, xhat + n, mean);
        Vec gw_sum{}, gwx_sum{};
        for (int64_t j = 0; j < n; j += kLanes) {
          const Vec gv = load(grad + j), xh = (load(xhat + j) - mean) * rstd;
          store(sum_w + j, load(sum_w + j) + gv * xh);
          store(sum_b + j, load(sum_b + j) + gv);
          const Vec gw = w.empty() ? gv : gv * load(w.data() + j);
          store(grad + j, gw);
          store(xhat + j, xh);
          gw_sum += gw, gwx_sum += gw * xh;
        }
        const float a = s.rms ? 0.0f : lane_sum(gw_sum) / static_cast<float>(s.c);
        const float c = lane_sum(gwx_sum) / static_cast<float>(s.c);
        for (int64_t j = 0; j < n; j += kLanes) store(grad + j, rstd * (load(grad + j) - a - load(xhat + j) * c));
        narrow(grad, dx + r * s.c, s.c);
      }
      if (partial_w) std::copy(sum_w, sum_w + s.c, partial_w + block * s.c);
      if (partial_b) std::copy(sum_b, sum_b + s.c, partial_b + block * s.c);
    }
  });
}

Rows rows_of(const at::Tensor& x, bool rms, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() >= 1 && float_or_bf16(x.scalar_type()),
              "norm_rows: x must be a contiguous fp32 or bf16 CPU tensor");
  const int64_t c = x.size(-1);
  TORCH_CHECK(c > 0, "norm_rows: rows of at least one value");
  return Rows{x.numel() / c, c, rms, static_cast<float>(eps)};
}

void check_param(const std::optional<at::Tensor>& t, const Rows& s, const char* name) {
  if (t.has_value() && t->defined())
    TORCH_CHECK(t->dim() == 1 && t->size(0) == s.c, "norm_rows: the ", name, " must hold one value per column");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_rows(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                                         const std::optional<at::Tensor>& bias, double eps,
                                                         bool rms) {
  const Rows s = rows_of(x, rms, eps);
  check_param(weight, s, "weight");
  check_param(bias, s, "bias");
  TORCH_CHECK(!(rms && bias.has_value() && bias->defined()), "norm_rows: RMSNorm has no bias");
  const std::vector<float> w = as_floats(weight, s.c), b = as_floats(bias, s.c);
  at::Tensor y = at::empty_like(x);
  const auto stats = x.options().dtype(at::kFloat);
  at::Tensor mean = at::empty({s.n}, stats), rstd = at::empty({s.n}, stats);
  on_type(x.scalar_type(), [&](auto type) {
    using T = decltype(type);
    forward(x.data_ptr<T>(), w, b, y.data_ptr<T>(), mean.data_ptr<float>(), rstd.data_ptr<float>(), s);
  });
  return {y, mean, rstd};
}

// (dx, dweight, dbias): the last two empty (no elements) where not asked for, else in `param_dtype`
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_rows_backward(
    const at::Tensor& grad, const at::Tensor& x, const std::optional<at::Tensor>& weight, const at::Tensor& mean,
    const at::Tensor& rstd, bool rms, bool weight_grad, bool bias_grad, at::ScalarType param_dtype) {
  const Rows s = rows_of(x, rms, 0.0);
  check_param(weight, s, "weight");
  TORCH_CHECK(grad.sizes() == x.sizes() && grad.scalar_type() == x.scalar_type(),
              "norm_rows_backward: a gradient of x's shape and dtype");
  TORCH_CHECK(mean.numel() == s.n && rstd.numel() == s.n && mean.scalar_type() == at::kFloat &&
                  rstd.scalar_type() == at::kFloat && mean.is_contiguous() && rstd.is_contiguous(),
              "norm_rows_backward: one fp32 mean and rstd per row");
  const at::Tensor g = grad.contiguous();
  const std::vector<float> w = as_floats(weight, s.c);
  const int64_t blocks = (s.n + kBlock - 1) / kBlock;
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor partial_w = weight_grad ? at::zeros({blocks, s.c}, f32) : at::Tensor();
  at::Tensor partial_b = bias_grad ? at::zeros({blocks, s.c}, f32) : at::Tensor();
  at::Tensor dx = at::empty_like(x);
  on_type(x.scalar_type(), [&](auto type) {
    using T = decltype(type);
    backward(g.data_ptr<T>(), x.data_ptr<T>(), w, mean.data_ptr<float>(), rstd.data_ptr<float>(), dx.data_ptr<T>(),
             weight_grad ? partial_w.data_ptr<float>() : nullptr, bias_grad ? partial_b.data_ptr<float>() : nullptr,
             s);
  });
  // the blocks' sums added in order, on one thread: the same bits whatever the threads did
  const auto total = [&](const at::Tensor& partial) {
    if (!partial.defined()) return at::empty({0}, f32);
    at::Tensor sum = at::zeros({s.c}, f32);
    float* out = sum.data_ptr<float>();
    const float* p = partial.data_ptr<float>();
    for (int64_t block = 0; block < blocks; ++block)
      for (int64_t j = 0; j < s.c; ++j) out[j] += p[block * s.c + j];
    return sum.to(param_dtype);
  };
  return {dx, total(partial_w), total(partial_b)};
}

}  // namespace
}  // namespace GPTLAB_NS

// CPU kernels of declared operators, so that fake tensors get the shapes from the fakes registered in
// gptlab/kernels/__init__.py
GPTLAB_LIBRARY_FRAGMENT(GPTLAB_NS, m) {
  m.def("norm_rows(Tensor x, Tensor? weight, Tensor? bias, float eps, bool rms) -> (Tensor, Tensor, Tensor)");
  m.impl("norm_rows", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(GPTLAB_NS::norm_rows)));
  m.def("norm_rows_backward(Tensor grad, Tensor x, Tensor? weight, Tensor mean, Tensor rstd, bool rms, "
        "bool weight_grad, bool bias_grad, ScalarType param_dtype) -> (Tensor, Tensor, Tensor)");
  m.impl("norm_rows_backward", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(GPTLAB_NS::norm_rows_backward)));
}
