// Rows of 16-bit activations times rows of a 16-bit matrix, products exact and summed in f32: what
// the 16-bit linear kernels share (linear.cc: one layer's matrix; experts.cc: each expert's matrices
// for the rows routed to it). AVX512-BF16 tiles where the CPU has them, widened f32 products elsewhere.
#pragma once

#include <type_traits>

#include "common.h"

namespace hloserve {
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
// 19.7 GB/s at 16 rows against 61.5 GB/s at 1 row; none where ahead_first >= kPrefetchRows and
// ahead_step > 1). The groups share the prefetching: group g of
// G (G <= 4) fetches rows g, g + G, ... of the next 4, a line per 32 elements as it computes, so
// the reads go on through every group instead of stalling the first while the others find the
// memory idle (decode of 16 sequences, gemma3-1b shape: 128 -> 116 ms, 2026-11-26).
constexpr int kPrefetchRows = 4;  // how far ahead (matrix rows) a tile prefetches
// Up to this many x rows (one or two decode rows) the matrix rows are read one after the other, one
// sequential stream per thread and no software prefetch, each row's products with every x row
// chained in one accumulator (the tiles' order: a row's sums do not change with the row count).
// The tiles read four rows side by side and prefetch four more: eight streams a thread, which the
// hardware prefetchers follow worse than one (one thread read 19-20 GB/s so against 29-30 one row
// after the other). One decode row of the default model took 10-11 ms a step against 14-17, of a
// 1B Llama shape 67-70 against 75-86 (2-core AMD EPYC, weights in 2 MiB pages on both sides,
// 2026-11-30, docs/performance.md); from four rows on, the tiles are the
// faster (at 4 rows 1B: 91-97 against 83-87 ms; at 16 rows the default model 36 against 22).
constexpr int64_t kSeqRows = 2;

template <int NR, int MR>
inline void bf16_tile(const uint16_t* w, int64_t K, const uint16_t* x, int64_t KP, float* out, int64_t N,
                      const uint16_t* ahead, int ahead_first, int ahead_step) {
  __m512 acc[NR][MR];
  HLOSERVE_UNROLL
  for (int i = 0; i < NR; ++i)
    HLOSERVE_UNROLL
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
    HLOSERVE_UNROLL
    for (int j = 0; j < MR; ++j) xv[j] = (__m512bh)_mm512_loadu_si512(x + j * KP + k);
    HLOSERVE_UNROLL
    for (int i = 0; i < NR; ++i) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + i * K + k);
      HLOSERVE_UNROLL
      for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xv[j]);
    }
  }
  if (k < K) {  // the rest of a row: masked loads, zeros add nothing (x is zero-padded to KP)
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m512bh xv[MR];
    HLOSERVE_UNROLL
    for (int j = 0; j < MR; ++j) xv[j] = (__m512bh)_mm512_loadu_si512(x + j * KP + k);
    HLOSERVE_UNROLL
    for (int i = 0; i < NR; ++i) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + i * K + k);
      HLOSERVE_UNROLL
      for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xv[j]);
    }
  }
  if constexpr (NR == 4 && MR == 4) {
    // the 16 sums at once: lane 4j+i of the result is acc[i][j] summed (45 instructions, not 16
    // separate horizontal sums of ~8 each)
    __m512 v[16];
    HLOSERVE_UNROLL
    for (int j = 0; j < 4; ++j)
      HLOSERVE_UNROLL
      for (int i = 0; i < 4; ++i) v[4 * j + i] = acc[i][j];
    const __m512 sums = sum16(v);
    HLOSERVE_UNROLL
    for (int j = 0; j < 4; ++j) _mm_storeu_ps(out + j * N, _mm512_extractf32x4_ps(sums, j));
  } else {
    HLOSERVE_UNROLL
    for (int i = 0; i < NR; ++i)
      HLOSERVE_UNROLL
      for (int j = 0; j < MR; ++j) out[j * N + i] = reduce16(acc[i][j]);   // sum16's order: rows alike
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

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Without AVX512-BF16: NR matrix rows x MR x rows, 16 products per FMA of the widened matrix and
// x (widened once per call, xf: f32 rows KP apart); exact products as vdpbf16ps's, summed in f32.
// Each widened matrix vector serves all MR rows.
template <Kind K16, int NR, int MR>
inline void widened_tile(const uint16_t* w, int64_t K, const float* xf, int64_t KP, float* out, int64_t N) {
  __m512 acc[NR][MR];
  HLOSERVE_UNROLL
  for (int i = 0; i < NR; ++i)
    HLOSERVE_UNROLL
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    // the rest of a row: masked loads of the matrix (x is zero-padded to KP)
    const __mmask16 mask = K - k >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 xv[MR];
    HLOSERVE_UNROLL
    for (int j = 0; j < MR; ++j) xv[j] = _mm512_loadu_ps(xf + j * KP + k);
    HLOSERVE_UNROLL
    for (int i = 0; i < NR; ++i) {
      const __m256i h = _mm256_maskz_loadu_epi16(mask, w + i * K + k);
      const __m512 wv = K16 == Kind::kBF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                                           : _mm512_cvtph_ps(h);
      HLOSERVE_UNROLL
      for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
    }
  }
  HLOSERVE_UNROLL
  for (int i = 0; i < NR; ++i)
    HLOSERVE_UNROLL
    for (int j = 0; j < MR; ++j) out[j * N + i] = _mm512_reduce_add_ps(acc[i][j]);
}

