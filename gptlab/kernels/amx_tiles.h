// The AMX build's products of many rows (Sapphire Rapids and later Xeons) on the tile unit, where the AVX-512
// kernels' dot products would be the limit (a batch of decoding rows, a prefill).
//
// bf16 and int4 weights: bf16 dot products (TDPBF16PS: a 16 x 16 block of fp32 sums from 16 rows of x by 32 inputs
// by 16 outputs per instruction) over the packed panels. The bf16 panels are already the tile unit's B layout: a
// panel's 32 inputs k0.. are 16 column pairs of 16 outputs, 64 bytes each (pack's (K / 2, 16, 2)). int4 panels are
// first widened to it in bf16, one panel at a time into the thread's scratch, a weight as q * s + m rounded once
// to bf16. x goes in bf16 (an fp32 x rounded once, for int4 weights), so a product is the dequantized weight times x
// summed in fp32: the numbers of PyTorch's weight-only kernels on bf16 input.
//
// int8 weights: byte dot products (TDPBSSD / TDPBUSD: 16 rows by 64 inputs by 16 outputs, exact int32 sums) on
// the int8 kernels' own numbers (int_tiles.h): each row of x in 16-bit fixed point, split into a signed high byte
// and an unsigned low byte (xq = 256 hi + lo), each multiplied by the weight's integers on the tiles over the whole
// row (exact in int32 up to kMaxInt8Depth inputs) and joined once in double: the exact integer sum, rounded once to
// fp32 (the AVX-512 kernel rounds once per 512 inputs: the same bits up to 512). The panels' column pairs are
// regrouped into the B tiles' quads (four inputs of an output in 32 bits), a permutation of 16-bit words, a tile
// step at a time between the tile instructions of the panels before: no widening, and the weights stream while the
// tile unit works.
//
// Fewer rows than `min_rows` keep the AVX-512 kernels: there the work is streaming the weights, which their loops
// do at memory speed.
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
// int8 on the byte dot products: the inputs a tile step takes (16 quads, a 64-byte tile row), and the most inputs
// whose int32 sums stay exact (hi: 128 * 127 * K, lo: 255 * 127 * K < 2^31); wider products keep the AVX-512 kernels
constexpr int64_t kQuadDepth = 64;
constexpr int64_t kMaxInt8Depth = 65536;

// the fewest rows whose product the tiles run faster than the AVX-512 kernels, by the packed weight's dtype (bf16,
// int8 = kChar, int4 = kByte), measured on a 2-core Xeon with AMX at GPT-2's shapes: widening an int4 panel costs
// the same for any number of rows, so int4 needs more rows to repay it (crossing at 21-22); int8's regrouping is
// a permutation beside the tiles' work, crossing at 5-6 rows over 48 products of GPT-2's (1.3x at 12 rows, 1.5x at
// 16); bf16 is 2.2x faster at 8; 0: never (fp32)
inline int64_t min_rows(at::ScalarType packed) {
  switch (packed) {
    case at::kBFloat16: return 8;
    case at::kChar: return 6;
    case at::kByte: return 24;
    default: return 0;
  }
}

// whether the tile unit takes a product of M rows with K inputs (K a whole number of tile steps)
inline bool applies(int64_t M, int64_t K, at::ScalarType packed) {
  return min_rows(packed) > 0 && M >= min_rows(packed) && K % kDepth == 0 &&
         (packed != at::kChar || K <= kMaxInt8Depth);
}

// palette 1, eight tiles of 16 rows x 64 bytes. bf16 products: C 0-3 (16 x 16 fp32 sums: rows 0-15 / 16-31 by
// panel 0 / 1), A 4-5 (16 rows of x by 32 bf16 inputs), B 6-7 (16 input pairs by 16 outputs of panel 0 / 1). Byte
// products (issue_i8): C 0-3 int32 sums (hi / lo by panel 0 / 1), A 4-5 (x's high / low bytes, 64 inputs), B 6-7
// (16 input quads by 16 outputs of panel 0 / 1)
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

