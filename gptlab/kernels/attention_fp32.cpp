// Causal attention of short sequences in fp32 training on a CPU, forward and backward (`gptlab.causal_attention`).
// PyTorch's CPU flash attention splits its work into blocks of 128 queries and 512 keys and runs their products as
// GEMM calls: at a small model's shapes (the CPU speedrun's 32 x 2 heads x 64 positions x 32) each call is a few
// thousand multiply-adds (a layer's forward and backward: ~1.6 ms on a 2-core Zen 3, ~1.4 ms here). Here each
// (batch, head) is one unit of work whose keys and values (transposed once, D x T) stay in the L1 cache, and each
// query row is done whole in registers (every build: 8 lanes in AVX2, 16 in AVX-512):
//   forward:  s = scale q K^T over the keys up to the query (causal), p = exp(s - max), l = sum p,
//             o = (p V) / l, lse = max + log l (the backward's);
//   backward: p = exp(scale q K^T - lse), dp = dO V^T, ds = scale p (dp - sum_j p_j dp_j) (= dO . O),
//             dQ = ds K query row by query row, P and dS kept transposed; then key row by key row
//             dK = dS^T Q, dV = P^T dO (summed over a kv head's group of query heads), in registers.
// All in fp32, summed in another order than ATen's: within fp32 rounding of the maths (tests/test_attention_fp32.py
// holds both against it in fp64). The output is written as (B, T, H, D) and handed back as its (B, H, T, D) view,
// the layout the attention's output projection reads: no copy between them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "linear_avx2.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace GPTLAB_NS {
namespace {

using simd::kLanes;
using simd::load;
using simd::splat;
using simd::store;
using simd::Vec;

constexpr int kMaxVecs = 8;  // vectors a register block holds (of keys, or of a row's D)

struct View {  // a (B, H, T, D) fp32 tensor's data and strides, D contiguous
  const float* data;
  int64_t sb, sh, st;
  const float* row(int64_t b, int64_t h, int64_t t) const { return data + b * sb + h * sh + t * st; }
};

View view_of(const at::Tensor& x) { return {x.data_ptr<float>(), x.stride(0), x.stride(1), x.stride(2)}; }

// out[0, N vectors) = sum_j w[j] * rows[j][d0, d0 + N vectors) over j < n (rows ld apart), with Add out += that:
// N accumulators, one broadcast of w[j] a step. Up to 4 vectors, even and odd j are summed apart: twice the
// independent sums, where a short row's latency, not its work, was the limit (8 sums cover the multiply-add's
// latency on two units). Every product here is one: a query's scores (w its q, rows K^T's), p V and dS K for a
// query, dS^T Q and P^T dO for a key.
template <int N, bool Add>
inline void weighted_block(const float* w, const float* rows, int64_t ld, int64_t n, int64_t d0, float* out) {
  constexpr bool kSplit = N <= 4;
  Vec acc[N] = {}, odd[kSplit ? N : 1] = {};
  if (Add) {
#pragma GCC unroll 8
    for (int u = 0; u < N; ++u) acc[u] = load(out + d0 + u * kLanes);
  }
  int64_t j = 0;
  if (kSplit) {
    for (; j + 2 <= n; j += 2) {
      const Vec w0 = splat(w[j]), w1 = splat(w[j + 1]);
      const float* r = rows + j * ld + d0;
#pragma GCC unroll 8
      for (int u = 0; u < N; ++u) {
        acc[u] += w0 * load(r + u * kLanes);
        odd[kSplit ? u : 0] += w1 * load(r + ld + u * kLanes);
      }
    }
  }
  for (; j < n; ++j) {
    const Vec wj = splat(w[j]);
    const float* r = rows + j * ld + d0;
#pragma GCC unroll 8
    for (int u = 0; u < N; ++u) acc[u] += wj * load(r + u * kLanes);
  }
#pragma GCC unroll 8
  for (int u = 0; u < N; ++u) store(out + d0 + u * kLanes, kSplit ? acc[u] + odd[kSplit ? u : 0] : acc[u]);
}

template <bool Add>
void weighted_any(const float* w, const float* rows, int64_t ld, int64_t n, int64_t vecs, float* out) {
  int64_t v = 0;
  for (; v + kMaxVecs <= vecs; v += kMaxVecs) weighted_block<kMaxVecs, Add>(w, rows, ld, n, v * kLanes, out);
  using Fn = void (*)(const float*, const float*, int64_t, int64_t, int64_t, float*);
  static constexpr Fn tail[kMaxVecs] = {nullptr, weighted_block<1, Add>, weighted_block<2, Add>,
                                        weighted_block<3, Add>, weighted_block<4, Add>, weighted_block<5, Add>,
                                        weighted_block<6, Add>, weighted_block<7, Add>};
  if (vecs > v) tail[vecs - v](w, rows, ld, n, v * kLanes, out);
}

// out (vecs vectors) = sum_j w[j] * rows[j] over j < n (rows ld apart), or out += that
void weighted_rows(const float* w, const float* rows, int64_t ld, int64_t n, int64_t vecs, float* out,
                   bool add = false) {
  if (add) weighted_any<true>(w, rows, ld, n, vecs, out);
  else weighted_any<false>(w, rows, ld, n, vecs, out);
}

// (T x D, st apart) into (D x ldt), the key columns past T zero (whole vectors of keys are read)
void transpose_padded(const float* x, int64_t st, int64_t T, int64_t D, float* out, int64_t ldt) {
  simd::transpose(x, st, T, D, out, ldt);
  for (int64_t d = 0; d < D; ++d) std::fill(out + d * ldt + T, out + (d + 1) * ldt, 0.0f);
}

struct Scratch {  // a thread's buffers, kept between calls
  std::vector<float> kt, vt, s, dp, pt, dst;
  void size(int64_t Tp, int64_t D, int64_t T, int64_t group, bool backward) {
    kt.resize(D * Tp), s.resize(Tp);
    if (backward) vt.resize(D * Tp), dp.resize(Tp), pt.resize(group * T * T), dst.resize(group * T * T);
  }
};

void check_inputs(const char* name, std::initializer_list<const at::Tensor*> tensors, const at::Tensor& q,
                  const at::Tensor& k, const at::Tensor& v) {
  for (const at::Tensor* t : tensors)
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 4 && t->stride(3) == 1, name,
                ": fp32 CPU tensors (B, H, T, D) with D contiguous");
  const int64_t H = q.size(1), Hkv = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(2) == q.size(2) && k.size(3) == q.size(3) &&
                  Hkv > 0 && H % Hkv == 0,
              name, ": queries (B, H, T, D), keys and values (B, Hkv, T, D) with Hkv dividing H");
  TORCH_CHECK(q.size(3) % kLanes == 0 && q.size(2) > 0, name, ": D must be a multiple of ", kLanes);
}

