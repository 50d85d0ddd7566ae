// The paged attention kernel's arithmetic (hloserve_paged_attention, paged_attention.cc): one token's
// attention over its sequence's blocks (`attend`) and a tile of a prompt chunk's tokens (`attend_tile`),
// templates over the cache's element kind. Each kind is compiled in its own file
// (paged_attention_float.cc: f32, bf16, f16; paged_attention_int8.cc: the int8 rows; paged_attention_fp8.cc:
// the fp8 e4m3 rows), so the library's
// slowest unit builds in parallel rather than alone.
#pragma once
#include "common.h"

namespace hloserve::paged {


// exp_nonpositive, prefetch_bytes: common.h

// A row of the cache into L1 ahead of its use: every 64-byte line it touches. Decode reads each
// sequence's blocks in table order, a few KiB each, scattered over the cache: the hardware
// prefetchers barely start on one block before the next, so without this the loop waits on memory
// for each row (docs/performance.md, "Decode attention at 16 sequences").
template <Kind K>
constexpr int64_t elem_size = K == Kind::kF32 ? 4 : scaled_rows<K> ? 1 : 2;   // bytes an element

template <Kind K, int64_t R>
inline void prefetch_row(const void* cache, int64_t off) {
  prefetch_bytes(cache, off * elem_size<K>, R * elem_size<K>);    // R known: the loop unrolls
}

// The same into L2 only (prefetcht1): rows read a whole pass later, which would push the rows in
// use out of L1 (a pass over 300 positions is 38 KiB of bf16 rows at D = 64)
template <Kind K, int64_t R>
inline void prefetch_row_l2(const void* cache, int64_t off) {
  const char* p = static_cast<const char*>(cache) + off * elem_size<K>;
  constexpr int64_t bytes = R * elem_size<K>;
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
  if (bytes % 64 != 0) __builtin_prefetch(p + bytes - 1, 0, 2);
}

// Rows this many positions ahead are prefetched: ~2 blocks of 16, about a memory latency of work.
constexpr int64_t kPrefetchRows = 32;
// A token's V rows are fetched into L2 during its K pass (its V pass then starts on rows already
// there rather than cold), where they take at most this many bytes; longer contexts, as before
constexpr int64_t kL2AheadBytes = 256 << 10;

// D and G known at compile time: the per-position loops unroll and the accumulators stay in
// registers; a K or V row is widened once and used by every query head of its group.
template <Kind K, int G, int D>
void attend_fixed(const float* q, const void* cache, int64_t kbase, int64_t vbase, const int32_t* table,
                  int64_t begin, int64_t end, int64_t BS, float scale, float softcap, float* scores, float* out) {
  const int64_t n = end - begin;
  constexpr int64_t R = D + row_extra<K>;  // elements per cache row
  const bool l2_ahead = n * R * elem_size<K> <= kL2AheadBytes;
  // each position's row in a (layer, K|V, head) plane, found once for K and V alike (no division
  // per position; every path reads it), and kPrefetchRows more entries so the prefetches past the
  // end read a valid row
  thread_local std::vector<int64_t> rows;
  rows.resize(n + kPrefetchRows);
  for (int64_t c = begin, b = begin / BS, o = begin % BS; c < end; ++c) {
    rows[c - begin] = (static_cast<int64_t>(table[b]) * BS + o) * R;
    if (++o == BS) o = 0, ++b;
  }
  std::fill(rows.begin() + n, rows.end(), rows[n - 1]);
  float qs[G][D];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) qs[g][d] = q[g * D + d] * scale;
#if defined(__AVX512F__)
  if constexpr (D % 16 == 0) {
    // 16 positions at a time: per position and head one vector of partial products, then the
    // 16 positions' sums in one transpose-and-add tree (not a horizontal sum each)
    // int8 rows: q.k of the stored codes, then per position (dot - zero * sum(q)) * scale, 16
    // positions in one vector (no per-element dequantization); fp8 rows: q.k of the e4m3 values
    // (times 2^-8, load16), then times the scale (times 2^8)
    constexpr int V = D / 16;
    __m512 part[G][16];
    __m512 qsum[G];
    for (int g = 0; g < G; ++g) {
      float t = 0.f;
      for (int d = 0; d < D; ++d) t += qs[g][d];
      qsum[g] = _mm512_set1_ps(t);
    }
    alignas(64) float rsa[16], rza[16];
    for (int64_t i = 0; i < kPrefetchRows && i < n; ++i) {
      prefetch_row<K, R>(cache, kbase + rows[i]);
      if (l2_ahead) prefetch_row_l2<K, R>(cache, vbase + rows[i]);
    }
    for (int64_t c0 = begin; c0 < end; c0 += 16) {
      const int nb = static_cast<int>(std::min<int64_t>(16, end - c0));
      for (int p = 0; p < 16; ++p) {
        if (p >= nb) {
          for (int g = 0; g < G; ++g) part[g][p] = _mm512_setzero_ps();
          rsa[p] = rza[p] = 0.f;
          continue;
        }
        const int64_t c = c0 + p;
        const int64_t off = kbase + rows[c - begin];
        prefetch_row<K, R>(cache, kbase + rows[c - begin + kPrefetchRows]);
        if (l2_ahead) prefetch_row_l2<K, R>(cache, vbase + rows[c - begin + kPrefetchRows]);
        __m512 kv[V];
        for (int v = 0; v < V; ++v) kv[v] = load16<K>(cache, off + 16 * v);
        rsa[p] = row_scale<K>(cache, off, D);
        rza[p] = row_zero<K>(cache, off, D);
        for (int g = 0; g < G; ++g) {
          __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qs[g]), kv[0]);
          for (int v = 1; v < V; ++v) a = _mm512_fmadd_ps(_mm512_loadu_ps(qs[g] + 16 * v), kv[v], a);
          part[g][p] = a;
        }
      }
      const __mmask16 mask = static_cast<__mmask16>((1u << nb) - 1);
      for (int g = 0; g < G; ++g) {
        __m512 sums = sum16(part[g]);
        if constexpr (int8_rows<K>)
          sums = _mm512_mul_ps(_mm512_fnmadd_ps(_mm512_load_ps(rza), qsum[g], sums), _mm512_load_ps(rsa));
        if constexpr (K == Kind::kF8E4M3Rows) sums = _mm512_mul_ps(sums, _mm512_load_ps(rsa));   // no zero point
        _mm512_mask_storeu_ps(scores + g * n + (c0 - begin), mask, sums);
      }
    }
  } else
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (D % 8 == 0) {
    // the AVX-512 path's with 8 positions at a time (sum8); the same scores, rows and prefetches
    constexpr int V = D / 8;
    __m256 part[G][8];
    __m256 qsum[G];
    for (int g = 0; g < G; ++g) {
      float t = 0.f;
      for (int d = 0; d < D; ++d) t += qs[g][d];
      qsum[g] = _mm256_set1_ps(t);
    }
    alignas(32) float rsa[8], rza[8], lanes[8];
    for (int64_t i = 0; i < kPrefetchRows && i < n; ++i) {
      prefetch_row<K, R>(cache, kbase + rows[i]);
      if (l2_ahead) prefetch_row_l2<K, R>(cache, vbase + rows[i]);
    }
    for (int64_t c0 = begin; c0 < end; c0 += 8) {
      const int nb = static_cast<int>(std::min<int64_t>(8, end - c0));
      for (int p = 0; p < 8; ++p) {
        if (p >= nb) {
          for (int g = 0; g < G; ++g) part[g][p] = _mm256_setzero_ps();
          rsa[p] = rza[p] = 0.f;
          continue;
        }
        const int64_t c = c0 + p;
        const int64_t off = kbase + rows[c - begin];
        prefetch_row<K, R>(cache, kbase + rows[c - begin + kPrefetchRows]);
        if (l2_ahead) prefetch_row_l2<K, R>(cache, vbase + rows[c - begin + kPrefetchRows]);
        __m256 kv[V];
        HLOSERVE_UNROLL
        for (int v = 0; v < V; ++v) kv[v] = load8<K>(cache, off + 8 * v);
        rsa[p] = row_scale<K>(cache, off, D);
        rza[p] = row_zero<K>(cache, off, D);
        HLOSERVE_UNROLL
        for (int g = 0; g < G; ++g) {
          __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qs[g]), kv[0]);
          HLOSERVE_UNROLL
          for (int v = 1; v < V; ++v) a = _mm256_fmadd_ps(_mm256_loadu_ps(qs[g] + 8 * v), kv[v], a);
          part[g][p] = a;
        }
      }
      for (int g = 0; g < G; ++g) {
        __m256 sums = sum8(part[g]);
        if constexpr (int8_rows<K>)
          sums = _mm256_mul_ps(_mm256_fnmadd_ps(_mm256_load_ps(rza), qsum[g], sums), _mm256_load_ps(rsa));
        if constexpr (K == Kind::kF8E4M3Rows) sums = _mm256_mul_ps(sums, _mm256_load_ps(rsa));
        _mm256_store_ps(lanes, sums);
        std::memcpy(scores + g * n + (c0 - begin), lanes, nb * sizeof(float));
      }
    }
  } else
