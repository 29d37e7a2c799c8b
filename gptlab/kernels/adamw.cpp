// AdamW's step for bf16 working-weight training on a CPU (`gptlab.train.flat`, Precision's "working" mode) in one
// pass over each parameter: the bf16 gradient read as it is (no fp32 copy of every gradient first), the fp32
// master, its two moments updated, and the master written back rounded to bf16 into the working weight (no copy
// of every weight after). Per parameter that is 28 bytes of memory traffic where the separate cast, fused AdamW
// and cast back move 48: at GPT-2 124M's 124M parameters, memory speed is the whole cost of these passes.
// `sum_squares` gives the gradients' global norm for clipping from the same bf16 gradients (exact in fp32: a bf16
// value widens exactly), summed in fp64 over fixed chunks, then the chunks in order: the same bits on any threads.
// The update is AdamW's (decoupled weight decay) as torch's fused kernel writes it, in fp32: the first moment by
// lerp, the second by multiply-add, the denominator sqrt(v) / sqrt(1 - beta2^t) + eps.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "linear_avx2.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace GPTLAB_NS {
namespace {

using simd::kLanes;
using simd::load;
using simd::on_type;
using simd::splat;
using simd::store;
using simd::Vec;

constexpr int64_t kChunk = 1 << 16;  // elements per unit of work (and per partial sum of the norm)

struct Chunk {
  int64_t tensor, begin, end;
};

// every tensor cut into chunks of at most kChunk elements, in order: one parallel loop over many small tensors
// (a model's norms and biases) and few large ones alike
std::vector<Chunk> chunks_of(const std::vector<int64_t>& sizes) {
  std::vector<Chunk> chunks;
  for (int64_t t = 0; t < static_cast<int64_t>(sizes.size()); ++t)
    for (int64_t b = 0; b < sizes[t]; b += kChunk) chunks.push_back({t, b, std::min(sizes[t], b + kChunk)});
  return chunks;
}

void check_list(const std::vector<at::Tensor>& list, const std::vector<at::Tensor>& like, const char* name,
                bool fp32) {
  TORCH_CHECK(list.size() == like.size(), "adamw_working: ", name, " must have one tensor per parameter");
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i];
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.numel() == like[i].numel() &&
                (fp32 ? t.scalar_type() == at::kFloat : simd::float_or_bf16(t.scalar_type())),
                "adamw_working: ", name, " must be contiguous CPU tensors of the parameters' sizes, in ",
                fp32 ? "fp32" : "fp32 or bf16");
  }
}

double sum_squares(const std::vector<at::Tensor>& tensors) {
  std::vector<int64_t> sizes;
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && simd::float_or_bf16(t.scalar_type()),
                "sum_squares: contiguous fp32 or bf16 CPU tensors");
    sizes.push_back(t.numel());
  }
  const std::vector<Chunk> chunks = chunks_of(sizes);
  std::vector<double> partial(chunks.size(), 0.0);
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const Chunk& k = chunks[c];
      on_type(tensors[k.tensor].scalar_type(), [&](auto type) {
        using T = decltype(type);
        const T* x = tensors[k.tensor].data_ptr<T>();
        double total = 0.0;
        int64_t i = k.begin;
        for (; i + 16 * kLanes <= k.end;) {  // fp32 lanes over blocks of 16 vectors (four chains), fp64 across
          Vec acc[4] = {splat(0.0f), splat(0.0f), splat(0.0f), splat(0.0f)};
          for (int r = 0; r < 16; ++r, i += kLanes) {
            const Vec v = load(x + i);
            acc[r % 4] += v * v;
          }
          total += simd::lane_sum((acc[0] + acc[1]) + (acc[2] + acc[3]));
        }
        for (; i < k.end; ++i) {
          const double v = static_cast<float>(x[i]);
          total += v * v;
        }
        partial[c] = total;
      });
    }
  });
  double total = 0.0;
  for (double p : partial) total += p;  // in order: the same sum whatever the threads
  return total;
}

// one parameter's coefficients for this step (its own step count: a parameter may have been stepped fewer times)
struct Coefficients {
  float decay, step_size, bc2_sqrt;
};

