// The machine's read bandwidth as docs/performance.md quotes it: a 1 GiB buffer (written once, so its
// pages exist) summed with 512-bit loads (256-bit without AVX-512) by T threads (default: every core), each its own slice,
// repeated; prints the best and the median of the repeats in GB/s (1e9 bytes a second).
//
//   g++ -O3 -march=native -pthread benchmarks/read_bandwidth.cc -o /tmp/read_bandwidth && /tmp/read_bandwidth [T]
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

int main(int argc, char** argv) {
  const int T = argc > 1 ? atoi(argv[1]) : static_cast<int>(std::thread::hardware_concurrency());
  const size_t bytes = size_t(1) << 30, n = bytes / sizeof(float);
  float* buf = static_cast<float*>(std::aligned_alloc(64, bytes));
  for (size_t i = 0; i < n; ++i) buf[i] = static_cast<float>(i & 7);
  std::vector<double> gbs;
  std::vector<float> sums(T);
  for (int rep = 0; rep < 10; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    for (int t = 0; t < T; ++t)
      pool.emplace_back([&, t] {
        const size_t a = n / T * t, b = t == T - 1 ? n : n / T * (t + 1);
#if defined(__AVX512F__)
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;   // 4 chains: the adds never wait
        for (size_t i = a; i + 64 <= b; i += 64) {
          s0 = _mm512_add_ps(s0, _mm512_load_ps(buf + i));
          s1 = _mm512_add_ps(s1, _mm512_load_ps(buf + i + 16));
          s2 = _mm512_add_ps(s2, _mm512_load_ps(buf + i + 32));
          s3 = _mm512_add_ps(s3, _mm512_load_ps(buf + i + 48));
        }
        sums[t] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
#else
        __m256 s[8];
        for (auto& v : s) v = _mm256_setzero_ps();
        for (size_t i = a; i + 64 <= b; i += 64)
          for (int j = 0; j < 8; ++j) s[j] = _mm256_add_ps(s[j], _mm256_load_ps(buf + i + 8 * j));
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(s[0], s[1]), _mm256_add_ps(s[2], s[3])),
                                             _mm256_add_ps(_mm256_add_ps(s[4], s[5]), _mm256_add_ps(s[6], s[7]))));
        sums[t] = 0;
        for (float v : lanes) sums[t] += v;
#endif
      });
    for (auto& th : pool) th.join();
    gbs.push_back(bytes / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9);
  }
  std::sort(gbs.begin(), gbs.end());
  printf("%d thread(s), 1 GiB read: best %.1f GB/s, median %.1f GB/s (checksum %g)\n", T, gbs.back(), gbs[gbs.size() / 2],
         static_cast<double>(sums[0]));
  std::free(buf);
}