// matrix rows [0, rows) of w times the M rows of x: tiles of 4 x 4, then the edges
template <Kind K16>
void widened_rows_avx512(const uint16_t* w, int64_t K, const uint16_t* x, int64_t KP, int64_t M, int64_t rows,
                         float* out, int64_t N) {
  std::vector<float> widened(M * KP);
  float* xf = widened.data();
  for (int64_t i = 0; i < M * KP; i += 16) _mm512_storeu_ps(xf + i, load16<K16>(x, i));   // KP: whole vectors
  int64_t n = 0;
  for (; n + 4 <= rows; n += 4) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) widened_tile<K16, 4, 4>(w + n * K, K, xf + m * KP, KP, out + m * N + n, N);
    for (; m < M; ++m) widened_tile<K16, 4, 1>(w + n * K, K, xf + m * KP, KP, out + m * N + n, N);
  }
  for (; n < rows; ++n)
    for (int64_t m = 0; m < M; ++m) widened_tile<K16, 1, 1>(w + n * K, K, xf + m * KP, KP, out + m * N + n, N);
}
#endif

#if defined(__AVX512F__)
// 16 f32 (as bits) -> 16 bf16, as f32_to_bf16
inline __m256i round16_bf16(__m512i u) {
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff), abs = _mm512_set1_epi32(0x7fffffff),
                inf = _mm512_set1_epi32(0x7f800000), quiet = _mm512_set1_epi32(0x40);
  const __m512i up = _mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs), inf);
  return _mm512_cvtepi32_epi16(_mm512_mask_or_epi32(_mm512_srli_epi32(up, 16), nan, _mm512_srli_epi32(u, 16), quiet));
}

// which of the 16 elements from k of a row of K lie in it
inline __mmask16 row_mask16(int64_t K, int64_t k) {
  return K - k >= 16 ? __mmask16(0xffff) : K > k ? static_cast<__mmask16>((1u << (K - k)) - 1) : 0;
}
#endif

// x f32[M, K] rounded to `kind`'s 16-bit type (to nearest even), each row zero-padded to KP (a
// whole number of 32-element vectors): the layout the row routines read.
inline void round_rows(const float* x, int64_t M, int64_t K, Kind kind, uint16_t* xr, int64_t KP) {
#if defined(__AVX512F__)
  if (kind == Kind::kBF16) {   // 16 at a time (a prompt chunk's rounding is not free)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < KP; k += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xr + m * KP + k),
                            round16_bf16(_mm512_maskz_loadu_epi32(row_mask16(K, k), x + m * K + k)));
    return;
  }
#endif
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) xr[m * KP + k] = kind == Kind::kBF16 ? f32_to_bf16(x[m * K + k]) : f32_to_f16(x[m * K + k]);
    for (int64_t k = K; k < KP; ++k) xr[m * KP + k] = 0;
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// linear.cc's AMX routines, shared with the grouped experts (experts.cc). linear_amx_pack: x
// [16 * blocks, KP] bf16 rows (rows past the real ones zero) into tiles; linear_amx_rows: matrix rows
// [n0, n0 + 16 * tiles) of w [., K] times the M rows so packed, into out [M, N] (both: linear.cc).
void linear_amx_pack(const uint16_t* x, int64_t KP, int64_t blocks, int64_t KC, uint16_t* xp);
void linear_amx_rows(const uint16_t* w, int64_t K, const uint16_t* xp, int64_t KC, int64_t M, int64_t n0, int64_t tiles,
                     float* out, int64_t N);

// An R x C block of AMX sums (R, C <= 2) in tiles 0-3: tile 0, 1 (C = 2), 2 (R = 2), 3 (both), as
// linear.cc's and quant_linear.cc's tile loops hold them. amx_sums_begin: zero, or loaded from `part`
// (1 KiB a tile, side by side); amx_sums_store: into `part` likewise.
template <int R, int C>
inline void amx_sums_begin(bool zero, const float* part) {
  if (zero) {
    _tile_zero(0);
    if constexpr (C > 1) _tile_zero(1);
    if constexpr (R > 1) _tile_zero(2);
    if constexpr (R > 1 && C > 1) _tile_zero(3);
    return;
  }
  _tile_loadd(0, part, 64);
  if constexpr (C > 1) _tile_loadd(1, part + 256, 64);
  if constexpr (R > 1) _tile_loadd(2, part + 512, 64);
  if constexpr (R > 1 && C > 1) _tile_loadd(3, part + 768, 64);
}

template <int R, int C>
inline void amx_sums_store(float* part) {
  _tile_stored(0, part, 64);
  if constexpr (C > 1) _tile_stored(1, part + 256, 64);
  if constexpr (R > 1) _tile_stored(2, part + 512, 64);
  if constexpr (R > 1 && C > 1) _tile_stored(3, part + 768, 64);
}

