// hloserve_layer_linear: a few rows times one layer's 16-bit matrix, read where it lies in the stack
// of all layers; XLA copies the layer out of the stack and then packs (transposes) it for its dot
// kernel, on every call: three passes over the weights where one is needed.
#include "linear.h"

namespace {
using namespace hloserve;

// ---- layer linear ---------------------------------------------------------------------------
// x f32[M, K]; weights [L, N, K] 16-bit floats (holds 1: bf16, 2: f16; any 16-bit storage);
// layer s32[] -> out f32[M, N] = round(x) . weights[layer]^T, products exact, sums in f32
// (the row routines: linear.h).


#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX (Intel Sapphire Rapids and later): a tile multiply does 16 x 16 x 32 bf16 products at
// once, exact, summed in f32 (like vdpbf16ps, denormal inputs and results flushed to zero).
// Computed transposed, out^T [N, M] = W [N, K] . x^T: the matrix is the A operand (a tile is 16 of
// its rows, 32 elements each, used as they lie), x the B operand, whose tiles interleave pairs of
// elements of 16 rows (a transpose of 32-bit pairs, once per call). The sums come out transposed
// too ([matrix row][x row]) and are transposed back into out.

inline void amx_configure() { amx_configure_16x64(); }

// 16 rows of 16 32-bit elements (src, rows `ss` bytes apart) -> their transpose (dst rows `ds` bytes
// apart): common.h's transpose16_rows
inline void transpose16(const void* src, int64_t ss, void* dst, int64_t ds) {
  const char* rows[16];
  for (int i = 0; i < 16; ++i) rows[i] = static_cast<const char*>(src) + i * ss;
  transpose16_rows(rows, dst, ds);
}

// x [16 * blocks, KP] (bf16 bits, rows past M zero) -> xp: per 16-row block g and 32-column chunk
// c, a 16 x 32 tile whose row r holds, for each x row i of the block, elements 2r and 2r + 1 of the
// chunk (xp[((g * KC + c) * 16 + r) * 32 + 2 * i + j] = x[16 g + i, 32 c + 2 r + j])
void amx_pack(const uint16_t* x, int64_t KP, int64_t blocks, int64_t KC, uint16_t* xp) {
  for (int64_t g = 0; g < blocks; ++g)
    for (int64_t c = 0; c < KC; ++c) transpose16(x + 16 * g * KP + 32 * c, KP * 2, xp + (g * KC + c) * 512, 64);
}

// Up to 16 rows of x f32[., K] rounded to bf16 (round16_bf16) straight into one block of tiles as
// amx_pack lays them out (rows past `rows` and elements past K zero): one pass over x where rounding
// into rows and then packing them took two, and no rounded copy of x at all (a 2,048-row chunk's
// is 2.4 MiB at K = 576)
void amx_pack_f32(const float* x, int64_t rows, int64_t K, int64_t KC, uint16_t* xp) {
  alignas(64) uint16_t t[16 * 32];   // the block's 32-element chunk c of each row
  for (int64_t c = 0; c < KC; ++c) {
    for (int64_t i = 0; i < 16; ++i) {
      const float* row = x + (i < rows ? i : 0) * K;   // rows past `rows`: nothing read (mask 0)
      for (int64_t h = 0; h < 32; h += 16) {
        const __mmask16 in = i < rows ? row_mask16(K, 32 * c + h) : __mmask16(0);
        _mm256_store_si256(reinterpret_cast<__m256i*>(t + 32 * i + h),
                           round16_bf16(_mm512_maskz_loadu_epi32(in, row + 32 * c + h)));
      }
    }
    transpose16(t, 64, xp + c * 512, 64);
  }
}

// The matrix rows of a task copied into whole tiles (wp): per pair of 16-row tiles and 32-column
// chunk c, the two tiles one after the other (1 KiB each), zeros past K. One read of the rows, as
// the unpacked tiles would need; then the tiles are contiguous: no rows K elements apart (4 KiB
// at K = 2048: all in one L1 set) and a sequential stream for the prefetchers.
void amx_pack_rows(const uint16_t* w, int64_t K, int64_t tiles, int64_t KC, uint16_t* wp) {
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t c = 0; c < KC; ++c) {
      uint16_t* d = wp + ((t / 2 * KC + c) * 2 + t % 2) * 512;
      const int64_t left = K - 32 * c;
      const __mmask32 mask = left >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1ull << left) - 1);
      for (int64_t i = 0; i < 16; ++i)
        _mm512_storeu_si512(d + 32 * i, _mm512_maskz_loadu_epi16(mask, w + (16 * t + i) * K + 32 * c));
    }
}