// x for the byte products: each row's 16-bit fixed point xq = 256 * hi + lo, hi signed and lo unsigned, rows of
// `ld` bytes (K rounded up to whole tile steps, zero-padded) in whole tiles of 16 rows, and the rows' scales
struct Int8Input {
  std::vector<int8_t> hi;
  std::vector<uint8_t> lo;
  std::vector<float> scale;
  int64_t ld = 0;

  Int8Input(const int16_t* xq, const float* xscale, int64_t M, int64_t K)
      : ld((K + kQuadDepth - 1) / kQuadDepth * kQuadDepth) {
    const int64_t rows = (M + 15) / 16 * 16;
    hi.assign(rows * ld, 0);
    lo.assign(rows * ld, 0);
    scale.assign(rows, 0.0f);
    std::copy(xscale, xscale + M, scale.begin());
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; k += 32) {  // K a multiple of 32 (applies)
        const __m512i v = _mm512_loadu_si512(xq + m * K + k);
        // hi: an arithmetic shift, -128..127; lo: the low byte, 0..255 (a truncation)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi.data() + m * ld + k),
                            _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo.data() + m * ld + k), _mm512_cvtepi16_epi8(v));
      }
  }
};

// two int8 panels' K inputs (pack_int8's column pairs, (K / 2, 16, 2)) as the B tiles' quads (4 inputs of 16
// outputs, 64 bytes: a tile row), zero-padded to whole tile steps: word 2r of a quad is output r's first pair, word
// 2r + 1 its second. This streams the weight, the only part of the product that reads memory; done a tile step's
// inputs at a time (`step`) between the tile unit's instructions, so that both work at once
struct Regroup {
  const int8_t *w0, *w1;  // the panels' pairs (w1 = w0: an odd last panel twice)
  int8_t *q0, *q1;        // their quads
  int64_t K;

  void step(int64_t s) const {
    const __m512i regroup = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                             23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const int64_t k0 = s * kQuadDepth, k1 = std::min(K, k0 + kQuadDepth);
    for (int64_t k = k0; k < k1; k += 4) {  // 64 bytes: 4 inputs of 16 outputs
      prefetch_ahead(w0 + k * kPanel, 64);
      prefetch_ahead(w1 + k * kPanel, 64);
      _mm512_store_si512(q0 + k * kPanel, _mm512_permutexvar_epi16(regroup, _mm512_loadu_si512(w0 + k * kPanel)));
      _mm512_store_si512(q1 + k * kPanel, _mm512_permutexvar_epi16(regroup, _mm512_loadu_si512(w1 + k * kPanel)));
    }
    if (k1 < k0 + kQuadDepth) {  // a last half step (K % 64 = 32): zero weights up to the step's end
      std::memset(q0 + k1 * kPanel, 0, (k0 + kQuadDepth - k1) * kPanel);
      std::memset(q1 + k1 * kPanel, 0, (k0 + kQuadDepth - k1) * kPanel);
    }
  }
};

// the sums of 16 rows of x (hi, lo: ld bytes apart) by two panels' quads b0, b1 over `steps` tile steps, into
// tiles 0-3 (hi by b0, hi by b1, lo by b0, lo by b1), issued, not waited for; `beside(s)` after each step's
template <typename Beside>
inline void issue_i8(const int8_t* hi, const uint8_t* lo, int64_t ld, const int8_t* b0, const int8_t* b1,
                     int64_t steps, const Beside& beside) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, hi + s * kQuadDepth, ld);
    _tile_loadd(5, lo + s * kQuadDepth, ld);
    _tile_loadd(6, b0 + s * kQuadDepth * kPanel, 64);
    _tile_loadd(7, b1 + s * kQuadDepth * kPanel, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
    beside(s);
  }
}

