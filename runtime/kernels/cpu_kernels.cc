// hloserve's CPU kernels, called from StableHLO through XLA's FFI (custom_call).
//
// Each kernel computes exactly what a portable StableHLO formulation in the artifact computes: the
// composites' contracts are runtime/artifact/kernels.py, their decompositions (the reference)
// exporter/lowerings/attention.py and linalg.py; the runtime builds this file on first use
// (runtime/kernels/__init__.py) and registers the targets for the CPU platform only. They exist
// because XLA:CPU materializes what these read in place:
//
//   hloserve_paged_attention: attention of each token over its own sequence's paged context,
//     read block by block straight from the KV cache (16-bit float bits or f32), only the blocks
//     in use; XLA gathers every sequence's padded context, widened to f32, before its dots.
//     hloserve_paged_attention_v2 is the same with the window an operand (composite version 2).
//   hloserve_layer_linear: a few rows times one layer's 16-bit matrix, read where it lies in the
//     stack of all layers; XLA copies the layer out of the stack and then packs (transposes) it
//     for its dot kernel, on every call: three passes over the weights where one is needed.
//   hloserve_quant_linear: the same with an int8 / int4 matrix, multiplied as integers (int8
//     activations, VNNI); XLA writes the dequantized f32 layer to memory and reads it back.
//
// Work is split over XLA's intra-op thread pool; the calling thread takes a share and never
// waits on a task that has not started.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <string>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// bf16 / f16 bits -> f32
inline float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float f16_to_f32(uint16_t h) { return static_cast<float>(*reinterpret_cast<const _Float16*>(&h)); }

// Runs fn(i) for i in [0, n) over the pool's threads and the calling thread.
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, int64_t grain, F fn) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  if (n <= 0) return;
  int64_t chunks = (n + grain - 1) / grain;
  int64_t helpers = std::min<int64_t>(pool.num_threads(), chunks) - 1;
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto shared = std::make_shared<Shared>();
  auto work = [shared, chunks, grain, n, fn]() {
    for (;;) {
      int64_t c = shared->next.fetch_add(1);
      if (c >= chunks) return;
      int64_t end = std::min(n, (c + 1) * grain);
      for (int64_t i = c * grain; i < end; ++i) fn(i);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t h = 0; h < helpers; ++h) {
    auto task = work;  // each task owns a copy; a late one finds no chunk left and returns
    pool.Schedule(std::move(task));
  }
  work();
  // every chunk is claimed; the ones still running belong to started helpers
  while (shared->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

// What a cache or weight buffer holds: the composites' `holds` attribute. The values are
// hloserve.runtime.artifact.kernels.Holds (OWN, BF16, F16); tests/runtime/test_contract.py checks them.
enum class Kind : int64_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

inline bool valid_kind(int64_t holds) { return holds >= 0 && holds <= static_cast<int64_t>(Kind::kF16); }


// Calls fn(std::integral_constant<Kind, K>{}) for the runtime `kind`.
template <typename F>
void with_kind(Kind kind, F fn) {
  switch (kind) {
    case Kind::kF32: return fn(std::integral_constant<Kind, Kind::kF32>{});
    case Kind::kBF16: return fn(std::integral_constant<Kind, Kind::kBF16>{});
    case Kind::kF16: return fn(std::integral_constant<Kind, Kind::kF16>{});
  }
}

template <Kind K>
inline float load(const void* base, int64_t i) {
  if constexpr (K == Kind::kF32) return static_cast<const float*>(base)[i];
  if constexpr (K == Kind::kBF16) return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
  return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
}

#if defined(__AVX512F__)
// Lane k of the result: the sum of v[k]'s 16 lanes. A transpose-and-add tree: pairs of vectors,
// then pairs of pairs (within each 128-bit segment), then the four segments.
inline __m512 sum16(const __m512* v) {
  __m512 a[8], b[4];
  for (int p = 0; p < 8; ++p)  // per segment: [x0+x2, y0+y2, x1+x3, y1+y3] of x = v[2p], y = v[2p+1]
    a[p] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * p], v[2 * p + 1]), _mm512_unpackhi_ps(v[2 * p], v[2 * p + 1]));
  for (int p = 0; p < 4; ++p) {  // per segment: [sum x, sum y, sum z, sum w] of v[4p..4p+3] over the segment
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(a[2 * p]), _mm512_castps_pd(a[2 * p + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(a[2 * p]), _mm512_castps_pd(a[2 * p + 1]));
    b[p] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  // b[p] segment s: partial sums of v[4p..4p+3] over segment s; add the four segments
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x44), _mm512_shuffle_f32x4(b[0], b[1], 0xEE));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x44), _mm512_shuffle_f32x4(b[2], b[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD));
}

// 16 consecutive elements of a K or V row, as f32
template <Kind K>
inline __m512 load16(const void* base, int64_t i) {
  if constexpr (K == Kind::kF32) return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
  if constexpr (K == Kind::kBF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}
#endif

// ---- paged attention ----------------------------------------------------------------------
// q f32[T, KV, G, D]; cache [L, 2, KV, N, BS, D]; layer s32[]; block_tables s32[S, B];
// seq_ids, positions s32[T]; context_lens s32[S] -> out f32[T, KV, G, D].
// Token t sees positions c of its sequence with c <= positions[t], c < context_len and, with a
// window w > 0, c > positions[t] - w; scores are scale * q.k, then softcap * tanh(s / softcap)
// when softcap > 0. A token that sees nothing (padding) gets zeros.

// e^x for x <= 0 (softmax arguments), vectorizable: 2^n * p(r), x = n ln2 + r, |r| <= ln2/2;
// relative error < 2e-7 (degree-6 Taylor polynomial of e^r); x below -87 gives 0.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // Cody-Waite: ln2 split in two
  float p = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// D and G known at compile time: the per-position loops unroll and the accumulators stay in
// registers; a K or V row is widened once and used by every query head of its group.
template <Kind K, int G, int D>
void attend_fixed(const float* q, const void* cache, int64_t kbase, int64_t vbase, const int32_t* table,
                  int64_t begin, int64_t end, int64_t BS, float scale, float softcap, float* scores, float* out) {
  const int64_t n = end - begin;
  float qs[G][D];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) qs[g][d] = q[g * D + d] * scale;
#if defined(__AVX512F__)
  if constexpr (D % 16 == 0) {
    // 16 positions at a time: per position and head one vector of partial products, then the
    // 16 positions' sums in one transpose-and-add tree (not a horizontal sum each)
    constexpr int V = D / 16;
    __m512 part[G][16];
    for (int64_t c0 = begin; c0 < end; c0 += 16) {
      const int nb = static_cast<int>(std::min<int64_t>(16, end - c0));
      for (int p = 0; p < 16; ++p) {
        if (p >= nb) {
          for (int g = 0; g < G; ++g) part[g][p] = _mm512_setzero_ps();
          continue;
        }
        const int64_t c = c0 + p;
        const int64_t off = kbase + (static_cast<int64_t>(table[c / BS]) * BS + c % BS) * D;
        __m512 kv[V];
        for (int v = 0; v < V; ++v) kv[v] = load16<K>(cache, off + 16 * v);
        for (int g = 0; g < G; ++g) {
          __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qs[g]), kv[0]);
          for (int v = 1; v < V; ++v) a = _mm512_fmadd_ps(_mm512_loadu_ps(qs[g] + 16 * v), kv[v], a);
          part[g][p] = a;
        }
      }
      const __mmask16 mask = static_cast<__mmask16>((1u << nb) - 1);
      for (int g = 0; g < G; ++g) _mm512_mask_storeu_ps(scores + g * n + (c0 - begin), mask, sum16(part[g]));
    }
  } else