std::tuple<at::Tensor, at::Tensor> causal_attention_fp32(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& v, double scale) {
  check_inputs("causal_attention_fp32", {&q, &k, &v}, q, k, v);
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1);
  const int64_t Tp = (T + kLanes - 1) / kLanes * kLanes, group = H / Hkv;
  const View Q = view_of(q), K = view_of(k), V = view_of(v);
  at::Tensor out = at::empty({B, T, H, D}, q.options());  // handed back as its (B, H, T, D) view
  at::Tensor lse = at::empty({B, H, T}, q.options());
  float* o_data = out.data_ptr<float>();
  float* l_data = lse.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const Vec lanes = simd::lane_index();
  const float minus_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, B * H, 1, [&](int64_t first, int64_t last) {
    thread_local Scratch w;
    w.size(Tp, D, T, group, false);
    for (int64_t unit = first; unit < last; ++unit) {
      const int64_t b = unit / H, h = unit % H, hk = h / group;
      transpose_padded(K.row(b, hk, 0), K.st, T, D, w.kt.data(), Tp);
      const float* values = V.row(b, hk, 0);
      for (int64_t t = 0; t < T; ++t) {
        const int64_t nv = t / kLanes + 1;  // key vectors up to the query's (causal)
        weighted_rows(Q.row(b, h, t), w.kt.data(), Tp, D, nv, w.s.data());  // q K^T
        Vec mx = splat(minus_inf);
        for (int64_t c = 0; c < nv * kLanes; c += kLanes) {
          const Vec x = load(w.s.data() + c) * sc;
          const Vec masked = simd::causal_lanes(lanes, c, t) > 0.0f ? x : splat(minus_inf);
          store(w.s.data() + c, masked);
          mx = masked > mx ? masked : mx;
        }
        const float m = simd::lane_max(mx);
        Vec sum = {};
        for (int64_t c = 0; c < nv * kLanes; c += kLanes) {
          const Vec p = simd::exp_vec(load(w.s.data() + c) - m);  // (exp_vec of a masked -inf: 0)
          store(w.s.data() + c, p);
          sum += p;
        }
        const float l = simd::lane_sum(sum);
        l_data[(b * H + h) * T + t] = m + std::log(l);
        float* o = o_data + ((b * T + t) * H + h) * D;
        weighted_rows(w.s.data(), values, V.st, t + 1, D / kLanes, o);
        const Vec inv = splat(1.0f / l);
        for (int64_t d = 0; d < D; d += kLanes) store(o + d, load(o + d) * inv);
      }
    }
  });
  return {out.permute({0, 2, 1, 3}), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_attention_fp32_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lse,
    double scale) {
  check_inputs("causal_attention_fp32_backward", {&grad_out, &q, &k, &v}, q, k, v);
  TORCH_CHECK(grad_out.sizes() == q.sizes(), "causal_attention_fp32_backward: a gradient of the queries' shape");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1);
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.sizes() == at::IntArrayRef({B, H, T}) && lse.is_contiguous(),
              "causal_attention_fp32_backward: lse (B, H, T) fp32, contiguous");
  const int64_t Tp = (T + kLanes - 1) / kLanes * kLanes, group = H / Hkv;
  const View Q = view_of(q), K = view_of(k), V = view_of(v), dO = view_of(grad_out);
  const float* L = lse.data_ptr<float>();
  at::Tensor dq = at::empty({B, H, T, D}, q.options()), dk = at::empty({B, Hkv, T, D}, q.options());
  at::Tensor dv = at::empty({B, Hkv, T, D}, q.options());
  float* dq_data = dq.data_ptr<float>();
  float* dk_data = dk.data_ptr<float>();
  float* dv_data = dv.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const Vec lanes = simd::lane_index();

  at::parallel_for(0, B * Hkv, 1, [&](int64_t first, int64_t last) {
    thread_local Scratch w;
    w.size(Tp, D, T, group, true);
    for (int64_t unit = first; unit < last; ++unit) {
      const int64_t b = unit / Hkv, hk = unit % Hkv;
      const float* keys = K.row(b, hk, 0);
      transpose_padded(keys, K.st, T, D, w.kt.data(), Tp);
      transpose_padded(V.row(b, hk, 0), V.st, T, D, w.vt.data(), Tp);
      // each query row: P and dS over its keys, dQ; P and dS kept transposed (key j's row: its queries i >= j)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = hk * group + g;
        const float* lse_h = L + (b * H + h) * T;
        float* pt = w.pt.data() + g * T * T;
        float* dst = w.dst.data() + g * T * T;
        for (int64_t t = 0; t < T; ++t) {
          const int64_t nv = t / kLanes + 1;
          const float* gt = dO.row(b, h, t);
          weighted_rows(Q.row(b, h, t), w.kt.data(), Tp, D, nv, w.s.data());  // q K^T
          weighted_rows(gt, w.vt.data(), Tp, D, nv, w.dp.data());  // dO V^T
          // delta = rowsum(dO * O) = sum_j p_j dp_j: from the same dp, so a row whose gradient is zero (one key, or
          // equal dp) gets exactly zero
          const float l = lse_h[t];
          Vec dots = {};
          for (int64_t c = 0; c < nv * kLanes; c += kLanes) {
            const Vec p = simd::exp_vec(load(w.s.data() + c) * sc - l) * simd::causal_lanes(lanes, c, t);
            store(w.s.data() + c, p);
            dots += p * load(w.dp.data() + c);
          }
          const float delta = simd::lane_sum(dots);
          for (int64_t c = 0; c < nv * kLanes; c += kLanes)
            store(w.dp.data() + c, load(w.s.data() + c) * (load(w.dp.data() + c) - delta) * sc);
          float* dq_row = dq_data + ((b * H + h) * T + t) * D;
          weighted_rows(w.dp.data(), keys, K.st, t + 1, D / kLanes, dq_row);  // dQ = dS K
          for (int64_t j = 0; j <= t; ++j) pt[j * T + t] = w.s[j], dst[j * T + t] = w.dp[j];
        }
      }
      // each key row: dK = dS^T Q, dV = P^T dO over the queries at or after it, summed over the group's heads
      float* dk_rows = dk_data + (b * Hkv + hk) * T * D;
      float* dv_rows = dv_data + (b * Hkv + hk) * T * D;
      for (int64_t j = 0; j < T; ++j)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = hk * group + g;
          const float* p_col = w.pt.data() + g * T * T + j * T + j;
          const float* ds_col = w.dst.data() + g * T * T + j * T + j;
          weighted_rows(ds_col, Q.row(b, h, j), Q.st, T - j, D / kLanes, dk_rows + j * D, g > 0);
          weighted_rows(p_col, dO.row(b, h, j), dO.st, T - j, D / kLanes, dv_rows + j * D, g > 0);
        }
    }
  });
  return {dq, dk, dv};
}

}  // namespace
}  // namespace GPTLAB_NS

// declared operators with CPU kernels (not catch-all ones): fake tensors and torch.compile's tracing get the shapes
// from the fakes registered in gptlab/kernels/__init__.py
GPTLAB_LIBRARY_FRAGMENT(GPTLAB_NS, m) {
  m.def("causal_attention_fp32(Tensor q, Tensor k, Tensor v, float scale) -> (Tensor, Tensor)");
  m.impl("causal_attention_fp32", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(GPTLAB_NS::causal_attention_fp32)));
  m.def("causal_attention_fp32_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor lse, float scale) "
        "-> (Tensor, Tensor, Tensor)");
  m.impl("causal_attention_fp32_backward",
         torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(GPTLAB_NS::causal_attention_fp32_backward)));
}
