// The emulated builds, for tests only: the AVX-512, AMX and AVX-VNNI builds' code compiled for a CPU with AVX2 alone
// (GPTLAB_KERNEL_EMULATE=1, gptlab/kernels/__init__.py), so that any x86 machine runs those builds' kernel tests.
// Slow, and never chosen to serve anything.
//
// The AVX-512 and VNNI intrinsics come from SIMDe (libsimde-dev: portable definitions of Intel's intrinsics, GCC
// vectors underneath), through its native aliases: the kernels' own `_mm512_*` calls compile unchanged. What SIMDe
// 0.7 lacks is defined below from Intel's descriptions of the instructions, as is the bf16 dot product (SIMDe's adds
// the pair in the other order and keeps denormals), and the AMX tiles: eight 1 KiB registers per thread in memory,
// each instruction a loop over their rows.
#pragma once

#include <immintrin.h>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace GPTLAB_NS::emulation {  // the build's own: no symbol shared between the libraries

inline float from_bf16(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }
inline uint16_t to_bf16(float f) {  // VCVTNEPS2BF16: nearest, ties to even; denormals as zero; NaN stays NaN
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);
  if ((u & 0x7F800000u) == 0) return static_cast<uint16_t>((u >> 16) & 0x8000);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// element-wise conversions SIMDe 0.7 does not have: `n` lanes of `From` read from `a`, written as `To`
template <typename To, typename From, int n, typename Out, typename In, typename F>
inline Out convert(const In& a, F f) {
  From in[n];
  To out[n];
  static_assert(sizeof in <= sizeof(In) && sizeof out == sizeof(Out));
  std::memcpy(in, &a, sizeof in);
  for (int i = 0; i < n; ++i) out[i] = f(in[i]);
  return std::bit_cast<Out>(out);
}

inline __m512i cvtepu8_epi32(__m128i a) {
  return convert<int32_t, uint8_t, 16, __m512i>(a, [](uint8_t v) { return int32_t(v); });
}
inline __m512i cvtepu16_epi32(__m256i a) {
  return convert<int32_t, uint16_t, 16, __m512i>(a, [](uint16_t v) { return int32_t(v); });
}
inline __m512 cvtepi32_ps(__m512i a) {  // nearest (the default rounding)
  return convert<float, int32_t, 16, __m512>(a, [](int32_t v) { return float(v); });
}
inline __m512d cvtepi32_pd(__m256i a) {
  return convert<double, int32_t, 8, __m512d>(a, [](int32_t v) { return double(v); });
}
inline __m256 cvtpd_ps(__m512d a) {  // nearest (the default rounding)
  return convert<float, double, 8, __m256>(a, [](double v) { return float(v); });
}
inline __m512 cvtph_ps(__m256i a) {  // fp16 to fp32, exactly: F16C's conversion, eight lanes at a time
  const __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(a));
  const __m256 hi = _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1));
  return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}
inline __m256bh cvtneps_pbh(__m512 a) {
  return convert<uint16_t, float, 16, __m256bh>(a, [](float v) { return to_bf16(v); });
}
inline __m512bh cvtne2ps_pbh(__m512 a, __m512 b) {  // b's 16 lanes first, then a's
  uint16_t out[32];
  const __m256bh lo = cvtneps_pbh(b), hi = cvtneps_pbh(a);
  std::memcpy(out, &lo, 32);
  std::memcpy(out + 16, &hi, 32);
  return std::bit_cast<__m512bh>(out);
}

// bf16 dot products as Intel defines them: each bf16 product exact in fp32 and added to the sum, denormal inputs
// read as zero and denormal sums flushed to zero
inline float denormal_as_zero(float v) {
  return (std::bit_cast<uint32_t>(v) & 0x7F800000u) == 0 ? std::copysign(0.0f, v) : v;
}
inline float add_product(float sum, uint16_t x, uint16_t w) {
  return denormal_as_zero(denormal_as_zero(sum) + denormal_as_zero(from_bf16(x)) * denormal_as_zero(from_bf16(w)));
}
// VDPBF16PS: lane j adds the odd pair's product first, then the even one's (the SDM's order)
inline __m512 dpbf16_ps(__m512 src, __m512bh a, __m512bh b) {
  float sum[16];
  uint16_t x[32], w[32];
  std::memcpy(sum, &src, sizeof sum), std::memcpy(x, &a, sizeof x), std::memcpy(w, &b, sizeof w);
  for (int j = 0; j < 16; ++j)
    sum[j] = add_product(add_product(sum[j], x[2 * j + 1], w[2 * j + 1]), x[2 * j], w[2 * j]);
  return std::bit_cast<__m512>(sum);
}

// the aligned load and store fault on an address off 64 bytes, as the instructions do (SIMDe's accept any)
inline __m512i load_si512(const void* p) {
  if (reinterpret_cast<uintptr_t>(p) % 64) __builtin_trap();
  return simde_mm512_loadu_si512(p);
}
inline void store_si512(void* p, __m512i v) {
  if (reinterpret_cast<uintptr_t>(p) % 64) __builtin_trap();
  simde_mm512_storeu_si512(p, v);
}

// AMX: palette 1's eight tiles of up to 16 rows of up to 64 bytes, and their shapes (TILECFG's layout)
struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
struct Tiles {
  TileConfig config{};
  alignas(64) uint8_t data[8][16][64]{};
};
inline thread_local Tiles tiles;