// The matrix as the tile multiply's B operand (linear.cc's layer_linear_tiles, quant_linear.cc's
// version 6 chunks): MA blocks of 16 x rows times NB matrix tiles (wb: tile t's chunks side by side,
// 512 elements each, the second tile KC chunks on), chunks [c0, c1). x's tiles: chunk c of the first
// block at x0 + c * xc, its 16 rows xs bytes apart, the second block xb elements on (x's rounded rows
// as they lie: xc = 32, xs = 2 KP, xb = 16 KP; or x laid out as tiles, round_tiles: 512, 64, KC * 512).
// Sums start at zero (c0 = 0) or from `part` and go back to it, or when c1 = KC are stored in out
// (x row m of M its first row; rows past M dropped). Tiles: sums 0-3, x 4-5, matrix 6-7. `ahead` > 0:
// each matrix tile's chunk that many chunks on is prefetched into L1 as this one is multiplied (for
// decode rows, whose tiles wait on memory: see kDecodeAhead).
template <int MA, int NB>
inline void b_block(const uint16_t* x0, int64_t xc, int64_t xs, int64_t xb, const uint16_t* wb, int64_t KC,
                    int64_t c0, int64_t c1, int64_t m, int64_t M, float* part, float* out, int64_t N,
                    int64_t ahead = 0) {
  amx_sums_begin<MA, NB>(c0 == 0, part);
  const uint16_t* x1 = x0 + xb;
  const uint16_t* w1 = wb + KC * 512;
  for (int64_t c = c0; c < c1; ++c) {
    if (ahead > 0) {   // past the tile: the next tile's first chunks, or harmless lines past the matrix
      const char* p0 = reinterpret_cast<const char*>(wb + (c + ahead) * 512);
      const char* p1 = reinterpret_cast<const char*>(w1 + (c + ahead) * 512);
      for (int i = 0; i < 16; ++i) {
        _mm_prefetch(p0 + 64 * i, _MM_HINT_T0);
        if constexpr (NB > 1) _mm_prefetch(p1 + 64 * i, _MM_HINT_T0);
      }
    }
    _tile_loadd(4, x0 + xc * c, xs);
    _tile_loadd(6, wb + c * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB > 1) { _tile_loadd(7, w1 + c * 512, 64); _tile_dpbf16ps(1, 4, 7); }
    if constexpr (MA > 1) {
      _tile_loadd(5, x1 + xc * c, xs);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NB > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  if (c1 < KC || m + 16 * MA > M) {   // partial sums, or a last block of fewer than 16 rows: via `part`
    amx_sums_store<MA, NB>(part);
    if (c1 < KC) return;
    for (int a = 0; a < MA; ++a)
      for (int64_t j = 0; j < 16 && m + 16 * a + j < M; ++j)
        for (int b = 0; b < NB; ++b) std::memcpy(out + (16 * a + j) * N + 16 * b, part + (2 * a + b) * 256 + 16 * j, 64);
    return;
  }
  _tile_stored(0, out, N * 4);
  if constexpr (NB > 1) _tile_stored(1, out + 16, N * 4);
  if constexpr (MA > 1) _tile_stored(2, out + 16 * N, N * 4);
  if constexpr (MA > 1 && NB > 1) _tile_stored(3, out + 16 * N + 16, N * 4);
}

// The tile loops' blocking (layer_linear's AMX path, quant_linear.cc's version 6 chunks): a pair of x
// blocks (32 rows) runs up to kAmxRun chunks of K at a time (48 KiB of x tiles, held in L1) against
// every matrix tile pair of the task in turn (streaming from L2), the partial sums kept in memory
// between runs. This order, x held and the matrix streaming, ran 1.15-1.5x faster at 256+ rows than
// the matrix pair held and x streaming (2026-11-30, one thread: 256 x 576 x 576 25.5-27.0 -> 21.2-22.2
// ns a tile multiply, 512 x 2048 x 2048 21.9-22.1 -> 18.3-19.4; docs/performance.md). block(g, c0, c1,
// t, T, B) computes x blocks [g, g + B) times matrix tiles [t, t + T) over chunks [c0, c1), T and B
// (1 or 2) as std::integral_constant so that the block is a template instance.
constexpr int64_t kAmxRun = 24;

template <class Block>
inline void amx_blocked(int64_t blocks, int64_t KC, int64_t tiles, Block&& block, int64_t most = kAmxRun) {
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  const int64_t runs = (KC + most - 1) / most, run = (KC + runs - 1) / runs;   // chunks per run, even
  for (int64_t g = 0; g < blocks; g += 2) {
    const bool pair = g + 2 <= blocks;
    for (int64_t c0 = 0; c0 < KC; c0 += run) {
      const int64_t c1 = std::min(KC, c0 + run);
      for (int64_t t = 0; t < tiles; t += 2) {
        const bool two = t + 2 <= tiles;
        if (two && pair) block(g, c0, c1, t, Two{}, Two{});
        else if (two) block(g, c0, c1, t, Two{}, One{});
        else if (pair) block(g, c0, c1, t, One{}, Two{});
        else block(g, c0, c1, t, One{}, One{});
      }
    }
  }
}

// Up to 16 rows of x f32[., K] (K a multiple of 32) rounded to bf16 into one block of A tiles: chunk c
// (elements 32c..32c + 31 of each row) a 1 KiB tile at xt + 512 c, rows past `rows` zero. Tiles, not
// rows: rows 2K bytes apart all fall in one L1 set where 2K is a multiple of 4 KiB (K = 2048, 8192),
// and a tile load's 16 lines evicted one another (16 decode rows of a 1B Llama's step 1.3x slower).
inline void round_tiles(const float* x, int64_t rows, int64_t K, uint16_t* xt) {
  const int64_t KC = K / 32;
  for (int64_t i = 0; i < 16; ++i)
    for (int64_t c = 0; c < KC; ++c)
      for (int64_t h = 0; h < 32; h += 16) {
        __m256i v = i < rows ? round16_bf16(_mm512_loadu_si512(x + i * K + 32 * c + h)) : _mm256_setzero_si256();
        _mm256_store_si256(reinterpret_cast<__m256i*>(xt + (c * 16 + i) * 32 + h), v);
      }
}

// x's rows [0, M) rounded into A tiles (round_tiles: block g's chunk c at xt + (g KC + c) 512) times
// matrix tiles [t0, t1) of one matrix laid out as B tiles (wb: tile t's KC chunks from t KC 512, as
// layouts.py lays a layer out), into out [M, N] (linear.cc's layer_linear_tiles, experts.cc's
// grouped_experts_tiles). One thread, the tile configuration already loaded (amx_configure_16x64);
// one block of rows (decode) runs the whole of K at once, its matrix tiles prefetched kDecodeAhead
// chunks ahead, more the blocking of amx_blocked.
//
// kDecodeAhead: a decode row's tile loads wait on memory, two streams of 1 KiB tiles a thread, which
// the hardware prefetchers follow worse than the in-place rows' 16-32 short streams: with every line
// of the chunk 4 on prefetched, one decode row of the default model took 0.905x the time (10 of 10
// alternations), 16 rows 0.952x (9 of 10), and the Llama-3.2-1B shape's laid-out step 0.913x / 0.906x,
// which put it ahead of the rows in place (0.96x / 0.97x) where it had been 1.06x behind (distances
// 2-8 measured alike; prompt chunks, whose later passes read the matrix from L2, gained nothing:
// 1.00x / 1.04x at 64 / 256 rows; 2026-12-02, docs/performance.md).
constexpr int64_t kDecodeAhead = 4;

inline void b_tiles_product(const uint16_t* xt, int64_t M, int64_t KC, const uint16_t* wb, int64_t t0, int64_t t1,
                            float* out, int64_t N) {
  thread_local LineVector<float> partial;   // kept by the pool's threads from call to call
  const int64_t blocks = (M + 15) / 16, tiles = t1 - t0;
  if (partial.size() < static_cast<size_t>((tiles + 1) / 2 * 1024)) partial.resize((tiles + 1) / 2 * 1024);
  amx_blocked(blocks, KC, tiles, [&](int64_t g, int64_t c0, int64_t c1, int64_t t, auto nb, auto ma) {
    b_block<decltype(ma)::value, decltype(nb)::value>(xt + g * KC * 512, 512, 64, KC * 512, wb + (t0 + t) * KC * 512,
                                                      KC, c0, c1, 16 * g, M, partial.data() + t / 2 * 1024,
                                                      out + 16 * g * N + 16 * (t0 + t), N, blocks == 1 ? kDecodeAhead : 0);
  }, blocks == 1 ? KC : kAmxRun);
}

// The split of an AMX product over N matrix rows (N / 16 whole tiles) into tasks on pairs of tiles:
// one task per thread at least, more where a task's packed rows (16 bf16 rows of KP elements a
// tile) would outgrow kAmxRowBytes (L2); run(t0, t1) computes tiles [t0, t1) (layer_linear's AMX path,
// quant_linear.cc's version 6 chunks).
constexpr int64_t kAmxRowBytes = 1 << 20;

template <class Run>
inline void amx_tasks(ffi::ThreadPool& pool, int64_t N, int64_t KP, Run&& run) {
  const int64_t tiles = N / 16, pairs = (tiles + 1) / 2;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t tasks = std::max(threads, (tiles * 16 * KP * 2 + kAmxRowBytes - 1) / kAmxRowBytes);
  tasks = std::min(pairs, (tasks + threads - 1) / threads * threads);
  parallel_for(pool, tasks, 1, [&](int64_t task) {
    const int64_t t0 = 2 * (pairs * task / tasks), t1 = std::min(tiles, 2 * (pairs * (task + 1) / tasks));
    if (t1 > t0) run(t0, t1);
  });
}
#endif

// The B-tile product where AMX is not there (a library built without it, or an OS that denies the
// tile state): x f32 [M, K] rows (K a multiple of 32) rounded to bf16, times matrix tiles [t0, t1) of
// wb (laid out as b_tiles_product reads it), each output's products in f32 summed in k's order, into
// out [M, N]. Correct and slow; the runtime lays weights out as tiles only where AMX or AVX512-BF16
// runs (b_tiles_pairs).
inline void b_tiles_portable(const float* x, int64_t M, int64_t K, const uint16_t* wb, int64_t t0, int64_t t1,
                             float* out, int64_t N) {
  const int64_t KC = K / 32;
  std::vector<float> xr(K);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) xr[k] = bf16_to_f32(f32_to_bf16(x[m * K + k]));
    for (int64_t t = t0; t < t1; ++t) {
      float acc[16] = {};
      for (int64_t c = 0; c < KC; ++c)
        for (int64_t r = 0; r < 16; ++r)
          for (int64_t j = 0; j < 2; ++j) {
            const float xv = xr[32 * c + 2 * r + j];
            const uint16_t* b = wb + (t * KC + c) * 512 + 32 * r + j;
            for (int64_t n = 0; n < 16; ++n) acc[n] += xv * bf16_to_f32(b[2 * n]);
          }
      std::memcpy(out + m * N + 16 * t, acc, sizeof(acc));
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
// The B-tile product with AVX2 and FMA only (CPUs without AVX-512: AMD Zen 2 / Zen 3, Intel before
// Ice Lake). A tile row's 16 pairs are two 256-bit vectors of 8 pairs; each pair's even element is
// its low half shifted up 16 bits, its odd one its high half masked: two exact f32 vectors per load,
// each multiplied against a broadcast of one x row's element and added in f32 (the exact products,
// in k's order, even before odd, as b_tiles_portable sums them). Up to 4 x rows share every tile row
// the loads bring (8 accumulators, 4 widened halves: 14 of the 16 ymm registers); 16 FMAs per 2
// loads, 8 broadcasts and 4 integer operations, so the FMA ports bound it.
//
// x's rows as the kernel reads them (pack_pairs_f32): block g (16 rows) chunk c tile row r as the
// even elements of the 16 rows then their odd ones, each rounded to bf16 and widened back to f32,
// at xp[((g KC + c) 16 + r) 32 + (j 16 + i)], rows past M zero.
inline __m256 round8_bf16(__m256 v) {   // as f32_to_bf16, kept in f32 (low 16 bits zero)
  const __m256i u = _mm256_castps_si256(v);
  const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
  const __m256i up = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                          _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
  const __m256i r = _mm256_blendv_epi8(up, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

inline void pack_pairs_f32(const float* x, int64_t rows, int64_t K, float* xp) {
  const int64_t KC = K / 32;
  alignas(32) float t[32];
  for (int64_t c = 0; c < KC; ++c)
    for (int64_t i = 0; i < 16; ++i) {
      if (i < rows) {
        const float* src = x + i * K + 32 * c;
        for (int q = 0; q < 4; ++q) _mm256_store_ps(t + 8 * q, round8_bf16(_mm256_loadu_ps(src + 8 * q)));
      } else {
        std::memset(t, 0, sizeof(t));
      }
      float* dst = xp + c * 512 + i;
      for (int r = 0; r < 16; ++r) {
        dst[32 * r] = t[2 * r];
        dst[32 * r + 16] = t[2 * r + 1];
      }
    }
}

// chunks prefetched ahead: 16 KB of a tile (a 1B Llama's one-row step 63.5 -> 62.2 ms against 8, the
// default model's 1-256 rows alike or better; Zen 3 EPYC, 2026-12-03)
constexpr int64_t kPairsAheadAvx2 = 16;

// MR packed rows (xp: the block's chunks, from row m0 of it) times NT consecutive tiles (wt: the first,
// KC chunks each, tstride apart) into out (each tile's 16 columns of MR rows, N apart). Every output's
// sum is one chain of FMAs in k's order whatever MR and NT are (a row's sums do not depend on the row
// count); NT tiles side by side only give the FMA units independent chains: one x row of one tile
// is 2 chains of 4-cycle FMAs, 32 deep a chunk, which held one core to ~20 GB/s of weights.
template <int MR, int NT = 1>
inline void b_tile_avx2(const float* xp, int64_t KC, const uint16_t* wt, int64_t tstride, float* out, int64_t N) {
  __m256 acc[NT][MR][2];
  HLOSERVE_UNROLL
  for (int t = 0; t < NT; ++t)
    HLOSERVE_UNROLL
    for (int m = 0; m < MR; ++m) acc[t][m][0] = acc[t][m][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t c = 0; c < KC; ++c) {
    HLOSERVE_UNROLL
    for (int t = 0; t < NT; ++t) {
      const char* ahead = reinterpret_cast<const char*>(wt + t * tstride + (c + kPairsAheadAvx2) * 512);
      HLOSERVE_UNROLL
      for (int l = 0; l < 16; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
    }
    HLOSERVE_UNROLL
    for (int r = 0; r < 16; ++r) {
      const float* p = xp + (c * 16 + r) * 32;
      HLOSERVE_UNROLL
      for (int t = 0; t < NT; ++t) {
        const uint16_t* row = wt + t * tstride + c * 512 + 32 * r;
        const __m256i v0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(row));
        const __m256i v1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(row + 16));
        const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)), o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, high));
        const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16)), o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, high));
        HLOSERVE_UNROLL
        for (int m = 0; m < MR; ++m) {
          const __m256 xe = _mm256_broadcast_ss(p + m);
          acc[t][m][0] = _mm256_fmadd_ps(e0, xe, acc[t][m][0]);
          acc[t][m][1] = _mm256_fmadd_ps(e1, xe, acc[t][m][1]);
          const __m256 xo = _mm256_broadcast_ss(p + 16 + m);
          acc[t][m][0] = _mm256_fmadd_ps(o0, xo, acc[t][m][0]);
          acc[t][m][1] = _mm256_fmadd_ps(o1, xo, acc[t][m][1]);
        }
      }
    }
  }
  HLOSERVE_UNROLL
  for (int t = 0; t < NT; ++t)
    HLOSERVE_UNROLL
    for (int m = 0; m < MR; ++m) {
      _mm256_storeu_ps(out + m * N + 16 * t, acc[t][m][0]);
      _mm256_storeu_ps(out + m * N + 16 * t + 8, acc[t][m][1]);
    }
}

