// An attention layer's q, k and v from its fused projection (B, T, (nh + 2 nkv) hs), for training on a CPU
// (`gptlab.heads.split_heads`): each head cut out, cast to the attention's dtype, q and k RMS-normalized (QK-norm,
// no weight) and rotated (RoPE, either pair layout, partial rotary), written as (B, heads, T, hs), in one pass per
// position; and the gradient of all that in one pass back. In PyTorch the same is ~35 ops forward and as many
// autograd nodes backward (casts, transposes, norm, rotate-half): at a small model's shapes most of a training
// step's framework time (~5 ms of the CPU speedrun's ~18 ms step). Computed in fp32, rounded once to the output's
// dtype: the reference ops' values within fp32 rounding.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "linear_avx2.h"
#include "simd.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace GPTLAB_NS {
namespace {

using simd::float_or_bf16;
using simd::narrow;
using simd::on_types;
using simd::widen;

struct Heads {
  int64_t B, T, nh, nkv, hs, half;  // half: pairs rotated per head (0: no rotation)
  int64_t table_rows;               // cos/sin rows: 1 (shared positions) or B (each row its own)
  const float* cos;                 // (table_rows, T, half) each; null without rotation
  const float* sin;
  bool interleaved, norm;
  double eps;
  int64_t width() const { return (nh + 2 * nkv) * hs; }
};

// 1 / sqrt(mean(x^2) + eps) of one head's hs values, in fp32 as F.rms_norm computes an fp32 input's
inline float inverse_rms(const float* x, const Heads& s) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < s.hs; ++d) sum += x[d] * x[d];
  return 1.0f / std::sqrt(sum / static_cast<float>(s.hs) + static_cast<float>(s.eps));
}

// each pair (a, b) of x, dims (2i, 2i + 1) (interleaved) or (i, i + half) ("rotate half"), turned by its angle:
// a' = a cos - b sin, b' = b cos + a sin; sign -1 turns back (the rotation's transpose, for the gradient)
inline void rotate(float* x, const float* cos, const float* sin, const Heads& s, float sign) {
  if (s.interleaved) {
    for (int64_t i = 0; i < s.half; ++i) {
      const float a = x[2 * i], b = x[2 * i + 1], sn = sign * sin[i];
      x[2 * i] = a * cos[i] - b * sn, x[2 * i + 1] = b * cos[i] + a * sn;
    }
    return;
  }
  float* first = x;
  float* second = x + s.half;
#pragma omp simd
  for (int64_t i = 0; i < s.half; ++i) {
    const float a = first[i], b = second[i], sn = sign * sin[i];
    first[i] = a * cos[i] - b * sn, second[i] = b * cos[i] + a * sn;
  }
}

// (row, position): where the head's slice starts in a (B, heads, T, hs) output
inline int64_t head_offset(const Heads& s, int64_t b, int64_t heads, int64_t h, int64_t t) {
  return ((b * heads + h) * s.T + t) * s.hs;
}

// head h's slice at (b, t) in the outputs q (B, nh, T, hs), k and v (B, nkv, T, hs)
template <typename T>
inline T* head_of(T* q, T* k, T* v, const Heads& s, int64_t b, int64_t h, int64_t t) {
  if (h < s.nh) return q + head_offset(s, b, s.nh, h, t);
  if (h < s.nh + s.nkv) return k + head_offset(s, b, s.nkv, h - s.nh, t);
  return v + head_offset(s, b, s.nkv, h - s.nh - s.nkv, t);
}

template <typename In, typename Out>
void forward(const In* qkv, Out* q, Out* k, Out* v, const Heads& s) {
  at::parallel_for(0, s.B * s.T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(s.width());
    float* x = buffer.data();
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / s.T, t = row % s.T;
      const int64_t table = ((s.table_rows > 1 ? b : 0) * s.T + t) * s.half;
      widen(qkv + row * s.width(), x, s.width());
      for (int64_t h = 0; h < s.nh + 2 * s.nkv; ++h) {
        float* head = x + h * s.hs;
        if (h < s.nh + s.nkv) {  // q and k heads: normalized, then rotated
          if (s.norm) {
            const float r = inverse_rms(head, s);
#pragma omp simd
            for (int64_t d = 0; d < s.hs; ++d) head[d] *= r;
          }
          if (s.half) rotate(head, s.cos + table, s.sin + table, s, 1.0f);
        }
        narrow(head, head_of(q, k, v, s, b, h, t), s.hs);
      }
    }
  });
}

// the gradient of `forward` at qkv: per q/k head, the rotation turned back on the gradient, then RMS norm's
// backward r (g - y mean(g y)), with y = x r recomputed from qkv
template <typename In, typename Out>
void backward(const Out* dq, const Out* dk, const Out* dv, const In* qkv, In* dqkv, const Heads& s) {
  at::parallel_for(0, s.B * s.T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buffers(2 * s.width());
    float* g = buffers.data();
    float* x = g + s.width();
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / s.T, t = row % s.T;
      const int64_t table = ((s.table_rows > 1 ? b : 0) * s.T + t) * s.half;
      if (s.norm) widen(qkv + row * s.width(), x, s.width());
      for (int64_t h = 0; h < s.nh + 2 * s.nkv; ++h) {
        float* grad = g + h * s.hs;
        widen(head_of(dq, dk, dv, s, b, h, t), grad, s.hs);
        if (h >= s.nh + s.nkv) continue;
        if (s.half) rotate(grad, s.cos + table, s.sin + table, s, -1.0f);
        if (s.norm) {
          const float* head = x + h * s.hs;
          const float r = inverse_rms(head, s);
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < s.hs; ++d) dot += grad[d] * head[d];
          const float mean = dot * r / static_cast<float>(s.hs);  // mean(g y), y = x r
#pragma omp simd
          for (int64_t d = 0; d < s.hs; ++d) grad[d] = r * (grad[d] - head[d] * r * mean);
        }
      }
      narrow(g, dqkv + row * s.width(), s.width());
    }
  });
}

