// What decode_avx2.cpp uses of linear_avx2.cpp: y = x @ W.T + bias over a packed weight (see linear_avx2.cpp).
#pragma once

#include <ATen/ATen.h>

namespace gptlab_avx2 {

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& qparams,
                  const c10::optional<at::Tensor>& bias, int64_t N);

}  // namespace gptlab_avx2
