// What every hloserve CPU kernel shares: the FFI, widening of 16-bit floats, the thread-pool loop,
// the `Kind` of a buffer (the composites' `holds` attribute) and 16-lane vector helpers.
//
// The kernels, one file per composite (runtime/kernels/cpu/targets.py lists their FFI targets):
//   paged_attention.cc  hloserve.paged_attention v1, v2
//   linear.cc           hloserve.layer_linear v1
//   quant_linear.cc     hloserve.quant_linear v1, v2 (over quant_rows.h, the int8 / int4 row routines)
//   quant_blocks.cc     hloserve.quant_linear v3 (GGUF K-quant blocks; over quant_rows.h too)
//   experts.cc          hloserve.grouped_experts v1 (over linear.h, the 16-bit row routines linear.cc shares)
//                       and hloserve.quant_experts v1 (over quant_rows.h, quant_linear.cc's)
//   product_sum.cc      hloserve.product_sum v1 (a*b + c*d without a fused multiply-add)
//   row_sum.cc          hloserve.row_sum v1 (each row's sum in one order at any row count)
// Each computes exactly what the composite's decomposition in the artifact computes (contracts:
// runtime/artifact/kernels.py; decompositions: exporter/composites/). They exist because XLA:CPU
// materializes what these read in place. Work is split over XLA's intra-op thread pool; the
// calling thread takes a share and never waits on a task that has not started.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <thread>
#include <type_traits>
#include <string>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "xla/ffi/api/ffi.h"

// Before a loop of a fixed trip count over a tile's accumulators (rows, x rows, steps of a block):
// unrolled before GCC decides where an array of vectors lives, so the array is kept in registers.
// Without it GCC 12 keeps `__m512 acc[NR][MR]` in registers AND stores every accumulator to the
// stack on every iteration (16 stores per 16 FMAs in the 4 x 4 tiles: store-bound, measured 2.5x
// slower). Clang reads the GCC spelling too.
#define HLOSERVE_UNROLL _Pragma("GCC unroll 64")