// the tiles b_tiles_avx2 runs side by side for M rows: a range cut at a multiple of it leaves none
// to one-tile groups (experts.cc's shares)
inline int64_t b_tiles_avx2_group(int64_t M) { return M == 1 ? 4 : 1; }

// x's rows [0, M) packed (pack_pairs_f32, block g at xp + g KC 512) times matrix tiles [t0, t1) of
// wb, into out [M, N]: per tile, every block of rows in turn, 4 rows at a time; one row (a request's
// decode) 4 tiles at a time (b_tile_avx2's independent chains: the default model's one-row step 11.5
// -> 10.4 ms, a 1B Llama's 71.7 -> 70.1, Zen 3 EPYC, 2026-12-03; two rows 2 tiles at a time spilled
// registers and lost 8% on the 1B shape, so two rows and more keep one tile)
inline void b_tiles_avx2(const float* xp, int64_t M, int64_t KC, const uint16_t* wb, int64_t t0, int64_t t1,
                         float* out, int64_t N) {
  const int64_t ts = KC * 512;
  int64_t t = t0;
  if (b_tiles_avx2_group(M) == 4)
    for (; t + 4 <= t1; t += 4) b_tile_avx2<1, 4>(xp, KC, wb + t * ts, ts, out + 16 * t, N);
  for (; t < t1; ++t) {
    const uint16_t* wt = wb + t * ts;
    for (int64_t m = 0; m < M; m += 4) {
      const float* xb = xp + (m / 16) * KC * 512 + m % 16;
      float* o = out + m * N + 16 * t;
      switch (std::min<int64_t>(4, M - m)) {
        case 1: b_tile_avx2<1>(xb, KC, wt, ts, o, N); break;
        case 2: b_tile_avx2<2>(xb, KC, wt, ts, o, N); break;
        case 3: b_tile_avx2<3>(xb, KC, wt, ts, o, N); break;
        default: b_tile_avx2<4>(xb, KC, wt, ts, o, N); break;
      }
    }
  }
}
#endif

