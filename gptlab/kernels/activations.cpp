// GELU in its exact (erf) form and its tanh form (GPT-2's "gelu_new": 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715
// x^3)))), with its slope dy/dx in the same pass, for training on a CPU (`gptlab.ops.gelu`): autograd keeps the
// slope instead of x, and the backward is one product, g * slope. ATen's backward evaluates the function's pieces
// again (two exps for the erf form's); its tanh form runs its vectorized tanh, ~4.5x the time of the erf form on an
// AVX-512 Xeon.
// Here every form comes from one exp over simd.h's vectors (within ~1e-7 relative of std::exp's), in fp32 and
// rounded once to the input's dtype:
// - erf form: Phi(x) = 1/2 erfc(-x / sqrt 2), erfc by Abramowitz & Stegun 7.1.26 (ATen's vectorized erf: |error| <=
//   1.5e-7), whose e^(-x^2 / 2) is also the density's; y = x Phi(x), slope = Phi(x) + x phi(x). (The decode step's
//   GELU, step_math.h, takes Numerical Recipes' erfcc for the tail's relative accuracy; with it and a second exp
//   for the density this pass took 0.65 ms at 32 x 64 x 256 against 0.34, more than ATen's forward and backward.)
// - tanh form: ATen's formulas, written so that the negative tail keeps its relative accuracy (ATen's 1 + tanh
//   loses it there).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "linear_avx2.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <tuple>

namespace GPTLAB_NS {
namespace {

using namespace simd;

constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kKappa = 0.044715f;

// With u = kBeta (x + kKappa x^3) and d = 1 - tanh |u| = 2 / (e^(2|u|) + 1): 1 + tanh u is d where u < 0, else 2 - d,
// and 1 - tanh^2 u = d (2 - d). Written so, neither cancels: the negative tail (1 + tanh u -> 0) keeps its
// relative accuracy (ATen's 1 + tanh loses it there).
struct Tanh {
  Vec one_plus, one_minus_sq;
  explicit Tanh(Vec x) {
    const Vec u = kBeta * (x + kKappa * x * x * x), a = u < 0.0f ? -u : u;
    const Vec d = a > 44.0f ? splat(0.0f) : 2.0f / (exp_vec(2.0f * a) + 1.0f);  // (fp32's exp overflows past 88)
    one_plus = u < 0.0f ? d : 2.0f - d, one_minus_sq = d * (2.0f - d);
  }
};

// a form's value and slope at x
struct GeluSlope {
  Vec y, slope;
};

GeluSlope gelu_tanh_of(Vec x) {
  const Tanh t(x);
  const Vec du = kBeta * (1.0f + 3.0f * kKappa * x * x);  // u'(x)
  return {0.5f * x * t.one_plus, 0.5f * t.one_plus + 0.5f * x * (t.one_minus_sq * du)};
}

GeluSlope gelu_erf_of(Vec x) {
  constexpr float kInvSqrt2 = 0.7071067811865476f, kInvSqrt2Pi = 0.3989422804014327f;
  const Vec z = (x < 0.0f ? -x : x) * kInvSqrt2;
  const Vec t = 1.0f / (1.0f + 0.3275911f * z);
  const Vec e = exp_vec(-z * z);  // e^(-x^2 / 2)
  const Vec poly =
      t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
  const Vec half_erfc = 0.5f * e * poly;
  const Vec cdf = x < 0.0f ? half_erfc : 1.0f - half_erfc;
  return {x * cdf, cdf + x * (kInvSqrt2Pi * e)};
}

// y[i], slope[i] = f(x[i]) over n values, a vector at a time over the threads; a share's last few values go through
// the same vector code, zero-padded (no scalar twin of the formulas)
template <typename T, typename F>
void map_lanes(const T* x, T* y, T* slope, int64_t n, const F& f) {
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + kLanes <= end; i += kLanes) {
      const GeluSlope r = f(load(x + i));
      store(y + i, r.y), store(slope + i, r.slope);
    }
    if (i < end) {
      T tail[kLanes] = {}, out_y[kLanes], out_slope[kLanes];
      std::copy(x + i, x + end, tail);
      const GeluSlope r = f(load(tail));
      store(out_y, r.y), store(out_slope, r.slope);
      std::copy(out_y, out_y + (end - i), y + i);
      std::copy(out_slope, out_slope + (end - i), slope + i);
    }
  });
}

template <typename T>
void gelu_rows(const T* x, T* y, T* slope, int64_t n, bool tanh_form) {
  // (lambdas, not the functions' pointers: a type of their own, so that each loop inlines its formulas)
  if (tanh_form) map_lanes(x, y, slope, n, [](Vec v) { return gelu_tanh_of(v); });
  else map_lanes(x, y, slope, n, [](Vec v) { return gelu_erf_of(v); });
}

std::tuple<at::Tensor, at::Tensor> gelu_with_slope(const at::Tensor& x, bool tanh_form) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "gelu_with_slope: a contiguous fp32 or bf16 CPU tensor");
  at::Tensor y = at::empty_like(x), slope = at::empty_like(x);
  if (x.scalar_type() == at::kFloat)
    gelu_rows(x.data_ptr<float>(), y.data_ptr<float>(), slope.data_ptr<float>(), x.numel(), tanh_form);
  else
    gelu_rows(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), slope.data_ptr<at::BFloat16>(), x.numel(),
              tanh_form);
  return {y, slope};
}

}  // namespace
}  // namespace GPTLAB_NS

GPTLAB_LIBRARY_FRAGMENT(GPTLAB_NS, m) {
  m.def("gelu_with_slope(Tensor x, bool tanh_form) -> (Tensor, Tensor)", &GPTLAB_NS::gelu_with_slope);
}