namespace hloserve {
namespace ffi = xla::ffi;

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
inline void parallel_for(ffi::ThreadPool& pool, int64_t n, int64_t grain, F fn) {
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
// kI8Rows (paged attention's KV cache only): rows of D int8 values, then the row's bf16 scale in
// 2 bytes (little-endian), a value being q * scale (runtime/artifact/kernels.py INT8_ROW); kI8ZpRows:
// the same then the row's int8 zero point z, a value being (q - z) * scale (INT8_ZP_ROW); kF8E4M3Rows:
// rows of D float8 e4m3fn bytes, then the row's bf16 scale, a value being e4m3(f) * scale (FP8_E4M3_ROW).
enum class Kind : int64_t { kF32 = 0, kBF16 = 1, kF16 = 2, kI8Rows = 3, kI8ZpRows = 4, kF8E4M3Rows = 5 };

template <Kind K>
constexpr bool int8_rows = K == Kind::kI8Rows || K == Kind::kI8ZpRows;

// rows of 8-bit values with a scale each (int8 or fp8): an s8 buffer
template <Kind K>
constexpr bool scaled_rows = int8_rows<K> || K == Kind::kF8E4M3Rows;

// An fp8 row's bytes are read as their e4m3 value times 2^-8 (kE4m3 below, and load16's float16
// trick: the byte's bits placed in a float16's are that value times 2^-8), and its scale times 2^8:
// powers of two, so every product and sum is the one of the unscaled values, bit for bit.
constexpr float kF8Unit = 1.f / 256;

// e4m3fn byte -> its value times kF8Unit (exact). Sign, 4 exponent bits of bias 7, 3 mantissa bits;
// exponent 0 is subnormal (m * 2^-9); 0x7F / 0xFF (NaN) are never written.
struct E4m3Table {
  float v[256];
};
constexpr E4m3Table make_e4m3_table() {
  E4m3Table t{};
  for (int b = 0; b < 256; ++b) {
    const int e = (b >> 3) & 0xF, m = b & 7;
    float mag = e == 0 ? static_cast<float>(m) / 512 : 1.f + static_cast<float>(m) / 8;
    for (int i = 7; i < e; ++i) mag *= 2;    // 2^(e - 7) for normal values
    for (int i = e; i < 7 && e > 0; ++i) mag /= 2;
    t.v[b] = (b & 0x80 ? -mag : mag) * kF8Unit;
  }
  return t;
}
inline constexpr E4m3Table kE4m3 = make_e4m3_table();

inline bool valid_kind(int64_t holds) { return holds >= 0 && holds <= static_cast<int64_t>(Kind::kF16); }

// Elements a row holds past its D values: the scale of an int8 or fp8 row (and its zero point).
template <Kind K>
constexpr int64_t row_extra = K == Kind::kI8Rows || K == Kind::kF8E4M3Rows ? 2 : K == Kind::kI8ZpRows ? 3 : 0;

// The factor a row's loaded elements are multiplied by: an int8 row's scale, read from the 2 bytes
// after its D values (`row` is the row's first element), an fp8 row's times 2^8 (kF8Unit); 1 for
// float rows.
template <Kind K>
inline float row_scale(const void* base, int64_t row, int64_t D) {
  if constexpr (scaled_rows<K>) {
    uint16_t bits;
    std::memcpy(&bits, static_cast<const int8_t*>(base) + row + D, 2);
    if constexpr (K == Kind::kF8E4M3Rows) return bf16_to_f32(bits) * (1.f / kF8Unit);
    return bf16_to_f32(bits);
  }
  return 1.f;
}

// The zero point subtracted from a row's loaded elements before its scale: an INT8_ZP_ROW's, the
// byte after its scale; 0 for other rows.
template <Kind K>
inline float row_zero(const void* base, int64_t row, int64_t D) {
  if constexpr (K == Kind::kI8ZpRows) return static_cast<float>(static_cast<const int8_t*>(base)[row + D + 2]);
  return 0.f;
}


// Calls fn(std::integral_constant<Kind, K>{}) for the runtime `kind`.
template <typename F>
void with_kind(Kind kind, F fn) {
  switch (kind) {
    case Kind::kF32: return fn(std::integral_constant<Kind, Kind::kF32>{});
    case Kind::kBF16: return fn(std::integral_constant<Kind, Kind::kBF16>{});
    case Kind::kF16: return fn(std::integral_constant<Kind, Kind::kF16>{});
    case Kind::kI8Rows: return fn(std::integral_constant<Kind, Kind::kI8Rows>{});
    case Kind::kI8ZpRows: return fn(std::integral_constant<Kind, Kind::kI8ZpRows>{});
    case Kind::kF8E4M3Rows: return fn(std::integral_constant<Kind, Kind::kF8E4M3Rows>{});
  }
}

template <Kind K>
inline float load(const void* base, int64_t i) {
  if constexpr (K == Kind::kF32) return static_cast<const float*>(base)[i];
  if constexpr (K == Kind::kBF16) return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
  if constexpr (int8_rows<K>) return static_cast<float>(static_cast<const int8_t*>(base)[i]);
  if constexpr (K == Kind::kF8E4M3Rows) return kE4m3.v[static_cast<const uint8_t*>(base)[i]];
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

// The 16 lanes of v summed in sum16's order: per 128-bit segment (x0 + x2) + (x1 + x3), then
// (S0 + S2) + (S1 + S3). A row's sum is then the same whether its tile summed it alone or with 15
// others (_mm512_reduce_add_ps adds in another order: a decode row and the same row in a step of
// four or more got different last bits from linear.h's tiles).
inline float reduce16(__m512 v) {
  const __m512 a = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4E));              // x0 + x2, x1 + x3
  const __m512 b = _mm512_add_ps(a, _mm512_permute_ps(a, 0xB1));              // (x0 + x2) + (x1 + x3)
  const __m512 c = _mm512_add_ps(b, _mm512_shuffle_f32x4(b, b, 0x4E));         // S0 + S2, S1 + S3
  return _mm512_cvtss_f32(_mm512_add_ps(c, _mm512_shuffle_f32x4(c, c, 0xB1)));
}

// 16 consecutive elements of a K or V row, as f32
template <Kind K>
inline __m512 load16(const void* base, int64_t i) {
  if constexpr (K == Kind::kF32) return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  if constexpr (int8_rows<K>)
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + i))));
  if constexpr (K == Kind::kF8E4M3Rows) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + i));
    // e4m3 bits as a float16's: sign to bit 15, exponent and mantissa to bits 13..7 (the byte sign-
    // extended, shifted by 7, bit 14 cleared); that float16 is the e4m3 value times 2^-8 (exponent
    // bias 15 against 7), subnormals included (vcvtph2ps converts them whatever MXCSR.DAZ says).
    // A gather from kE4m3 instead made one decode token's attention over 2,000 positions 1.8x slower
    // (G 3, D 64, one thread, AMX Xeon, 2026-11-29: 48-59 us against 91-148 us; int8 rows 40-52 us).
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16(-16512));
    return _mm512_cvtph_ps(h);
  }
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
  if constexpr (K == Kind::kBF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}