#endif
  {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t off = kbase + (static_cast<int64_t>(table[c / BS]) * BS + c % BS) * D;
      float kf[D];
#pragma omp simd
      for (int d = 0; d < D; ++d) kf[d] = load<K>(cache, off + d);
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
    for (int64_t i = 1; i < n; ++i) m = std::max(m, s[i]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      s[i] = exp_nonpositive(s[i] - m);
      sum += s[i];
    }
    inv[g] = 1.f / sum;
  }
  float acc[G][D] = {};
  for (int64_t c = begin; c < end; ++c) {
    const int64_t off = vbase + (static_cast<int64_t>(table[c / BS]) * BS + c % BS) * D;
    float vf[D];
#pragma omp simd
    for (int d = 0; d < D; ++d) vf[d] = load<K>(cache, off + d);
    for (int g = 0; g < G; ++g) {
      const float p = scores[g * n + (c - begin)];
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[g][d] += p * vf[d];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) out[g * D + d] = acc[g][d] * inv[g];
}

// Any G and D: one query head at a time.
template <Kind K>
void attend_any(const float* q, const void* cache, int64_t kbase, int64_t vbase, const int32_t* table,
                int64_t begin, int64_t end, int64_t BS, int64_t D, int64_t G, float scale, float softcap, float* scores,
                float* out) {
  const int64_t n = end - begin;
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * D;
    float* og = out + g * D;
    for (int64_t c = begin; c < end; ++c) {
      const int64_t off = kbase + (static_cast<int64_t>(table[c / BS]) * BS + c % BS) * D;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < D; ++d) acc += qg[d] * load<K>(cache, off + d);
      scores[c - begin] = softcap > 0.f ? softcap * std::tanh(acc * scale / softcap) : acc * scale;
    }
    float m = scores[0];
    for (int64_t i = 1; i < n; ++i) m = std::max(m, scores[i]);
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) sum += (scores[i] = exp_nonpositive(scores[i] - m));
    std::fill(og, og + D, 0.f);
    for (int64_t c = begin; c < end; ++c) {
      const int64_t off = vbase + (static_cast<int64_t>(table[c / BS]) * BS + c % BS) * D;
      const float p = scores[c - begin] / sum;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) og[d] += p * load<K>(cache, off + d);
    }
  }
}