#if defined(__AVX512BF16__)
// The B-tile product with AVX512-BF16 (CPUs without AMX: the AMD EPYC kind): a B tile's row r holds
// 16 matrix rows' pairs (elements 2r, 2r + 1 of a 32-element chunk), so one vdpbf16ps of that row
// against a broadcast pair of an x row adds two products to each of the 16 outputs of that x row:
// outer products, each output's sum in its own lane, in k's order (a row's sums do not depend on the
// row count), no horizontal sums at the end. Up to 16 x rows share every tile row the load brings
// (16 accumulators), where the row routines (rows16: the matrix as rows, 4 x 4 tiles reduced at the
// end) load a matrix vector per 4 products and sum 16 lanes per output. The default model's 30 layers
// at 16 rows, two threads (a /work harness, weights in 2 MiB pages, 2026-12-02, AMD EPYC): 5.6 ms
// against rows16's 9.7; 1 row 5.4 against 5.3-8.0; 256 rows 70 ms, 774 GFLOP/s (vdpbf16ps's peak
// there ~860 on two cores).
//
// x's rows as the kernel reads them: block g (16 rows) chunk c as 16 pairs x 16 rows of 32 bits (pair
// r of row i at xp[((g KC + c) 16 + r) 16 + i], rounded to bf16), rows past M zero.
inline void pack_pairs(const float* x, int64_t rows, int64_t K, int32_t* xp) {
  const int64_t KC = K / 32;
  alignas(64) int32_t t[16 * 16];
  const char* row[16];
  for (int i = 0; i < 16; ++i) row[i] = reinterpret_cast<const char*>(t + 16 * i);
  for (int64_t c = 0; c < KC; ++c) {
    for (int64_t i = 0; i < 16; ++i) {
      __m512i v = _mm512_setzero_si512();
      if (i < rows) {
        const float* src = x + i * K + 32 * c;
        v = _mm512_inserti64x4(_mm512_castsi256_si512(round16_bf16(_mm512_loadu_si512(src))),
                               round16_bf16(_mm512_loadu_si512(src + 16)), 1);
      }
      _mm512_store_si512(t + 16 * i, v);
    }
    transpose16_rows(row, xp + c * 256, 64);   // pair r of the 16 rows at xp + (c 16 + r) 16
  }
}