#endif


#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// The AVX2 twins of sum16 and load16, for CPUs without AVX-512 (AMD Zen 2 / Zen 3, Intel before
// Skylake-SP). Lane k of the result: the sum of v[k]'s 8 lanes (the same tree: pairs, then pairs of
// pairs within each 128-bit segment, then the two segments).
inline __m256 sum8(const __m256* v) {
  __m256 a[4], b[2];
  for (int p = 0; p < 4; ++p)
    a[p] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * p], v[2 * p + 1]), _mm256_unpackhi_ps(v[2 * p], v[2 * p + 1]));
  for (int p = 0; p < 2; ++p) {
    const __m256d lo = _mm256_unpacklo_pd(_mm256_castps_pd(a[2 * p]), _mm256_castps_pd(a[2 * p + 1]));
    const __m256d hi = _mm256_unpackhi_pd(_mm256_castps_pd(a[2 * p]), _mm256_castps_pd(a[2 * p + 1]));
    b[p] = _mm256_add_ps(_mm256_castpd_ps(lo), _mm256_castpd_ps(hi));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}

// 8 consecutive elements of a K or V row, as f32 (fp8 rows by load16's float16 trick, F16C)
template <Kind K>
inline __m256 load8(const void* base, int64_t i) {
  if constexpr (K == Kind::kF32) return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  if constexpr (int8_rows<K>)
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + i))));
  if constexpr (K == Kind::kF8E4M3Rows) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + i));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm_set1_epi16(-16512)));
  }
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
  if constexpr (K == Kind::kBF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}
#endif

#if defined(__AMX_TILE__)
// AMX (Intel Sapphire Rapids and later; linear.cc's bf16 tiles, quant_linear.cc's int8 ones): Linux
// hands out the tile state on request (once per process; false where it refuses)
inline bool amx_usable() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// the tile configuration _tile_loadconfig reads: palette 1, each tile's rows and bytes a row
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// every tile 16 rows of 64 bytes (bf16: 16 x 32, sums 16 x 16 f32), loaded into this thread's tile state
inline void amx_configure_16x64() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
  // GCC 12 at -O3 can drop the colsb stores as dead before ldtilecfg where this is inlined (seen in
  // a benchmark: ldtilecfg then faults on a zero-width tile); the clobber makes them visible
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

#endif