#endif
  {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t off = kbase + rows[c - begin];
      const float rs = row_scale<K>(cache, off, D), rz = row_zero<K>(cache, off, D);
      float kf[D];
#pragma omp simd
      for (int d = 0; d < D; ++d) kf[d] = (load<K>(cache, off + d) - rz) * rs;
      for (int g = 0; g < G; ++g) {
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int d = 0; d < D; ++d) acc += qs[g][d] * kf[d];
        scores[g * n + (c - begin)] = acc;
      }
    }
  }
  if (softcap > 0.f)
    for (int64_t i = 0; i < G * n; ++i) scores[i] = softcap * std::tanh(scores[i] / softcap);
  float inv[G];
  for (int g = 0; g < G; ++g) {
    float* s = scores + g * n;
    float m = s[0];
#pragma omp simd reduction(max : m)   // (a scalar max is a 4-cycle chain per position: a fifth of the kernel)
    for (int64_t i = 1; i < n; ++i) m = s[i] > m ? s[i] : m;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      s[i] = exp_nonpositive(s[i] - m);
      sum += s[i];
    }
    inv[g] = 1.f / sum;
  }
  // out = sum_c p_c (v_c - z_c) s_c: the codes summed with weight p_c s_c, and the zero points'
  // sum_c p_c s_c z_c subtracted once at the end (int8 rows; s = 1, z = 0 for float rows)
  float zsum[G] = {};