inline void tile_loadconfig(const void* config) { std::memcpy(&tiles.config, config, sizeof(TileConfig)); }
inline void tile_release() { tiles = Tiles{}; }
inline void tile_zero(int t) { std::memset(tiles.data[t], 0, sizeof tiles.data[t]); }
// rows and bytes beyond the tile's shape read as zero
inline void tile_loadd(int t, const void* base, int64_t stride) {
  tile_zero(t);
  for (int r = 0; r < tiles.config.rows[t]; ++r)
    std::memcpy(tiles.data[t][r], static_cast<const uint8_t*>(base) + r * stride, tiles.config.colsb[t]);
}
inline void tile_stored(int t, void* base, int64_t stride) {
  for (int r = 0; r < tiles.config.rows[t]; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, tiles.data[t][r], tiles.config.colsb[t]);
}
// TDPBF16PS: c's fp32 (m, n) += a's bf16 pair k of row m times b's pair n of row k, the pair's two products added
// in turn (the even one first, the SDM's order here)
inline void tile_dpbf16ps(int c, int a, int b) {
  for (int m = 0; m < tiles.config.rows[c]; ++m)
    for (int k = 0; k < tiles.config.colsb[a] / 4; ++k)
      for (int n = 0; n < tiles.config.colsb[c] / 4; ++n) {
        uint16_t x[2], w[2];
        float sum;
        std::memcpy(x, &tiles.data[a][m][4 * k], 4);
        std::memcpy(w, &tiles.data[b][k][4 * n], 4);
        std::memcpy(&sum, &tiles.data[c][m][4 * n], 4);
        sum = add_product(add_product(sum, x[0], w[0]), x[1], w[1]);
        std::memcpy(&tiles.data[c][m][4 * n], &sum, 4);
      }
}
// TDPB[SU]SD: c's int32 (m, n) += the four byte products of a's quad k of row m (signed or unsigned) and b's
// quad n of row k (signed)
template <bool ASigned>
inline void tile_dpb_sd(int c, int a, int b) {
  for (int m = 0; m < tiles.config.rows[c]; ++m)
    for (int k = 0; k < tiles.config.colsb[a] / 4; ++k)
      for (int n = 0; n < tiles.config.colsb[c] / 4; ++n) {
        int32_t sum;
        std::memcpy(&sum, &tiles.data[c][m][4 * n], 4);
        for (int i = 0; i < 4; ++i) {
          const uint8_t x = tiles.data[a][m][4 * k + i];
          const int32_t xv = ASigned ? int32_t(static_cast<int8_t>(x)) : int32_t(x);
          sum += xv * int32_t(static_cast<int8_t>(tiles.data[b][k][4 * n + i]));
        }
        std::memcpy(&tiles.data[c][m][4 * n], &sum, 4);
      }
}

}  // namespace GPTLAB_NS::emulation

#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps GPTLAB_NS::emulation::dpbf16_ps
#undef _mm512_load_si512
#define _mm512_load_si512 GPTLAB_NS::emulation::load_si512
#undef _mm512_store_si512
#define _mm512_store_si512 GPTLAB_NS::emulation::store_si512
#undef _mm512_cvtepu8_epi32
#define _mm512_cvtepu8_epi32 GPTLAB_NS::emulation::cvtepu8_epi32
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32 GPTLAB_NS::emulation::cvtepu16_epi32
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps GPTLAB_NS::emulation::cvtepi32_ps
#undef _mm512_cvtepi32_pd
#define _mm512_cvtepi32_pd GPTLAB_NS::emulation::cvtepi32_pd
#undef _mm512_cvtpd_ps
#define _mm512_cvtpd_ps GPTLAB_NS::emulation::cvtpd_ps
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps GPTLAB_NS::emulation::cvtph_ps
#undef _mm512_cvtneps_pbh
#define _mm512_cvtneps_pbh GPTLAB_NS::emulation::cvtneps_pbh
#undef _mm512_cvtne2ps_pbh
#define _mm512_cvtne2ps_pbh GPTLAB_NS::emulation::cvtne2ps_pbh
// AVX-VNNI's VEX-encoded byte and word dot products: the same operations as AVX512-VL's 256-bit ones
#undef _mm256_dpbusd_avx_epi32
#define _mm256_dpbusd_avx_epi32 _mm256_dpbusd_epi32
#undef _mm256_dpwssd_avx_epi32
#define _mm256_dpwssd_avx_epi32 _mm256_dpwssd_epi32

#undef _tile_loadconfig
#define _tile_loadconfig GPTLAB_NS::emulation::tile_loadconfig
#undef _tile_release
#define _tile_release GPTLAB_NS::emulation::tile_release
#undef _tile_zero
#define _tile_zero GPTLAB_NS::emulation::tile_zero
#undef _tile_loadd
#define _tile_loadd GPTLAB_NS::emulation::tile_loadd
#undef _tile_stored
#define _tile_stored GPTLAB_NS::emulation::tile_stored
#undef _tile_dpbf16ps
#define _tile_dpbf16ps GPTLAB_NS::emulation::tile_dpbf16ps
#undef _tile_dpbssd
#define _tile_dpbssd GPTLAB_NS::emulation::tile_dpb_sd<true>
#undef _tile_dpbusd
#define _tile_dpbusd GPTLAB_NS::emulation::tile_dpb_sd<false>