#if defined(__AVX512F__)
// 16 rows of 16 32-bit elements, row i at rows[i] -> their transpose into dst (row r, element i =
// rows[i] element r; dst rows `ds` bytes apart): pairs of rows, pairs of pairs, then 128-bit lanes.
// The AMX kernels' packing of B tiles and linear.h's pack_pairs (pairs of bf16 as 32-bit elements).
inline void transpose16_rows(const char* const rows[16], void* dst, int64_t ds) {
  __m512i r[16], t[16];
  HLOSERVE_UNROLL
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows[i]);
  HLOSERVE_UNROLL
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  HLOSERVE_UNROLL
  for (int q = 0; q < 4; ++q) {
    r[4 * q] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
    r[4 * q + 1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
    r[4 * q + 2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
    r[4 * q + 3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
  }
  char* d = static_cast<char*>(dst);
  HLOSERVE_UNROLL
  for (int j = 0; j < 4; ++j) {
    const __m512i ab_lo = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), ab_hi = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
    const __m512i cd_lo = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
    const __m512i cd_hi = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
    _mm512_storeu_si512(d + j * ds, _mm512_shuffle_i32x4(ab_lo, cd_lo, 0x88));
    _mm512_storeu_si512(d + (4 + j) * ds, _mm512_shuffle_i32x4(ab_lo, cd_lo, 0xDD));
    _mm512_storeu_si512(d + (8 + j) * ds, _mm512_shuffle_i32x4(ab_hi, cd_hi, 0x88));
    _mm512_storeu_si512(d + (12 + j) * ds, _mm512_shuffle_i32x4(ab_hi, cd_hi, 0xDD));
  }
}

#endif

// A std::vector whose storage starts on a 64-byte line. AMX tile rows are 64 bytes: packed tiles
// in a plain vector (malloc aligns to 16) have every row straddle two lines, two reads where one
// is needed (measured: tile multiplies fed from such buffers ran 1.45x slower).
template <class T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <class U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};
template <class T>
using LineVector = std::vector<T, LineAllocator<T>>;


// fn(u0, u1) over `units` split into as many contiguous, even shares as the pool has threads (fewer
// where the units are fewer): for units that cost alike, where fixed-size tasks handed out in turn
// leave a thread idle for part of a small matrix (a 192-row matrix as three 64-row tasks on two
// threads: one thread takes two)
template <typename F>
inline void even_shares(ffi::ThreadPool& pool, int64_t units, F fn) {
  const int64_t shares = std::min<int64_t>(units, std::max<int64_t>(1, pool.num_threads()));
  parallel_for(pool, shares, 1, [&](int64_t s) { fn(units * s / shares, units * (s + 1) / shares); });
}

// output rows (matrix rows) per task of the linear kernels (layer_linear, quant_linear)
constexpr int64_t kLinearRows = 64;

// std::allocator whose size constructor and resize leave the elements default-initialized (no
// zeros written for trivial types): for scratch buffers every element of which is written before it
// is read. A prompt chunk's grouped experts zeroed ~13 MB of such buffers a layer (memset 4% of a
// mixture-of-experts step's samples, 2026-11-30).
template <class T>
struct NoInitAllocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = NoInitAllocator<U>;
  };
  NoInitAllocator() = default;
  template <class U>
  NoInitAllocator(const NoInitAllocator<U>&) {}
  template <class U>
  void construct(U* p) {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
template <class T>
using Scratch = std::vector<T, NoInitAllocator<T>>;

// A Scratch on 64-byte lines: LineVector's storage, left unwritten by the size constructor (packed
// x blocks that the packing writes whole: the zeros LineVector wrote first were 1% of a mixture of
// experts' 2-token decode step's samples, 2026-12-03)
template <class T>
struct LineNoInitAllocator : NoInitAllocator<T> {
  template <class U>
  struct rebind {
    using other = LineNoInitAllocator<U>;
  };
  LineNoInitAllocator() = default;
  template <class U>
  LineNoInitAllocator(const LineNoInitAllocator<U>&) {}
  T* allocate(size_t n) { return LineAllocator<T>().allocate(n); }
  void deallocate(T* p, size_t n) { LineAllocator<T>().deallocate(p, n); }
};
template <class T>
using LineScratch = std::vector<T, LineNoInitAllocator<T>>;

// bytes [at, at + bytes) of base into L1 (every 64-byte line they touch; __builtin_prefetch, so
// any -march): the attention's cache rows, the quantized linears' weights and scales; LOCALITY 2:
// into L2 (the quantized tiles' next groups)
template <int LOCALITY = 3>
inline void prefetch_bytes(const void* base, int64_t at, int64_t bytes) {
  const char* p = static_cast<const char*>(base) + at;
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, LOCALITY);
  if (bytes % 64 != 0) __builtin_prefetch(p + bytes - 1, 0, LOCALITY);   // a row that ends mid-line
}

// e^x for x <= 0 (softmax arguments, the logistic's), vectorizable: 2^n * p(r), x = n ln2 + r,
// |r| <= ln2/2; relative error < 2e-7 (degree-6 Taylor polynomial of e^r); x below -87 gives 0.
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

}  // namespace hloserve