// Decode steps of up to 8 rows (bound by the weights' reads): 4 tiles side by side up to 4 rows, 2 up
// to 8; 9 rows and more (bound by the products) as halves of 8 rows over 3 tiles; the tiles left over
// past the last whole group 2, then 1 at a time; none prefetched by hand but the next group of tiles
// behind a 9-16-row block's second half (b_block_tiles).
// A harness of M rows over 2 GB of tiles, two threads (Zen 4 EPYC, 2026-12-03, GB/s, medians of 7;
// the machine's plain read moved between 32 and 57 through the runs, so compare within a line):
// one row, one tile prefetching 8 chunks ahead 26.6-27.1, 4 tiles prefetching 29.3, 4-16 tiles
// without prefetches 30.2-33.0 (read 32-33); 2 rows 23.2 / 33.0 (one tile prefetching / 2 tiles
// without), 4 rows 20.4 / 46.5 (4 tiles), 8 rows 22.5 / 36.4 (2 tiles; read 55-57); 16 rows, one
// tile, 17.8 prefetching, 15.6 without, and as two halves of 8 rows over 3 tiles side by side
// (b_block_tiles<3>: half the broadcasts a product) 18.9-19.4 against 15.9 (bound by the products
// there). The hardware's prefetchers keep up with 4 streams a thread; the hand-made ones took load
// slots from them.

