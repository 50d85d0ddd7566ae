// The paged-attention kernel's decode path alone (docs/performance.md, "Decode attention at 16
// sequences"): S sequences of C cached tokens each, one query token each, every layer's K and V
// planes in a cache larger than the last-level cache with each sequence's blocks scattered (as a
// served cache's are), one thread, the fastest of R rounds; then the bytes read per second.
// Built against jaxlib's FFI headers:
//
//   g++ -O3 -march=native -fopenmp-simd -std=c++17 -I $(python -c "import jax; print(jax.ffi.include_dir())") \
//       benchmarks/attention_kernel.cc -o /tmp/attention_kernel && /tmp/attention_kernel [S C LAYERS [int8]]
//
// Defaults: SmolLM2-135M's attention (3 KV heads of 3 query heads, head_dim 64, blocks of 16,
// 30 layers, bf16 cache) at 16 sequences of 300 tokens: a c=16 decode step's attention. `int8`:
// the int8 cache rows with a zero point (--kv-cache-dtype int8).
#include "../runtime/kernels/cpu/paged_attention_float.cc"
#include "../runtime/kernels/cpu/paged_attention_int8.cc"
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
using namespace hloserve;
using namespace hloserve::paged;
constexpr int KV = 3, G = 3, D = 64, BS = 16;
template <Kind KIND, typename E>
double run(int64_t S, int64_t C, int64_t L) {
  constexpr int64_t R = D + row_extra<KIND>;
  const int64_t B = (C + BS - 1) / BS, N = 1 + S * B;            // blocks a sequence holds; the cache's
  std::mt19937 rng(1);
  std::vector<E> cache(static_cast<size_t>(L) * 2 * KV * N * BS * R);
  for (size_t i = 0; i < cache.size(); ++i) {
    if constexpr (int8_rows<KIND>) {               // codes, then a bf16 scale of 1/64 and a zero point
      const int64_t e = i % R;
      cache[i] = e < D ? static_cast<int8_t>(rng() % 255 - 127) : e == D ? 0 : e == D + 1 ? 0x3c : 3;
    } else {                                       // bf16 bits of a value in [-1, 1)
      const float f = (rng() % 2000) / 1000.f - 1.f;
      uint32_t u;
      std::memcpy(&u, &f, 4);
      cache[i] = static_cast<uint16_t>(u >> 16);
    }
  }
  std::vector<int32_t> ids(N - 1);
  std::iota(ids.begin(), ids.end(), 1);
  std::shuffle(ids.begin(), ids.end(), rng);                      // each sequence's blocks scattered
  std::vector<float> q(S * KV * G * D), out(S * KV * G * D), scores(G * C);
  for (auto& v : q) v = (rng() % 2000) / 1000.f - 1.f;
  const int64_t plane = N * BS * R;
  using clock = std::chrono::steady_clock;
  double best = 1e9;
  for (int r = 0; r < 15; ++r) {
    const auto t0 = clock::now();
    for (int64_t l = 0; l < L; ++l)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t h = 0; h < KV; ++h)
          attend<KIND>(q.data() + (s * KV + h) * G * D, cache.data(), ((l * 2 + 0) * KV + h) * plane,
                       ((l * 2 + 1) * KV + h) * plane, ids.data() + s * B, 0, C, BS, D, G, 0.125f, 0.f,
                       scores.data(), out.data() + (s * KV + h) * G * D);
    best = std::min(best, std::chrono::duration<double, std::milli>(clock::now() - t0).count());
  }
  return best;
}

// A prompt chunk's tile: the last tokens of a C-token prompt (a work item's count), each seeing the positions up to
// its own, through the tile kernel (attend_tile), every layer and KV head; GFLOP/s of q.k and p.v.
double chunk_gflops(int64_t C, int64_t L) {
  const int64_t B = (C + BS - 1) / BS, N = 1 + B;
  std::mt19937 rng(2);
  std::vector<uint16_t> cache(static_cast<size_t>(L) * 2 * KV * N * BS * D);
  for (auto& v : cache) v = static_cast<uint16_t>(0x3c00 + rng() % 0x200);   // bf16 values in [2^-7, 2^-6)
  std::vector<int32_t> ids(B);
  std::iota(ids.begin(), ids.end(), 1);
  const int64_t T = chunk_tile_tokens(Kind::kBF16, D, 0.f);   // a work item's tokens (32 on AMX, else 16)
  std::vector<float> q(T * KV * G * D), out(T * KV * G * D);
  for (auto& v : q) v = (rng() % 2000) / 1000.f - 1.f;
  std::vector<int64_t> begins(T, 0), ends(T);
  double flops = 0;
  for (int64_t t = 0; t < T; ++t) ends[t] = C - T + t + 1, flops += 4.0 * ends[t] * G * D;
  const int64_t plane = N * BS * D;
  using clock = std::chrono::steady_clock;
  double best = 1e9;
  for (int r = 0; r < 7; ++r) {
    const auto t0 = clock::now();
    for (int64_t l = 0; l < L; ++l)
      for (int64_t h = 0; h < KV; ++h)
        attend_tile<Kind::kBF16>(q.data() + h * G * D, out.data() + h * G * D, KV * G * D, T, begins.data(),
                                 ends.data(), cache.data(), ((l * 2 + 0) * KV + h) * plane,
                                 ((l * 2 + 1) * KV + h) * plane, ids.data(), BS, D, G, 0.125f, 0.f);
    best = std::min(best, std::chrono::duration<double, std::milli>(clock::now() - t0).count());
  }
  return flops * L * KV / best / 1e6;
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "chunk") {
    const int64_t C = argc > 2 ? atoi(argv[2]) : 1800;
    printf("chunk tile: %ld tokens at %ld, 30 layers: %.1f GFLOP/s (one thread)\n",
           chunk_tile_tokens(Kind::kBF16, D, 0.f), C, chunk_gflops(C, 30));
    return 0;
  }
  const int64_t S = argc > 1 ? atoi(argv[1]) : 16, C = argc > 2 ? atoi(argv[2]) : 300,
                L = argc > 3 ? atoi(argv[3]) : 30;
  const bool int8 = argc > 4 && std::string(argv[4]) == "int8";
  const double ms = int8 ? run<Kind::kI8ZpRows, int8_t>(S, C, L) : run<Kind::kBF16, uint16_t>(S, C, L);
  const double bytes = 2.0 * L * S * KV * C * (int8 ? D + 3 : 2 * D);
  printf("%s S=%ld C=%ld layers=%ld: %.2f ms (one thread), %.1f GB/s of K and V read\n", int8 ? "int8" : "bf16", S, C,
         L, ms, bytes / ms / 1e6);
}
