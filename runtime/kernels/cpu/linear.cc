// hloserve_layer_linear: a few rows times one layer's 16-bit matrix, read where it lies in the stack
// of all layers; XLA copies the layer out of the stack and then packs (transposes) it for its dot
// kernel, on every call: three passes over the weights where one is needed.
#include "common.h"

namespace {
using namespace hloserve;

// ---- layer linear ---------------------------------------------------------------------------
// x f32[M, K]; weights [L, N, K] 16-bit floats (holds 1: bf16, 2: f16; any 16-bit storage);
// layer s32[] -> out f32[M, N] = round(x) . weights[layer]^T, products exact, sums in f32.

// f32 -> bf16 bits, round to nearest even (NaN stays NaN)
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline uint16_t f32_to_f16(float f) {
  _Float16 h = static_cast<_Float16>(f);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}

#if defined(__AVX512BF16__)
// NR matrix rows x MR x rows: NR * MR accumulators, 32 products per instruction (vdpbf16ps:
// exact products added in f32; it flushes denormal inputs and results to zero, below 1e-38);
// each matrix row is read from memory once and reused from L1 by every group of x rows.
// `ahead`: the matrix rows the next tiles read, prefetched while this one computes (with several
// groups of x rows the tile is compute-bound and the hardware prefetcher falls behind: measured
// 19.7 GB/s at 16 rows against 61.5 GB/s at 1 row). The groups share the prefetching: group g of
// G (G <= 4) fetches rows g, g + G, ... of the next 4, a line per 32 elements as it computes, so
// the reads go on through every group instead of stalling the first while the others find the
// memory idle (decode of 16 sequences, gemma3-1b shape: 128 -> 116 ms, 2026-11-26).
constexpr int kPrefetchRows = 4;  // how far ahead (matrix rows) a tile prefetches

template <int NR, int MR>
inline void bf16_tile(const uint16_t* w, int64_t K, const uint16_t* x, int64_t KP, float* out, int64_t N,
                      const uint16_t* ahead, int ahead_first, int ahead_step) {
  __m512 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if (ahead_step == 1) {   // one group of x rows (up to 4): it prefetches every row
      for (int i = 0; i < kPrefetchRows; ++i) _mm_prefetch(reinterpret_cast<const char*>(ahead + i * K + k), _MM_HINT_T0);
    } else {
      for (int i = ahead_first; i < kPrefetchRows; i += ahead_step)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + i * K + k), _MM_HINT_T0);
    }
    __m512bh xv[MR];
    for (int j = 0; j < MR; ++j) xv[j] = (__m512bh)_mm512_loadu_si512(x + j * KP + k);
    for (int i = 0; i < NR; ++i) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + i * K + k);
      for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xv[j]);
    }
  }
  if (k < K) {  // the rest of a row: masked loads, zeros add nothing (x is zero-padded to KP)
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m512bh xv[MR];
    for (int j = 0; j < MR; ++j) xv[j] = (__m512bh)_mm512_loadu_si512(x + j * KP + k);
    for (int i = 0; i < NR; ++i) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + i * K + k);
      for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xv[j]);
    }
  }
  if constexpr (NR == 4 && MR == 4) {
    // the 16 sums at once: lane 4j+i of the result is acc[i][j] summed (45 instructions, not 16
    // separate horizontal sums of ~8 each)
    __m512 v[16];
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 4; ++i) v[4 * j + i] = acc[i][j];
    const __m512 sums = sum16(v);
    for (int j = 0; j < 4; ++j) _mm_storeu_ps(out + j * N, _mm512_extractf32x4_ps(sums, j));
  } else {
    for (int i = 0; i < NR; ++i)
      for (int j = 0; j < MR; ++j) out[j * N + i] = _mm512_reduce_add_ps(acc[i][j]);
  }
}