#if defined(__AVX512F__)
  if constexpr (D % 16 == 0) {
    // the row widened once into V vectors, the G heads' sums in registers (a float array here was
    // kept on the stack and loaded and stored for every position); the same sums in the same order
    constexpr int V = D / 16;
    __m512 vacc[G][V];
    HLOSERVE_UNROLL
    for (int g = 0; g < G; ++g)
      HLOSERVE_UNROLL
      for (int v = 0; v < V; ++v) vacc[g][v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < kPrefetchRows && i < n; ++i) prefetch_row<K, R>(cache, vbase + rows[i]);
    for (int64_t c = begin; c < end; ++c) {
      const int64_t off = vbase + rows[c - begin];
      prefetch_row<K, R>(cache, vbase + rows[c - begin + kPrefetchRows]);
      const float rs = row_scale<K>(cache, off, D), rz = row_zero<K>(cache, off, D);
      __m512 vv[V];
      HLOSERVE_UNROLL
      for (int v = 0; v < V; ++v) vv[v] = load16<K>(cache, off + 16 * v);
      HLOSERVE_UNROLL
      for (int g = 0; g < G; ++g) {
        const float p = scores[g * n + (c - begin)] * rs;
        zsum[g] += p * rz;
        const __m512 pv = _mm512_set1_ps(p);
        HLOSERVE_UNROLL
        for (int v = 0; v < V; ++v) vacc[g][v] = _mm512_fmadd_ps(pv, vv[v], vacc[g][v]);
      }
    }
    HLOSERVE_UNROLL
    for (int g = 0; g < G; ++g)
      HLOSERVE_UNROLL
      for (int v = 0; v < V; ++v)
        _mm512_storeu_ps(out + g * D + 16 * v, _mm512_mul_ps(_mm512_sub_ps(vacc[g][v], _mm512_set1_ps(zsum[g])),
                                                              _mm512_set1_ps(inv[g])));
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (D % 8 == 0) {
    // 16 ymm registers: the G heads' sums for VC of the row's V vectors at a time (G VC + VC <= 16:
    // D = 64, G = 3 in two passes of 32 dims over the positions, the second reading rows from L1/L2),
    // each in registers for the whole pass; the same sums in the same order as the AVX-512 path's
    constexpr int V = D / 8;
    constexpr int VC = [] {
      int best = 1;
      for (int c = 1; c <= V; ++c)
        if (V % c == 0 && (G + 1) * c <= 16) best = c;
      return best;
    }();
    for (int v0 = 0; v0 < V; v0 += VC) {
      __m256 vacc[G][VC];
      HLOSERVE_UNROLL
      for (int g = 0; g < G; ++g)
        HLOSERVE_UNROLL
        for (int v = 0; v < VC; ++v) vacc[g][v] = _mm256_setzero_ps();
      for (int64_t i = 0; i < kPrefetchRows && i < n; ++i) prefetch_row<K, R>(cache, vbase + rows[i]);
      for (int64_t c = begin; c < end; ++c) {
        const int64_t off = vbase + rows[c - begin];
        prefetch_row<K, R>(cache, vbase + rows[c - begin + kPrefetchRows]);
        const float rs = row_scale<K>(cache, off, D);
        __m256 vv[VC];
        HLOSERVE_UNROLL
        for (int v = 0; v < VC; ++v) vv[v] = load8<K>(cache, off + 8 * (v0 + v));
        HLOSERVE_UNROLL
        for (int g = 0; g < G; ++g) {
          const float p = scores[g * n + (c - begin)] * rs;
          if (v0 == 0) zsum[g] += p * row_zero<K>(cache, off, D);
          const __m256 pv = _mm256_set1_ps(p);
          HLOSERVE_UNROLL
          for (int v = 0; v < VC; ++v) vacc[g][v] = _mm256_fmadd_ps(pv, vv[v], vacc[g][v]);
        }
      }
      HLOSERVE_UNROLL
      for (int g = 0; g < G; ++g)
        HLOSERVE_UNROLL
        for (int v = 0; v < VC; ++v)
          _mm256_storeu_ps(out + g * D + 8 * (v0 + v), _mm256_mul_ps(_mm256_sub_ps(vacc[g][v], _mm256_set1_ps(zsum[g])),
                                                                     _mm256_set1_ps(inv[g])));
    }
    return;
  }
#endif
  float acc[G][D] = {};
  for (int64_t c = begin; c < end; ++c) {
    const int64_t off = vbase + rows[c - begin];
    const float rs = row_scale<K>(cache, off, D), rz = row_zero<K>(cache, off, D);
    float vf[D];
#pragma omp simd
    for (int d = 0; d < D; ++d) vf[d] = load<K>(cache, off + d);
    for (int g = 0; g < G; ++g) {
      const float p = scores[g * n + (c - begin)] * rs;
      zsum[g] += p * rz;
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[g][d] += p * vf[d];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) out[g * D + d] = (acc[g][d] - zsum[g]) * inv[g];
}

// Any G and D: one query head at a time.
template <Kind K>
void attend_any(const float* q, const void* cache, int64_t kbase, int64_t vbase, const int32_t* table,
                int64_t begin, int64_t end, int64_t BS, int64_t D, int64_t G, float scale, float softcap, float* scores,
                float* out) {
  const int64_t n = end - begin;
  const int64_t R = D + row_extra<K>;  // elements per cache row
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * D;
    float* og = out + g * D;
    for (int64_t c = begin; c < end; ++c) {
      const int64_t off = kbase + (static_cast<int64_t>(table[c / BS]) * BS + c % BS) * R;
      const float rz = row_zero<K>(cache, off, D);
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < D; ++d) acc += qg[d] * (load<K>(cache, off + d) - rz);
      acc *= row_scale<K>(cache, off, D);
      scores[c - begin] = softcap > 0.f ? softcap * std::tanh(acc * scale / softcap) : acc * scale;
    }
    float m = scores[0];
    for (int64_t i = 1; i < n; ++i) m = std::max(m, scores[i]);
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) sum += (scores[i] = exp_nonpositive(scores[i] - m));
    std::fill(og, og + D, 0.f);
    for (int64_t c = begin; c < end; ++c) {
      const int64_t off = vbase + (static_cast<int64_t>(table[c / BS]) * BS + c % BS) * R;
      const float p = scores[c - begin] / sum * row_scale<K>(cache, off, D), rz = row_zero<K>(cache, off, D);
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) og[d] += p * (load<K>(cache, off + d) - rz);
    }
  }
}

