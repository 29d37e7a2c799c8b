// Small-batch Linear products for CPUs with AVX2 + FMA but no native bf16 matmul (AMD Zen 2/3, pre-Sapphire-Rapids
// Xeons), where torch's own bf16 matmul is several times slower than fp32 and oneDNN refuses to prepack bf16; and
// for int8/int4 weights (gptlab/quantize.py) there, where PyTorch's weight-only kernels are slower than bf16.
//
// Decoding multiplies a few activation rows (M = the batch) by every weight matrix once per token, so the work is
// reading the weights: the kernel must stream them at memory speed and do its arithmetic in fp32 on the way.
//
// Built up to four times (gptlab/kernels/__init__.py): for AVX2 + FMA (torch.ops.gptlab_avx2), AVX2 + AVX-VNNI
// (torch.ops.gptlab_avxvnni), AVX-512 with VNNI and BF16 (torch.ops.gptlab_avx512: see linear_avx2.h) and AVX-512 +
// AMX (torch.ops.gptlab_amx: products of many rows on the tile unit, amx_tiles.h); one packing layout, so a weight
// packed by any of them runs on all.
//
// * `pack(W)` (packing.cpp, as the two below): W (N, K), bf16 or fp32, re-laid out once per model as panels of 16
//   output rows: (ceil(N/16), K, 16), zero-padded. fp32: one panel's column k is 16 consecutive values; bf16:
//   column pairs, each output's (W[n][k], W[n][k + 1]) in one 32-bit lane (the int8 layout; see dense_tiles.h).
// * `pack_int8(q)`: int8 q (N, K) (gptlab.quantize's per-row w = q * scale) in the same panels as column pairs (see
//   int_tiles.h). Each row of x is put in 16-bit fixed point (xq * s, |xq| <= 32767: rounding error up to 2^-16 of
//   the row's largest value, no more than bf16's 2^-9 for values above 1/128 of it) and multiplied with integer
//   multiply-adds, summed exactly in int32, scaled in fp32.
// * `pack_int4(q, scale, zero)`: q (N, K) in 0..15 with per-group scale and zero (gptlab.quantize's asymmetric
//   w = (q - 8) * scale + zero, groups of a multiple of 32 inputs) as nibble quads (see int4_tiles.h), with `qparams`
//   (panels, K / group, 2, 16) fp16: per group and output row the scale s and the offset m = zero - 8 s (exact for
//   gptlab.quantize's, fp16 values). Each row of x is rounded to int8 per block of 32 inputs (llama.cpp's q8_0:
//   error up to 1/254 of the block's largest value) and multiplied by byte dot products, exact in int32 per block.
// * `linear(x, packed, qparams, bias, N)` (declared in linear_avx2.h, with `linear_part` for decode_step.cpp's
//   step): y = x @ W.T + bias for x (M, K) in bf16 or fp32, out in x's dtype. A micro-kernel (dense_tiles.h,
//   int_tiles.h, int4_tiles.h) takes up to 6 rows of x (int8 on AVX2: 3; int4: 8 on AVX-512, 4 on AVX2: as many
//   as keep its accumulators in registers) and one panel, whose weights it unpacks once for all of them;
//   AVX-512's bf16-by-bf16 one takes 8 rows and two panels, so each x
//   broadcast serves two dot products, and prefetches the next two panels. Threads (torch's pool,
//   at::parallel_for, or the step's team) split the panels; rows go in blocks of 96 so a block of x stays in L2.
//   The result is rounded once: for bf16 the numbers of a native bf16 matmul (fp32 accumulation), for int8 those
//   of the dequantized weight times x in 16-bit fixed point, for int4 times x in int8 blocks.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "amx_tiles.h"
#include "dense_tiles.h"
#include "input_quant.h"
#include "int4_tiles.h"
#include "int_tiles.h"
#include "linear_avx2.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using GPTLAB_NS::kPanel;
using GPTLAB_NS::kTile;
using GPTLAB_NS::dense_tiles::tile;
using GPTLAB_NS::dense_tiles::tile1;
using GPTLAB_NS::int_tiles::tile_i8;
using GPTLAB_NS::input_quant::quantize_blocks;
using GPTLAB_NS::input_quant::quantize_rows;
constexpr int64_t kRowBlock = 96;