// c (16 rows, 32 fp32 apart) = tiles 0-3's sums joined, 256 hi + lo: the exact integer sum of xq * q, rounded
// once to fp32, times each row's scale
inline void join_i8(const float* scale, float* c) {
  alignas(64) int32_t t[4][16][kPanel];
  _tile_stored(0, t[0], 64);  // (tile numbers are immediates)
  _tile_stored(1, t[1], 64);
  _tile_stored(2, t[2], 64);
  _tile_stored(3, t[3], 64);
  for (int r = 0; r < 16; ++r) {
    const __m512 s = _mm512_set1_ps(scale[r]);
    for (int j = 0; j < 2; ++j) {
      const __m512i h = _mm512_load_si512(t[j][r]), l = _mm512_load_si512(t[2 + j][r]);
      const auto exact = [](__m256i h8, __m256i l8) {  // 8 lanes in double: |256 hi + lo| < 2^40, exact
        return _mm512_cvtpd_ps(_mm512_fmadd_pd(_mm512_cvtepi32_pd(h8), _mm512_set1_pd(256.0), _mm512_cvtepi32_pd(l8)));
      };
      const __m256 lo8 = exact(_mm512_castsi512_si256(h), _mm512_castsi512_si256(l));
      const __m256 hi8 = exact(_mm512_extracti64x4_epi64(h, 1), _mm512_extracti64x4_epi64(l, 1));
      const __m512 sum = _mm512_insertf32x8(_mm512_castps256_ps512(lo8), hi8, 1);
      _mm512_storeu_ps(c + r * 2 * kPanel + j * kPanel, _mm512_mul_ps(sum, s));
    }
  }
}

// the panels [p0, p1) of an int8 weight (pack_int8's, K <= kMaxInt8Depth inputs) times x (M rows) on the byte
// products: `store(m, p, rows, span, c)` as run's, c the sums times each row's scale (the weight's row scales and
// the bias still to come). Panels go two at a time, the next two regrouped while the tile unit works on these
template <typename Store>
void run_int8(const Int8Input& x, int64_t M, int64_t K, const int8_t* packed, int64_t p0, int64_t p1,
              const Store& store) {
  const int64_t ld = x.ld, rows = (M + 15) / 16 * 16, steps = ld / kQuadDepth, quads = ld * kPanel;
  thread_local std::vector<int8_t> scratch;
  scratch.resize(4 * quads + 64);
  int8_t* base = scratch.data() + (64 - reinterpret_cast<uintptr_t>(scratch.data()) % 64) % 64;
  int8_t* buf[2] = {base, base + 2 * quads};  // two panels' quads each: these and the next
  alignas(64) float c[16 * 2 * kPanel];
  // an odd last panel is paired with itself, its copy's sums dropped
  const auto regroup = [&](int64_t p, int8_t* to) {
    const int8_t* w = packed + p * K * kPanel;
    return Regroup{w, p + 1 < p1 ? w + K * kPanel : w, to, to + quads, K};
  };
  const auto nothing = [](int64_t) {};
  configure();
  const Regroup first = regroup(p0, buf[0]);
  for (int64_t s = 0; s < steps; ++s) first.step(s);
  for (int64_t p = p0, i = 0; p < p1; p += 2, i ^= 1) {
    const int span = p + 1 < p1 ? 2 : 1;
    const int8_t *b0 = buf[i], *b1 = buf[i] + quads;
    for (int64_t m = 0; m < rows; m += 16) {
      const int8_t* hi = x.hi.data() + m * ld;
      const uint8_t* lo = x.lo.data() + m * ld;
      if (m == 0 && p + 2 < p1) {  // the next two panels regrouped beside the first row block's tile steps
        const Regroup next = regroup(p + 2, buf[i ^ 1]);
        issue_i8(hi, lo, ld, b0, b1, steps, [&](int64_t s) { next.step(s); });
      } else {
        issue_i8(hi, lo, ld, b0, b1, steps, nothing);
      }
      join_i8(x.scale.data() + m, c);
      store(m, p, std::min<int64_t>(16, M - m), span, c);
    }
  }
  _tile_release();  // the thread's tile state is not saved at every switch from now on
}

}  // namespace GPTLAB_NS::amx_tiles

#endif  // GPTLAB_AMX
