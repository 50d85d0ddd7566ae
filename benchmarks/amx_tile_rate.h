// The tile unit's own rate, for the AMX benchmarks (amx_linear.cc, amx_vcpus.cc): nanoseconds a tile
// multiply of a 2 x 2 loop on L1 operands (4 bf16 multiplies a step, each matrix and x tile used
// twice, as layer_linear's tiles), run for `iters` steps on the calling thread. Reads ~7.5-9 ns on
// a Sapphire Rapids core whose unit is its own, ~30 when another tenant's thread shares it
// (docs/performance.md, "Paired runs on the AMX Xeon kind").
#pragma once
#include <chrono>
#include "../runtime/kernels/cpu/common.h"

inline double tile_multiply_ns(int64_t iters) {
  alignas(64) static uint16_t a[4 * 512], b[4 * 512];   // two steps' operands, read only
  hloserve::amx_configure_16x64();
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  const auto s0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    const int o = (i & 1) * 1024;
    _tile_loadd(4, a + o, 64); _tile_loadd(5, a + o + 512, 64); _tile_loadd(6, b + o, 64); _tile_loadd(7, b + o + 512, 64);
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
  }
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - s0).count() / (4.0 * iters);
  _tile_release();
  return ns;
}