constexpr int kOutRows = 16;  // a micro-kernel's output rows at most: 8 rows of x by 2 panels (tile2)

// A weight in panels, its input, and how to run one micro-kernel for rows m.. of the input on `span` panels from
// p: `Dense<W>` for bf16/fp32 columns, `Int8` for column pairs against 16-bit x, `Int4` for nibble quads against
// 8-bit x blocks. `span(left)`: how many panels the next call takes when `left` remain (1 or 2), `rows()`: rows
// of x per call; the output of row r and panel j of a call is out[span * r + j].
template <int Rows>
struct OnePanel {  // kernels that take one panel per call
  static constexpr int kRows = Rows;
  int span(int64_t) const { return 1; }
  int rows() const { return kRows; }
};

template <typename W>
struct Dense {
  static constexpr int kRows = kTile;
  static constexpr bool kTiles = std::is_same_v<W, at::BFloat16>;  // bf16 panels are the AMX tiles' layout
  const W* data;
  int64_t K;
  const float* x;             // (M, K)
  const at::BFloat16* xb;     // x as it came in bf16 (M, K), or null
  int64_t M;
#if defined(GPTLAB_AMX)
  // the tiles' product for `tiles`, x in bf16 (bf16 panels only: kTiles)
  template <typename Store>
  void run_tiles(const void* tiles, int64_t M, int64_t p0, int64_t p1, const Store& store) const {
    const auto panel = [this](int64_t p, at::BFloat16*) { return data + p * K * kPanel; };
    GPTLAB_NS::amx_tiles::run(static_cast<const at::BFloat16*>(tiles), M, K, p0, p1, panel, store);
  }
#endif
  // two panels per call where AVX-512 BF16 dot products run (bf16 x against bf16 weights) on more than one row;
  // one row keeps tile1's four chains over one panel, which stream a matrix-vector product faster
  bool paired() const {
#if defined(GPTLAB_AVX512)
    return std::is_same_v<W, at::BFloat16> && xb != nullptr && M > 1;
#else
    return false;
#endif
  }
  int span(int64_t left) const { return paired() && left >= 2 ? 2 : 1; }
  int rows() const { return paired() ? 8 : kRows; }
  void run(int rows, int64_t m, int64_t p, int span, float out[][kPanel]) const {
    const W* panel = data + p * K * kPanel;
    const float* xm = x + m * K;
    const at::BFloat16* xbm = xb ? xb + m * K : nullptr;
#if defined(GPTLAB_AVX512)
    if constexpr (std::is_same_v<W, at::BFloat16>) {
      // the first call on these panels in a block of rows prefetches the next two. A thread's odd last panel goes
      // through tile2 too (paired with itself, the copy's sums dropped): every panel's sums run in one order, so
      // the bits do not depend on how the threads split the panels
      if (span == 2)
        return run2(rows, xbm, panel, panel + K * kPanel, m % kRowBlock == 0 ? panel + 2 * K * kPanel : nullptr, out);
      if (paired()) {
        float both[kOutRows][kPanel];
        run2(rows, xbm, panel, panel, nullptr, both);
        for (int r = 0; r < rows; ++r) std::memcpy(out[r], both[2 * r], sizeof out[r]);
        return;
      }
    }
#endif
    switch (rows) {
      case 1: return tile1(xm, xbm, panel, K, out);
      case 2: return tile<2>(xm, K, xbm, panel, K, out);
      case 3: return tile<3>(xm, K, xbm, panel, K, out);
      case 4: return tile<4>(xm, K, xbm, panel, K, out);
      case 5: return tile<5>(xm, K, xbm, panel, K, out);
      default: return tile<6>(xm, K, xbm, panel, K, out);
    }
  }
#if defined(GPTLAB_AVX512)
  void run2(int rows, const at::BFloat16* xbm, const W* panel, const W* next, const W* ahead,
            float out[][kPanel]) const {
    using GPTLAB_NS::dense_tiles::tile2;
    switch (rows) {
      case 1: return tile2<1>(xbm, K, panel, next, K, ahead, out);
      case 2: return tile2<2>(xbm, K, panel, next, K, ahead, out);
      case 3: return tile2<3>(xbm, K, panel, next, K, ahead, out);
      case 4: return tile2<4>(xbm, K, panel, next, K, ahead, out);
      case 5: return tile2<5>(xbm, K, panel, next, K, ahead, out);
      case 6: return tile2<6>(xbm, K, panel, next, K, ahead, out);
      case 7: return tile2<7>(xbm, K, panel, next, K, ahead, out);
      default: return tile2<8>(xbm, K, panel, next, K, ahead, out);
    }
  }
#endif
};