template <Kind K>
void attend(const float* q, const void* cache, int64_t kbase, int64_t vbase, const int32_t* table, int64_t begin,
            int64_t end, int64_t BS, int64_t D, int64_t G, float scale, float softcap, float* scores, float* out) {
#define HLOSERVE_ATTEND(g, d)                                                                      \
  if (G == g && D == d)                                                                            \
    return attend_fixed<K, g, d>(q, cache, kbase, vbase, table, begin, end, BS, scale, softcap, scores, out);
#if defined(HLOSERVE_TESTED_SHAPES_ONLY)
  // a test build (build.py TESTED_SHAPES_ENV; the fallback builds of tests/runtime/
  // test_kernel_fallbacks.py): only the head shapes the kernel tests run (test_kernels.py HEADS)
  // are specialized, a quarter of the compile; any other runs attend_any
  HLOSERVE_ATTEND(3, 64) HLOSERVE_ATTEND(4, 128) HLOSERVE_ATTEND(4, 256) HLOSERVE_ATTEND(1, 96)
#else
  HLOSERVE_ATTEND(1, 64) HLOSERVE_ATTEND(2, 64) HLOSERVE_ATTEND(3, 64) HLOSERVE_ATTEND(4, 64)
  HLOSERVE_ATTEND(5, 64) HLOSERVE_ATTEND(6, 64) HLOSERVE_ATTEND(7, 64) HLOSERVE_ATTEND(8, 64)
  HLOSERVE_ATTEND(1, 128) HLOSERVE_ATTEND(2, 128) HLOSERVE_ATTEND(3, 128) HLOSERVE_ATTEND(4, 128)
  HLOSERVE_ATTEND(5, 128) HLOSERVE_ATTEND(6, 128) HLOSERVE_ATTEND(7, 128) HLOSERVE_ATTEND(8, 128)
  HLOSERVE_ATTEND(1, 96) HLOSERVE_ATTEND(2, 96) HLOSERVE_ATTEND(4, 96)              // Phi-3
  HLOSERVE_ATTEND(1, 256) HLOSERVE_ATTEND(2, 256) HLOSERVE_ATTEND(4, 256) HLOSERVE_ATTEND(8, 256)   // Gemma 2/3
#endif
#undef HLOSERVE_ATTEND
  attend_any<K>(q, cache, kbase, vbase, table, begin, end, BS, D, G, scale, softcap, scores, out);
}

