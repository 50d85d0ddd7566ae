// hloserve's CPU kernels, called from StableHLO through XLA's FFI (custom_call).
//
// Each kernel computes exactly what a portable StableHLO formulation in the artifact computes
// (exporter/lowerings/kernels.py holds both); the runtime builds this file on first use
// (runtime/kernels/__init__.py) and registers the targets for the CPU platform only. They exist
// because XLA:CPU materializes what these read in place:
//
//   hloserve_paged_attention: attention of each token over its own sequence's paged context,
//     read block by block straight from the KV cache (16-bit float bits or f32), only the blocks
//     in use; XLA gathers every sequence's padded context, widened to f32, before its dots.
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
#include <vector>

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

enum class Kind { kF32, kBF16, kF16 };


template <Kind K>
inline float load(const void* base, int64_t i) {
  if constexpr (K == Kind::kF32) return static_cast<const float*>(base)[i];
  if constexpr (K == Kind::kBF16) return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
  return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
}

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
#undef HLOSERVE_ATTEND
  attend_any<K>(q, cache, kbase, vbase, table, begin, end, BS, D, G, scale, softcap, scores, out);
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
  // holds: 0 = the cache's own dtype (f32), 1 = bf16 bits, 2 = f16 bits (in an s16/u16 buffer)
  Kind kind = holds == 1 ? Kind::kBF16 : holds == 2 ? Kind::kF16 : Kind::kF32;
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

  parallel_for(pool, T * KV, 1, [&, kind](int64_t i) {
    const int64_t t = i / KV, h = i % KV;
    float* o = op + i * G * D;
    const int64_t s = seqs[t];
    int64_t end = std::min<int64_t>(static_cast<int64_t>(pos[t]) + 1, s >= 0 && s < S ? lens[s] : 0);
    end = std::min(end, B * BS);
    int64_t begin = window > 0 ? std::max<int64_t>(0, static_cast<int64_t>(pos[t]) - window + 1) : 0;
    if (s < 0 || s >= S || end <= begin) {
      std::fill(o, o + G * D, 0.f);
      return;
    }
    thread_local std::vector<float> scores;
    if (static_cast<int64_t>(scores.size()) < G * (end - begin)) scores.resize(G * (end - begin));
    const int64_t kbase = ((l * 2 + 0) * KV + h) * head_stride;
    const int64_t vbase = ((l * 2 + 1) * KV + h) * head_stride;
    const int32_t* table = tables + s * B;
    const float* qi = qp + i * G * D;
    switch (kind) {
      case Kind::kF32: attend<Kind::kF32>(qi, cdata, kbase, vbase, table, begin, end, BS, D, G, scale, softcap, scores.data(), o); break;
      case Kind::kBF16: attend<Kind::kBF16>(qi, cdata, kbase, vbase, table, begin, end, BS, D, G, scale, softcap, scores.data(), o); break;
      case Kind::kF16: attend<Kind::kF16>(qi, cdata, kbase, vbase, table, begin, end, BS, D, G, scale, softcap, scores.data(), o); break;
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(hloserve_paged_attention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("holds")
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Ret<ffi::Buffer<ffi::F32>>());
