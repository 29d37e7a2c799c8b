// The AMX build's products of many rows (Sapphire Rapids and later Xeons): the tile unit's bf16 dot products
// (TDPBF16PS: a 16 x 16 block of fp32 sums from 16 rows of x by 32 inputs by 16 outputs per instruction) over the
// packed panels, where the AVX-512 kernels' dot products would be the limit (a batch of decoding rows, a prefill).
//
// The bf16 panels are already the tile unit's B layout: a panel's 32 inputs k0.. are 16 column pairs of 16 outputs,
// 64 bytes each (pack's (K / 2, 16, 2)). int8 and int4 panels are first widened to that layout in bf16, one panel
// at a time into the thread's scratch: an int8 weight exactly (|q| <= 127 fits bf16's 8 significant bits), an int4
// weight as q * s + m rounded once to bf16. x goes in bf16 (an fp32 x rounded once, for integer weights only), so a
// product is the dequantized weight times x summed in fp32: the numbers of PyTorch's weight-only kernels on bf16
// input, not those of the int8 and int4 kernels' fixed-point x (linear_avx2.cpp). Fewer rows than `min_rows` keep
// those kernels: there the work is streaming the weights, which the AVX-512 loops do at memory speed.
#pragma once

#include "linear_avx2.h"  // which build this is (GPTLAB_AMX)

#if defined(GPTLAB_AMX)

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace GPTLAB_NS::amx_tiles {

constexpr int64_t kRows = 32;   // rows of x a call: two A tiles of 16
constexpr int64_t kDepth = 32;  // inputs a tile step takes: 16 pairs, a 64-byte tile row

// the fewest rows whose product the tiles run faster than the AVX-512 kernels, by the packed weight's dtype (bf16,
// int8 = kChar, int4 = kByte): widening a panel costs the same for any number of rows, so the integer weights need
// more rows to repay it (measured on a 2-core Xeon with AMX at GPT-2's 3072 x 768 and 768 x 3072: int8 crosses at
// 11-12 rows, int4 at 21-22; bf16 is 2.2x faster at 8); 0: never (fp32)
inline int64_t min_rows(at::ScalarType packed) {
  switch (packed) {
    case at::kBFloat16: return 8;
    case at::kChar: return 12;
    case at::kByte: return 24;
    default: return 0;
  }
}

// whether the tile unit takes a product of M rows with K inputs (K a whole number of tile steps)
inline bool applies(int64_t M, int64_t K, at::ScalarType packed) {
  return min_rows(packed) > 0 && M >= min_rows(packed) && K % kDepth == 0;
}

// palette 1, eight tiles of 16 rows x 64 bytes: C 0-3 (16 x 16 fp32 sums: rows 0-15 / 16-31 by panel 0 / 1),
// A 4-5 (16 rows of x by 32 bf16 inputs), B 6-7 (16 input pairs by 16 outputs of panel 0 / 1)
struct alignas(64) Config {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

inline constexpr Config kConfig = [] {
  Config c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  return c;
}();

// loaded by every thread before its tiles run: the state is per thread, and another library's tiles (oneDNN's)
// may have loaded their own shapes since. A constant, not a local: GCC drops a local's stores before the load
// (the instruction's memory read is invisible to it), and unconfigured tiles fault as illegal instructions
inline void configure() { _tile_loadconfig(&kConfig); }

// c (16 or 32 rows, 32 fp32 apart) = x rows (ldx apart, 16 or 32 of them: Two) times panels b0 and b1 (each K / 2
// pairs of 16 outputs in bf16): columns 0-15 from b0, 16-31 from b1
template <bool Two>
inline void tile(const at::BFloat16* x, int64_t ldx, const at::BFloat16* b0, const at::BFloat16* b1, int64_t K,
                 float* c) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (Two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += kDepth) {
    _tile_loadd(4, x + k, ldx * 2);
    _tile_loadd(6, b0 + k * kPanel, 64);  // pair k / 2 of a panel starts k * 16 values in
    _tile_loadd(7, b1 + k * kPanel, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (Two) {
      _tile_loadd(5, x + 16 * ldx + k, ldx * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 2 * kPanel * 4);
  _tile_stored(1, c + kPanel, 2 * kPanel * 4);
  if constexpr (Two) {
    _tile_stored(2, c + 16 * 2 * kPanel, 2 * kPanel * 4);
    _tile_stored(3, c + 16 * 2 * kPanel + kPanel, 2 * kPanel * 4);
  }
}

inline void store_bf16(at::BFloat16* out, __m512 lo, __m512 hi) {
  _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));  // lo's 16 values first
}

// an int8 panel (K / 2 pairs of 16 outputs, pack_int8's) in bf16, value for value
inline void widen_int8(const int8_t* q, int64_t K, at::BFloat16* out) {
  for (int64_t i = 0; i < K * kPanel; i += 32) {
    const auto* at = reinterpret_cast<const __m128i*>(q + i);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(at)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(at + 1)));
    store_bf16(out + i, lo, hi);
  }
}

