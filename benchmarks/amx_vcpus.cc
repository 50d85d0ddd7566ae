// The tile unit's rate on each vCPU alone and on both at once (docs/performance.md, "Paired runs on
// the AMX Xeon kind"): a loop of tile multiplies on L1 operands (2 x 2 accumulators, as layer_linear's
// tiles), pinned to vCPU 0, to vCPU 1, then to both; nanoseconds a multiply, four rounds. A vCPU whose
// physical core's tile unit another tenant shares reads ~3-4x slower in spells of seconds; two vCPUs
// that are siblings of one core would slow each other when run together.
//
//   g++ -O2 -march=native -std=c++17 -pthread -I $(python -c "import jax; print(jax.ffi.include_dir())") \
//       benchmarks/amx_vcpus.cc -o /tmp/amx_vcpus && /tmp/amx_vcpus
#include "../runtime/kernels/cpu/common.h"
#include <pthread.h>
#include <chrono>
#include <cstdio>
#include <thread>
using namespace hloserve;

static double multiply_ns(int64_t n) {
  alignas(64) static thread_local uint16_t a[2][512], b[2][512];
  amx_configure_16x64();
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) {
    _tile_loadd(4, a[0], 64); _tile_loadd(6, b[0], 64); _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b[1], 64); _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a[1], 64); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float s[256];
  _tile_stored(0, s, 64);
  _tile_release();
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / (4.0 * n);
}

static void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

int main() {
  if (!amx_usable()) return fprintf(stderr, "amx_vcpus: this CPU has no usable AMX\n"), 1;
  const int64_t n = 2000000;
  for (int round = 0; round < 4; ++round) {
    double alone0 = 0, alone1 = 0, both0 = 0, both1 = 0;
    std::thread([&] { pin(0); alone0 = multiply_ns(n); }).join();
    std::thread([&] { pin(1); alone1 = multiply_ns(n); }).join();
    std::thread t0([&] { pin(0); both0 = multiply_ns(n); }), t1([&] { pin(1); both1 = multiply_ns(n); });
    t0.join();
    t1.join();
    printf("ns a tile multiply: vCPU 0 alone %.1f, vCPU 1 alone %.1f, both at once %.1f / %.1f\n", alone0, alone1,
           both0, both1);
  }
}
