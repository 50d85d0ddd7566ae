// hloserve.quant_linear version 2's CPU paths alone (docs/quantization.md, "Version 2"), one thread,
// random weights in the v2 layout: the AVX512-VNNI tiles against the AMX-INT8 tiles, and the bf16
// AMX tiles of layer_linear (linear.cc) on a bf16 matrix of the same shape; each time the least of
// 21 repeats of this thread's CPU time (other processes only add time), the activations'
// quantization (or bf16 rounding and packing) included. Prints the
// largest difference between the two integer paths' outputs (they do the same f32 arithmetic: 0).
// Built against jaxlib's FFI headers, on a CPU with AMX:
//
//   g++ -O3 -march=native -fopenmp-simd -std=c++17 -I $(python -c "import jax; print(jax.ffi.include_dir())") \
//       benchmarks/quant_amx_kernel.cc -o /tmp/quant_amx_kernel && /tmp/quant_amx_kernel N K ROWS...
#include "../runtime/kernels/cpu/quant_linear.cc"
#include "../runtime/kernels/cpu/linear.cc"
#include <ctime>
#include <cstdio>
#include <random>
using namespace hloserve;

// this thread's CPU time (not wall time: on a shared machine the time slices other processes take
// are not the kernel's)
inline double thread_us() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

template <typename F>
double least_us(F f) {
  std::vector<double> t;
  for (int r = 0; r < 21; ++r) {
    const double a = thread_us();
    for (int i = 0; i < 3; ++i) f();
    t.push_back((thread_us() - a) / 3);
  }
  std::sort(t.begin(), t.end());
  return t[0];
}

int main(int argc, char** argv) {
  const int64_t N = atoi(argv[1]), K = atoi(argv[2]);
  std::mt19937 rng(1);
  if (!amx_usable()) { printf("no AMX\n"); return 1; }
  for (int ai = 3; ai < argc; ++ai) {
    const int64_t M = atoi(argv[ai]);
    std::vector<float> x(M * K), o1(M * N), o2(M * N), ob(M * N);
    for (auto& v : x) v = (rng() % 2001) / 1000.f - 1.f;
    std::vector<uint16_t> wb(N * K);
    for (auto& v : wb) v = 0x3c00 + (rng() & 0x1ff) - 0x100 + ((rng() & 1) << 15);   // bf16 near +-0.01
    double bf = least_us([&] {
      const int64_t KP = K;
      std::vector<uint16_t> xr(M * KP);
      round_rows(x.data(), M, K, Kind::kBF16, xr.data(), KP);
      std::vector<uint16_t> xz((M + 15) / 16 * 16 * KP, 0);   // x padded to whole 16-row blocks
      std::copy(xr.begin(), xr.end(), xz.begin());
      std::vector<uint16_t> packed((M + 15) / 16 * (KP / 32) * 512);
      amx_pack(xz.data(), KP, (M + 15) / 16, KP / 32, packed.data());
      amx_rows(wb.data(), K, packed.data(), KP / 32, M, 0, N / 16, ob.data(), N);
    });
    printf("N %ld K %ld M %4ld  bf16-amx %8.1f us |", N, K, M, bf);
    for (int kind = 0; kind < 3; ++kind) {   // int8, int4 sym, int4 with mins; groups of 32
      const int bits = kind == 0 ? 8 : 4;
      std::vector<uint8_t> q(N * K * bits / 8);
      for (auto& v : q) v = rng();
      std::vector<float> s(N * K / 32), mn(kind == 2 ? N * K / 32 : 0);
      for (auto& v : s) v = (rng() % 100 + 1) * 1e-4f;
      for (auto& v : mn) v = -(rng() % 100) * 1e-3f;
      QuantMatrix w{q.data(), s.data(), kind == 2 ? mn.data() : nullptr, false, bits, N, K, K / 32, 32};
      const int off = bits == 8 ? 128 : kind == 1 ? 8 : 0;
      auto run = [&](bool amx, float* out) {
        QuantX2 xq = quantize_x2(x.data(), M, K, w.G, 32, off);
        const int64_t MA = amx ? amx_rows(bits, M) : 0;   // 0: the VNNI tiles alone
        if (MA > M) pad_rows(xq, MA, K, w.G);
        if (MA > 0) {
          if (kind == 0) quant2_amx<8, false>(w, xq, MA, M, 0, N / 16, out);
          else if (kind == 1) quant2_amx<4, true>(w, xq, MA, M, 0, N / 16, out);
          else quant2_amx<4, false>(w, xq, MA, M, 0, N / 16, out);
        } else {
          if (kind == 0) quant2_vnni<8, false>(w, xq, 0, M, 0, N / 16, out);
          else if (kind == 1) quant2_vnni<4, true>(w, xq, 0, M, 0, N / 16, out);
          else quant2_vnni<4, false>(w, xq, 0, M, 0, N / 16, out);
        }
      };
      const double tv = least_us([&] { run(false, o1.data()); });
      const double ta = least_us([&] { run(true, o2.data()); });
      double md = 0;
      for (int64_t i = 0; i < M * N; ++i) md = std::max(md, (double)std::fabs(o1[i] - o2[i]));
      printf(" %s vnni %8.1f amx %8.1f (diff %g) |", kind == 0 ? "int8" : kind == 1 ? "int4s" : "int4a", tv, ta, md);
    }
    printf("\n");
    fflush(stdout);
  }
}