// 32 nibble values (16 outputs' pairs, as bytes) times the pairs' scales plus offsets, rounded to bf16
inline void widen_pairs(__m256i q, __m512 s0, __m512 m0, __m512 s1, __m512 m1, at::BFloat16* out) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1)));
  store_bf16(out, _mm512_fmadd_ps(lo, s0, m0), _mm512_fmadd_ps(hi, s1, m1));
}

// an int4 panel (pack_int4's nibble quads, K / 2 bytes of 16 outputs; qparams (G, 2, 16) fp16: per group each
// output's scale s and offset m) as bf16 pairs: w = q * s + m
inline void widen_int4(const uint8_t* q, const at::Half* qp, int64_t K, int64_t G, at::BFloat16* out) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  // 16-bit word 2r of 8 inputs' 64 bytes holds output r's first pair, word 2r + 1 its second: evens, then odds
  const __m512i split = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1,
                                         30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  // each of 16 outputs' scale twice (a pair's two inputs): outputs 0-7, then 8-15
  const __m512i twice0 = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i twice1 = _mm512_add_epi32(twice0, _mm512_set1_epi32(8));
  const int64_t gs = K / G;
  for (int64_t g = 0; g < G; ++g) {
    const auto* p = reinterpret_cast<const __m256i*>(qp + g * 2 * kPanel);
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(p)), m = _mm512_cvtph_ps(_mm256_loadu_si256(p + 1));
    const __m512 s0 = _mm512_permutexvar_ps(twice0, s), s1 = _mm512_permutexvar_ps(twice1, s);
    const __m512 m0 = _mm512_permutexvar_ps(twice0, m), m1 = _mm512_permutexvar_ps(twice1, m);
    for (int64_t k0 = g * gs; k0 < (g + 1) * gs; k0 += 8) {
      // byte 4r + j: output r's input k0 + j (low nibble) and k0 + 4 + j (high)
      const __m512i v = _mm512_loadu_si512(q + k0 * 8);
      const __m512i low = _mm512_permutexvar_epi16(split, _mm512_and_si512(v, nibble));
      const __m512i high = _mm512_permutexvar_epi16(split, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
      at::BFloat16* o = out + k0 * kPanel;  // pair k0 / 2
      widen_pairs(_mm512_castsi512_si256(low), s0, m0, s1, m1, o);
      widen_pairs(_mm512_extracti64x4_epi64(low, 1), s0, m0, s1, m1, o + 2 * kPanel);
      widen_pairs(_mm512_castsi512_si256(high), s0, m0, s1, m1, o + 4 * kPanel);
      widen_pairs(_mm512_extracti64x4_epi64(high, 1), s0, m0, s1, m1, o + 6 * kPanel);
    }
  }
}

// the panels [p0, p1) of y = x @ W.T for x (M rows, bf16, in whole tiles: a multiple of 16 rows) through the tiles.
// `panel(p, scratch)`: panel p in bf16 pairs (the packed weight itself, or widened into scratch, K * 16 values);
// `store(m, p, rows, span, c)`: c's rows (32 fp32 apart: span panels of 16 outputs) are y's rows m.. at panel p..
template <typename Panel, typename Store>
void run(const at::BFloat16* x, int64_t M, int64_t K, int64_t p0, int64_t p1, const Panel& panel,
         const Store& store) {
  thread_local std::vector<at::BFloat16> scratch;
  scratch.resize(2 * K * kPanel);
  alignas(64) float c[kRows * 2 * kPanel];
  configure();
  for (int64_t p = p0; p < p1; p += 2) {
    // an odd last panel is paired with itself, its copy's sums dropped: every panel's sums run in one order, so
    // the bits do not depend on how the threads split the panels
    const int span = p + 1 < p1 ? 2 : 1;
    const at::BFloat16* b0 = panel(p, scratch.data());
    const at::BFloat16* b1 = span == 2 ? panel(p + 1, scratch.data() + K * kPanel) : b0;
    for (int64_t m = 0; m < M; m += kRows) {
      const int64_t rows = std::min(kRows, M - m);
      if (rows > 16) tile<true>(x + m * K, K, b0, b1, K, c);
      else tile<false>(x + m * K, K, b0, b1, K, c);
      store(m, p, rows, span, c);
    }
  }
  _tile_release();  // the thread's tile state is not saved at every switch from now on
}

}  // namespace GPTLAB_NS::amx_tiles

#endif  // GPTLAB_AMX
