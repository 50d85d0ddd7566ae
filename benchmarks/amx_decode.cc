// The AMX path of layer_linear at decode rows (docs/performance.md, "Decode attention at 16
// sequences"): M rows of x times every layer matrix of a model, each matrix read where it lies (as
// a served decode step reads them: a few hundred MB, far past the last-level cache), one thread,
// the fastest of 7 rounds, and the rate the matrices stream at. Built against jaxlib's FFI headers,
// on a CPU with AMX:
//
//   g++ -O3 -march=native -std=c++17 -I $(python -c "import jax; print(jax.ffi.include_dir())") \
//       benchmarks/amx_decode.cc -o /tmp/amx_decode && /tmp/amx_decode [M LAYERS]
//
// Defaults: SmolLM2-135M's layer matrices (q, k, v, o, gate, up, down) over its 30 layers, 16 rows.
#include "../runtime/kernels/cpu/linear.cc"
#include <chrono>
#include <cstdio>
#include <random>
using namespace hloserve;
int main(int argc, char** argv) {
  if (!amx_usable()) return fprintf(stderr, "amx_decode: this CPU has no usable AMX\n"), 1;
  const int64_t M = argc > 1 ? atoi(argv[1]) : 16, L = argc > 2 ? atoi(argv[2]) : 30;
  const int64_t shapes[7][2] = {{576, 576}, {192, 576}, {192, 576}, {576, 576}, {1536, 576}, {1536, 576}, {576, 1536}};
  std::mt19937 rng(1);
  std::vector<std::vector<uint16_t>> w;   // [layer * 7 + i]: N x K bf16
  double bytes = 0;
  for (int64_t l = 0; l < L; ++l)
    for (auto& s : shapes) {
      w.emplace_back(s[0] * s[1]);
      for (auto& v : w.back()) v = f32_to_bf16((rng() % 2000) / 1000.f - 1.f);
      bytes += 2.0 * s[0] * s[1];
    }
  std::vector<float> x(M * 1536), out(M * 1536);
  for (auto& v : x) v = (rng() % 2000) / 1000.f - 1.f;
  std::vector<uint16_t> xr(16 * 1536), xp(16 * 1536);
  using clock = std::chrono::steady_clock;
  double best = 1e9;
  for (int r = 0; r < 7; ++r) {
    const auto t0 = clock::now();
    for (int64_t l = 0; l < L; ++l)
      for (int i = 0; i < 7; ++i) {
        const int64_t N = shapes[i][0], K = shapes[i][1], KC = K / 32;
        round_rows(x.data(), M, K, Kind::kBF16, xr.data(), K);
        amx_pack(xr.data(), K, 1, KC, xp.data());
        amx_rows(w[l * 7 + i].data(), K, xp.data(), KC, M, 0, N / 16, out.data(), N);
      }
    best = std::min(best, std::chrono::duration<double, std::milli>(clock::now() - t0).count());
  }
  printf("M=%ld, %ld layers: %.2f ms (one thread), %.1f GB/s of matrices\n", M, L, best, bytes / best / 1e6);
}