template <int NR>
inline void bf16_rows(const uint16_t* w, int64_t K, const uint16_t* x, int64_t KP, int64_t M, float* out, int64_t N) {
  const uint16_t* ahead = w + kPrefetchRows * K;  // a prefetch past the matrix is harmless (never faults)
  const int groups = static_cast<int>(std::min<int64_t>((M + 3) / 4, kPrefetchRows));
  int64_t m = 0;
  for (int g = 0; m + 4 <= M; m += 4, ++g)
    bf16_tile<NR, 4>(w, K, x + m * KP, KP, out + m * N, N, ahead, g < groups ? g : kPrefetchRows, groups);
  const int g = static_cast<int>(m / 4);
  switch (M - m) {
    case 3: bf16_tile<NR, 3>(w, K, x + m * KP, KP, out + m * N, N, ahead, g < groups ? g : kPrefetchRows, groups); break;
    case 2: bf16_tile<NR, 2>(w, K, x + m * KP, KP, out + m * N, N, ahead, g < groups ? g : kPrefetchRows, groups); break;
    case 1: bf16_tile<NR, 1>(w, K, x + m * KP, KP, out + m * N, N, ahead, g < groups ? g : kPrefetchRows, groups); break;
  }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX (Intel Sapphire Rapids and later): a tile multiply does 16 x 16 x 32 bf16 products at
// once, exact, summed in f32 (like vdpbf16ps, denormal inputs and results flushed to zero).
// Computed transposed, out^T [N, M] = W [N, K] . x^T: a tile of the matrix is 16 of its rows,
// 32 elements each, read where they lie (stride K); x is packed once per call in the pair-
// interleaved layout the B operand needs (xp below).

// Linux hands out the tile state on request (once per process; false where it refuses)
bool amx_usable() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void amx_configure() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
  _tile_loadconfig(&c);
}

// x [M, K] (bf16 bits, rows KP apart) -> xp: per 16-row block g and 32-column chunk c, a 16 x 32
// tile whose row r holds, for each x row i of the block, elements 2r and 2r+1 of the chunk
// (xp[((g * KC + c) * 16 + r) * 32 + 2 * i + j] = x[16 g + i, 32 c + 2 r + j]); rows past M are 0.
std::vector<uint16_t> amx_pack(const uint16_t* x, int64_t KP, int64_t M, int64_t KC) {
  const int64_t blocks = (M + 15) / 16;
  std::vector<uint16_t> xp(blocks * KC * 512, 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < KC; ++c)
      for (int64_t r = 0; r < 16; ++r)
        for (int64_t j = 0; j < 2; ++j)
          xp[(((m / 16) * KC + c) * 16 + r) * 32 + 2 * (m % 16) + j] = x[m * KP + 32 * c + 2 * r + j];
  return xp;
}