template <Kind K>
void attend(const float* q, const void* cache, int64_t kbase, int64_t vbase, const int32_t* table, int64_t begin,
            int64_t end, int64_t BS, int64_t D, int64_t G, float scale, float softcap, float* scores, float* out) {
#define HLOSERVE_ATTEND(g, d)                                                                      \
  if (G == g && D == d)                                                                            \
    return attend_fixed<K, g, d>(q, cache, kbase, vbase, table, begin, end, BS, scale, softcap, scores, out);
  HLOSERVE_ATTEND(1, 64) HLOSERVE_ATTEND(2, 64) HLOSERVE_ATTEND(3, 64) HLOSERVE_ATTEND(4, 64)
  HLOSERVE_ATTEND(5, 64) HLOSERVE_ATTEND(6, 64) HLOSERVE_ATTEND(7, 64) HLOSERVE_ATTEND(8, 64)
  HLOSERVE_ATTEND(1, 128) HLOSERVE_ATTEND(2, 128) HLOSERVE_ATTEND(3, 128) HLOSERVE_ATTEND(4, 128)
  HLOSERVE_ATTEND(5, 128) HLOSERVE_ATTEND(6, 128) HLOSERVE_ATTEND(7, 128) HLOSERVE_ATTEND(8, 128)
  HLOSERVE_ATTEND(1, 96) HLOSERVE_ATTEND(2, 96) HLOSERVE_ATTEND(4, 96)              // Phi-3
  HLOSERVE_ATTEND(1, 256) HLOSERVE_ATTEND(2, 256) HLOSERVE_ATTEND(4, 256) HLOSERVE_ATTEND(8, 256)   // Gemma 2/3
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
constexpr int kRowBlock = 4;     // rows per output register block
constexpr int kDimBlock = 32;    // head dims per output register block

struct TileScratch {
  std::vector<float> k, v, qt, s, inv;
  std::vector<int32_t> lo, hi;
};

// q and out: the tile's first token's heads, `stride` apart from one token to the next.
template <Kind K>
void attend_tile(const float* q, float* out, int64_t stride, int64_t ntok, const int64_t* begins, const int64_t* ends,
                 const void* cache, int64_t kbase, int64_t vbase, const int32_t* table, int64_t BS, int64_t D,
                 int64_t G, float scale, float softcap) {
  thread_local TileScratch w;
  int64_t lo = INT64_MAX, hi = 0;                                        // over tokens that see something
  for (int64_t i = 0; i < ntok; ++i)
    if (ends[i] > begins[i]) lo = std::min(lo, begins[i]), hi = std::max(hi, ends[i]);
  const int64_t rows = ntok * G;
  const int64_t RP = (rows + kLanes - 1) / kLanes * kLanes;              // rows padded to whole vectors
  const int64_t n = hi - lo;
  const int64_t NP = (n + kPosBlock - 1) / kPosBlock * kPosBlock;       // positions padded to blocks
  const int64_t DP = (D + kDimBlock - 1) / kDimBlock * kDimBlock;       // V rows padded to dim blocks
  w.k.assign(NP * D, 0.f);
  w.v.assign(n * DP, 0.f);
  w.qt.assign(D * RP, 0.f);
  w.s.resize(NP * RP);
  w.inv.assign(RP, 0.f);
  w.lo.assign(RP, 0);
  w.hi.assign(RP, 0);                                                    // padded rows see nothing
  float* kf = w.k.data();
  float* vf = w.v.data();
  for (int64_t c = lo; c < hi; ++c) {                                   // widen each row once
    const int64_t slot = static_cast<int64_t>(table[c / BS]) * BS + c % BS;
    float* kr = kf + (c - lo) * D;
    float* vr = vf + (c - lo) * DP;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) kr[d] = load<K>(cache, kbase + slot * D + d);
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) vr[d] = load<K>(cache, vbase + slot * D + d);
  }
  for (int64_t t = 0; t < ntok; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = t * G + g;
      for (int64_t d = 0; d < D; ++d) w.qt[d * RP + r] = q[t * stride + g * D + d] * scale;
      w.lo[r] = static_cast<int32_t>(std::max<int64_t>(begins[t] - lo, 0));
      w.hi[r] = static_cast<int32_t>(std::max<int64_t>(ends[t] - lo, 0));
    }
  // s[c][r] = sum_d k[c][d] * qt[d][r]: kPosBlock x kLanes accumulators
  float* st = w.s.data();
  for (int64_t r0 = 0; r0 < RP; r0 += kLanes)
    for (int64_t c0 = 0; c0 < NP; c0 += kPosBlock) {
      float acc[kPosBlock][kLanes] = {};
      for (int64_t d = 0; d < D; ++d) {
        const float* qv = w.qt.data() + d * RP + r0;
        for (int i = 0; i < kPosBlock; ++i) {
          const float kv = kf[(c0 + i) * D + d];
#pragma omp simd
          for (int l = 0; l < kLanes; ++l) acc[i][l] += kv * qv[l];
        }
      }
      for (int i = 0; i < kPosBlock; ++i)
#pragma omp simd
        for (int l = 0; l < kLanes; ++l) st[(c0 + i) * RP + r0 + l] = acc[i][l];
    }
  // softcap, mask, softmax over c: vertical, one lane per row
  const int32_t* rlo = w.lo.data();
  const int32_t* rhi = w.hi.data();
  for (int64_t r0 = 0; r0 < RP; r0 += kLanes) {
    float m[kLanes], sum[kLanes] = {};
    for (int l = 0; l < kLanes; ++l) m[l] = -INFINITY;
    for (int64_t c = 0; c < n; ++c) {
      float* sc = st + c * RP + r0;
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) {
        float x = softcap > 0.f ? softcap * std::tanh(sc[l] / softcap) : sc[l];
        const bool seen = c >= rlo[r0 + l] && c < rhi[r0 + l];
        sc[l] = x;
        m[l] = seen ? std::max(m[l], x) : m[l];
      }
    }
    for (int64_t c = 0; c < n; ++c) {
      float* sc = st + c * RP + r0;
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) {
        const bool seen = c >= rlo[r0 + l] && c < rhi[r0 + l];
        const float p = seen ? exp_nonpositive(std::min(sc[l] - m[l], 0.f)) : 0.f;
        sc[l] = p;
        sum[l] += p;
      }
    }
    for (int l = 0; l < kLanes; ++l) w.inv[r0 + l] = sum[l] > 0.f ? 1.f / sum[l] : 0.f;
  }
  // out[r][d] = inv[r] * sum_c p[c][r] * v[c][d]: kRowBlock x kDimBlock accumulators
  for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock)
    for (int64_t d0 = 0; d0 < DP; d0 += kDimBlock) {
      float acc[kRowBlock][kDimBlock] = {};
      for (int64_t c = 0; c < n; ++c) {
        const float* vr = vf + c * DP + d0;
        const float* pc = st + c * RP + r0;                              // rows past `rows` are 0
        for (int i = 0; i < kRowBlock; ++i) {
          const float p = pc[i];
#pragma omp simd
          for (int l = 0; l < kDimBlock; ++l) acc[i][l] += p * vr[l];
        }
      }
      for (int i = 0; i < kRowBlock && r0 + i < rows; ++i) {
        const int64_t r = r0 + i, t = r / G, g = r % G;
        float* o = out + t * stride + g * D;
        for (int l = 0; l < kDimBlock && d0 + l < D; ++l) o[d0 + l] = acc[i][l] * w.inv[r];
      }
    }
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer cache,
                          ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> block_tables,
                          ffi::Buffer<ffi::S32> seq_ids, ffi::Buffer<ffi::S32> positions,
                          ffi::Buffer<ffi::S32> context_lens, int64_t window, int64_t holds, float scale,
                          float softcap, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto cd = cache.dimensions();
  auto bd = block_tables.dimensions();
  if (qd.size() != 4 || cd.size() != 6 || bd.size() != 2)
    return ffi::Error::InvalidArgument("hloserve_paged_attention: q must be [T,KV,G,D], cache [L,2,KV,N,BS,D]");
  const int64_t T = qd[0], KV = qd[1], G = qd[2], D = qd[3];
  const int64_t L = cd[0], N = cd[3], BS = cd[4];
  const int64_t S = bd[0], B = bd[1];
  if (cd[1] != 2 || cd[2] != KV || cd[5] != D)
    return ffi::Error::InvalidArgument("hloserve_paged_attention: cache shape does not match q");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("hloserve_paged_attention: layer out of range");
  // holds: the cache's own dtype (f32), or bf16 / f16 bits (in an s16/u16 buffer)
  if (!valid_kind(holds)) return ffi::Error::InvalidArgument("hloserve_paged_attention: holds must be 0, 1 or 2");
  const Kind kind = static_cast<Kind>(holds);
  if ((kind == Kind::kF32) != (cache.element_type() == ffi::F32))
    return ffi::Error::InvalidArgument("hloserve_paged_attention: cache dtype does not match `holds`");
  const void* cdata = cache.untyped_data();
  const float* qp = q.typed_data();
  float* op = out->typed_data();
  const int32_t* tables = block_tables.typed_data();
  const int32_t* seqs = seq_ids.typed_data();
  const int32_t* pos = positions.typed_data();
  const int32_t* lens = context_lens.typed_data();
  const int64_t head_stride = N * BS * D;  // one (layer, K|V, kv head) plane

  // each token's visible positions [begin, end): empty for padding (no sequence, or context 0)
  std::vector<int64_t> begins(T), ends(T);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = seqs[t];
    int64_t e = s >= 0 && s < S ? std::min<int64_t>(static_cast<int64_t>(pos[t]) + 1, lens[s]) : 0;
    e = std::min(e, B * BS);
    const int64_t b = window > 0 ? std::max<int64_t>(0, static_cast<int64_t>(pos[t]) - window + 1) : 0;
    begins[t] = b;
    ends[t] = std::max(e, b);
  }
  // every block a token will read is in the cache, checked before any is read: a table entry
  // outside [0, N) (a scheduler bug) is an error, not a read out of bounds. One pass over the
  // visible blocks' ids: T * (context / BS) int compares, against the BS * D * KV elements each
  // of those blocks makes the kernel read.
  for (int64_t t = 0; t < T; ++t) {
    if (ends[t] <= begins[t]) continue;
    const int32_t* row = tables + static_cast<int64_t>(seqs[t]) * B;
    for (int64_t b = begins[t] / BS, last = (ends[t] - 1) / BS; b <= last; ++b)
      if (row[b] < 0 || row[b] >= N)
        return ffi::Error::InvalidArgument("hloserve_paged_attention: block table entry " + std::to_string(row[b]) +
                                           " (sequence " + std::to_string(seqs[t]) + ", block " + std::to_string(b) +
                                           ") is outside the cache's " + std::to_string(N) + " blocks");
  }
  // work items: (tile, kv head); a tile is up to kTileTokens consecutive tokens of one sequence
  std::vector<int64_t> starts;
  for (int64_t t = 0; t < T; ++t)
    if (t == 0 || seqs[t] != seqs[t - 1] || t - starts.back() >= kTileTokens) starts.push_back(t);
  starts.push_back(T);
  const int64_t tiles = static_cast<int64_t>(starts.size()) - 1;
  const int64_t token_stride = KV * G * D;  // q and out, from one token to the next

  parallel_for(pool, tiles * KV, 1, [&, kind](int64_t i) {
    const int64_t tile = i / KV, h = i % KV;
    const int64_t t0 = starts[tile], ntok = starts[tile + 1] - t0;
    const int64_t s = seqs[t0];
    const int64_t kbase = ((l * 2 + 0) * KV + h) * head_stride;
    const int64_t vbase = ((l * 2 + 1) * KV + h) * head_stride;
    const float* qi = qp + (t0 * KV + h) * G * D;
    float* o = op + (t0 * KV + h) * G * D;
    bool any = false;
    for (int64_t t = t0; t < t0 + ntok; ++t) any = any || ends[t] > begins[t];
    if (!any) {
      for (int64_t t = 0; t < ntok; ++t) std::fill(o + t * token_stride, o + t * token_stride + G * D, 0.f);
      return;
    }
    const int32_t* table = tables + s * B;
    with_kind(kind, [&](auto k) {
      constexpr Kind K = decltype(k)::value;
      if (ntok > 1) {
        attend_tile<K>(qi, o, token_stride, ntok, &begins[t0], &ends[t0], cdata, kbase, vbase, table, BS, D, G, scale,
                       softcap);
        return;
      }
      const int64_t begin = begins[t0], end = ends[t0];
      thread_local std::vector<float> scores;
      if (static_cast<int64_t>(scores.size()) < G * (end - begin)) scores.resize(G * (end - begin));
      attend<K>(qi, cdata, kbase, vbase, table, begin, end, BS, D, G, scale, softcap, scores.data(), o);
    });
  });
  return ffi::Error::Success();
}