struct Int8 : OnePanel<GPTLAB_NS::int_tiles::kRows> {
  static constexpr bool kTiles = true;
  const int8_t* data;
  int64_t K;
  const int16_t* xq;    // (M, K)
  const float* xscale;  // (M,)
#if defined(GPTLAB_AMX)
  // the tiles' byte products for `tiles`, x as an amx_tiles::Int8Input: `run`'s numbers, the integer sums kept
  // exact to the end (`run` rounds them to fp32 once per 512 inputs: the same bits up to 512)
  template <typename Store>
  void run_tiles(const void* tiles, int64_t M, int64_t p0, int64_t p1, const Store& store) const {
    GPTLAB_NS::amx_tiles::run_int8(*static_cast<const GPTLAB_NS::amx_tiles::Int8Input*>(tiles), M, K, data, p0, p1,
                                   store);
  }
#endif
  void run(int rows, int64_t m, int64_t p, int, float out[][kPanel]) const {
    const int8_t* panel = data + p * K * kPanel;
    const int16_t* xm = xq + m * K;
    switch (rows) {
      case 1: return tile_i8<1>(xm, K, xscale + m, panel, K / 2, out);
      case 2: return tile_i8<2>(xm, K, xscale + m, panel, K / 2, out);
#if defined(GPTLAB_AVX512)
      case 3: return tile_i8<3>(xm, K, xscale + m, panel, K / 2, out);
      case 4: return tile_i8<4>(xm, K, xscale + m, panel, K / 2, out);
      case 5: return tile_i8<5>(xm, K, xscale + m, panel, K / 2, out);
      default: return tile_i8<6>(xm, K, xscale + m, panel, K / 2, out);
#else
      default: return tile_i8<3>(xm, K, xscale + m, panel, K / 2, out);
#endif
    }
  }
};

struct Int4 : OnePanel<GPTLAB_NS::int4_tiles::kRows> {
  const uint8_t* data;
  const at::Half* qparams;  // (panels, G, 2, 16)
  int64_t K, G;
  const int8_t* xq;   // (M, K)
  const float* d;     // (M, K / 32): each block's scale
  const float* msum;  // (M, G): per group, the sum over its blocks of d * (sum of xq)
  static constexpr bool kTiles = true;
#if defined(GPTLAB_AMX)
  // the tiles' product for `tiles`, x in bf16, each panel widened to bf16
  template <typename Store>
  void run_tiles(const void* tiles, int64_t M, int64_t p0, int64_t p1, const Store& store) const {
    const auto panel = [this](int64_t p, at::BFloat16* scratch) {
      GPTLAB_NS::amx_tiles::widen_int4(data + p * (K / 2) * kPanel, qparams + p * G * 2 * kPanel, K, G, scratch);
      return static_cast<const at::BFloat16*>(scratch);
    };
    GPTLAB_NS::amx_tiles::run(static_cast<const at::BFloat16*>(tiles), M, K, p0, p1, panel, store);
  }
#endif
  void run(int rows, int64_t m, int64_t p, int, float out[][kPanel]) const {
    using GPTLAB_NS::int4_tiles::tile;
    const uint8_t* panel = data + p * (K / 2) * kPanel;
    const at::Half* qp = qparams + p * G * 2 * kPanel;
    const int64_t B = K / GPTLAB_NS::int4_tiles::kBlock, gs = K / G;
    const int8_t* xm = xq + m * K;
    const float *dm = d + m * B, *sm = msum + m * G;
    switch (rows) {
      case 1: return tile<1>(xm, K, dm, B, sm, G, panel, qp, K, gs, out);
      case 2: return tile<2>(xm, K, dm, B, sm, G, panel, qp, K, gs, out);
      case 3: return tile<3>(xm, K, dm, B, sm, G, panel, qp, K, gs, out);
#if defined(GPTLAB_AVX512)
      case 4: return tile<4>(xm, K, dm, B, sm, G, panel, qp, K, gs, out);
      case 5: return tile<5>(xm, K, dm, B, sm, G, panel, qp, K, gs, out);
      case 6: return tile<6>(xm, K, dm, B, sm, G, panel, qp, K, gs, out);
      case 7: return tile<7>(xm, K, dm, B, sm, G, panel, qp, K, gs, out);
      default: return tile<8>(xm, K, dm, B, sm, G, panel, qp, K, gs, out);
#else
      default: return tile<GPTLAB_NS::int4_tiles::kRows>(xm, K, dm, B, sm, G, panel, qp, K, gs, out);
#endif
    }
  }
};

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

