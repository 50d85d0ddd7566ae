// hloserve_product_sum: a*b + c*d elementwise with both products rounded to f32 before the sum, never
// a fused multiply-add (the composite exists for that: exporter/composites/product_sum.py). GCC fuses
// a*b + c*d into an FMA too (-ffp-contract=fast is its default outside ISO C mode), so this file's
// arithmetic is compiled with contraction off.
#include "common.h"

namespace {
using namespace hloserve;

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
// out[i] = f32(a[i] * b[i]) + f32(c[i] * d[i]) for i in [i0, i1)
__attribute__((noinline)) void product_sum_range(const float* a, const float* b, const float* c, const float* d,
                                                 float* out, int64_t i0, int64_t i1) {
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i) {
    const float p = a[i] * b[i], q = c[i] * d[i];
    out[i] = p + q;
  }
}
#pragma GCC pop_options

// Elements a task takes: a prompt chunk's rotary embedding is 10^5-10^6 of them, a decode step's
// a few thousand (one task: waking a pool thread costs more than the loop).
constexpr int64_t kProductSumTask = 1 << 15;

ffi::Error ProductSum(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b, ffi::Buffer<ffi::F32> c,
                      ffi::Buffer<ffi::F32> d, ffi::ResultBuffer<ffi::F32> out) {
  const int64_t n = a.element_count();
  if (b.element_count() != n || c.element_count() != n || d.element_count() != n || out->element_count() != n)
    return ffi::Error::InvalidArgument("hloserve_product_sum: a, b, c and d must have the same number of elements");
  const float *pa = a.typed_data(), *pb = b.typed_data(), *pc = c.typed_data(), *pd = d.typed_data();
  float* po = out->typed_data();
  parallel_for(pool, (n + kProductSumTask - 1) / kProductSumTask, 1, [&](int64_t t) {
    product_sum_range(pa, pb, pc, pd, po, t * kProductSumTask, std::min(n, (t + 1) * kProductSumTask));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(hloserve_product_sum, ProductSum,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
