// decode_step.cpp's arguments checked before its parallel region (where nothing may throw): the rows' cache rows and
// positions, the rotary cos/sin, the attention masks.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace GPTLAB_NS::step_args {

inline bool given(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// rows and pos (B each, int64): row b is cache row rows[b]'s token at pos[b], within the cache's `cache_rows` rows
// and before `end`; kept contiguous in rows_c and pos_c
inline void checked_rows(const c10::optional<at::Tensor>& rows, const c10::optional<at::Tensor>& pos, int64_t B,
                         int64_t cache_rows, int64_t end, at::Tensor& rows_c, at::Tensor& pos_c) {
  TORCH_CHECK(given(rows) && given(pos), "decode_step: where < 0 takes rows and pos");
  rows_c = rows->reshape({-1}).contiguous(), pos_c = pos->reshape({-1}).contiguous();
  TORCH_CHECK(rows_c.numel() == B && pos_c.numel() == B, "decode_step: a row and position per row");
  const int64_t *r = rows_c.data_ptr<int64_t>(), *p = pos_c.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(r[b] >= 0 && r[b] < cache_rows && p[b] >= 0 && p[b] < end,
                "decode_step: row ", b, " is cache row ", r[b], " at ", p[b], ": outside the cache or the step");
}

// cos and sin (rows, rot / 2) as fp32 into cos_c and sin_c: how many rows (0: no rotation)
inline int64_t checked_rope(const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin, int64_t rot,
                            at::Tensor& cos_c, at::Tensor& sin_c) {
  if (!given(cos)) return 0;
  TORCH_CHECK(given(sin), "decode_step: cos without sin");
  cos_c = cos->to(at::kFloat).contiguous(), sin_c = sin->to(at::kFloat).contiguous();
  const int64_t rows = cos_c.size(0);
  TORCH_CHECK(cos_c.numel() == rows * (rot / 2) && sin_c.numel() == cos_c.numel(),
              "decode_step: cos/sin (B or 1, rot / 2)");
  return rows;
}

// a mask's bools (B or 1, 1, 1, end), or null where none is given; its rows into `rows`
inline const bool* mask_data(const c10::optional<at::Tensor>& mask, int64_t end, int64_t& rows) {
  if (!given(mask)) return nullptr;
  TORCH_CHECK(mask->scalar_type() == at::kBool && mask->is_contiguous() && mask->size(-1) == end,
              "decode_step: masks must be contiguous bool (B or 1, 1, 1, end)");
  rows = mask->size(0);
  return mask->data_ptr<bool>();
}

}  // namespace GPTLAB_NS::step_args