Heads heads_of(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t n_head,
               int64_t n_kv_head, bool interleaved, bool norm, double eps) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 3 && qkv.is_contiguous() && float_or_bf16(qkv.scalar_type()),
              "split_heads: qkv must be a contiguous (B, T, width) fp32 or bf16 CPU tensor");
  TORCH_CHECK(n_head > 0 && n_kv_head > 0 && qkv.size(2) % (n_head + 2 * n_kv_head) == 0,
              "split_heads: the width is not (n_head + 2 n_kv_head) head sizes");
  Heads s{qkv.size(0), qkv.size(1), n_head, n_kv_head, qkv.size(2) / (n_head + 2 * n_kv_head), 0, 1,
          nullptr, nullptr, interleaved, norm, eps};
  if (cos.numel() > 0) {  // tables (1 or B, T, half): the rotation's cos and sin per position and pair
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 3,
                "split_heads: cos and sin must be contiguous fp32 (1 or B, T, half) tensors");
    TORCH_CHECK((cos.size(0) == 1 || cos.size(0) == s.B) && cos.size(1) == s.T && 2 * cos.size(2) <= s.hs,
                "split_heads: cos and sin do not fit qkv's rows, positions and head size");
    s.table_rows = cos.size(0), s.half = cos.size(2);
    s.cos = cos.data_ptr<float>(), s.sin = sin.data_ptr<float>();
  }
  return s;
}

std::vector<at::Tensor> split_heads(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                    int64_t n_head, int64_t n_kv_head, bool interleaved, bool norm, double eps,
                                    at::ScalarType out_dtype) {
  const Heads s = heads_of(qkv, cos, sin, n_head, n_kv_head, interleaved, norm, eps);
  TORCH_CHECK(float_or_bf16(out_dtype), "split_heads: fp32 or bf16 outputs");
  const auto options = qkv.options().dtype(out_dtype);
  at::Tensor q = at::empty({s.B, s.nh, s.T, s.hs}, options), k = at::empty({s.B, s.nkv, s.T, s.hs}, options),
             v = at::empty({s.B, s.nkv, s.T, s.hs}, options);
  on_types(qkv.scalar_type(), out_dtype, [&](auto in, auto out) {
    using In = decltype(in);
    using Out = decltype(out);
    forward(qkv.data_ptr<In>(), q.data_ptr<Out>(), k.data_ptr<Out>(), v.data_ptr<Out>(), s);
  });
  return {q, k, v};
}

at::Tensor split_heads_backward(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                                const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t n_head,
                                int64_t n_kv_head, bool interleaved, bool norm, double eps) {
  const Heads s = heads_of(qkv, cos, sin, n_head, n_kv_head, interleaved, norm, eps);
  const at::ScalarType dtype = dq.scalar_type();
  TORCH_CHECK(float_or_bf16(dtype) && dk.scalar_type() == dtype &&
                  dv.scalar_type() == dtype,
              "split_heads_backward: the gradients must all be fp32 or all bf16");
  TORCH_CHECK(dq.sizes() == at::IntArrayRef({s.B, s.nh, s.T, s.hs}) &&
                  dk.sizes() == at::IntArrayRef({s.B, s.nkv, s.T, s.hs}) && dv.sizes() == dk.sizes(),
              "split_heads_backward: gradients not shaped as split_heads' outputs");
  const at::Tensor gq = dq.contiguous(), gk = dk.contiguous(), gv = dv.contiguous();
  at::Tensor dqkv = at::empty_like(qkv);
  on_types(qkv.scalar_type(), dtype, [&](auto in, auto out) {
    using In = decltype(in);
    using Out = decltype(out);
    backward(gq.data_ptr<Out>(), gk.data_ptr<Out>(), gv.data_ptr<Out>(), qkv.data_ptr<In>(), dqkv.data_ptr<In>(), s);
  });
  return dqkv;
}

}  // namespace
}  // namespace GPTLAB_NS

// CPU kernels of declared operators (not catch-all ones), so that fake tensors and torch.compile's tracing get the
// shapes from the fakes registered in gptlab/kernels/__init__.py
GPTLAB_LIBRARY_FRAGMENT(GPTLAB_NS, m) {
  m.def("split_heads(Tensor qkv, Tensor cos, Tensor sin, int n_head, int n_kv_head, bool interleaved, bool norm, "
        "float eps, ScalarType out_dtype) -> Tensor[]");
  m.impl("split_heads", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(GPTLAB_NS::split_heads)));
  m.def("split_heads_backward(Tensor dq, Tensor dk, Tensor dv, Tensor qkv, Tensor cos, Tensor sin, int n_head, "
        "int n_kv_head, bool interleaved, bool norm, float eps) -> Tensor");
  m.impl("split_heads_backward", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(GPTLAB_NS::split_heads_backward)));
}
