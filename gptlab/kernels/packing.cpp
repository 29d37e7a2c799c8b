// The packed layouts every build's kernels read (see linear_avx2.cpp's header): one source of truth for how a
// weight is laid out in panels of 16 outputs, registered in each build as `pack`, `pack_int8` and `pack_int4`.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "int4_tiles.h"
#include "linear_avx2.h"

namespace {

using GPTLAB_NS::kPanel;

// (N, K) rows zero-padded to whole panels, as (panels, 16, K)
at::Tensor panel_rows(const at::Tensor& weight) {
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kPanel - 1) / kPanel;
  auto padded = at::zeros({panels * kPanel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({panels, kPanel, K});
}

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack: the weight must be 2-D, got ", weight.dim(), "-D");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat,
              "pack: bf16 or fp32 weights only, got ", weight.scalar_type());
  auto rows = panel_rows(weight);
  const int64_t panels = rows.size(0), K = rows.size(2), K2 = K - K % 2;
  if (weight.scalar_type() == at::kFloat)  // (panels, 16, K) -> (panels, K, 16): column k is 16 consecutive values
    return rows.transpose(1, 2).contiguous();
  // bf16: column pairs (panels, K / 2, 16, 2), as pack_int8's; with K odd the last column plain (see dense_tiles.h)
  auto pairs = rows.narrow(2, 0, K2).reshape({panels, kPanel, K2 / 2, 2}).permute({0, 2, 1, 3});
  auto packed = pairs.reshape({panels, K2, kPanel});
  if (K2 < K) packed = at::cat({packed, rows.narrow(2, K2, 1).transpose(1, 2)}, 1);
  return packed.contiguous();
}

// q (N, K) int8, K even -> (panels, K, 16) whose column pair j is (16 rows, 2): the layout tile_i8 reads
at::Tensor pack_int8(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "pack_int8: a 2-D int8 weight, got ", q.scalar_type());
  TORCH_CHECK(q.size(1) % 2 == 0, "pack_int8: the input width must be even, got ", q.size(1));
  auto rows = panel_rows(q);
  const int64_t panels = rows.size(0), K = rows.size(2);
  return rows.view({panels, kPanel, K / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({panels, K, kPanel});
}

// q (N, K) uint8 in 0..15, scale and zero (N, K / gs), gs a multiple of 32 -> (nibble panels (panels, K / 2, 16)
// uint8, qparams): per panel and 8 columns k0.., 64 bytes whose byte 4 r + j holds row r's q[k0 + j] (low nibble)
// and q[k0 + 4 + j] (high): the layout int4_tiles.h reads
std::vector<at::Tensor> pack_int4(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& zero) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte, "pack_int4: a 2-D uint8 weight of values 0..15");
  const int64_t N = q.size(0), K = q.size(1), G = scale.size(1);
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N && zero.sizes() == scale.sizes() && G > 0 && K % G == 0 &&
              (K / G) % GPTLAB_NS::int4_tiles::kBlock == 0,
              "pack_int4: scale and zero must be (N, K / group) with a group size that is a multiple of 32");
  auto rows = panel_rows(q);
  const int64_t panels = rows.size(0);
  // (panels, 16, K / 8, 2, 4) -> (panels, K / 8, 16, 2, 4): per 8 columns, each row's low quad and high quad
  auto quads = rows.view({panels, kPanel, K / 8, 2, 4}).permute({0, 2, 1, 3, 4});
  auto packed = quads.select(3, 0).bitwise_or(quads.select(3, 1).mul(16)).contiguous().view({panels, K / 2, kPanel});
  const auto s = scale.to(at::kFloat), offset = zero.to(at::kFloat) - 8 * s;  // w = q * s + (zero - 8 s)
  auto qparams = at::stack({panel_rows(s).transpose(1, 2), panel_rows(offset).transpose(1, 2)}, 2);
  // fp16 (2 bytes a value): exact for gptlab.quantize's int4 weights, whose scales and low ends are fp16 values
  return std::vector<at::Tensor>{packed, qparams.to(at::kHalf).contiguous()};  // qparams (panels, G, 2, 16)
}

}  // namespace

GPTLAB_LIBRARY_FRAGMENT(GPTLAB_NS, m) {
  m.def("pack(Tensor weight) -> Tensor", &pack);
  m.def("pack_int8(Tensor q) -> Tensor", &pack_int8);
  m.def("pack_int4(Tensor q, Tensor scale, Tensor zero) -> Tensor[]", &pack_int4);
}