// Blocking: linear.h's amx_blocked. No software prefetch: 32 prefetches a chunk cost more than
// they saved once the tiles lay on whole lines (2026-11-29). Up to kAmxInPlaceRows x rows the matrix
// is read where it lies where K is whole chunks (few rows: the copy would cost as much as the
// products).
constexpr int64_t kAmxInPlaceRows = 64;

// Where a pair of matrix tiles lies: tile a (0, 1) of chunk c at p + c * chunk + a * second, its
// 16 rows `stride` bytes apart (packed: 1 KiB tiles side by side; in place: rows K apart)
struct MatrixTiles {
  const uint16_t* p;
  int64_t chunk, second, stride;
};

// NA matrix tiles (wt) times MB blocks of 16 x rows (blocks g, g + 1) over chunks [c0, c1) of K:
// each tile loaded is used by NA or MB tile multiplies (sums in tiles 0-3, matrix tiles 4-5, x
// tiles 6-7). The sums start at zero (c0 = 0) or from `part`, and go back to `part`, or when the
// chunks reach KC are transposed into out (rows past M dropped).
template <int NA, int MB>
inline void amx_block(const MatrixTiles& wt, const uint16_t* xp, int64_t KC, int64_t c0, int64_t c1, int64_t g,
                      int64_t M, float* part, float* out, int64_t N) {
  amx_sums_begin<NA, MB>(c0 == 0, part);
  const uint16_t* x0 = xp + g * KC * 512;
  const uint16_t* x1 = x0 + KC * 512;
  for (int64_t c = c0; c < c1; ++c) {
    _tile_loadd(4, wt.p + c * wt.chunk, wt.stride);
    _tile_loadd(6, x0 + c * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (MB > 1) { _tile_loadd(7, x1 + c * 512, 64); _tile_dpbf16ps(1, 4, 7); }
    if constexpr (NA > 1) {
      _tile_loadd(5, wt.p + c * wt.chunk + wt.second, wt.stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (MB > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  const bool last = c1 == KC;
  alignas(64) float sums[4][16 * 16];   // [tile][matrix row i][x row j]
  float* s = last ? sums[0] : part;
  amx_sums_store<NA, MB>(s);
  if (!last) return;
  for (int a = 0; a < NA; ++a)
    for (int b = 0; b < MB; ++b) {
      const int64_t m = (g + b) * 16;
      if (m + 16 <= M) {
        transpose16(sums[2 * a + b], 64, out + m * N + 16 * a, N * 4);
      } else {
        alignas(64) float t[16 * 16];
        transpose16(sums[2 * a + b], 64, t, 64);
        for (int64_t j = 0; m + j < M; ++j) std::memcpy(out + (m + j) * N + 16 * a, t + 16 * j, 64);
      }
    }
}

// matrix rows [n0, n0 + 16 tiles) of w times every row of x (packed: 16-row blocks)
void amx_rows(const uint16_t* w, int64_t K, const uint16_t* xp, int64_t KC, int64_t M, int64_t n0, int64_t tiles,
              float* out, int64_t N) {
  thread_local LineVector<uint16_t> packed;   // kept by the pool's threads from call to call
  thread_local LineVector<float> partial;
  const bool in_place = M <= kAmxInPlaceRows && K % 32 == 0;
  const size_t size = in_place ? 0 : static_cast<size_t>((tiles + 1) / 2 * KC * 1024);
  if (packed.size() < size) packed.resize(size);
  if (partial.size() < static_cast<size_t>((tiles + 1) / 2 * 1024)) partial.resize((tiles + 1) / 2 * 1024);
  if (!in_place) amx_pack_rows(w + n0 * K, K, tiles, KC, packed.data());
  amx_configure();
  amx_blocked((M + 15) / 16, KC, tiles, [&](int64_t g, int64_t c0, int64_t c1, int64_t t, auto na, auto mb) {
    const MatrixTiles wt = in_place ? MatrixTiles{w + (n0 + 16 * t) * K, 32, 16 * K, 2 * K}
                                    : MatrixTiles{packed.data() + t / 2 * KC * 1024, 1024, 512, 64};
    amx_block<decltype(na)::value, decltype(mb)::value>(wt, xp, KC, c0, c1, g, M, partial.data() + t / 2 * 1024,
                                                        out + n0 + 16 * t, N);
  });
  _tile_release();
}

// Every whole 16-row tile of the matrix (N / 16 of them) times x (packed: amx_pack_f32) on AMX, split
// over the pool: one task per thread at least, more where a task's packed rows would outgrow
// kAmxRowBytes; task boundaries on pairs of tiles. Returns the matrix rows done (the rest: the row
// routines).
int64_t amx_linear(ffi::ThreadPool& pool, const uint16_t* w, int64_t K, int64_t N, const uint16_t* xp, int64_t KP,
                   int64_t M, float* out) {
  amx_tasks(pool, N, KP, [&](int64_t t0, int64_t t1) { amx_rows(w, K, xp, KP / 32, M, 16 * t0, t1 - t0, out, N); });
  return N / 16 * 16;
}
#endif

}  // namespace

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
namespace hloserve {
void linear_amx_pack(const uint16_t* x, int64_t KP, int64_t blocks, int64_t KC, uint16_t* xp) {
  amx_pack(x, KP, blocks, KC, xp);
}
void linear_amx_rows(const uint16_t* w, int64_t K, const uint16_t* xp, int64_t KC, int64_t M, int64_t n0, int64_t tiles,
                     float* out, int64_t N) {
  amx_rows(w, K, xp, KC, M, n0, tiles, out, N);
}
}  // namespace hloserve
#endif

namespace {
using namespace hloserve;

ffi::Error LayerLinear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer weights,
                       ffi::Buffer<ffi::S32> layer, int64_t holds, ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions();
  auto wd = weights.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[2])
    return ffi::Error::InvalidArgument("hloserve_layer_linear: x must be [M, K] and weights [L, N, K]");
  if (!valid_kind(holds) || static_cast<Kind>(holds) == Kind::kF32)
    return ffi::Error::InvalidArgument("hloserve_layer_linear: holds must be 1 (bf16) or 2 (f16)");
  const Kind kind = static_cast<Kind>(holds);
  const int64_t M = xd[0], K = xd[1], L = wd[0], N = wd[1];
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("hloserve_layer_linear: layer out of range");
  const uint16_t* w = static_cast<const uint16_t*>(weights.untyped_data()) + l * N * K;
  const float* xp = x.typed_data();
  float* op = out->typed_data();
  // x rounded to the weights' type once, each row zero-padded to a whole number of 32-element vectors
  // (and zero rows up to a whole 16-row block: AMX multiplies whole blocks)
  const int64_t KP = (K + 31) / 32 * 32, blocks = (M + 15) / 16;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  // AMX for bf16 matrices, every whole 16-row tile (the rest below): x rounded straight into tiles,
  // and into rows only where matrix rows past the last whole tile need them
  const bool amx = kind == Kind::kBF16 && N >= 16 && amx_usable();
  LineVector<uint16_t> packed(amx ? blocks * KP * 16 : 0);   // tiles on whole lines (common.h)
#else
  const bool amx = false;
#endif
  const bool rows = !amx || N % 16 != 0;
  std::vector<uint16_t> xr(rows ? blocks * 16 * KP : 0);
  parallel_for(pool, blocks, 1, [&](int64_t g) {
    const int64_t m = std::min<int64_t>(16, M - 16 * g);
    if (rows) round_rows(xp + 16 * g * K, m, K, kind, xr.data() + 16 * g * KP, KP);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx) amx_pack_f32(xp + 16 * g * K, m, K, KP / 32, packed.data() + g * KP * 16);
#endif
  });
  const uint16_t* xb = xr.data();
  int64_t done = 0;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx) done = amx_linear(pool, w, K, N, packed.data(), KP, M, op);
#endif
  const int64_t tasks = (N - done + kLinearRows - 1) / kLinearRows;
  parallel_for(pool, tasks, 1, [&](int64_t task) {
    const int64_t n0 = done + task * kLinearRows, n1 = std::min(N, n0 + kLinearRows);
    rows16(kind, w, K, xb, KP, M, n0, n1, op, N);
  });
  return ffi::Error::Success();
}

// ---- layer linear, the matrix laid out as B tiles -----------------------------------------------
// hloserve_layer_linear_tiles: layer_linear's operands, attribute and result, for a bf16 stack whose
// every layer [N, K] (N a multiple of 16, K of 32) the runtime laid out once at load as the tile
// multiply's B operand (runtime/kernels/cpu/layouts.py): matrix tile t (rows 16t..16t + 15) and
// chunk c (elements 32c..32c + 31) at (t * K / 32 + c) * 512, its row r holding, for each row 16t + n
// of the tile, elements 32c + 2r and 32c + 2r + 1 (at 32r + 2n, 32r + 2n + 1). x's rounded rows are
// the A operand as they lie and the sums come out as out's rows: no copy of the matrix into tiles
// per call and no transposes of the sums (layer_linear's AMX path does both), and the same products
// summed in the same order as layer_linear's, so the same bits.

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
void tiles_amx(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* out) {
  const int64_t KC = K / 32, blocks = (M + 15) / 16;
  LineVector<uint16_t> xt(blocks * KC * 512);   // x rounded into A tiles (round_tiles), block by block
  auto round_block = [&](int64_t g) {
    round_tiles(x + 16 * g * K, std::min<int64_t>(16, M - 16 * g), K, xt.data() + g * KC * 512);
  };
  if (blocks == 1) round_block(0);   // decode rows: no hand-off for 16 rows of rounding
  else parallel_for(pool, blocks, 1, round_block);
  amx_tasks(pool, N, K, [&](int64_t t0, int64_t t1) {
    amx_configure_16x64();
    b_tiles_product(xt.data(), M, KC, w, t0, t1, out, N);
    _tile_release();
  });
}
#endif

#if defined(__AVX512BF16__)
// Without AMX: x packed into pairs (linear.h's pack_pairs), then each thread's share of the tiles
// (contiguous, as even as N / 16 tiles split: tasks of 64 rows handed out in turn left a thread idle
// for a third of a 192-row matrix) through b_tiles_pairs
void tiles_pairs(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                 float* out) {
  const int64_t KC = K / 32, blocks = (M + 15) / 16, tiles = N / 16;
  LineVector<int32_t> xp(blocks * KC * 256);
  auto pack_block = [&](int64_t g) {
    pack_pairs(x + 16 * g * K, std::min<int64_t>(16, M - 16 * g), K, xp.data() + g * KC * 256);
  };
  if (blocks == 1) pack_block(0);   // decode rows: no hand-off for 16 rows of rounding
  else parallel_for(pool, blocks, 1, pack_block);
  even_shares(pool, tiles, [&](int64_t t0, int64_t t1) { b_tiles_pairs(xp.data(), M, KC, w, t0, t1, out, N); });
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
// With AVX2 and FMA only: x packed as f32 pairs (linear.h's pack_pairs_f32), then each thread's
// share of the tiles through b_tiles_avx2
void tiles_avx2(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                float* out) {
  const int64_t KC = K / 32, blocks = (M + 15) / 16, tiles = N / 16;
  LineVector<float> xp(blocks * KC * 512);
  auto pack_block = [&](int64_t g) {
    pack_pairs_f32(x + 16 * g * K, std::min<int64_t>(16, M - 16 * g), K, xp.data() + g * KC * 512);
  };
  if (blocks == 1) pack_block(0);
  else parallel_for(pool, blocks, 1, pack_block);
  even_shares(pool, tiles, [&](int64_t t0, int64_t t1) { b_tiles_avx2(xp.data(), M, KC, w, t0, t1, out, N); });
}
#endif

// Without AMX, AVX512-BF16 or AVX2: linear.h's b_tiles_portable, a row of x per task (rounded once)
void tiles_portable(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                    float* out) {
  parallel_for(pool, M, 1, [&](int64_t m) { b_tiles_portable(x + m * K, 1, K, w, 0, N / 16, out + m * N, N); });
}

ffi::Error LayerLinearTiles(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer weights,
                            ffi::Buffer<ffi::S32> layer, int64_t holds, ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions();
  auto wd = weights.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[2])
    return ffi::Error::InvalidArgument("hloserve_layer_linear_tiles: x must be [M, K] and weights [L, N, K]");
  if (holds != static_cast<int64_t>(Kind::kBF16) || wd[1] % 16 != 0 || wd[2] % 32 != 0)
    return ffi::Error::InvalidArgument("hloserve_layer_linear_tiles: the weights must hold bf16 (holds 1), N a "
                                       "multiple of 16 and K of 32 (the runtime lays out no other matrix as tiles)");
  const int64_t M = xd[0], K = xd[1], L = wd[0], N = wd[1];
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("hloserve_layer_linear_tiles: layer out of range");
  const uint16_t* w = static_cast<const uint16_t*>(weights.untyped_data()) + l * N * K;
  if (M == 0) return ffi::Error::Success();
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx_usable()) {
    tiles_amx(pool, x.typed_data(), M, K, w, N, out->typed_data());
    return ffi::Error::Success();
  }
#endif
#if defined(__AVX512BF16__)
  tiles_pairs(pool, x.typed_data(), M, K, w, N, out->typed_data());
#elif defined(__AVX2__) && defined(__FMA__)
  tiles_avx2(pool, x.typed_data(), M, K, w, N, out->typed_data());
#else
  tiles_portable(pool, x.typed_data(), M, K, w, N, out->typed_data());
#endif
  return ffi::Error::Success();
}

}  // namespace

// layer_linear's operands and attribute, for both symbols
static auto LayerLinearBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Attr<int64_t>("holds")
      .Ret<ffi::Buffer<ffi::F32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(hloserve_layer_linear, LayerLinear, LayerLinearBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(hloserve_layer_linear_tiles, LayerLinearTiles, LayerLinearBinding());
