// QLoRA's int4 base weight back to numbers (gptlab/qlora.py's blocks): `dequantize_int4(packed, scale, low, out)`
// writes out[r, c] = q[r, c] * scale[r, g] + low[r, g] (g = c / group) for two weights a byte (input 2j in the high
// nibble) and fp16 scale and low end per group, into `out` in fp32 or bf16 (rounded to nearest even, as a cast of
// the fp32 value is). The same numbers as the ATen reference (unpack, fp32 multiply and add, cast) to the bit: q is
// at most 4 bits and an fp16 scale 11, so q * scale is exact in fp32 and the only rounding is the add's (a fused
// multiply-add gives the same), then the cast. One pass over the bytes instead of ATen's ~6 passes over a block in
// fp32; rows in parallel. Views are fine where each row's elements are contiguous.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "linear_avx2.h"

#include <cstdint>
#include <type_traits>

namespace GPTLAB_NS {
namespace {

// 16 weights from 8 packed bytes, in input order: the high nibble of each byte, then its low one
inline __m128i unpack16(const uint8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i nibble = _mm_set1_epi8(15);
  return _mm_unpacklo_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble), _mm_and_si128(bytes, nibble));
}

#if GPTLAB_AVX512
inline void store16(float* out, __m512 v) { _mm512_storeu_ps(out, v); }
inline void store16(at::BFloat16* out, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(v));
}
inline void group16(const uint8_t* p, float scale, float low, float* f32, at::BFloat16* b16) {
  const __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(unpack16(p))),
                                               _mm512_set1_ps(scale)), _mm512_set1_ps(low));
  if (f32 != nullptr) store16(f32, v); else store16(b16, v);
}
#else
// fp32 -> bf16 rounded to nearest even (finite values: the weights), two vectors of 8 into 16 in order
inline __m256i round_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
}
inline void group16(const uint8_t* p, float scale, float low, float* f32, at::BFloat16* b16) {
  const __m128i q = unpack16(p);
  const __m256 s = _mm256_set1_ps(scale), l = _mm256_set1_ps(low);
  const __m256 lo = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), s), l);
  const __m256 hi = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))), s), l);
  if (f32 != nullptr) {
    _mm256_storeu_ps(f32, lo);
    _mm256_storeu_ps(f32 + 8, hi);
    return;
  }
  // packus interleaves the 128-bit lanes (lo0-3 hi0-3 lo4-7 hi4-7): the permute puts them back in order
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(round_bf16(lo), round_bf16(hi)), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(b16), packed);
}
#endif

// one row: `groups` groups of `group` weights (a multiple of 16, or the scalar loop)
template <typename T>
void dequantize_row(const uint8_t* q, const at::Half* scale, const at::Half* low, int64_t groups, int64_t group,
                    T* out) {
  for (int64_t g = 0; g < groups; ++g, q += group / 2, out += group) {
    const float s = static_cast<float>(scale[g]), l = static_cast<float>(low[g]);
    if (group % 16 == 0) {
      for (int64_t i = 0; i < group; i += 16) {
        if constexpr (std::is_same_v<T, float>) group16(q + i / 2, s, l, out + i, nullptr);
        else group16(q + i / 2, s, l, nullptr, out + i);
      }
      continue;
    }
    for (int64_t i = 0; i < group; ++i) {
      const float w = static_cast<float>((i % 2 ? q[i / 2] : q[i / 2] >> 4) & 15) * s + l;
      out[i] = T(w);
    }
  }
}

template <typename T>
void dequantize_rows(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& low, const at::Tensor& out) {
  const int64_t rows = out.size(0), groups = scale.size(1), group = out.size(1) / groups;
  const uint8_t* q = packed.data_ptr<uint8_t>();
  const at::Half* s = scale.data_ptr<at::Half>();
  const at::Half* l = low.data_ptr<at::Half>();
  T* o = out.data_ptr<T>();
  const int64_t qs = packed.stride(0), ss = scale.stride(0), ls = low.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dequantize_row(q + r * qs, s + r * ss, l + r * ls, groups, group, o + r * os);
  });
}

void dequantize_int4(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& low, const at::Tensor& out) {
  TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 2 && packed.scalar_type() == at::kByte,
              "dequantize_int4: packed must be a 2-D uint8 CPU tensor");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && low.scalar_type() == at::kHalf && scale.dim() == 2 &&
                  low.sizes() == scale.sizes(), "dequantize_int4: scale and low must be (rows, groups) float16");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16,
              "dequantize_int4: out must be float32 or bfloat16");
  const int64_t rows = out.size(0), cols = out.size(1), groups = scale.size(1);
  TORCH_CHECK(out.dim() == 2 && packed.size(0) == rows && scale.size(0) == rows && packed.size(1) * 2 == cols &&
                  groups > 0 && cols % groups == 0 && (cols / groups) % 2 == 0,
              "dequantize_int4: shapes do not match (rows, 2 * bytes) = (rows, groups * even group)");
  for (const at::Tensor* t : {&packed, &scale, &low, &out})
    TORCH_CHECK(t->size(1) <= 1 || t->stride(1) == 1, "dequantize_int4: each row must be contiguous");
  if (out.scalar_type() == at::kFloat) dequantize_rows<float>(packed, scale, low, out);
  else dequantize_rows<at::BFloat16>(packed, scale, low, out);
}

}  // namespace
}  // namespace GPTLAB_NS

GPTLAB_LIBRARY_FRAGMENT(GPTLAB_NS, m) {
  m.def("dequantize_int4(Tensor packed, Tensor scale, Tensor low, Tensor(a!) out) -> ()", &GPTLAB_NS::dequantize_int4);
}
