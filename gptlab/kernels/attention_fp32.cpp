// Causal attention in fp32 training on a CPU, forward and backward (`gptlab.causal_attention`), for sequences whose
// T x T scores fit the cache. PyTorch's CPU flash attention splits its work into blocks of 128 queries and 512 keys
// and runs their products as GEMM calls: at a small model's shapes (the CPU speedrun's 32 x 2 heads x 64 positions
// x 32) each call is a few thousand multiply-adds. Here each (batch, head) is one unit of work whose keys (K^T,
// transposed once, D x T) and values (V^T too in the backward) stay in the cache, and every product runs on one
// register tile (`tile`): a block of kRows query (or key) rows by 2 vectors, kRows broadcasts and 2 loads feeding
// 2 kRows multiply-adds a step (every build: 8 lanes in AVX2, 16 in AVX-512):
//   forward, a block of queries at a time:  S = scale Q K^T over the keys up to the block's last query (causal),
//             P = exp(S - rowmax), l = rowsum P, O = (P V) / l, lse = rowmax + log l (the backward's);
//   backward, a kv head at a time, each of its query heads in turn: P = exp(scale Q K^T - lse), dP = dO V^T,
//             dS = scale P (dP - rowsum(P dP)) (= dO . O), dQ = dS K, a block of queries at a time, P and dS kept
//             (T x T); then a block of keys at a time dK = dS^T Q, dV = P^T dO (the tile's weights read down P's and
//             dS's columns), summed over the kv head's group of query heads.
// All in fp32, summed in another order than ATen's: within fp32 rounding of the maths (tests/test_attention_fp32.py
// holds both against it in fp64). The output is written as (B, T, H, D) and handed back as its (B, H, T, D) view,
// the layout the attention's output projection reads: no copy between them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "linear_avx2.h"
#include "simd.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

