// The quantized linears at decode rows as a step reads them (docs/performance.md, "int8 tiles at 16
// rows: stores behind their multiply, the weights prefetched"): M rows of x times every matrix of
// SmolLM2-135M's 30 layers (q, k, v, o, gate, up, down), one thread, in three forms of the same
// shapes: bf16 through layer_linear's AMX path (linear.cc), int8 g32 and int4 g32 with mins through
// quant_linear version 2 (quant_linear.cc: AMX-INT8 tiles from 12 / 16 rows, VNNI below). A 512 MB
// buffer is read before each form's round, so the matrices come from DRAM; prints the least and the
// median of the rounds' thread CPU time (other processes only add time). Built against jaxlib's FFI
// headers, on a CPU with AMX:
//
//   g++ -O3 -march=native -std=c++17 -I $(python -c "import jax; print(jax.ffi.include_dir())") \
//       -I runtime/kernels/cpu benchmarks/quant_decode.cc -o /tmp/quant_decode && /tmp/quant_decode [M ROUNDS]
//
// -I another tree's runtime/kernels/cpu builds the same harness against that tree's kernels (A/B).
#include "quant_linear.cc"
#include "linear.cc"
#include <ctime>
#include <cstdio>
#include <random>
using namespace hloserve;

inline double thread_ms() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

int main(int argc, char** argv) {
  if (!amx_usable()) return fprintf(stderr, "quant_decode: this CPU has no usable AMX\n"), 1;
  const int64_t M = argc > 1 ? atoi(argv[1]) : 16, R = argc > 2 ? atoi(argv[2]) : 11, L = 30;
  const int64_t shapes[7][2] = {{576, 576}, {192, 576}, {192, 576}, {576, 576}, {1536, 576}, {1536, 576}, {576, 1536}};
  std::mt19937 rng(1);
  std::vector<std::vector<uint16_t>> wb;                  // bf16 N x K
  std::vector<std::vector<uint8_t>> w8, w4;               // int8 / int4 bytes, version 2's layout (random)
  std::vector<std::vector<float>> scale, mins;            // [N / 16, K / 32, 16]
  for (int64_t l = 0; l < L; ++l)
    for (auto& s : shapes) {
      const int64_t n = s[0] * s[1];
      wb.emplace_back(n);
      for (auto& v : wb.back()) v = 0x3c00 + (rng() & 0x1ff) - 0x100 + ((rng() & 1) << 15);   // bf16 near +-0.01
      w8.emplace_back(n);
      for (auto& v : w8.back()) v = rng();
      w4.emplace_back(n / 2);
      for (auto& v : w4.back()) v = rng();
      scale.emplace_back(n / 32);
      for (auto& v : scale.back()) v = (rng() % 100 + 1) * 1e-4f;
      mins.emplace_back(n / 32);
      for (auto& v : mins.back()) v = -(rng() % 100) * 1e-3f;
    }
  std::vector<float> x(M * 1536), out(M * 1536);
  for (auto& v : x) v = (rng() % 2000) / 1000.f - 1.f;
  auto bf16_step = [&] {
    for (size_t i = 0; i < wb.size(); ++i) {
      const int64_t N = shapes[i % 7][0], K = shapes[i % 7][1], KC = K / 32;
      LineVector<uint16_t> packed((M + 15) / 16 * K * 16);
      for (int64_t g = 0; g < (M + 15) / 16; ++g)
        amx_pack_f32(x.data() + 16 * g * K, std::min<int64_t>(16, M - 16 * g), K, KC, packed.data() + g * K * 16);
      amx_rows(wb[i].data(), K, packed.data(), KC, M, 0, N / 16, out.data(), N);
    }
  };
  auto quant_step = [&](int bits) {
    for (size_t i = 0; i < w8.size(); ++i) {
      const int64_t N = shapes[i % 7][0], K = shapes[i % 7][1];
      const bool four = bits == 4;
      QuantMatrix w{four ? w4[i].data() : w8[i].data(), scale[i].data(), four ? mins[i].data() : nullptr, false, bits,
                    N, K, K / 32, 32};
      QuantX2 xq = quantize_x2(x.data(), M, K, w.G, 32, four ? 0 : 128);
      const int64_t MA = amx_rows(bits, M);
      if (MA > M) pad_rows(xq, MA, K, w.G);
      if (four) {
        if (MA > 0) quant2_amx<4, false>(w, xq, MA, M, 0, N / 16, out.data());
        else quant2_vnni<4, false>(w, xq, 0, M, 0, N / 16, out.data());
      } else {
        if (MA > 0) quant2_amx<8, false>(w, xq, MA, M, 0, N / 16, out.data());
        else quant2_vnni<8, false>(w, xq, 0, M, 0, N / 16, out.data());
      }
    }
  };
  std::vector<float> flush(size_t(128) << 20, 1.f);
  float sink = 0;
  std::vector<double> t[3];
  for (int64_t r = 0; r < R; ++r)
    for (int f = 0; f < 3; ++f) {
      for (size_t i = 0; i < flush.size(); i += 16) sink += flush[i];
      const double a = thread_ms();
      if (f == 0) bf16_step(); else quant_step(f == 1 ? 8 : 4);
      t[f].push_back(thread_ms() - a);
    }
  const char* names[3] = {"bf16", "int8 g32", "int4 g32 asym"};
  printf("M %ld, 30 layers of SmolLM2-135M, one thread, %ld rounds (%g):", M, R, sink > 0 ? 0. : 1.);
  for (int f = 0; f < 3; ++f) {
    std::sort(t[f].begin(), t[f].end());
    printf(" | %s least %.2f median %.2f ms", names[f], t[f][0], t[f][R / 2]);
  }
  printf("\n");
}