// The operands both versions take: q, cache, layer, block_tables, seq_ids, positions, context_lens.
auto PagedAttentionOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>();
}

// Version 2: the window an s32[] operand (a scanned layer's own), not an attribute.
ffi::Error PagedAttentionV2(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer cache,
                            ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> block_tables,
                            ffi::Buffer<ffi::S32> seq_ids, ffi::Buffer<ffi::S32> positions,
                            ffi::Buffer<ffi::S32> context_lens, ffi::Buffer<ffi::S32> window, int64_t holds,
                            float scale, float softcap, ffi::ResultBuffer<ffi::F32> out) {
  return PagedAttention(pool, q, cache, layer, block_tables, seq_ids, positions, context_lens,
                        window.typed_data()[0], holds, scale, softcap, out);
}

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

constexpr int64_t kLinearRows = 64;  // output rows (matrix rows) per task

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
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  // AMX for bf16 matrices whose rows are whole 32-element tiles (the tail of 16-row tiles below)
  const bool amx = kind == Kind::kBF16 && K % 32 == 0 && amx_usable();
  const std::vector<uint16_t> packed = amx ? amx_pack(xb, KP, M, K / 32) : std::vector<uint16_t>();
#endif
  const int64_t tasks = (N + kLinearRows - 1) / kLinearRows;
  parallel_for(pool, tasks, 1, [&](int64_t task) {
    const int64_t n0 = task * kLinearRows, n1 = std::min(N, n0 + kLinearRows);
    if (kind == Kind::kF16) {
      widened_rows<Kind::kF16>(w + n0 * K, K, xb, KP, M, n1 - n0, op + n0, N);
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
    widened_rows<Kind::kBF16>(w + n * K, K, xb, KP, M, n1 - n, op + n, N);
#endif
  });
  return ffi::Error::Success();
}


// -- hloserve_quant_linear: weight-only int8 / int4 matrices times int8 activations -------------
//
// W = q * scale (+ min) per group of `group` elements of a row (quantization/schemes.py); x is
// quantized per block of 32 elements as llama.cpp's Q8_0 (d = max|x| / 127, x8 = round(x / d)).
// Each block's integer dot product is exact in int32; it is then scaled by d * scale in f32.
// With AVX512-VNNI one vpdpbusd multiplies 64 unsigned weight bytes by 64 signed activation
// bytes and adds them in fours: the weights are made unsigned (int8: q + 128; int4 two's
// complement: q + 8; int4 with a min: q as is) and each lane's integer sum starts at -offset
// times the sum of its activations (computed once per call), so it comes out exact; a min adds
// min_g * (x summed over group g) per matrix row. The weights are read from memory once, 1 or
// 1/2 byte each, and never widened.
constexpr int64_t kXBlock = 32;

struct QuantMatrix {
  const void* q;      // layer's qweight [N, K] s8 or [N, K/2] u8
  const void* scale;  // [N, G] f16 or f32
  const void* min;    // like scale, or nullptr (symmetric)
  bool f16;           // scale / min dtype
  int bits;
  int64_t N, K, G, group;
};

inline float scalar_of(const void* base, bool f16, int64_t i) {
  return f16 ? f16_to_f32(static_cast<const uint16_t*>(base)[i]) : static_cast<const float*>(base)[i];
}

// count scales (or mins) from element `start` of base, widened to f32 into dst
inline void widen(const void* base, bool f16, int64_t start, int64_t count, float* dst) {
  if (!f16) {
    std::memcpy(dst, static_cast<const float*>(base) + start, count * sizeof(float));
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(base) + start;
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= count; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
#endif
  for (; i < count; ++i) dst[i] = f16_to_f32(h[i]);
}

// Activations quantized once per call: xq [M, K] int8 (int4 weights: each row as its even then its
// odd elements, the order the packed nibbles hold them), d [M, K/32], and xsum [M, G]: the sum of
// x8 = xq * d over each weight group.
struct QuantizedX {
  std::vector<int8_t> xq;
  std::vector<float> d, xsum;
  std::vector<float> lanes;   // d per vpdpbusd lane: [M, chunks, 16] (filled by the VNNI path)
  std::vector<int32_t> start; // per lane, -offset * (sum of the xq the lane multiplies): [M, chunks, 16]
};

// (xq and d are padded with zeros: a row's last, half chunk is read whole, against zero weights)
QuantizedX quantize_x(const float* x, int64_t M, const QuantMatrix& w) {
  const int64_t K = w.K, B = K / kXBlock;
  QuantizedX r{std::vector<int8_t>(M * K + 64, 0), std::vector<float>(M * B + 4, 0.f),
               std::vector<float>(M * w.G, 0.f), {}, {}};
  std::vector<int8_t> row(K);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < B; ++b) {
      const float* xb = x + m * K + b * kXBlock;
      float amax = 0.f;
      for (int64_t k = 0; k < kXBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
      const float d = amax / 127.f;
      int32_t sum = 0;
      for (int64_t k = 0; k < kXBlock; ++k) {
        const int v = d > 0.f ? static_cast<int>(std::nearbyint(xb[k] / d)) : 0;
        row[b * kXBlock + k] = static_cast<int8_t>(v);
        sum += v;
      }
      r.d[m * B + b] = d;
      r.xsum[m * w.G + b * kXBlock / w.group] += d * static_cast<float>(sum);
    }
    int8_t* dst = r.xq.data() + m * K;
    if (w.bits == 8) {
      std::memcpy(dst, row.data(), K);
    } else {
      for (int64_t k = 0; k < K / 2; ++k) dst[k] = row[2 * k], dst[K / 2 + k] = row[2 * k + 1];
    }
  }
  return r;
}

// the integer value q of element k of matrix row n (element 2j of a byte pair is the low nibble)
inline int int_of(const QuantMatrix& w, int64_t n, int64_t k) {
  if (w.bits == 8) return static_cast<const int8_t*>(w.q)[n * w.K + k];
  const uint8_t b = static_cast<const uint8_t*>(w.q)[n * (w.K / 2) + k / 2];
  const int v = (k % 2) ? (b >> 4) : (b & 0xF);
  return w.min == nullptr && v > 7 ? v - 16 : v;
}