// Several consecutive tokens of one sequence (a prompt chunk): they share every K and V row, so
// the tile's rows r = (token, query head) are computed together. Scores are held transposed,
// s[c][r], with the rows across vector lanes: each K element is broadcast against a vector of
// query rows (no horizontal sums), and the softmax over positions c is vertical. K and V rows are
// widened once per tile instead of once per token.
constexpr int kTileTokens = 16;  // query tokens per work item
constexpr int kLanes = 16;       // rows per score vector
constexpr int kPosBlock = 8;     // positions per score register block
constexpr int kDimBlock = 8;     // head dims per output register block
#if defined(__AVX512F__)
constexpr int kGroups = 3;       // vectors of rows per register block (up to 48 rows: 24 of 32 registers)
#else
constexpr int kGroups = 1;       // 16 ymm registers: one vector of rows (2 ymm) x 8
#endif

// s[c][r] = sum_d k[c][d] * qt[d][r] for RG vectors of rows from r0 and kPosBlock positions from c0:
// each k element is broadcast once against RG row vectors (sums over d in order, as ever)
template <int RG>
inline void score_block(const float* kf, const float* qt, int64_t D, int64_t RP, int64_t r0, int64_t c0, float* st) {
  float acc[kPosBlock][RG][kLanes] = {};
  for (int64_t d = 0; d < D; ++d) {
    const float* qv = qt + d * RP + r0;
    HLOSERVE_UNROLL
    for (int i = 0; i < kPosBlock; ++i) {
      const float kv = kf[(c0 + i) * D + d];
      HLOSERVE_UNROLL
      for (int g = 0; g < RG; ++g)
#pragma omp simd
        for (int l = 0; l < kLanes; ++l) acc[i][g][l] += kv * qv[g * kLanes + l];
    }
  }
  for (int i = 0; i < kPosBlock; ++i)
    for (int g = 0; g < RG; ++g)
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) st[(c0 + i) * RP + r0 + g * kLanes + l] = acc[i][g][l];
}

