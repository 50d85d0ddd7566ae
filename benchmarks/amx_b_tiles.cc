// A step's bf16 linears two ways, one thread, the matrices coming from DRAM (a 400 MB read between
// rounds): layer_linear's AMX path (the matrix as the tile multiply's A operand: read in place up to
// 64 rows, copied into tiles per call above) and layer_linear_tiles' (the matrix laid out once as B
// tiles, runtime/kernels/cpu/layouts.py; x rounded into A tiles, the sums stored as out's rows), in
// alternated rounds; medians of 11 and the count of output bits that differ (0: the same sums).
// Shapes: SmolLM2-135M's four layer matrices x 30 layers, or with `big` the Llama-3.2-1B shape's x 4.
// Built against jaxlib's FFI headers, on a CPU with AMX:
//
//   g++ -O3 -march=native -std=c++17 -I $(python -c "import jax; print(jax.ffi.include_dir())") \
//       benchmarks/amx_b_tiles.cc -o /tmp/amx_b_tiles && /tmp/amx_b_tiles [big] ROWS [ROWS ...]
#include "../runtime/kernels/cpu/linear.cc"
#include <chrono>
#include <cstdio>
#include <random>
#include <algorithm>
#include <string>
using namespace hloserve;

// matrix [N, K] bf16 -> B tiles (layouts.py): tile t, chunk c, row r holds (row 16t + n, elements 32c + 2r, + 1)
static void pack_b(const uint16_t* w, int64_t N, int64_t K, uint16_t* wb) {
  const int64_t KC = K / 32;
  for (int64_t t = 0; t < N / 16; ++t)
    for (int64_t c = 0; c < KC; ++c) {
      uint16_t* d = wb + (t * KC + c) * 512;
      for (int r = 0; r < 16; ++r)
        for (int n = 0; n < 16; ++n) {
          d[r * 32 + 2 * n] = w[(16 * t + n) * K + 32 * c + 2 * r];
          d[r * 32 + 2 * n + 1] = w[(16 * t + n) * K + 32 * c + 2 * r + 1];
        }
    }
}

// B form: x rounded into A tiles, then the loop (as linear.cc's tiles_amx, one thread)
static void b_linear(const float* x, int64_t M, int64_t K, const uint16_t* wb, int64_t N, float* out,
                     LineVector<uint16_t>& xt, LineVector<float>& partial) {
  const int64_t KC = K / 32, blocks = (M + 15) / 16, tiles = N / 16;
  xt.resize(blocks * KC * 512);
  for (int64_t g = 0; g < blocks; ++g) round_tiles(x + 16 * g * K, std::min<int64_t>(16, M - 16 * g), K, xt.data() + g * KC * 512);
  partial.resize((tiles + 1) / 2 * 1024);
  amx_configure_16x64();
  amx_blocked(blocks, KC, tiles, [&](int64_t g, int64_t c0, int64_t c1, int64_t t, auto nb, auto ma) {
    b_block<decltype(ma)::value, decltype(nb)::value>(xt.data() + g * KC * 512, 512, 64, KC * 512, wb + t * KC * 512, KC, c0, c1,
                                                      16 * g, M, partial.data() + t / 2 * 1024, out + 16 * g * N + 16 * t, N);
  }, blocks == 1 ? KC : kAmxRun);
  _tile_release();
}

// A form, as LayerLinear's AMX path does it (one thread): x packed from f32, then amx_rows
static void a_linear(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* out,
                     LineVector<uint16_t>& xp) {
  const int64_t KP = K, blocks = (M + 15) / 16;
  xp.resize(blocks * KP * 16);
  for (int64_t g = 0; g < blocks; ++g)
    amx_pack_f32(x + 16 * g * K, std::min<int64_t>(16, M - 16 * g), K, KP / 32, xp.data() + g * KP * 16);
  amx_rows(w, K, xp.data(), KP / 32, M, 0, N / 16, out, N);
}

int main(int argc, char** argv) {
  if (!amx_usable()) return 1;
  const bool big = argc > 1 && std::string(argv[1]) == "big";
  const int L = big ? 4 : 30;
  const int64_t small_shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};   // N, K
  const int64_t big_shapes[4][2] = {{3072, 2048}, {2048, 2048}, {16384, 2048}, {2048, 8192}};
  const int64_t (*shapes)[2] = big ? big_shapes : small_shapes;
  std::mt19937 rng(1);
  std::vector<LineVector<uint16_t>> wa(4 * L), wb(4 * L);
  for (int l = 0; l < L; ++l)
    for (int s = 0; s < 4; ++s) {
      const int64_t N = shapes[s][0], K = shapes[s][1];
      auto& a = wa[l * 4 + s];
      a.resize(N * K);
      for (auto& v : a) v = f32_to_bf16((int(rng() % 2001) - 1000) / 1000.f);
      wb[l * 4 + s].resize(N * K);
      pack_b(a.data(), N, K, wb[l * 4 + s].data());
    }
  std::vector<char> flush(400 << 20, 1);
  LineVector<uint16_t> xp, xr; LineVector<float> partial;
  using clock = std::chrono::steady_clock;
  for (int ai = big ? 2 : 1; ai < argc; ++ai) {
    const int64_t M = atoi(argv[ai]);
    std::vector<float> x(M * 16384), outa(M * 16384), outb(M * 16384);
    for (auto& v : x) v = (int(rng() % 2001) - 1000) / 1000.f;
    // bitwise check on each shape
    size_t bad = 0;
    for (int s = 0; s < 4; ++s) {
      const int64_t N = shapes[s][0], K = shapes[s][1];
      a_linear(x.data(), M, K, wa[s].data(), N, outa.data(), xp);
      b_linear(x.data(), M, K, wb[s].data(), N, outb.data(), xr, partial);
      for (int64_t i = 0; i < M * N; ++i) bad += std::memcmp(&outa[i], &outb[i], 4) != 0;
    }
    std::vector<double> ta, tb;
    for (int r = 0; r < 11; ++r) {
      for (int form = 0; form < 2; ++form) {
        long sum = 0; for (size_t i = 0; i < flush.size(); i += 64) sum += flush[i]++;
        const auto t0 = clock::now();
        for (int l = 0; l < L; ++l)
          for (int s = 0; s < 4; ++s) {
            const int64_t N = shapes[s][0], K = shapes[s][1];
            if ((form + r) % 2 == 0) a_linear(x.data(), M, K, wa[l * 4 + s].data(), N, outa.data(), xp);
            else b_linear(x.data(), M, K, wb[l * 4 + s].data(), N, outb.data(), xr, partial);
          }
        const double ms = std::chrono::duration<double, std::milli>(clock::now() - t0).count() + (sum == 7 ? 1 : 0);
        ((form + r) % 2 == 0 ? ta : tb).push_back(ms);
      }
    }
    std::sort(ta.begin(), ta.end()); std::sort(tb.begin(), tb.end());
    printf("M=%4ld  A(today) min %.2f med %.2f ms   B(prepacked) min %.2f med %.2f ms   B/A med %.3f   bits differing %zu\n",
           (long)M, ta[0], ta[ta.size() / 2], tb[0], tb[tb.size() / 2], tb[tb.size() / 2] / ta[ta.size() / 2], bad);
    fflush(stdout);
  }
}