// the activation value xq of element k of row m (in quantize_x's order)
inline int x_of(const QuantizedX& x, const QuantMatrix& w, int64_t m, int64_t k) {
  const int8_t* row = x.xq.data() + m * w.K;
  return w.bits == 8 ? row[k] : row[(k % 2) * (w.K / 2) + k / 2];
}

// rows [n0, n1): the same integer block sums and f32 scaling, portably (CPUs without AVX512-VNNI)
void quant_portable(const QuantMatrix& w, const QuantizedX& x, int64_t M, int64_t n0, int64_t n1, float* out) {
  const int64_t B = w.K / kXBlock;
  std::vector<int32_t> row(w.K);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t k = 0; k < w.K; ++k) row[k] = int_of(w, n, k);
    for (int64_t m = 0; m < M; ++m) {
      float total = 0.f;
      for (int64_t b = 0; b < B; ++b) {
        int32_t dot = 0;
        for (int64_t k = b * kXBlock; k < (b + 1) * kXBlock; ++k) dot += x_of(x, w, m, k) * row[k];
        total += static_cast<float>(dot) * (x.d[m * B + b] * scalar_of(w.scale, w.f16, n * w.G + b * kXBlock / w.group));
      }
      for (int64_t g = 0; w.min != nullptr && g < w.G; ++g)
        total += scalar_of(w.min, w.f16, n * w.G + g) * x.xsum[m * w.G + g];
      out[m * w.N + n] = total;
    }
  }
}

#if defined(__AVX512VNNI__)
// Lanes of a vpdpbusd result per 64 weight bytes: int8, 8 lanes per x block (2 blocks); int4, the
// low and the high nibbles of 64 bytes are 128 elements, 4 lanes per block (4 blocks).
template <int BITS>
struct Layout {
  static constexpr int64_t kElems = BITS == 8 ? 64 : 128;   // elements per 64 weight bytes
  static constexpr int kLanesPerBlock = BITS == 8 ? 8 : 4;
};

// 16 lanes: lane l holds v[block of lane l] (v: the chunk's 2 or 4 per-block values)
template <int BITS>
inline __m512 per_lane(const float* v) {
  if constexpr (BITS == 8) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(v[0])), _mm256_set1_ps(v[1]), 1);
  } else {
    const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(v)));
  }
}

// NR matrix rows x MR x rows, chunk by chunk of 64 weight bytes: exact int32 block sums, scaled
// in f32 by (weight scale x activation d) per lane; `ws` holds each matrix row's scale per x block
template <int BITS, int NR, int MR>
inline void vnni_tile(const uint8_t* q, int64_t qstride, const float* ws, const QuantizedX& x, int64_t m0,
                      int64_t K, int64_t B, bool sym4, float* out, int64_t N) {
  const bool offset = BITS == 8 || sym4;
  using Lay = Layout<BITS>;
  __m512 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i flip = _mm512_set1_epi8(BITS == 8 ? static_cast<char>(0x80) : 0x08);
  const int64_t blocks = Lay::kElems / kXBlock, chunks = (K + Lay::kElems - 1) / Lay::kElems;
  for (int64_t c = 0, e = 0; e < K; ++c, e += Lay::kElems) {
    // the last chunk of a row may be half a chunk (32 bytes): its other lanes get zero weights
    const int64_t bytes = std::min<int64_t>(64, (K - e) * BITS / 8);
    const __mmask64 valid = bytes == 64 ? ~__mmask64(0) : (__mmask64(1) << bytes) - 1;
    __m512i lo[NR], hi[NR];
    for (int i = 0; i < NR; ++i) {
      const __m512i v = _mm512_maskz_loadu_epi8(valid, q + i * qstride + c * 64);
      if constexpr (BITS == 8) {
        lo[i] = _mm512_maskz_mov_epi8(valid, _mm512_xor_si512(v, flip));   // q + 128
      } else {
        lo[i] = _mm512_and_si512(v, low);
        hi[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        if (sym4) {                                                          // q + 8
          lo[i] = _mm512_maskz_mov_epi8(valid, _mm512_xor_si512(lo[i], flip));
          hi[i] = _mm512_maskz_mov_epi8(valid, _mm512_xor_si512(hi[i], flip));
        }
      }
    }
    __m512 wsv[NR];
    for (int i = 0; i < NR; ++i) wsv[i] = per_lane<BITS>(ws + i * B + c * blocks);
    for (int j = 0; j < MR; ++j) {
      const int8_t* xr = x.xq.data() + (m0 + j) * K;
      const __m512 dv = _mm512_loadu_ps(x.lanes.data() + ((m0 + j) * chunks + c) * 16);
      const __m512i sv = offset ? _mm512_loadu_si512(x.start.data() + ((m0 + j) * chunks + c) * 16)
                                : _mm512_setzero_si512();
      __m512i xa, xb;
      if constexpr (BITS == 8) {
        xa = _mm512_loadu_si512(xr + e);
      } else {
        xa = _mm512_loadu_si512(xr + e / 2);            // even elements
        xb = _mm512_loadu_si512(xr + K / 2 + e / 2);    // odd elements
      }
      for (int i = 0; i < NR; ++i) {
        __m512i part = _mm512_dpbusd_epi32(sv, lo[i], xa);
        if constexpr (BITS == 4) part = _mm512_dpbusd_epi32(part, hi[i], xb);
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part), _mm512_mul_ps(wsv[i], dv), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) out[(m0 + j) * N + i] = _mm512_reduce_add_ps(acc[i][j]);
}

template <int BITS, int NR>
inline void vnni_rows(const uint8_t* q, int64_t qstride, const float* ws, const QuantizedX& x, int64_t M, int64_t K,
                      int64_t B, bool sym4, float* out, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) vnni_tile<BITS, NR, 4>(q, qstride, ws, x, m, K, B, sym4, out, N);
  switch (M - m) {
    case 3: vnni_tile<BITS, NR, 3>(q, qstride, ws, x, m, K, B, sym4, out, N); break;
    case 2: vnni_tile<BITS, NR, 2>(q, qstride, ws, x, m, K, B, sym4, out, N); break;
    case 1: vnni_tile<BITS, NR, 1>(q, qstride, ws, x, m, K, B, sym4, out, N); break;
  }
}

// rows [n0, n1) with VNNI: the weights' per-block scales of NR rows at a time, then the tiles, then
// (asymmetric int4) the mins' term
template <int BITS>
void quant_vnni(const QuantMatrix& w, const QuantizedX& x, int64_t M, int64_t n0, int64_t n1, float* out) {
  constexpr int NR = 2;
  const int64_t K = w.K, B = K / kXBlock, qstride = BITS == 8 ? K : K / 2;
  const bool sym4 = BITS == 4 && w.min == nullptr;
  const int64_t per_group = w.group / kXBlock;
  std::vector<float> ws(NR * B + 4, 0.f), corr(w.G);   // padded: a half chunk reads 4 blocks' scales
  for (int64_t n = n0; n < n1; n += NR) {
    const int64_t rows = std::min<int64_t>(NR, n1 - n);
    for (int64_t i = 0; i < rows; ++i) {               // each group's scale, repeated for its x blocks
      float* wi = ws.data() + i * B;
      if (per_group == 1) {
        widen(w.scale, w.f16, (n + i) * w.G, w.G, wi);
      } else {
        widen(w.scale, w.f16, (n + i) * w.G, w.G, corr.data());
        for (int64_t g = 0, b = 0; g < w.G; ++g)
          for (int64_t e = 0; e < per_group; ++e) wi[b++] = corr[g];
      }
    }
    const uint8_t* q = static_cast<const uint8_t*>(w.q) + n * qstride;
    if (rows == NR) vnni_rows<BITS, NR>(q, qstride, ws.data(), x, M, K, B, sym4, out + n, w.N);
    else vnni_rows<BITS, 1>(q, qstride, ws.data(), x, M, K, B, sym4, out + n, w.N);
    for (int64_t i = 0; w.min != nullptr && i < rows; ++i) {   // the mins: sum_g min_g * (x summed over g)
      const int64_t r = (n + i) * w.G;
      widen(w.min, w.f16, r, w.G, corr.data());
      for (int64_t m = 0; m < M; ++m) {
        const float* xs = x.xsum.data() + m * w.G;
        float extra = 0.f;
#pragma omp simd reduction(+ : extra)
        for (int64_t g = 0; g < w.G; ++g) extra += corr[g] * xs[g];
        out[m * w.N + n + i] += extra;
      }
    }
  }
}
#endif

#if defined(__AVX512VNNI__)
// x.lanes: each row's block scales d laid out per vpdpbusd lane, read with one load per chunk
// x.start: where the unsigned weights carry an offset (int8: q + 128; symmetric int4: q + 8), each
// lane's sum starts at -offset * (its activations' sum), so the integer sums come out exact
template <int BITS>
void spread_lanes(QuantizedX& x, int64_t M, int64_t K, int offset) {
  using Lay = Layout<BITS>;
  const int64_t B = K / kXBlock, chunks = (K + Lay::kElems - 1) / Lay::kElems, blocks = Lay::kElems / kXBlock;
  x.lanes.assign(M * chunks * 16, 0.f);
  x.start.assign(M * chunks * 16, 0);
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* xr = x.xq.data() + m * K;
    for (int64_t c = 0; c < chunks; ++c) {
      _mm512_storeu_ps(x.lanes.data() + (m * chunks + c) * 16, per_lane<BITS>(x.d.data() + m * B + c * blocks));
      if (offset == 0) continue;
      __m512i sum;
      if constexpr (BITS == 8) {
        sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(xr + c * 64));
      } else {
        sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(xr + c * 64));
        sum = _mm512_dpbusd_epi32(sum, ones, _mm512_loadu_si512(xr + K / 2 + c * 64));
      }
      // a row's last, half chunk: the lanes past it multiply zero weights and must start at zero too
      const int64_t bytes = std::min<int64_t>(64, (K - c * Lay::kElems) * BITS / 8);
      const __mmask16 valid = static_cast<__mmask16>((1u << (bytes / 4)) - 1);
      _mm512_storeu_si512(x.start.data() + (m * chunks + c) * 16,
                          _mm512_maskz_mullo_epi32(valid, sum, _mm512_set1_epi32(-offset)));
    }
  }
}
#endif

