// Muon's Newton-Schulz iteration over a stack of small matrices in one call (`gptlab.train.muon`), on the CPU's
// bf16 dot products (the AMX build's tiles, the AVX-512 build's vdpbf16ps: bf16_products.h). Each step is
//   G = X X^T, U = b G + c G G, X = a X + U X,
// every product summed in fp32 and rounded once to bf16, as torch's bf16 matmul and baddbmm round them (the
// iteration torch.optim.Muon runs). A small model's matrices (the speedrun's 64 x 64 to 64 x 256) make products of
// a few microseconds each: through ATen that is 15 calls a step of the optimizer with their copies and casts, here
// one call, each matrix's iteration staying in its thread's cache. Matrices are zero-padded to multiples of 32
// inside (exact: zero rows and columns stay zero).
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
#include <vector>

namespace GPTLAB_NS {
namespace {

using bf16_products::gemm;
using bf16_products::Pair;
using bf16_products::pairs_across;
using bf16_products::pairs_down;
using simd::bf16_bits;
using simd::from_bf16_bits;

inline int64_t whole_blocks(int64_t n) { return (n + 31) / 32 * 32; }

// a thread's buffers for one R x C matrix (R <= C, both multiples of 32), kept between calls
struct NewtonSchulzScratch {
  std::vector<uint16_t> x, gram, update;  // X (R x C), G (R x R), U (R x R): bf16 rows
  std::vector<Pair> xt, gram_pairs, x_pairs;  // X^T as pairs along C, G and X as pairs of rows
  std::vector<float> sums;  // a product's fp32 sums (R x C at most)
  void size(int64_t R, int64_t C) {
    x.resize(R * C), gram.resize(R * R), update.resize(R * R);
    xt.resize(C / 2 * R), gram_pairs.resize(R / 2 * R), x_pairs.resize(R / 2 * C), sums.resize(R * C);
  }
};

at::Tensor newton_schulz(const at::Tensor& x, int64_t steps, double a, double b, double c) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 3 && x.is_contiguous(),
              "newton_schulz: a contiguous bf16 CPU stack (S, rows, cols)");
  const int64_t S = x.size(0), rows = x.size(1), cols = x.size(2);
  TORCH_CHECK(rows <= cols && steps >= 0, "newton_schulz: wide matrices (rows <= cols), steps >= 0");
  const int64_t R = whole_blocks(rows), C = whole_blocks(cols);
  at::Tensor out = at::empty_like(x);
  const auto* in = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto* result = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float fa = static_cast<float>(a), fb = static_cast<float>(b), fc = static_cast<float>(c);

  at::parallel_for(0, S, 1, [&](int64_t first, int64_t last) {
    thread_local NewtonSchulzScratch w;
    w.size(R, C);
#if defined(GPTLAB_AMX)
    amx_tiles::configure();
#endif
    for (int64_t s = first; s < last; ++s) {
      std::fill(w.x.begin(), w.x.end(), uint16_t{0});
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(w.x.data() + r * C, in + (s * rows + r) * cols, cols * sizeof(uint16_t));
      for (int64_t step = 0; step < steps; ++step) {
        pairs_across(w.x.data(), C, R, C, w.xt.data());
        gemm(w.x.data(), C, w.xt.data(), R, w.sums.data(), R, R, R, C, false);  // G = X X^T
        simd::narrow(w.sums.data(), reinterpret_cast<at::BFloat16*>(w.gram.data()), R * R);
        pairs_down(w.gram.data(), R, R, R, w.gram_pairs.data());
        gemm(w.gram.data(), R, w.gram_pairs.data(), R, w.sums.data(), R, R, R, R, false);  // G G
#pragma omp simd
        for (int64_t i = 0; i < R * R; ++i) w.update[i] = bf16_bits(fb * from_bf16_bits(w.gram[i]) + fc * w.sums[i]);
        pairs_down(w.x.data(), C, R, C, w.x_pairs.data());
        gemm(w.update.data(), R, w.x_pairs.data(), C, w.sums.data(), C, R, C, R, false);  // U X
#pragma omp simd
        for (int64_t i = 0; i < R * C; ++i) w.x[i] = bf16_bits(fa * from_bf16_bits(w.x[i]) + w.sums[i]);
      }
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(result + (s * rows + r) * cols, w.x.data() + r * C, cols * sizeof(uint16_t));
    }
#if defined(GPTLAB_AMX)
    _tile_release();
#endif
  });
  return out;
}

}  // namespace
}  // namespace GPTLAB_NS

GPTLAB_LIBRARY_FRAGMENT(GPTLAB_NS, m) {
  m.def("newton_schulz(Tensor x, int steps, float a, float b, float c) -> Tensor");
  m.impl("newton_schulz", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(GPTLAB_NS::newton_schulz)));
}

#endif  // GPTLAB_AVX512
