// The tile unit's rate on each vCPU alone and on both at once (docs/performance.md, "Paired runs on
// the AMX Xeon kind"): amx_tile_rate.h's loop of tile multiplies on L1 operands pinned to vCPU 0, to
// vCPU 1, then to both; nanoseconds a multiply, four rounds. A vCPU whose physical core's tile unit
// another tenant shares reads ~3-4x slower in spells of seconds; two vCPUs that are siblings of one
// core would slow each other when run together.
//
//   g++ -O2 -march=native -std=c++17 -pthread -I $(python -c "import jax; print(jax.ffi.include_dir())") \
//       benchmarks/amx_vcpus.cc -o /tmp/amx_vcpus && /tmp/amx_vcpus
#include "amx_tile_rate.h"
#include <pthread.h>
#include <cstdio>
#include <thread>

static void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

int main() {
  if (!hloserve::amx_usable()) return fprintf(stderr, "amx_vcpus: this CPU has no usable AMX\n"), 1;
  const int64_t n = 2000000;
  for (int round = 0; round < 4; ++round) {
    double alone0 = 0, alone1 = 0, both0 = 0, both1 = 0;
    std::thread([&] { pin(0); alone0 = tile_multiply_ns(n); }).join();
    std::thread([&] { pin(1); alone1 = tile_multiply_ns(n); }).join();
    std::thread t0([&] { pin(0); both0 = tile_multiply_ns(n); }), t1([&] { pin(1); both1 = tile_multiply_ns(n); });
    t0.join();
    t1.join();
    printf("ns a tile multiply: vCPU 0 alone %.1f, vCPU 1 alone %.1f, both at once %.1f / %.1f\n", alone0, alone1,
           both0, both1);
  }
}