// What both quant_linear versions refuse beyond their shapes (nullptr: nothing): min, bits, layer
const char* quant_operands_error(int64_t bits, const ffi::AnyBuffer& scale, const ffi::AnyBuffer& min, int64_t l,
                                 int64_t L) {
  const bool asym = min.element_count() != 0;
  if (asym && (min.element_type() != scale.element_type() || min.element_count() != scale.element_count()))
    return "min must have scale's dtype and shape, or no elements";
  if (asym && bits == 8) return "int8 weights have no min";
  if (l < 0 || l >= L) return "layer out of range";
  return nullptr;
}

ffi::Error QuantLinear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer qweight, ffi::AnyBuffer scale,
                       ffi::AnyBuffer min, ffi::Buffer<ffi::S32> layer, int64_t bits, int64_t group,
                       ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions();
  auto qd = qweight.dimensions();
  auto sd = scale.dimensions();
  if (xd.size() != 2 || qd.size() != 3 || sd.size() != 3)
    return ffi::Error::InvalidArgument("hloserve_quant_linear: x must be [M, K], qweight [L, N, K | K/2], scale [L, N, G]");
  const int64_t M = xd[0], K = xd[1], L = qd[0], N = qd[1];
  if (bits != 8 && bits != 4) return ffi::Error::InvalidArgument("hloserve_quant_linear: bits must be 8 or 4");
  const ffi::DataType want = bits == 8 ? ffi::DataType::S8 : ffi::DataType::U8;
  if (qweight.element_type() != want || qd[2] != (bits == 8 ? K : K / 2))
    return ffi::Error::InvalidArgument("hloserve_quant_linear: qweight must be s8 [L, N, K] (bits 8) or u8 [L, N, K/2] (bits 4)");
  if (group <= 0 || group % kXBlock || K % group)
    return ffi::Error::InvalidArgument("hloserve_quant_linear: group must be a multiple of 32 dividing K");
  const int64_t G = K / group;
  const bool f16 = scale.element_type() == ffi::DataType::F16;
  if ((!f16 && scale.element_type() != ffi::DataType::F32) || sd[0] != L || sd[1] != N || sd[2] != G)
    return ffi::Error::InvalidArgument("hloserve_quant_linear: scale must be f16 or f32 [L, N, K / group]");
  const bool asym = min.element_count() != 0;
  const int64_t l = layer.typed_data()[0];
  if (const char* why = quant_operands_error(bits, scale, min, l, L))
    return ffi::Error::InvalidArgument(std::string("hloserve_quant_linear: ") + why);
  const int64_t qrow = bits == 8 ? K : K / 2, ssize = f16 ? 2 : 4;
  QuantMatrix w{static_cast<const char*>(qweight.untyped_data()) + l * N * qrow,
                static_cast<const char*>(scale.untyped_data()) + l * N * G * ssize,
                asym ? static_cast<const char*>(min.untyped_data()) + l * N * G * ssize : nullptr,
                f16, static_cast<int>(bits), N, K, G, group};
  QuantizedX xq = quantize_x(x.typed_data(), M, w);
#if defined(__AVX512VNNI__)
  if (bits == 8) spread_lanes<8>(xq, M, K, 128);
  else spread_lanes<4>(xq, M, K, asym ? 0 : 8);
#endif
  float* op = out->typed_data();
  const int64_t tasks = (N + kLinearRows - 1) / kLinearRows;
  parallel_for(pool, tasks, 1, [&](int64_t task) {
    const int64_t n0 = task * kLinearRows, n1 = std::min(N, n0 + kLinearRows);
#if defined(__AVX512VNNI__)
    if (bits == 8) quant_vnni<8>(w, xq, M, n0, n1, op);
    else quant_vnni<4>(w, xq, M, n0, n1, op);
#else
    quant_portable(w, xq, M, n0, n1, op);
#endif
  });
  return ffi::Error::Success();
}


