// hloserve_row_sum: each row's sum in one fixed order, whatever the number of rows (the composite
// exists for that: exporter/composites/row_sum.py). A row of N values is summed as 16 running lanes
// (lane j takes the elements j, j + 16, ...), then the lanes pairwise (8, 4, 2, 1). The source fixes
// the order: without -ffast-math the compiler may vectorize the lanes but not reassociate them.
#include "common.h"

namespace {
using namespace hloserve;

constexpr int kLanes = 16;

__attribute__((noinline)) float row_sum(const float* x, int64_t n) {
  float lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) lane[j] += x[i + j];
  for (int j = 0; i + j < n; ++j) lane[j] += x[i + j];
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) lane[j] += lane[j + w];
  return lane[0];
}

// Elements a task takes: a prompt chunk's norm is 10^5 of them, a decode step's a few thousand (one
// task: waking a pool thread costs more than the loop).
constexpr int64_t kRowSumTask = 1 << 15;

ffi::Error RowSum(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out) {
  auto d = x.dimensions();
  if (d.size() != 2 || out->element_count() != d[0])
    return ffi::Error::InvalidArgument("hloserve_row_sum: x must be [R, N] and the result [R]");
  const int64_t rows = d[0], n = d[1];
  const float* px = x.typed_data();
  float* po = out->typed_data();
  const int64_t per = std::max<int64_t>(1, kRowSumTask / std::max<int64_t>(n, 1));   // rows a task takes
  parallel_for(pool, (rows + per - 1) / per, 1, [&](int64_t t) {
    for (int64_t r = t * per, end = std::min(rows, (t + 1) * per); r < end; ++r) po[r] = row_sum(px + r * n, n);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(hloserve_row_sum, RowSum,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