// o[d][r] = sum_c p[c][r] * v[c][d] for RG vectors of rows from r0 and kDimBlock dims from d0, rows
// across lanes (p[c][r0...] is contiguous in s): each v element is broadcast once against RG row
// vectors (sums over c in order, as ever)
template <int RG>
inline void value_block(const float* st, const float* vf, int64_t n, int64_t DP, int64_t RP, int64_t r0, int64_t d0,
                        float* ot) {
  float acc[kDimBlock][RG][kLanes] = {};
  for (int64_t c = 0; c < n; ++c) {
    const float* pc = st + c * RP + r0;
    const float* vr = vf + c * DP + d0;
    HLOSERVE_UNROLL
    for (int j = 0; j < kDimBlock; ++j) {
      const float v = vr[j];
      HLOSERVE_UNROLL
      for (int g = 0; g < RG; ++g)
#pragma omp simd
        for (int l = 0; l < kLanes; ++l) acc[j][g][l] += v * pc[g * kLanes + l];
    }
  }
  for (int j = 0; j < kDimBlock; ++j)
    for (int g = 0; g < RG; ++g)
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) ot[(d0 + j) * RP + r0 + g * kLanes + l] = acc[j][g][l];
}

}  // namespace hloserve::paged

#include "paged_attention_amx.h"