// -- hloserve_quant_linear_v2: the same product, matrices interleaved by 16 rows ---------------
//
// Version 2 of the composite stores each layer's matrix 16 rows at a time, k-step by k-step
// (runtime/artifact/kernels.py QUANT_LINEAR_V2): int8, element (n, k) at byte
// ((n / 16) * K/4 + k / 4) * 64 + (n % 16) * 4 + k % 4; int4, k-steps of 8 elements, byte
// ((n / 16) * K/8 + k / 8) * 64 + (n % 16) * 4 + k % 4 holding element k in its low nibble
// (k % 8 < 4) or k - 4 in its high one; scales and mins [N / 16, G, 16]. One 64-byte load is then
// 16 matrix rows x 4 elements: vpdpbusd against 4 activation bytes broadcast gives each lane (a
// matrix row) its exact integer sum, kept in int32 over the whole 32-element block, so the block
// is scaled once (cvt, mul, fma per 16 rows x 32 elements, where version 1 does it per 64
// elements of one row) and 16 outputs are stored at once, with no horizontal sums.
struct QuantX2 {
  std::vector<int8_t> xq;      // [M, K] (+ padding)
  std::vector<float> d;        // [M, B] block scales
  std::vector<int32_t> start;  // [M, B] -offset * (sum of the block's xq): the unsigned weights' correction
  std::vector<float> xsum;     // [M, G] x8 summed over each weight group (the mins' term)
};

// x quantized per 32-element block as Q8_0 (d = max|x| / 127, xq = round_half_even(x / d)), like quantize_x
QuantX2 quantize_x2(const float* x, int64_t M, int64_t K, int64_t G, int64_t group, int offset) {
  const int64_t B = K / kXBlock;
  QuantX2 r{std::vector<int8_t>(M * K + 64, 0), std::vector<float>(M * B, 0.f), std::vector<int32_t>(M * B, 0),
            std::vector<float>(M * G, 0.f)};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < B; ++b) {
      const float* xb = x + m * K + b * kXBlock;
      int8_t* dst = r.xq.data() + m * K + b * kXBlock;
      int32_t sum = 0;
      float d = 0.f;
#if defined(__AVX512F__)
      const __m512 a = _mm512_loadu_ps(xb), c = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
      d = amax / 127.f;
      if (d > 0.f) {
        const __m512 dv = _mm512_set1_ps(d);   // true division and round-to-nearest-even, as the reference
        const __m512i qa = _mm512_cvtps_epi32(_mm512_div_ps(a, dv)), qc = _mm512_cvtps_epi32(_mm512_div_ps(c, dv));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qc));
        sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
      }
#else
      float amax = 0.f;
      for (int64_t k = 0; k < kXBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
      d = amax / 127.f;
      for (int64_t k = 0; k < kXBlock; ++k) {
        const int v = d > 0.f ? static_cast<int>(std::nearbyint(xb[k] / d)) : 0;
        dst[k] = static_cast<int8_t>(v);
        sum += v;
      }
#endif
      r.d[m * B + b] = d;
      r.start[m * B + b] = -offset * sum;
      r.xsum[m * G + b * kXBlock / group] += d * static_cast<float>(sum);
    }
  return r;
}

struct QuantMatrix2 {
  const uint8_t* q;     // the layer's interleaved bytes
  const void* scale;    // [N / 16, G, 16], f16 or f32
  const void* min;      // like scale, or nullptr
  bool f16;
  int bits;
  int64_t N, K, G, group;
};

// row group g's scales (or mins) [G, 16] as f32: in place for f32, else widened into `buf`
inline const float* group_scalars(const void* base, bool f16, int64_t g, int64_t G, std::vector<float>& buf) {
  if (!f16) return static_cast<const float*>(base) + g * G * 16;
  buf.resize(G * 16);
  widen(base, true, g * G * 16, G * 16, buf.data());
  return buf.data();
}

// the integer value of element k of matrix row n in the interleaved layout (portable path)
inline int int_of2(const QuantMatrix2& w, int64_t n, int64_t k) {
  if (w.bits == 8)
    return static_cast<const int8_t*>(static_cast<const void*>(w.q))[((n / 16) * (w.K / 4) + k / 4) * 64 + (n % 16) * 4 + k % 4];
  const uint8_t b = w.q[((n / 16) * (w.K / 8) + k / 8) * 64 + (n % 16) * 4 + k % 4];
  const int v = (k % 8) < 4 ? (b & 0xF) : (b >> 4);
  return w.min == nullptr && v > 7 ? v - 16 : v;
}

// row groups [g0, g1), portably: the integer block sums (the weights as they are, signed), then f32
void quant2_portable(const QuantMatrix2& w, const QuantX2& x, int64_t M, int64_t g0, int64_t g1, float* out) {
  const int64_t B = w.K / kXBlock, per_group = w.group / kXBlock;
  std::vector<float> sbuf, mbuf;
  for (int64_t rg = g0; rg < g1; ++rg) {
    const float* ws = group_scalars(w.scale, w.f16, rg, w.G, sbuf);
    const float* wm = w.min != nullptr ? group_scalars(w.min, w.f16, rg, w.G, mbuf) : nullptr;
    for (int64_t n = rg * 16; n < (rg + 1) * 16; ++n)
      for (int64_t m = 0; m < M; ++m) {
        float total = 0.f;
        const int8_t* xr = x.xq.data() + m * w.K;
        for (int64_t b = 0; b < B; ++b) {
          int32_t dot = 0;
          for (int64_t k = b * kXBlock; k < (b + 1) * kXBlock; ++k) dot += xr[k] * int_of2(w, n, k);
          total += static_cast<float>(dot) * (ws[(b / per_group) * 16 + n % 16] * x.d[m * B + b]);
        }
        for (int64_t g = 0; wm != nullptr && g < w.G; ++g) total += wm[g * 16 + n % 16] * x.xsum[m * w.G + g];
        out[m * w.N + n] = total;
      }
  }
}

#if defined(__AVX512VNNI__)
// one group of 16 matrix rows times MR rows of x (from m0): per block, int32 sums started at the
// offset correction, then one f32 scaling per row of x; outputs 16 contiguous floats per row of x
template <int BITS, bool SYM4, int MR>
inline void quant2_tile(const uint8_t* q, const float* ws, const float* wm, const QuantX2& x, int64_t m0, int64_t K,
                        int64_t G, int64_t per_group, float* out, int64_t N) {
  const int64_t B = K / kXBlock;
  constexpr int64_t kBlockBytes = BITS == 8 ? 16 * 32 : 16 * 16;
  const __m512i flip = _mm512_set1_epi8(BITS == 8 ? static_cast<char>(0x80) : static_cast<char>(0x88));
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 facc[MR];
  for (int j = 0; j < MR; ++j) facc[j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    __m512i iacc[MR];
    for (int j = 0; j < MR; ++j) iacc[j] = _mm512_set1_epi32(x.start[(m0 + j) * B + b]);
    const uint8_t* qb = q + b * kBlockBytes;
    const int8_t* xb = x.xq.data() + m0 * K + b * kXBlock;
    if constexpr (BITS == 8) {
      for (int s = 0; s < 8; ++s) {
        const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(qb + s * 64), flip);   // q + 128
        for (int j = 0; j < MR; ++j) {
          int32_t four;
          std::memcpy(&four, xb + j * K + s * 4, 4);
          iacc[j] = _mm512_dpbusd_epi32(iacc[j], w, _mm512_set1_epi32(four));
        }
      }
    } else {
      for (int s = 0; s < 4; ++s) {
        __m512i v = _mm512_loadu_si512(qb + s * 64);
        if constexpr (SYM4) v = _mm512_xor_si512(v, flip);                          // q + 8, both nibbles
        const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        for (int j = 0; j < MR; ++j) {
          int32_t a, c;
          std::memcpy(&a, xb + j * K + s * 8, 4);
          std::memcpy(&c, xb + j * K + s * 8 + 4, 4);
          iacc[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(iacc[j], lo, _mm512_set1_epi32(a)), hi,
                                        _mm512_set1_epi32(c));
        }
      }
    }
    const __m512 sv = _mm512_loadu_ps(ws + (b / per_group) * 16);
    for (int j = 0; j < MR; ++j)
      facc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[j]), _mm512_mul_ps(sv, _mm512_set1_ps(x.d[(m0 + j) * B + b])),
                                facc[j]);
  }
  for (int64_t g = 0; wm != nullptr && g < G; ++g) {
    const __m512 mv = _mm512_loadu_ps(wm + g * 16);
    for (int j = 0; j < MR; ++j) facc[j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(x.xsum[(m0 + j) * G + g]), facc[j]);
  }
  for (int j = 0; j < MR; ++j) _mm512_storeu_ps(out + (m0 + j) * N, facc[j]);
}

