// Causal attention's backward for training in bf16 on a CPU with bf16 dot products (`gptlab.causal_attention`):
// the AVX-512 builds (AVX512-BF16's vdpbf16ps) and the AMX build (the tile unit's). PyTorch's CPU flash-attention
// backward runs its products as many small GEMM calls and takes ~14 ms a layer at GPT-2's 4 x 12 heads x 256 x 64
// on a 2-core AMX Xeon, ~10x its forward. Here each (batch, kv head) is one unit of work: its keys and values are
// packed once as bf16 pairs (the dot-product instructions' layout), then for each query head of its group and each
// block of 32 queries, over the keys up to the block's end (causal):
//   S = Q K^T, P = exp(scale S - lse) (the forward's log-sum-exp), dP = dO V^T, dS = scale P (dP - rowsum(dO * O)),
//   dV += P^T dO, dK += dS^T Q, dQ = dS K,
// with S, dP and the sums in fp32, P and dS rounded to bf16 for the products that take them (as the forward's P is
// for P V), dK and dV summed over the group's heads in fp32 and each gradient rounded once to bf16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "linear_avx2.h"

#if defined(GPTLAB_AVX512)

#include "amx_tiles.h"
#include "bf16_products.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace GPTLAB_NS {
namespace {

constexpr int64_t kQueryBlock = 32;  // queries per block; head sizes and sequence lengths are whole multiples of it

using bf16_products::gemm;
using bf16_products::Pair;
using bf16_products::pairs_across;
using bf16_products::pairs_down;
using simd::bf16_bits;

struct Bf16View {  // a (B, H, T, D) tensor's data and strides, D contiguous
  const uint16_t* data;
  int64_t sb, sh, st;
  const uint16_t* row(int64_t b, int64_t h, int64_t t) const { return data + b * sb + h * sh + t * st; }
};

Bf16View bf16_view(const at::Tensor& x) {
  return {reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0), x.stride(1), x.stride(2)};
}

// a thread's buffers, kept between calls (no page faults for fresh memory each call)
struct BackwardScratch {
  std::vector<Pair> kt, vt, kd, pp, sp;
  std::vector<float> dkt, dvt, S, dP, dq;
  std::vector<uint16_t> qt, ot, ds;
  void size(int64_t T, int64_t D) {
    kt.resize(D / 2 * T), vt.resize(D / 2 * T), kd.resize(T / 2 * D);
    pp.resize(kQueryBlock / 2 * T), sp.resize(kQueryBlock / 2 * T);
    dkt.resize(D * T), dvt.resize(D * T), S.resize(kQueryBlock * T), dP.resize(kQueryBlock * T);
    dq.resize(kQueryBlock * D);
    qt.resize(D * T), ot.resize(D * T), ds.resize(kQueryBlock * T);
  }
};