namespace hloserve::paged {

// tokens a prompt chunk's work item takes (the AMX tiles take more: their K and V packing is per item)
inline int64_t chunk_tile_tokens(Kind kind, int64_t D, float softcap) {
#if defined(HLOSERVE_PAGED_AMX)
  if (kind == Kind::kBF16 && amx_tiles_apply(D, softcap)) return kAmxTileTokens;
#endif
  (void)kind, (void)D, (void)softcap;
  return kTileTokens;
}

struct TileScratch {
  std::vector<float> k, v, qt, s, o, inv;
  std::vector<int32_t> lo, hi;
};

// q and out: the tile's first token's heads, `stride` apart from one token to the next.
template <Kind K>
void attend_tile(const float* q, float* out, int64_t stride, int64_t ntok, const int64_t* begins, const int64_t* ends,
                 const void* cache, int64_t kbase, int64_t vbase, const int32_t* table, int64_t BS, int64_t D,
                 int64_t G, float scale, float softcap) {
#if defined(HLOSERVE_PAGED_AMX)
  if constexpr (K == Kind::kBF16)
    if (attend_tile_amx(q, out, stride, ntok, begins, ends, cache, kbase, vbase, table, BS, D, G, scale, softcap)) return;
#endif
  thread_local TileScratch w;
  int64_t lo = INT64_MAX, hi = 0;                                        // over tokens that see something
  for (int64_t i = 0; i < ntok; ++i)
    if (ends[i] > begins[i]) lo = std::min(lo, begins[i]), hi = std::max(hi, ends[i]);
  const int64_t rows = ntok * G;
  const int64_t RP = (rows + kLanes - 1) / kLanes * kLanes;              // rows padded to whole vectors
  const int64_t n = hi - lo;
  const int64_t NP = (n + kPosBlock - 1) / kPosBlock * kPosBlock;       // positions padded to blocks
  const int64_t DP = (D + kDimBlock - 1) / kDimBlock * kDimBlock;       // V rows padded to dim blocks
  // every element read is written below, but for the padding: K's rows past n, V's dims past D
  // (zeroing the whole scratch each tile was 7% of a long chunk's attention)
  w.k.resize(NP * D);
  std::fill(w.k.begin() + n * D, w.k.begin() + NP * D, 0.f);
  w.v.resize(n * DP);
  w.qt.assign(D * RP, 0.f);
  w.s.resize(NP * RP);
  w.o.resize(DP * RP);
  w.inv.assign(RP, 0.f);
  w.lo.assign(RP, 0);
  w.hi.assign(RP, 0);                                                    // padded rows see nothing
  float* kf = w.k.data();
  float* vf = w.v.data();
  const int64_t R = D + row_extra<K>;                                    // elements per cache row
  for (int64_t c = lo; c < hi; ++c) {                                   // widen (dequantize) each row once
    const int64_t slot = static_cast<int64_t>(table[c / BS]) * BS + c % BS;
    if (const int64_t a = c + kPrefetchRows; a < hi) {                   // a row ahead (see prefetch_row)
      const int64_t ahead = static_cast<int64_t>(table[a / BS]) * BS + a % BS;
      prefetch_bytes(cache, (kbase + ahead * R) * elem_size<K>, R * elem_size<K>);
      prefetch_bytes(cache, (vbase + ahead * R) * elem_size<K>, R * elem_size<K>);
    }
    const int64_t koff = kbase + slot * R, voff = vbase + slot * R;
    const float ks = row_scale<K>(cache, koff, D), vs = row_scale<K>(cache, voff, D);
    const float kz = row_zero<K>(cache, koff, D), vz = row_zero<K>(cache, voff, D);
    float* kr = kf + (c - lo) * D;
    float* vr = vf + (c - lo) * DP;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) kr[d] = (load<K>(cache, koff + d) - kz) * ks;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) vr[d] = (load<K>(cache, voff + d) - vz) * vs;
    std::fill(vr + D, vr + DP, 0.f);
  }
  for (int64_t t = 0; t < ntok; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = t * G + g;
      for (int64_t d = 0; d < D; ++d) w.qt[d * RP + r] = q[t * stride + g * D + d] * scale;
      w.lo[r] = static_cast<int32_t>(std::max<int64_t>(begins[t] - lo, 0));
      w.hi[r] = static_cast<int32_t>(std::max<int64_t>(ends[t] - lo, 0));
    }
  // s[c][r] = sum_d k[c][d] * qt[d][r]: kPosBlock x up to kGroups vectors of rows
  float* st = w.s.data();
  for (int64_t r0 = 0; r0 < RP; r0 += kGroups * kLanes) {
    const int64_t groups = std::min<int64_t>(kGroups, (RP - r0) / kLanes);
    for (int64_t c0 = 0; c0 < NP; c0 += kPosBlock) {
      if (groups == 3) score_block<3>(kf, w.qt.data(), D, RP, r0, c0, st);
      else if (groups == 2) score_block<2>(kf, w.qt.data(), D, RP, r0, c0, st);
      else score_block<1>(kf, w.qt.data(), D, RP, r0, c0, st);
    }
  }
  // softcap, mask, softmax over c: vertical, one lane per row
  const int32_t* rlo = w.lo.data();
  const int32_t* rhi = w.hi.data();
  if (softcap > 0.f)
    for (int64_t i = 0; i < n * RP; ++i) st[i] = softcap * std::tanh(st[i] / softcap);
  for (int64_t r0 = 0; r0 < RP; r0 += kLanes) {
    // positions every live lane (row) of this vector sees, [clo, chi): no per-lane test there; the
    // edges (a window's start, the causal end of the tile's tokens) test each lane. Masked terms were
    // and are exact zeros, summed in the same order c = 0, 1, ...: the same bits as one masked loop.
    int32_t clo = 0, chi = static_cast<int32_t>(n);
    float live[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      live[l] = rhi[r0 + l] > rlo[r0 + l] ? 1.f : 0.f;
      if (live[l] != 0.f) clo = std::max(clo, rlo[r0 + l]), chi = std::min(chi, rhi[r0 + l]);
    }
    chi = std::max(chi, clo);
    float m[kLanes], sum[kLanes] = {};
    for (int l = 0; l < kLanes; ++l) m[l] = -INFINITY;
    auto max_edge = [&](int64_t c) {
      const float* sc = st + c * RP + r0;
      const int32_t ci = static_cast<int32_t>(c);
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) m[l] = ci >= rlo[r0 + l] && ci < rhi[r0 + l] ? std::max(m[l], sc[l]) : m[l];
    };
    for (int64_t c = 0; c < clo; ++c) max_edge(c);
    for (int64_t c = clo; c < chi; ++c) {
      const float* sc = st + c * RP + r0;
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) m[l] = std::max(m[l], sc[l]);
    }
    for (int64_t c = chi; c < n; ++c) max_edge(c);
    auto exp_edge = [&](int64_t c) {
      float* sc = st + c * RP + r0;
      const int32_t ci = static_cast<int32_t>(c);
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) {
        const float p = ci >= rlo[r0 + l] && ci < rhi[r0 + l] ? exp_nonpositive(std::min(sc[l] - m[l], 0.f)) : 0.f;
        sc[l] = p;
        sum[l] += p;
      }
    };
    for (int64_t c = 0; c < clo; ++c) exp_edge(c);
    for (int64_t c = clo; c < chi; ++c) {           // padded lanes (m = -inf or garbage) give 0 by `live`
      float* sc = st + c * RP + r0;
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) {
        const float p = live[l] * exp_nonpositive(std::min(sc[l] - m[l], 0.f));
        sc[l] = p;
        sum[l] += p;
      }
    }
    for (int64_t c = chi; c < n; ++c) exp_edge(c);
    for (int l = 0; l < kLanes; ++l) w.inv[r0 + l] = sum[l] > 0.f ? 1.f / sum[l] : 0.f;
  }
  // out[r][d] = inv[r] * sum_c p[c][r] * v[c][d], computed transposed (o[d][r]) in blocks of
  // kDimBlock dims x up to kGroups vectors of rows; padded rows' p are 0
  float* ot = w.o.data();
  for (int64_t r0 = 0; r0 < RP; r0 += kGroups * kLanes) {
    const int64_t groups = std::min<int64_t>(kGroups, (RP - r0) / kLanes);
    for (int64_t d0 = 0; d0 < DP; d0 += kDimBlock) {
      if (groups == 3) value_block<3>(st, vf, n, DP, RP, r0, d0, ot);
      else if (groups == 2) value_block<2>(st, vf, n, DP, RP, r0, d0, ot);
      else value_block<1>(st, vf, n, DP, RP, r0, d0, ot);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r / G, g = r % G;
    float* o = out + t * stride + g * D;
    for (int64_t d = 0; d < D; ++d) o[d] = ot[d * RP + r] * w.inv[r];
  }
}

// Declared for every kind here, defined in the file compiling that kind (see the top of this file).
#define HLOSERVE_PAGED_KIND(PREFIX, K)                                                                     \
  PREFIX template void attend<K>(const float*, const void*, int64_t, int64_t, const int32_t*, int64_t, int64_t, \
                                 int64_t, int64_t, int64_t, float, float, float*, float*);                 \
  PREFIX template void attend_tile<K>(const float*, float*, int64_t, int64_t, const int64_t*, const int64_t*, \
                                      const void*, int64_t, int64_t, const int32_t*, int64_t, int64_t, int64_t, \
                                      float, float);
HLOSERVE_PAGED_KIND(extern, Kind::kF32)
HLOSERVE_PAGED_KIND(extern, Kind::kBF16)
HLOSERVE_PAGED_KIND(extern, Kind::kF16)
HLOSERVE_PAGED_KIND(extern, Kind::kI8Rows)
HLOSERVE_PAGED_KIND(extern, Kind::kI8ZpRows)
HLOSERVE_PAGED_KIND(extern, Kind::kF8E4M3Rows)

}  // namespace hloserve::paged