template <int BITS, bool SYM4>
void quant2_vnni(const QuantMatrix2& w, const QuantX2& x, int64_t M, int64_t g0, int64_t g1, float* out) {
  const int64_t per_group = w.group / kXBlock;
  const int64_t gbytes = BITS == 8 ? 16 * w.K : 8 * w.K;   // bytes per group of 16 rows
  std::vector<float> sbuf, mbuf;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* q = w.q + g * gbytes;
    const float* ws = group_scalars(w.scale, w.f16, g, w.G, sbuf);
    const float* wm = w.min != nullptr ? group_scalars(w.min, w.f16, g, w.G, mbuf) : nullptr;
    float* o = out + g * 16;
    int64_t m = 0;
    for (; m + 6 <= M; m += 6) quant2_tile<BITS, SYM4, 6>(q, ws, wm, x, m, w.K, w.G, per_group, o, w.N);
    switch (M - m) {
      case 5: quant2_tile<BITS, SYM4, 5>(q, ws, wm, x, m, w.K, w.G, per_group, o, w.N); break;
      case 4: quant2_tile<BITS, SYM4, 4>(q, ws, wm, x, m, w.K, w.G, per_group, o, w.N); break;
      case 3: quant2_tile<BITS, SYM4, 3>(q, ws, wm, x, m, w.K, w.G, per_group, o, w.N); break;
      case 2: quant2_tile<BITS, SYM4, 2>(q, ws, wm, x, m, w.K, w.G, per_group, o, w.N); break;
      case 1: quant2_tile<BITS, SYM4, 1>(q, ws, wm, x, m, w.K, w.G, per_group, o, w.N); break;
    }
  }
}
#endif

ffi::Error QuantLinear2(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer qweight, ffi::AnyBuffer scale,
                        ffi::AnyBuffer min, ffi::Buffer<ffi::S32> layer, int64_t bits, int64_t group,
                        ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions();
  auto qd = qweight.dimensions();
  auto sd = scale.dimensions();
  if (xd.size() != 2 || qd.size() != 3 || sd.size() != 4)
    return ffi::Error::InvalidArgument("hloserve_quant_linear_v2: x must be [M, K], qweight [L, N/16, 16 K | 8 K], "
                                       "scale [L, N/16, G, 16]");
  if (bits != 8 && bits != 4) return ffi::Error::InvalidArgument("hloserve_quant_linear_v2: bits must be 8 or 4");
  const int64_t M = xd[0], K = xd[1], L = qd[0], NG = qd[1], N = NG * 16;
  const ffi::DataType want = bits == 8 ? ffi::DataType::S8 : ffi::DataType::U8;
  if (qweight.element_type() != want || qd[2] != (bits == 8 ? 16 * K : 8 * K))
    return ffi::Error::InvalidArgument("hloserve_quant_linear_v2: qweight must be s8 [L, N/16, 16 K] (bits 8) or "
                                       "u8 [L, N/16, 8 K] (bits 4)");
  if (group <= 0 || group % kXBlock || K % group)
    return ffi::Error::InvalidArgument("hloserve_quant_linear_v2: group must be a multiple of 32 dividing K");
  const int64_t G = K / group;
  const bool f16 = scale.element_type() == ffi::DataType::F16;
  if ((!f16 && scale.element_type() != ffi::DataType::F32) || sd[0] != L || sd[1] != NG || sd[2] != G || sd[3] != 16)
    return ffi::Error::InvalidArgument("hloserve_quant_linear_v2: scale must be f16 or f32 [L, N/16, K / group, 16]");
  const bool asym = min.element_count() != 0;
  const int64_t l = layer.typed_data()[0];
  if (const char* why = quant_operands_error(bits, scale, min, l, L))
    return ffi::Error::InvalidArgument(std::string("hloserve_quant_linear_v2: ") + why);
  const int64_t ssize = f16 ? 2 : 4, per_layer = N * G, qlayer = bits == 8 ? N * K : N * K / 2;
  QuantMatrix2 w{static_cast<const uint8_t*>(qweight.untyped_data()) + l * qlayer,
                 static_cast<const char*>(scale.untyped_data()) + l * per_layer * ssize,
                 asym ? static_cast<const char*>(min.untyped_data()) + l * per_layer * ssize : nullptr, f16,
                 static_cast<int>(bits), N, K, G, group};
  const bool sym4 = bits == 4 && !asym;
  const QuantX2 xq = quantize_x2(x.typed_data(), M, K, G, group, bits == 8 ? 128 : sym4 ? 8 : 0);
  float* op = out->typed_data();
  constexpr int64_t kGroupsPerTask = kLinearRows / 16;
  const int64_t tasks = (NG + kGroupsPerTask - 1) / kGroupsPerTask;
  parallel_for(pool, tasks, 1, [&](int64_t task) {
    const int64_t g0 = task * kGroupsPerTask, g1 = std::min(NG, g0 + kGroupsPerTask);
#if defined(__AVX512VNNI__)
    if (bits == 8) quant2_vnni<8, false>(w, xq, M, g0, g1, op);
    else if (sym4) quant2_vnni<4, true>(w, xq, M, g0, g1, op);
    else quant2_vnni<4, false>(w, xq, M, g0, g1, op);
#else
    quant2_portable(w, xq, M, g0, g1, op);
#endif
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(hloserve_paged_attention, PagedAttention,
                              PagedAttentionOperands().Attr<int64_t>("window").Attr<int64_t>("holds")
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(hloserve_paged_attention_v2, PagedAttentionV2,
                              PagedAttentionOperands().Arg<ffi::Buffer<ffi::S32>>().Attr<int64_t>("holds")
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(hloserve_layer_linear, LayerLinear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("holds")
                                  .Ret<ffi::Buffer<ffi::F32>>());

// x, qweight, scale, min, layer; bits, group: both versions of hloserve.quant_linear
static auto QuantLinearBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Attr<int64_t>("bits")
      .Attr<int64_t>("group")
      .Ret<ffi::Buffer<ffi::F32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(hloserve_quant_linear, QuantLinear, QuantLinearBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(hloserve_quant_linear_v2, QuantLinear2, QuantLinearBinding());