template <typename G, typename W>
void update(float* p, const G* g, float* m, float* v, W* w, int64_t begin, int64_t end, const Coefficients& c,
            float lerp, float beta2, float one_minus_beta2, float eps, float scale) {
  // torch's lerp form: m + lerp (g - m) for lerp < 0.5, else g + (lerp - 1) (g - m)
  const bool small = lerp < 0.5f;
  const float coeff = small ? lerp : lerp - 1.0f;
  const auto step = [&](Vec pv, Vec gv, Vec mv, Vec vv, Vec& p_out, Vec& m_out, Vec& v_out) {
    gv = gv * scale;
    pv = pv * c.decay;
    m_out = simd::fma(splat(coeff), gv - mv, small ? mv : gv);  // fused, as ATen's lerp
    v_out = vv * beta2 + one_minus_beta2 * gv * gv;
    const Vec denom = simd::sqrt(v_out) / c.bc2_sqrt + eps;
    p_out = pv - c.step_size * m_out / denom;
  };
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    Vec pn, mn, vn;
    step(load(p + i), load(g + i), load(m + i), load(v + i), pn, mn, vn);
    store(p + i, pn), store(m + i, mn), store(v + i, vn);
    if (w) store(w + i, pn);
  }
  if (i < end) {  // the last few through the same vector code, zero-padded
    const int64_t n = end - i;
    float pt[kLanes] = {}, mt[kLanes] = {}, vt[kLanes] = {};
    G gt[kLanes] = {};
    std::copy(p + i, p + end, pt), std::copy(g + i, g + end, gt), std::copy(m + i, m + end, mt);
    std::copy(v + i, v + end, vt);
    Vec pn, mn, vn;
    step(load(pt), load(gt), load(mt), load(vt), pn, mn, vn);
    store(pt, pn), store(mt, mn), store(vt, vn);
    std::copy(pt, pt + n, p + i), std::copy(mt, mt + n, m + i), std::copy(vt, vt + n, v + i);
    if (w) {
      W wt[kLanes];
      store(wt, pn);
      std::copy(wt, wt + n, w + i);
    }
  }
}

void adamw_working(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                   const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                   const std::vector<at::Tensor>& working, const std::vector<at::Tensor>& steps, double lr,
                   double beta1, double beta2, double weight_decay, double eps, double grad_scale,
                   const std::optional<at::Tensor>& found_inf) {
  check_list(params, params, "params", true);
  check_list(grads, params, "grads", false);
  check_list(exp_avgs, params, "exp_avgs", true);
  check_list(exp_avg_sqs, params, "exp_avg_sqs", true);
  TORCH_CHECK(working.empty() || working.size() == params.size(),
              "adamw_working: working must be empty or have one tensor per parameter");
  for (size_t i = 0; i < working.size(); ++i)
    TORCH_CHECK(working[i].device().is_cpu() && working[i].is_contiguous() &&
                working[i].scalar_type() == at::kBFloat16 && working[i].numel() == params[i].numel(),
                "adamw_working: working must be contiguous bf16 CPU tensors of the parameters' sizes");
  TORCH_CHECK(steps.size() == params.size(), "adamw_working: steps must have one tensor per parameter");
  for (const at::Tensor& s : steps)
    TORCH_CHECK(s.device().is_cpu() && s.numel() == 1 && s.scalar_type() == at::kFloat,
                "adamw_working: steps must be one-element fp32 CPU tensors");
  if (found_inf && found_inf->defined() && found_inf->item<double>() != 0.0) return;  // a skipped step: no change

  std::vector<Coefficients> coefficients;
  for (const at::Tensor& s : steps) {
    float* count = s.data_ptr<float>();
    *count += 1.0f;
    const double t = *count;  // as torch: the bias corrections in double
    coefficients.push_back({static_cast<float>(1.0 - lr * weight_decay),
                            static_cast<float>(lr / (1.0 - std::pow(beta1, t))),
                            static_cast<float>(std::sqrt(1.0 - std::pow(beta2, t)))});
  }
  std::vector<int64_t> sizes;
  for (const at::Tensor& p : params) sizes.push_back(p.numel());
  const std::vector<Chunk> chunks = chunks_of(sizes);
  const float lerp = static_cast<float>(1.0 - beta1), b2 = static_cast<float>(beta2);
  const float one_minus_b2 = static_cast<float>(1.0 - beta2), e = static_cast<float>(eps);
  const float scale = static_cast<float>(grad_scale);
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const Chunk& k = chunks[c];
      const int64_t t = k.tensor;
      on_type(grads[t].scalar_type(), [&](auto type) {
        using G = decltype(type);
        at::BFloat16* w = working.empty() ? nullptr : working[t].data_ptr<at::BFloat16>();
        update(params[t].data_ptr<float>(), grads[t].data_ptr<G>(), exp_avgs[t].data_ptr<float>(),
               exp_avg_sqs[t].data_ptr<float>(), w, k.begin, k.end, coefficients[t], lerp, b2, one_minus_b2, e,
               scale);
      });
    }
  });
}

}  // namespace
}  // namespace GPTLAB_NS

// CPU kernels of declared operators (as the other training kernels: what a dispatch mode or profiler sees)
GPTLAB_LIBRARY_FRAGMENT(GPTLAB_NS, m) {
  m.def("sum_squares(Tensor[] tensors) -> float");
  m.impl("sum_squares", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(GPTLAB_NS::sum_squares)));
  m.def("adamw_working(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] working, Tensor(e!)[] steps, float lr, float beta1, float beta2, float weight_decay, "
        "float eps, float grad_scale, Tensor? found_inf) -> ()");
  m.impl("adamw_working", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(GPTLAB_NS::adamw_working)));
}
