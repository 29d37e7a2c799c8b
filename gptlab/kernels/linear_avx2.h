// What linear_avx2.cpp shares: the panel shape (int_tiles.h's micro-kernels work on it) and `linear`, y = x @ W.T +
// bias over a packed weight (decode_avx2.cpp's step calls it). See linear_avx2.cpp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace gptlab_avx2 {

constexpr int64_t kPanel = 16;  // output rows per panel
constexpr int kTile = 6;        // x rows per micro-kernel call

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& qparams,
                  const c10::optional<at::Tensor>& bias, int64_t N);

}  // namespace gptlab_avx2