// y (M, N) = x (M, K) @ W.T, times the per-row scales `row_scale` (int8; null otherwise), plus bias. `part`: this
// thread's share of the panels when the caller runs its own threads (the decode step's), else all of them over
// torch's pool. `tiles`: x for the AMX build's tile unit where it runs the product (the weight's run_tiles says
// in what form), else null
template <typename Weight, typename O, typename B>
void linear_impl(int64_t M, int64_t K, const Weight& w, const float* row_scale, const B* bias, int64_t N, O* y,
                 GPTLAB_NS::Part part, const void* tiles) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  static_assert(Weight::kRows <= kOutRows, "a micro-kernel's output must fit `out`");
  // rows m.. of y at panels p.., from `rows` rows of sums `out` (row r's panel j at out + r * ld + 16 j)
  auto store = [&](int64_t m, int64_t p, int64_t rows, int64_t span, const float* out, int64_t ld) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < span; ++j) {
        const int64_t n0 = (p + j) * kPanel, cols = std::min(kPanel, N - n0);
        const float* src = out + r * ld + j * kPanel;
        O* dst = y + (m + r) * N + n0;
        for (int64_t c = 0; c < cols; ++c)
          dst[c] = static_cast<O>(src[c] * (row_scale ? row_scale[n0 + c] : 1.0f) +
                                  (bias ? to_float(bias[n0 + c]) : 0.0f));
      }
  };
  auto run = [&](int64_t p0, int64_t p1) {
#if defined(GPTLAB_AMX)
    if constexpr (Weight::kTiles) {
      if (tiles) {  // the tiles' sums come two panels wide whatever the span: rows 2 * 16 values apart
        return w.run_tiles(tiles, M, p0, p1, [&](int64_t m, int64_t p, int64_t rows, int span, const float* c) {
          store(m, p, rows, span, c, 2 * kPanel);
        });
      }
    }
#endif
    float out[kOutRows][kPanel];
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const int64_t m1 = std::min(M, m0 + kRowBlock);
      for (int64_t p = p0, span; p < p1; p += span) {
        span = w.span(p1 - p);
        const int per_call = w.rows();
        for (int64_t m = m0; m < m1; m += per_call) {
          const int rows = static_cast<int>(std::min<int64_t>(per_call, m1 - m));
          w.run(rows, m, p, static_cast<int>(span), out);
          store(m, p, rows, span, out[0], span * kPanel);
        }
      }
    }
  };
  if (part.of > 0) return run(part.begin(panels), part.end(panels));
  // grain: enough panels per task that a thread reads at least ~64 KB of weights per hand-off
  at::parallel_for(0, panels, std::max<int64_t>(1, 2048 / std::max<int64_t>(K, 1)), run);
}

// the output and bias dtypes (each bf16 or fp32) picked at run time
template <typename Weight>
void dispatch(int64_t M, int64_t K, const Weight& w, const float* row_scale, const at::Tensor& bias, int64_t N,
              void* y, bool bf16_out, GPTLAB_NS::Part part, const void* tiles = nullptr) {
  auto* yb = static_cast<at::BFloat16*>(y);
  auto* yf = static_cast<float*>(y);
  if (!bias.defined()) {
    const float* none = nullptr;
    if (bf16_out) linear_impl(M, K, w, row_scale, none, N, yb, part, tiles);
    else linear_impl(M, K, w, row_scale, none, N, yf, part, tiles);
  } else if (bias.scalar_type() == at::kBFloat16) {
    const auto* b = bias.data_ptr<at::BFloat16>();
    if (bf16_out) linear_impl(M, K, w, row_scale, b, N, yb, part, tiles);
    else linear_impl(M, K, w, row_scale, b, N, yf, part, tiles);
  } else {
    const auto* b = bias.data_ptr<float>();
    if (bf16_out) linear_impl(M, K, w, row_scale, b, N, yb, part, tiles);
    else linear_impl(M, K, w, row_scale, b, N, yf, part, tiles);
  }
}