// NA blocks of 16 matrix rows (w, w + 16 K) times MB blocks of 16 x rows (blocks g, g + 1): each
// tile loaded is used by NA or MB tile multiplies (sums in tiles 0-3, matrix tiles 4-5, x tiles 6-7)
template <int NA, int MB>
inline void amx_block(const uint16_t* w, int64_t K, const uint16_t* xp, int64_t KC, int64_t g, int64_t M,
                      float* out, int64_t N) {
  _tile_zero(0);
  if constexpr (MB > 1) _tile_zero(1);
  if constexpr (NA > 1) _tile_zero(2);
  if constexpr (NA > 1 && MB > 1) _tile_zero(3);
  const uint16_t* x0 = xp + g * KC * 512;
  const uint16_t* x1 = x0 + KC * 512;
  const uint16_t* w1 = w + 16 * K;
  for (int64_t c = 0; c < KC; ++c) {
    _tile_loadd(4, w + 32 * c, K * 2);
    _tile_loadd(6, x0 + c * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (MB > 1) { _tile_loadd(7, x1 + c * 512, 64); _tile_dpbf16ps(1, 4, 7); }
    if constexpr (NA > 1) {
      _tile_loadd(5, w1 + 32 * c, K * 2);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (MB > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float sums[4][16 * 16];   // [tile][matrix row i][x row j]
  _tile_stored(0, sums[0], 64);
  if constexpr (MB > 1) _tile_stored(1, sums[1], 64);
  if constexpr (NA > 1) _tile_stored(2, sums[2], 64);
  if constexpr (NA > 1 && MB > 1) _tile_stored(3, sums[3], 64);
  for (int a = 0; a < NA; ++a)
    for (int b = 0; b < MB; ++b)
      for (int64_t j = 0, m = (g + b) * 16; j < 16 && m < M; ++j, ++m)
        for (int i = 0; i < 16; ++i) out[m * N + 16 * a + i] = sums[2 * a + b][i * 16 + j];
}

// matrix rows [n0, n1) (whole tiles of 16) times every row of x: pairs of 16-row matrix blocks
// against pairs of 16-row x blocks, the matrix rows' slab staying in L1/L2 while x is swept
inline void amx_rows(const uint16_t* w, int64_t K, const uint16_t* xp, int64_t KC, int64_t M, int64_t n0,
                     int64_t n1, float* out, int64_t N) {
  amx_configure();
  const int64_t blocks = (M + 15) / 16;
  for (int64_t n = n0; n < n1; n += 32) {
    const uint16_t* wn = w + n * K;
    const bool two = n + 32 <= n1;
    for (int64_t g = 0; g < blocks; g += 2) {
      const bool pair = g + 2 <= blocks;
      if (two && pair) amx_block<2, 2>(wn, K, xp, KC, g, M, out + n, N);
      else if (two) amx_block<2, 1>(wn, K, xp, KC, g, M, out + n, N);
      else if (pair) amx_block<1, 2>(wn, K, xp, KC, g, M, out + n, N);
      else amx_block<1, 1>(wn, K, xp, KC, g, M, out + n, N);
    }
  }
  _tile_release();
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HLOSERVE_WIDENED_AVX512 1
#endif

#if defined(HLOSERVE_WIDENED_AVX512)
// Without vdpbf16ps (AVX-512 CPUs before Cooper Lake; every f16 matrix): NR matrix rows x MR x
// rows in NR * MR f32 accumulators, 16 products each per k-step. The matrix rows are widened once
// per step and reused by every x row; x was widened once for the call (xf, rows KP apart, zeros
// past K). Each output's sums run in the same order whatever M is (one accumulator per output,
// the same reduction tree), so a row gets the same value alone or in a batch.
template <Kind K16, int NR, int MR>
inline void widened_tile(const uint16_t* w, int64_t K, const float* xf, int64_t KP, float* out, int64_t N) {
  __m512 acc[NR * MR];
  for (int i = 0; i < NR * MR; ++i) acc[i] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[NR];
    for (int i = 0; i < NR; ++i) wv[i] = load16<K16>(w + i * K, k);
    for (int j = 0; j < MR; ++j) {
      const __m512 xv = _mm512_loadu_ps(xf + j * KP + k);
      for (int i = 0; i < NR; ++i) acc[i * MR + j] = _mm512_fmadd_ps(wv[i], xv, acc[i * MR + j]);
    }
  }
  if (k < K) {  // the last partial 16: the matrix rows' tail masked (x is zero-padded past K)
    const __mmask16 tail = static_cast<__mmask16>((1u << (K - k)) - 1);
    for (int i = 0; i < NR; ++i) {
      const __m256i h = _mm256_maskz_loadu_epi16(tail, w + i * K + k);
      const __m512 wv = K16 == Kind::kBF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                                           : _mm512_cvtph_ps(h);
      for (int j = 0; j < MR; ++j) acc[i * MR + j] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xf + j * KP + k), acc[i * MR + j]);
    }
  }
  __m512 v[16];
  for (int i = 0; i < 16; ++i) v[i] = i < NR * MR ? acc[i] : _mm512_setzero_ps();
  alignas(64) float sums[16];
  _mm512_store_ps(sums, sum16(v));
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) out[j * N + i] = sums[i * MR + j];
}

template <Kind K16, int NR>
inline void widened_group(const uint16_t* w, int64_t K, const float* xf, int64_t KP, int64_t M, float* out, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) widened_tile<K16, NR, 4>(w, K, xf + m * KP, KP, out + m * N, N);
  switch (M - m) {
    case 3: widened_tile<K16, NR, 3>(w, K, xf + m * KP, KP, out + m * N, N); break;
    case 2: widened_tile<K16, NR, 2>(w, K, xf + m * KP, KP, out + m * N, N); break;
    case 1: widened_tile<K16, NR, 1>(w, K, xf + m * KP, KP, out + m * N, N); break;
  }
}