// MR packed rows of one block (xp) times NT consecutive tiles (wt: the first, KC chunks each, tstride
// apart), into out (each tile's 16 columns of MR rows, N apart). Every output's sum is one chain in k's
// order whatever MR and NT are; NT tiles side by side give one row several independent chains (one row
// of one tile is a chain of 16 vdpbf16ps a chunk, each waiting on the one before) and let one
// broadcast of x serve NT products. With PF, each step also prefetches NT lines of `next` into L2
// (NT KC KiB over the call: the next group's tiles, b_block_tiles)
template <int MR, int NT, bool PF = false>
inline void b_tile_pairs(const int32_t* xp, int64_t KC, const uint16_t* wt, int64_t tstride, float* out, int64_t N,
                         const char* next = nullptr) {
  __m512 acc[NT][MR];
  HLOSERVE_UNROLL
  for (int t = 0; t < NT; ++t)
    HLOSERVE_UNROLL
    for (int m = 0; m < MR; ++m) acc[t][m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < KC; ++c) {
    HLOSERVE_UNROLL
    for (int r = 0; r < 16; ++r) {
      const int32_t* pr = xp + (c * 16 + r) * 16;
      if constexpr (PF)
        HLOSERVE_UNROLL
        for (int t = 0; t < NT; ++t) _mm_prefetch(next + ((c * 16 + r) * NT + t) * 64, _MM_HINT_T1);
      HLOSERVE_UNROLL
      for (int t = 0; t < NT; ++t) {
        const __m512bh w = (__m512bh)_mm512_load_si512(wt + t * tstride + c * 512 + 32 * r);
        HLOSERVE_UNROLL
        for (int m = 0; m < MR; ++m)
          acc[t][m] = _mm512_dpbf16_ps(acc[t][m], w, (__m512bh)_mm512_set1_epi32(pr[m]));
      }
    }
  }
  HLOSERVE_UNROLL
  for (int t = 0; t < NT; ++t)
    HLOSERVE_UNROLL
    for (int m = 0; m < MR; ++m) _mm512_storeu_ps(out + m * N + 16 * t, acc[t][m]);
}

// mr <= 8 rows of a block (xb) times NT tiles (b_tile_pairs)
template <int NT, bool PF = false>
inline void b_rows_tiles(const int32_t* xb, int64_t mr, int64_t KC, const uint16_t* wt, int64_t ts, float* o,
                         int64_t N, const char* next = nullptr) {
  switch (mr) {
    case 1: b_tile_pairs<1, NT, PF>(xb, KC, wt, ts, o, N, next); break;
    case 2: b_tile_pairs<2, NT, PF>(xb, KC, wt, ts, o, N, next); break;
    case 3: b_tile_pairs<3, NT, PF>(xb, KC, wt, ts, o, N, next); break;
    case 4: b_tile_pairs<4, NT, PF>(xb, KC, wt, ts, o, N, next); break;
    case 5: b_tile_pairs<5, NT, PF>(xb, KC, wt, ts, o, N, next); break;
    case 6: b_tile_pairs<6, NT, PF>(xb, KC, wt, ts, o, N, next); break;
    case 7: b_tile_pairs<7, NT, PF>(xb, KC, wt, ts, o, N, next); break;
    default: b_tile_pairs<8, NT, PF>(xb, KC, wt, ts, o, N, next); break;
  }
}

