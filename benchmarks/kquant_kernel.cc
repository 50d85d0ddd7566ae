// The K-quant kernel's paths alone (docs/quantization.md, "The CPU kernel"), one thread, random
// blocks: version 1's row loop (quant_rows), the 16-row tiles over the per-call copy (kquant_groups)
// and (below 4 rows) version 3's own row loop (kquant_row_loop), and the copy and the header decode by
// themselves; prints the largest difference of the tiles' and the row loop's outputs from version 1's.
// Built against jaxlib's FFI headers, on a CPU with VNNI:
//
//   g++ -O3 -march=native -fopenmp-simd -std=c++17 -I $(python -c "import jax; print(jax.ffi.include_dir())") \
//       benchmarks/kquant_kernel.cc -o /tmp/kquant_kernel && /tmp/kquant_kernel KIND ROWS [N]
//
// KIND: 12 Q4_K, 13 Q5_K, 14 Q6_K; K is 1536 (SmolLM2's down matrix), N 2304 unless given.
#include "../runtime/kernels/cpu/quant_blocks.cc"
#include <chrono>
#include <cstdio>
#include <random>
using namespace hloserve;
int main(int argc, char** argv) {
  const int64_t K = 1536; int64_t N = argc > 3 ? atoi(argv[3]) : 2304;
  int64_t kind = atoi(argv[1]), M = atoi(argv[2]);
  std::mt19937 rng(1);
  const int bits = kind == kQ4K ? 4 : 8, head = kind == kQ6K ? 18 : 16, group = kind == kQ6K ? 16 : 32;
  const int64_t qrow = bits == 8 ? K : K / 2;
  std::vector<uint8_t> q(N * qrow), h(N * K / 256 * head);
  for (auto& v : q) v = rng() & (bits == 8 ? 0x1F : 0xFF);
  for (size_t i = 0; i < h.size(); ++i) h[i] = rng() & 0x3F;
  std::vector<float> x(M * K), out(M * N);
  for (auto& v : x) v = (rng() % 1000) / 500.f - 1.f;
  QuantMatrix w{q.data(), h.data(), kind == kQ6K ? nullptr : h.data(), false, bits, N, K, K / group, group, kind};
  std::vector<uint8_t> sq(16 * qrow);
  std::vector<float> ws(16 * w.G), wm(16 * w.G), ts(16 * w.G), tm(16 * w.G);
  auto t0 = std::chrono::steady_clock::now();
  const int R = 50;
  for (int r = 0; r < R; ++r) for (int64_t g = 0; g < N / 16; ++g) interleave16(w, g * 16, sq.data(), ws.data(), wm.data(), ts.data(), tm.data());
  auto t1 = std::chrono::steady_clock::now();
  for (int r = 0; r < R; ++r) { KQuantX xq = quantize_for_blocks(x.data(), M, w); kquant_groups(w, xq, M, 0, N / 16, out.data()); }
  auto t2 = std::chrono::steady_clock::now();
  for (int r = 0; r < R; ++r) for (int64_t g = 0; g < N / 16; ++g) for (int i = 0; i < 16; ++i) block_row(w, g * 16 + i, ts.data() + i * w.G, w.min ? tm.data() + i * w.G : nullptr);
  auto t3 = std::chrono::steady_clock::now();
  for (int r = 0; r < R; ++r) { QuantizedX xq = quantize_for(x.data(), M, w); quant_rows(w, xq, M, 0, N, out.data()); }
  auto t4 = std::chrono::steady_clock::now();
  for (int r = 0; r < R; ++r) {
    RowX xq = quantize_for_rows(x.data(), M, w);
    if (kind == kQ4K) kquant_row_loop<kQ4K>(w, xq, M, 0, N, out.data());
    else if (kind == kQ5K) kquant_row_loop<kQ5K>(w, xq, M, 0, N, out.data());
    else kquant_row_loop<kQ6K>(w, xq, M, 0, N, out.data());
  }
  auto t5 = std::chrono::steady_clock::now();
  std::vector<float> o2(M * N), o3(M * N);
  { KQuantX xq = quantize_for_blocks(x.data(), M, w); kquant_groups(w, xq, M, 0, (N + 15) / 16, out.data()); }
  { QuantizedX xq = quantize_for(x.data(), M, w); quant_rows(w, xq, M, 0, N, o2.data()); }
  if (M < 4) {
    RowX xq = quantize_for_rows(x.data(), M, w);
    if (kind == kQ4K) kquant_row_loop<kQ4K>(w, xq, M, 0, N, o3.data());
    else if (kind == kQ5K) kquant_row_loop<kQ5K>(w, xq, M, 0, N, o3.data());
    else kquant_row_loop<kQ6K>(w, xq, M, 0, N, o3.data());
  }
  double md = 0, md3 = 0, mx = 0;
  for (int64_t i = 0; i < M * N; ++i) {
    md = std::max(md, (double)std::fabs(out[i] - o2[i])), mx = std::max(mx, (double)std::fabs(o2[i]));
    if (M < 4) md3 = std::max(md3, (double)std::fabs(o3[i] - o2[i]));
  }
  printf("max diff tiles %g, row loop %g (max |out| %g)\n", md, md3, mx);
  auto us = [&](auto a, auto b) { return std::chrono::duration<double, std::micro>(b - a).count() / R; };
  printf("kind %ld M %ld: interleave %.1f us, tiles %.1f us, decode only %.1f us, v1 row loop %.1f us, "
         "v3 row loop %.1f us\n", kind, M, us(t0, t1), us(t1, t2), us(t2, t3), us(t3, t4), us(t4, t5));
}