// the packed weight, its qparams and bias checked against x's width K and the output width N: the bias (undefined
// where absent) for `product`
at::Tensor checked(const at::Tensor& packed, const c10::optional<at::Tensor>& qparams,
                   const c10::optional<at::Tensor>& bias, int64_t K, int64_t N) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(), "linear: not a packed weight");
  const bool int4 = packed.scalar_type() == at::kByte, int8 = packed.scalar_type() == at::kChar;
  const int64_t panels = packed.size(0);
  TORCH_CHECK((int4 ? 2 * packed.size(1) : packed.size(1)) == K, "linear: input has ", K, " features, the weight ",
              int4 ? 2 * packed.size(1) : packed.size(1));
  TORCH_CHECK(panels * kPanel >= N && N > (panels - 1) * kPanel, "linear: N does not fit the panels");
  const bool has_qparams = qparams.has_value() && qparams->defined();
  TORCH_CHECK(has_qparams == (int4 || int8), "linear: int8 and int4 weights take qparams, others none");
  if (int8)
    TORCH_CHECK(qparams->scalar_type() == at::kFloat && qparams->is_contiguous() && qparams->numel() >= N,
                "linear: int8 qparams are the fp32 row scales");
  if (int4)
    TORCH_CHECK(qparams->scalar_type() == at::kHalf && qparams->is_contiguous() && qparams->dim() == 4 &&
                qparams->size(0) == panels && qparams->size(1) > 0 && K % qparams->size(1) == 0 &&
                (K / qparams->size(1)) % GPTLAB_NS::int4_tiles::kBlock == 0 && qparams->size(2) == 2 &&
                qparams->size(3) == kPanel,
                "linear: int4 qparams must be (panels, groups, 2, 16) fp16, groups of a multiple of 32 inputs");
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->numel() == N && bias->is_contiguous(), "linear: bias must be contiguous with ", N, " values");
  TORCH_CHECK(bias->scalar_type() == at::kBFloat16 || bias->scalar_type() == at::kFloat, "linear: bias dtype");
  return *bias;
}