// One block of mr <= 16 rows (xb) times NT consecutive tiles (wt: the first, tstride apart), into out:
// up to 8 rows at once, so 9-16 as two halves (rows 0-7, then the rest; the second reads the tiles
// from L1/L2). The first half reads the tiles from memory while it multiplies, the second only
// multiplies: where `next` is given (the first block over a group), the second half prefetches it
// into L2, so the read goes on through both. A harness of 16 rows over the default model's fused
// gate_up [3072, 576] and down [576, 1536] from memory, two threads (Zen 4 EPYC, 2026-12-03, GFLOP/s,
// 3 runs each): 236-262 against 165-224, and 241-255 against 227-234; 256 rows alike (375-395 against
// 362-398); prefetching to L1 (T0) or L3 (T2) instead gained less or lost.
template <int NT>
inline void b_block_tiles(const int32_t* xb, int64_t mr, int64_t KC, const uint16_t* wt, int64_t ts, float* o,
                          int64_t N, const char* next = nullptr) {
  if (mr > 8) {
    b_tile_pairs<8, NT>(xb, KC, wt, ts, o, N);
    xb += 8, o += 8 * N, mr -= 8;
    if (next != nullptr) {
      b_rows_tiles<NT, true>(xb, mr, KC, wt, ts, o, N, next);
      return;
    }
  }
  b_rows_tiles<NT>(xb, mr, KC, wt, ts, o, N);
}

// Tiles [t, t1) of wb NT at a time, every block of x's M rows in turn over each group (the first block
// of each prefetching the next group's tiles, b_block_tiles); returns the first tile of the remainder
// (fewer than NT)
template <int NT>
inline int64_t b_tile_groups(const int32_t* xp, int64_t M, int64_t KC, const uint16_t* wb, int64_t t, int64_t t1,
                             float* out, int64_t N) {
  const int64_t ts = KC * 512;
  for (; t + NT <= t1; t += NT) {
    const char* next = t + 2 * NT <= t1 ? reinterpret_cast<const char*>(wb + (t + NT) * ts) : nullptr;
    for (int64_t g = 0; 16 * g < M; ++g)
      b_block_tiles<NT>(xp + g * KC * 256, std::min<int64_t>(16, M - 16 * g), KC, wb + t * ts, ts,
                        out + 16 * g * N + 16 * t, N, g == 0 ? next : nullptr);
  }
  return t;
}

// the tiles b_tiles_pairs runs side by side for M rows (as measured above): a range cut at a multiple
// of it leaves none to the 2- and 1-tile groups (experts.cc's shares)
inline int64_t b_tiles_pairs_group(int64_t M) { return M <= 4 ? 4 : M <= 8 ? 2 : 3; }

// x's rows [0, M) packed (pack_pairs, block g at xp + g KC 256) times matrix tiles [t0, t1) of wb (laid
// out as b_tiles_product reads it), into out [M, N]: groups of b_tiles_pairs_group(M) tiles side by
// side, then what is left 2 and 1 at a time
inline void b_tiles_pairs(const int32_t* xp, int64_t M, int64_t KC, const uint16_t* wb, int64_t t0, int64_t t1,
                          float* out, int64_t N) {
  const int64_t group = b_tiles_pairs_group(M);
  int64_t t = group == 4   ? b_tile_groups<4>(xp, M, KC, wb, t0, t1, out, N)
              : group == 2 ? b_tile_groups<2>(xp, M, KC, wb, t0, t1, out, N)
                           : b_tile_groups<3>(xp, M, KC, wb, t0, t1, out, N);
  t = b_tile_groups<2>(xp, M, KC, wb, t, t1, out, N);
  b_tile_groups<1>(xp, M, KC, wb, t, t1, out, N);
}
#endif

// out[m * N + n] = x[m] . w[n] for the matrix rows n in [n0, n1) of w [., K] and the M rows of x
// (16-bit `kind`, rows KP apart, zero-padded): the instruction path this build has.
inline void rows16(Kind kind, const uint16_t* w, int64_t K, const uint16_t* x, int64_t KP, int64_t M, int64_t n0,
                   int64_t n1, float* out, int64_t N) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  constexpr auto widened_f16 = widened_rows_avx512<Kind::kF16>;
  [[maybe_unused]] constexpr auto widened_bf16 = widened_rows_avx512<Kind::kBF16>;
#else
  constexpr auto widened_f16 = widened_rows<Kind::kF16>;
  [[maybe_unused]] constexpr auto widened_bf16 = widened_rows<Kind::kBF16>;
#endif
  if (kind == Kind::kF16) {
    widened_f16(w + n0 * K, K, x, KP, M, n1 - n0, out + n0, N);
    return;
  }
  int64_t n = n0;
#if defined(__AVX512BF16__)
  if (M <= kSeqRows) {   // one or two decode rows: the matrix rows one after the other
    for (; n < n1; ++n) {
      if (M == 2) bf16_tile<1, 2>(w + n * K, K, x, KP, out + n, N, nullptr, kPrefetchRows, 2);
      else bf16_tile<1, 1>(w + n * K, K, x, KP, out + n, N, nullptr, kPrefetchRows, 2);
    }
    return;
  }
  for (; n + 4 <= n1; n += 4) bf16_rows<4>(w + n * K, K, x, KP, M, out + n, N);
  for (; n < n1; ++n) bf16_rows<1>(w + n * K, K, x, KP, M, out + n, N);
#else
  widened_bf16(w + n * K, K, x, KP, M, n1 - n, out + n, N);
#endif
}

}  // namespace hloserve