namespace GPTLAB_NS {
namespace {

using simd::kLanes;
using simd::load;
using simd::splat;
using simd::store;
using simd::Vec;

struct View {  // a (B, H, T, D) fp32 tensor's data and strides, D contiguous
  const float* data;
  int64_t sb, sh, st;
  const float* row(int64_t b, int64_t h, int64_t t) const { return data + b * sb + h * sh + t * st; }
};

View view_of(const at::Tensor& x) { return {x.data_ptr<float>(), x.stride(0), x.stride(1), x.stride(2)}; }

// query (or key) rows a register tile holds: kRows x 2 accumulators, 2 vectors and a broadcast fit AVX2's 16
// registers (6 rows) and AVX-512's 32 (8)
constexpr int kRows = kLanes == 16 ? 8 : 6;

// out[r][d0, d0 + N vectors) = sum_j w[r * wr + j * wj] * rows[j][d0, d0 + N vectors) over j < n (rows ld apart,
// out's rows out_r apart), for r < R; with Add out += that. Each step loads N vectors of a row and R weights and does
// R x N multiply-adds: the register tile every product of the attention runs on (a block of queries' scores over
// K^T's rows, P V and dS K over key rows; dS^T Q and P^T dO over query rows, the weights read down a column).
template <int R, int N, bool Add>
void tile(const float* w, int64_t wr, int64_t wj, const float* rows, int64_t ld, int64_t n, int64_t d0, float* out,
          int64_t out_r) {
  Vec acc[R][N];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int u = 0; u < N; ++u) acc[r][u] = Add ? load(out + r * out_r + d0 + u * kLanes) : Vec{};
  for (int64_t j = 0; j < n; ++j) {
    const float* row = rows + j * ld + d0;
    const float* wj_ = w + j * wj;
    Vec x[N];
#pragma GCC unroll 2
    for (int u = 0; u < N; ++u) x[u] = load(row + u * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const Vec s = splat(wj_[r * wr]);
#pragma GCC unroll 2
      for (int u = 0; u < N; ++u) acc[r][u] += s * x[u];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int u = 0; u < N; ++u) store(out + r * out_r + d0 + u * kLanes, acc[r][u]);
}

using TileFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, int64_t, float*, int64_t);

template <int N, bool Add, int... R>
constexpr std::array<TileFn, kRows> tiles_of(std::integer_sequence<int, R...>) {
  return {tile<R + 1, N, Add>...};
}

// out (nr <= kRows rows, out_r apart; vecs vectors each) = sum_j w[r * wr + j * wj] * rows[j] over j < n, or += that
void rows_product(const float* w, int64_t wr, int64_t wj, const float* rows, int64_t ld, int64_t n, int64_t vecs,
                  float* out, int64_t out_r, int nr, bool add) {
  static constexpr auto seq = std::make_integer_sequence<int, kRows>{};
  static constexpr std::array<TileFn, kRows> pair[2] = {tiles_of<2, false>(seq), tiles_of<2, true>(seq)};
  static constexpr std::array<TileFn, kRows> single[2] = {tiles_of<1, false>(seq), tiles_of<1, true>(seq)};
  int64_t v = 0;
  for (; v + 2 <= vecs; v += 2) pair[add][nr - 1](w, wr, wj, rows, ld, n, v * kLanes, out, out_r);
  if (v < vecs) single[add][nr - 1](w, wr, wj, rows, ld, n, v * kLanes, out, out_r);
}

// (T x D, st apart) into (D x ldt), the key columns past T zero (whole vectors of keys are read)
void transpose_padded(const float* x, int64_t st, int64_t T, int64_t D, float* out, int64_t ldt) {
  simd::transpose(x, st, T, D, out, ldt);
  for (int64_t d = 0; d < D; ++d) std::fill(out + d * ldt + T, out + (d + 1) * ldt, 0.0f);
}

// a buffer row's floats for T keys: whole vectors and one more, as a stride of a power of two bytes would put the rows
// that a product reads down a column in a few cache sets (on the Zen 3 the forward at T = 1,024 went from 1.16x to
// 1.24x PyTorch's, GPT-2's 4 x 12 x 256 x 64 forward and backward from 12.1 to 11.1-11.6 ms)
int64_t buffer_row(int64_t T) { return (T + kLanes - 1) / kLanes * kLanes + kLanes; }

struct Scratch {  // a thread's buffers, kept between calls; they only grow (a forward between two backwards does
                  // not shrink P for the next backward to fill again)
  std::vector<float> kt, vt, p, ds;
  void size(int64_t ld, int64_t D, int64_t T, bool backward) {  // rows of ld floats
    at_least(kt, D * ld), at_least(p, (backward ? T : kRows) * ld);
    if (backward) at_least(vt, D * ld), at_least(ds, T * ld);
  }
  static void at_least(std::vector<float>& buffer, int64_t n) {
    if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
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
  const int64_t ld = buffer_row(T), group = H / Hkv;
  const View Q = view_of(q), K = view_of(k), V = view_of(v);
  at::Tensor out = at::empty({B, T, H, D}, q.options());  // handed back as its (B, H, T, D) view
  at::Tensor lse = at::empty({B, H, T}, q.options());
  float* o_data = out.data_ptr<float>();
  float* l_data = lse.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const Vec lanes = simd::lane_index();

  at::parallel_for(0, B * H, 1, [&](int64_t first, int64_t last) {
    thread_local Scratch w;
    w.size(ld, D, T, false);
    for (int64_t unit = first; unit < last; ++unit) {
      const int64_t b = unit / H, h = unit % H, hk = h / group;
      transpose_padded(K.row(b, hk, 0), K.st, T, D, w.kt.data(), ld);
      for (int64_t i0 = 0; i0 < T; i0 += kRows) {  // a block of queries: its scores, their softmax, P V
        const int nr = static_cast<int>(std::min<int64_t>(kRows, T - i0));
        const int64_t keys = i0 + nr, nv = (keys - 1) / kLanes + 1;  // keys up to the block's last query (causal)
        rows_product(Q.row(b, h, i0), Q.st, 1, w.kt.data(), ld, D, nv, w.p.data(), ld, nr, false);  // q K^T
        // each row's softmax over the block's keys, row by row in each pass so that one row's reduction across
        // lanes overlaps the next row's work
        float m[kRows], l[kRows];
        for (int r = 0; r < nr; ++r) {
          float* s = w.p.data() + r * ld;
          Vec mx = splat(-simd::kInf);
          for (int64_t c = 0; c < nv * kLanes; c += kLanes) {
            const Vec x = load(s + c) * sc;
            const Vec masked = simd::causal_lanes(lanes, c, i0 + r) > 0.0f ? x : splat(-simd::kInf);
            store(s + c, masked);
            mx = masked > mx ? masked : mx;
          }
          m[r] = simd::lane_max(mx);
        }
        for (int r = 0; r < nr; ++r) {
          float* s = w.p.data() + r * ld;
          Vec sum = {};
          for (int64_t c = 0; c < nv * kLanes; c += kLanes) {
            const Vec p = simd::exp_vec(load(s + c) - m[r]);  // (exp_vec of a masked -inf: 0)
            store(s + c, p);
            sum += p;
          }
          l[r] = simd::lane_sum(sum);
        }
        for (int r = 0; r < nr; ++r) l_data[(b * H + h) * T + i0 + r] = m[r] + std::log(l[r]);
        float* o = o_data + ((b * T + i0) * H + h) * D;
        rows_product(w.p.data(), ld, 1, V.row(b, hk, 0), V.st, keys, D / kLanes, o, H * D, nr, false);  // P V
        for (int r = 0; r < nr; ++r)
          for (int64_t d = 0; d < D; d += kLanes) store(o + r * H * D + d, load(o + r * H * D + d) / l[r]);
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
  const int64_t ld = buffer_row(T), group = H / Hkv;
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
    w.size(ld, D, T, true);
    for (int64_t unit = first; unit < last; ++unit) {
      const int64_t b = unit / Hkv, hk = unit % Hkv;
      const float* keys = K.row(b, hk, 0);
      transpose_padded(keys, K.st, T, D, w.kt.data(), ld);
      transpose_padded(V.row(b, hk, 0), V.st, T, D, w.vt.data(), ld);
      float* dk_rows = dk_data + (b * Hkv + hk) * T * D;
      float* dv_rows = dv_data + (b * Hkv + hk) * T * D;
      for (int64_t g = 0; g < group; ++g) {  // the kv head's query heads, one after another
        const int64_t h = hk * group + g;
        const float* lse_h = L + (b * H + h) * T;
        // blocks of query rows: P and dS (T x ld, zero past each row's keys), dQ = dS K
        for (int64_t i0 = 0; i0 < T; i0 += kRows) {
          const int nr = static_cast<int>(std::min<int64_t>(kRows, T - i0));
          const int64_t n_keys = i0 + nr, nv = (n_keys - 1) / kLanes + 1;
          float* p_rows = w.p.data() + i0 * ld;
          float* ds_rows = w.ds.data() + i0 * ld;
          rows_product(Q.row(b, h, i0), Q.st, 1, w.kt.data(), ld, D, nv, p_rows, ld, nr, false);  // q K^T
          rows_product(dO.row(b, h, i0), dO.st, 1, w.vt.data(), ld, D, nv, ds_rows, ld, nr, false);  // dO V^T
          // P, then dS = P (dP - delta) sc, each pass row by row (one row's sum across lanes overlaps the next's work)
          // with delta = rowsum(dO * O) = sum_j p_j dp_j: from the same dp, so a row whose gradient is zero (one key,
          // or equal dp) gets exactly zero
          float delta[kRows];
          for (int r = 0; r < nr; ++r) {
            float* p = p_rows + r * ld;
            const float* dp = ds_rows + r * ld;
            const float l = lse_h[i0 + r];
            Vec dots = {};
            for (int64_t c = 0; c < nv * kLanes; c += kLanes) {
              const Vec pc = simd::exp_vec(load(p + c) * sc - l) * simd::causal_lanes(lanes, c, i0 + r);
              store(p + c, pc);
              dots += pc * load(dp + c);
            }
            delta[r] = simd::lane_sum(dots);
          }
          for (int r = 0; r < nr; ++r) {
            float* p = p_rows + r * ld;
            float* ds = ds_rows + r * ld;
            for (int64_t c = 0; c < nv * kLanes; c += kLanes)
              store(ds + c, load(p + c) * (load(ds + c) - delta[r]) * sc);
            std::fill(p + nv * kLanes, p + ld, 0.0f);  // the key blocks below read down these columns
            std::fill(ds + nv * kLanes, ds + ld, 0.0f);
          }
          rows_product(ds_rows, ld, 1, keys, K.st, n_keys, D / kLanes, dq_data + ((b * H + h) * T + i0) * D, D, nr,
                       false);  // dQ = dS K
        }
        // blocks of key rows j: dK = dS^T Q, dV = P^T dO over the queries at or after j (the weights read down
        // dS's and P's columns), summed over the group's heads
        for (int64_t j0 = 0; j0 < T; j0 += kRows) {
          const int nr = static_cast<int>(std::min<int64_t>(kRows, T - j0));
          rows_product(w.ds.data() + j0 * ld + j0, 1, ld, Q.row(b, h, j0), Q.st, T - j0, D / kLanes, dk_rows + j0 * D,
                       D, nr, g > 0);
          rows_product(w.p.data() + j0 * ld + j0, 1, ld, dO.row(b, h, j0), dO.st, T - j0, D / kLanes,
                       dv_rows + j0 * D, D, nr, g > 0);
        }
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