// matrix rows [0, rows) of w times every row of x, in tiles of 4 matrix rows (then single rows)
template <Kind K16>
void widened_rows(const uint16_t* w, int64_t K, const float* xf, int64_t KP, int64_t M, int64_t rows, float* out,
                  int64_t N) {
  int64_t n = 0;
  for (; n + 4 <= rows; n += 4) widened_group<K16, 4>(w + n * K, K, xf, KP, M, out + n, N);
  for (; n < rows; ++n) widened_group<K16, 1>(w + n * K, K, xf, KP, M, out + n, N);
}
#else
// Any 16-bit float: widen and multiply-add in f32 (the same products and f32 sums).
template <Kind K16>
void widened_rows(const uint16_t* w, int64_t K, const uint16_t* x, int64_t KP, int64_t M, int64_t rows, float* out,
                  int64_t N) {
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < K; ++k) acc += load<K16>(x, m * KP + k) * load<K16>(w, n * K + k);
      out[m * N + n] = acc;
    }
}
#endif

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
  const int64_t KP = (K + 31) / 32 * 32;
  std::vector<uint16_t> xr(M * KP, 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xr[m * KP + k] = kind == Kind::kBF16 ? f32_to_bf16(xp[m * K + k]) : f32_to_f16(xp[m * K + k]);
  const uint16_t* xb = xr.data();
#if defined(HLOSERVE_WIDENED_AVX512)
  // the widened path's x: the rounded rows as f32, zeros past K (AVX-512 without vdpbf16ps, or f16)
  std::vector<float> xw;
#if defined(__AVX512BF16__)
  const bool widen = kind == Kind::kF16;
#else
  const bool widen = true;
#endif
  if (widen) {
    xw.assign(M * KP, 0.f);
    for (int64_t i = 0; i < M * KP; ++i) xw[i] = kind == Kind::kBF16 ? bf16_to_f32(xb[i]) : f16_to_f32(xb[i]);
  }
  const float* xwide = xw.data();
#else
  const uint16_t* xwide = xb;
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  // AMX for bf16 matrices whose rows are whole 32-element tiles (the tail of 16-row tiles below)
  const bool amx = kind == Kind::kBF16 && K % 32 == 0 && amx_usable();
  const std::vector<uint16_t> packed = amx ? amx_pack(xb, KP, M, K / 32) : std::vector<uint16_t>();
#endif
  const int64_t tasks = (N + kLinearRows - 1) / kLinearRows;
  parallel_for(pool, tasks, 1, [&](int64_t task) {
    const int64_t n0 = task * kLinearRows, n1 = std::min(N, n0 + kLinearRows);
    if (kind == Kind::kF16) {
      widened_rows<Kind::kF16>(w + n0 * K, K, xwide, KP, M, n1 - n0, op + n0, N);
      return;
    }
    int64_t n = n0;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx) {
      const int64_t whole = n0 + (n1 - n0) / 16 * 16;
      if (whole > n0) amx_rows(w, K, packed.data(), K / 32, M, n0, whole, op, N);
      n = whole;
    }
#endif
#if defined(__AVX512BF16__)
    for (; n + 4 <= n1; n += 4) bf16_rows<4>(w + n * K, K, xb, KP, M, op + n, N);
    for (; n < n1; ++n) bf16_rows<1>(w + n * K, K, xb, KP, M, op + n, N);
#else
    widened_rows<Kind::kBF16>(w + n * K, K, xwide, KP, M, n1 - n, op + n, N);
#endif
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(hloserve_layer_linear, LayerLinear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("holds")
                                  .Ret<ffi::Buffer<ffi::F32>>());