// y (M, N) = x (M, K) @ W.T + bias over a checked weight: x in fp32 (xb: the same values in bf16, or null), y in
// bf16 or fp32
void product(const float* xp, const at::BFloat16* xb, int64_t M, int64_t K, const at::Tensor& packed,
             const c10::optional<at::Tensor>& qparams, const at::Tensor& b, int64_t N, void* y, bool bf16_out,
             GPTLAB_NS::Part part = {}) {
  const bool int4 = packed.scalar_type() == at::kByte, int8 = packed.scalar_type() == at::kChar;
  // the AMX build: x for the tile unit. int8 weights: x in 16-bit fixed point as for the other kernels, split into
  // bytes (amx_tiles::Int8Input). bf16 and int4 weights: x in bf16 in whole tiles of 16 rows (bf16 x of whole
  // tiles as it is, else a zero-padded copy); int4 takes fp32 x rounded to bf16 (its other kernels round it as
  // coarsely: to 8-bit blocks), bf16 weights only x that came in bf16 (fp32 x keeps its fp32 products)
  std::vector<at::BFloat16> padded;
  const at::BFloat16* xt = nullptr;
  [[maybe_unused]] bool tiled = false;
#if defined(GPTLAB_AMX)
  tiled = (xb || int8 || int4) && GPTLAB_NS::amx_tiles::applies(M, K, packed.scalar_type());
  if (tiled && !int8) {
    if (xb && M % 16 == 0) {
      xt = xb;
    } else {
      padded.assign((M + 15) / 16 * 16 * K, at::BFloat16(0.0f));
      for (int64_t i = 0; i < M * K; ++i) padded[i] = xb ? xb[i] : static_cast<at::BFloat16>(xp[i]);
      xt = padded.data();
    }
  }
#endif
  if (int8) {
    std::vector<int16_t> xq(M * K);
    std::vector<float> xscale(M);
    quantize_rows(xp, M, K, xq.data(), xscale.data());
    const Int8 w{{}, packed.data_ptr<int8_t>(), K, xq.data(), xscale.data()};
#if defined(GPTLAB_AMX)
    if (tiled) {
      const GPTLAB_NS::amx_tiles::Int8Input bytes(xq.data(), xscale.data(), M, K);
      return dispatch(M, K, w, qparams->data_ptr<float>(), b, N, y, bf16_out, part, &bytes);
    }
#endif
    dispatch(M, K, w, qparams->data_ptr<float>(), b, N, y, bf16_out, part);
  } else if (int4) {
    const int64_t G = qparams->size(1);
    std::vector<int8_t> xq(xt ? 0 : M * K);
    std::vector<float> d(xt ? 0 : M * K / GPTLAB_NS::int4_tiles::kBlock), msum(xt ? 0 : M * G);
    if (!xt) quantize_blocks(xp, M, K, K / G, xq.data(), d.data(), msum.data());
    dispatch(M, K, Int4{{}, packed.data_ptr<uint8_t>(), qparams->data_ptr<at::Half>(), K, G, xq.data(), d.data(),
                        msum.data()}, nullptr, b, N, y, bf16_out, part, xt);
  } else if (packed.scalar_type() == at::kBFloat16) {
    dispatch(M, K, Dense<at::BFloat16>{packed.data_ptr<at::BFloat16>(), K, xp, xb, M}, nullptr, b, N, y, bf16_out,
             part, xt);
  } else {
    dispatch(M, K, Dense<float>{packed.data_ptr<float>(), K, xp, nullptr, M}, nullptr, b, N, y, bf16_out, part);
  }
}

}  // namespace

namespace GPTLAB_NS {

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& qparams,
                  const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "linear: bf16 or fp32 input only");
  const int64_t K = x.size(-1);
  const at::Tensor b = checked(packed, qparams, bias, K, N);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  const auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  // the input in fp32, converted once here (a few rows: no tensor, no dispatcher round trip)
  std::vector<float> xbuf;
  const float* xp;
  if (x2.scalar_type() == at::kFloat) {
    xp = x2.data_ptr<float>();
  } else {
    xbuf.resize(M * K);
    const auto* src = x2.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < M * K; ++i) xbuf[i] = static_cast<float>(src[i]);
    xp = xbuf.data();
  }
  auto y = at::empty({M, N}, x.options());
  const auto* xb = x2.scalar_type() == at::kBFloat16 ? x2.data_ptr<at::BFloat16>() : nullptr;
  product(xp, xb, M, K, packed, qparams, b, N, y.data_ptr(), y.scalar_type() == at::kBFloat16);
  return y.view(sizes);
}

void check_linear(const at::Tensor& packed, const c10::optional<at::Tensor>& qparams,
                  const c10::optional<at::Tensor>& bias, int64_t K, int64_t N) {
  checked(packed, qparams, bias, K, N);
}

void linear_part(const float* x, const at::BFloat16* xb, int64_t M, int64_t K, const at::Tensor& packed,
                 const c10::optional<at::Tensor>& qparams, const c10::optional<at::Tensor>& bias, int64_t N,
                 float* y, Part part) {
  const at::Tensor b = bias.has_value() && bias->defined() ? *bias : at::Tensor();
  product(x, xb, M, K, packed, qparams, b, N, y, false, part);
}

}  // namespace GPTLAB_NS

GPTLAB_LIBRARY(GPTLAB_NS, m) {
  // linear runs inside models' forwards: a CPU kernel (not a catch-all one) lets Python give it a shape function,
  // so torch.compile can trace a model through it (gptlab/kernels/__init__.py)
  m.def("linear(Tensor x, Tensor packed, Tensor? qparams, Tensor? bias, int N) -> Tensor");
  m.impl("linear", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(GPTLAB_NS::linear)));
}
