// What linear_avx2.cpp shares: the panel shape (the micro-kernels of dense_tiles.h and int_tiles.h work on it),
// which build this is, and `linear`, y = x @ W.T + bias over a packed weight (decode_step.cpp's step calls
// `linear_part`, the same over raw rows, a thread's share of it).
//
// The same sources are compiled up to four times (gptlab/kernels/__init__.py): with AVX2 + FMA, with AVX2 +
// AVX-VNNI, with AVX-512 (F/BW/VL/DQ + VNNI + BF16), and with AVX-512 + AMX. The compiler's own macros pick the
// build: the AVX-512 one registers its operators as torch.ops.gptlab_avx512 and keeps its C++ in namespace
// gptlab_avx512 (GPTLAB_NS), so all the libraries can be loaded in one process without sharing a symbol. All read
// the same packed weights (one `pack`). For tests, GPTLAB_EMULATE_* compiles the AVX-VNNI, AVX-512 or AMX build's
// code for AVX2 (emulation.h), as gptlab_avx512_emulated and so on.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>

#if defined(GPTLAB_EMULATE_AVX512) || defined(GPTLAB_EMULATE_AVXVNNI)  // a test build (emulation.h, below)
#define GPTLAB_EMULATED_OR(name) name##_emulated  // its own library and namespace: gptlab_avx512_emulated, ...
#else
#define GPTLAB_EMULATED_OR(name) name
#endif

#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
     defined(__AVX512VNNI__) && defined(__AVX512BF16__)) || defined(GPTLAB_EMULATE_AVX512)
#define GPTLAB_AVX512 1
#if (defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)) || defined(GPTLAB_EMULATE_AMX)
#define GPTLAB_AMX 1  // the AVX-512 build with the tile unit's bf16 and byte products for many rows (amx_tiles.h)
#endif
#elif defined(__AVXVNNI__) || defined(GPTLAB_EMULATE_AVXVNNI)
#define GPTLAB_AVXVNNI 1  // the AVX2 build with AVX-VNNI's 256-bit byte dot products (int4's vpdpbusd)
#endif

#if defined(GPTLAB_AMX)
#define GPTLAB_NS GPTLAB_EMULATED_OR(gptlab_amx)
#elif defined(GPTLAB_AVX512)
#define GPTLAB_NS GPTLAB_EMULATED_OR(gptlab_avx512)
#elif defined(GPTLAB_AVXVNNI)
#define GPTLAB_NS GPTLAB_EMULATED_OR(gptlab_avxvnni)
#else
#define GPTLAB_NS gptlab_avx2
#endif

#if defined(GPTLAB_EMULATE_AVX512) || defined(GPTLAB_EMULATE_AVXVNNI)
#include "emulation.h"  // AVX-512's, AMX's or AVX-VNNI's intrinsics on an AVX2 CPU
#endif

// TORCH_LIBRARY pastes its argument unexpanded: one more level expands GPTLAB_NS first
#define GPTLAB_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define GPTLAB_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)

namespace GPTLAB_NS {

constexpr int64_t kPanel = 16;  // output rows per panel: two 8-float AVX2 registers, one 16-float AVX-512 one
constexpr int kTile = 6;        // x rows per micro-kernel call

// Software prefetch of the weights GPTLAB_PF bytes ahead of [p, p + bytes) in the AVX-512 batch-1 loops and the
// AVX2 dense and integer tiles (0: none): 1 KiB measured 0-10% faster than none on a busy 2-core Zen 4 (within its
// noise; 512 B no better); on a Zen 3 (AVX2) a 12-layer width-256 model's products 14-20% faster at 2-8 rows of
// fp32, ~10% at 5 rows of bf16 and ~7% at one (fp32's one row: no change), the hardware's own prefetch falling
// behind once each weight feeds several rows' FMAs
#ifndef GPTLAB_PF
#define GPTLAB_PF 1024
#endif
inline void prefetch_ahead(const void* p, int bytes) {
  if constexpr (GPTLAB_PF > 0)
    for (int b = 0; b < bytes; b += 64)
      _mm_prefetch(static_cast<const char*>(p) + GPTLAB_PF + b, _MM_HINT_T0);
}

// one thread's share of a product's panels when the caller runs its own team of `of` threads (of = 0: the whole
// product over torch's pool): contiguous and balanced, so each thread streams one run of the weight
struct Part {
  int index = 0, of = 0;
  int64_t begin(int64_t n) const { return n * index / of; }
  int64_t end(int64_t n) const { return n * (index + 1) / of; }
};

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& qparams,
                  const c10::optional<at::Tensor>& bias, int64_t N);
// `linear`'s checks alone, and its product over raw rows for panels `part` of y (M, N) in fp32 (a thread of the
// decode step's team; unchecked: the step checks every weight first, as nothing may throw inside its parallel
// region): x in fp32, xb the same values in bf16 where they are bf16 values (the bf16 dot products then run on
// them), else null
void check_linear(const at::Tensor& packed, const c10::optional<at::Tensor>& qparams,
                  const c10::optional<at::Tensor>& bias, int64_t K, int64_t N);
void linear_part(const float* x, const at::BFloat16* xb, int64_t M, int64_t K, const at::Tensor& packed,
                 const c10::optional<at::Tensor>& qparams, const c10::optional<at::Tensor>& bias, int64_t N,
                 float* y, Part part);

}  // namespace GPTLAB_NS