// P and scale * P * (dP - delta) of one block of queries, in place of S and dP: rows i (query r0 + i) over `keys`
// keys, zero past the query (causal)
void softmax_grads(float* S, float* dP, int64_t keys, int64_t r0, const float* lse, int64_t lse_stride,
                   const float* delta, float scale) {
  using simd::Vec;
  const Vec lanes = simd::lane_index();
  for (int64_t i = 0; i < kQueryBlock; ++i) {
    const float l = lse[(r0 + i) * lse_stride];
    float* srow = S + i * keys;
    float* grow = dP + i * keys;
    for (int64_t c = 0; c < keys; c += simd::kLanes) {  // keys is a multiple of 32
      const Vec p = simd::exp_vec(simd::load(srow + c) * scale - l) * simd::causal_lanes(lanes, c, r0 + i);
      simd::store(srow + c, p);
      simd::store(grow + c, p * (simd::load(grow + c) - delta[i]) * scale);
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, double scale) {
  for (const at::Tensor* t : {&grad_out, &q, &k, &v, &out})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->dim() == 4 && t->stride(3) == 1,
                "causal_attention_backward: bf16 CPU tensors (B, H, T, D) with D contiguous");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(2) == T && k.size(3) == D && Hkv > 0 &&
                  H % Hkv == 0 && grad_out.sizes() == q.sizes() && out.sizes() == q.sizes(),
              "causal_attention_backward: queries (B, H, T, D), keys and values (B, Hkv, T, D) with Hkv dividing H");
  TORCH_CHECK(T % kQueryBlock == 0 && D % kQueryBlock == 0,
              "causal_attention_backward: T and D must be multiples of 32");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.sizes() == at::IntArrayRef({B, H, T}),
              "causal_attention_backward: lse (B, H, T) fp32");
  const Bf16View Q = bf16_view(q), K = bf16_view(k), V = bf16_view(v), O = bf16_view(out), dO = bf16_view(grad_out);
  const float* L = lse.data_ptr<float>();
  at::Tensor dq = at::empty({B, H, T, D}, q.options()), dk = at::empty({B, Hkv, T, D}, q.options());
  at::Tensor dv = at::empty({B, Hkv, T, D}, q.options());
  auto* dq_out = reinterpret_cast<uint16_t*>(dq.data_ptr<at::BFloat16>());
  auto* dk_out = reinterpret_cast<uint16_t*>(dk.data_ptr<at::BFloat16>());
  auto* dv_out = reinterpret_cast<uint16_t*>(dv.data_ptr<at::BFloat16>());
  const float s = static_cast<float>(scale);
  const int64_t group = H / Hkv;

  at::parallel_for(0, B * Hkv, 1, [&](int64_t first, int64_t last) {
    thread_local BackwardScratch w;
    w.size(T, D);
    float delta[kQueryBlock];
#if defined(GPTLAB_AMX)
    amx_tiles::configure();
#endif
    for (int64_t unit = first; unit < last; ++unit) {
      const int64_t b = unit / Hkv, hk = unit % Hkv;
      pairs_across(K.row(b, hk, 0), K.st, T, D, w.kt.data());
      pairs_across(V.row(b, hk, 0), V.st, T, D, w.vt.data());
      pairs_down(K.row(b, hk, 0), K.st, T, D, w.kd.data());
      std::fill(w.dkt.begin(), w.dkt.end(), 0.0f);  // dK^T and dV^T (D x T): the products' natural layout here
      std::fill(w.dvt.begin(), w.dvt.end(), 0.0f);
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        simd::transpose(Q.row(b, h, 0), Q.st, T, D, w.qt.data(), T);  // Q^T, dO^T: the A operands of dK^T, dV^T
        simd::transpose(dO.row(b, h, 0), dO.st, T, D, w.ot.data(), T);
        const float* lse_h = L + b * lse.stride(0) + h * lse.stride(1);
        for (int64_t r0 = 0; r0 < T; r0 += kQueryBlock) {
          const int64_t keys = r0 + kQueryBlock;  // causal: the block's queries see keys [0, r0 + 32)
          for (int64_t i = 0; i < kQueryBlock; ++i) {
            const uint16_t* g = dO.row(b, h, r0 + i);
            const uint16_t* o = O.row(b, h, r0 + i);
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < D; ++j) sum += simd::from_bf16_bits(g[j]) * simd::from_bf16_bits(o[j]);
            delta[i] = sum;
          }
          gemm(Q.row(b, h, r0), Q.st, w.kt.data(), T, w.S.data(), keys, kQueryBlock, keys, D, false);     // Q K^T
          gemm(dO.row(b, h, r0), dO.st, w.vt.data(), T, w.dP.data(), keys, kQueryBlock, keys, D, false);  // dO V^T
          softmax_grads(w.S.data(), w.dP.data(), keys, r0, lse_h, lse.stride(2), delta, s);               // P, dS
          pairs_down(w.S.data(), keys, kQueryBlock, keys, w.pp.data());
          pairs_down(w.dP.data(), keys, kQueryBlock, keys, w.sp.data());
          gemm(w.ot.data() + r0, T, w.pp.data(), keys, w.dvt.data(), T, D, keys, kQueryBlock, true);  // dV^T += dO^T P
          gemm(w.qt.data() + r0, T, w.sp.data(), keys, w.dkt.data(), T, D, keys, kQueryBlock, true);  // dK^T += Q^T dS
          for (int64_t i = 0; i < kQueryBlock; ++i)
            simd::narrow(w.dP.data() + i * keys, reinterpret_cast<at::BFloat16*>(w.ds.data()) + i * keys, keys);
          gemm(w.ds.data(), keys, w.kd.data(), D, w.dq.data(), D, kQueryBlock, D, keys, false);  // dQ = dS K
          simd::narrow(w.dq.data(), reinterpret_cast<at::BFloat16*>(dq_out) + ((b * H + h) * T + r0) * D,
                       kQueryBlock * D);
        }
      }
      uint16_t* dk_rows = dk_out + (b * Hkv + hk) * T * D;
      uint16_t* dv_rows = dv_out + (b * Hkv + hk) * T * D;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < D; ++j) {
          dk_rows[t * D + j] = bf16_bits(w.dkt[j * T + t]);
          dv_rows[t * D + j] = bf16_bits(w.dvt[j * T + t]);
        }
    }
#if defined(GPTLAB_AMX)
    _tile_release();
#endif
  });
  return {dq, dk, dv};
}

}  // namespace
}  // namespace GPTLAB_NS

GPTLAB_LIBRARY_FRAGMENT(GPTLAB_NS, m) {
  m.def("causal_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "float scale) -> (Tensor, Tensor, Tensor)");
  m.impl("causal_attention_backward",
         torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(GPTLAB_NS::causal_attention_backward)));
}

#endif  // GPTLAB_AVX512
