// hloserve_quant_linear (v1), hloserve_quant_linear_v2 (rows interleaved by 16),
// hloserve_quant_linear_v4 (5-bit values, GGUF Q5_0, interleaved as v2's int4 with their fifth bits
// beside) and hloserve_quant_linear_v6 (v2's, prompt chunks in bf16): an int8 / int5 / int4 matrix
// multiplied as integers (int8 activations, VNNI; v6's chunks as bf16 tiles); XLA writes
// the dequantized f32 layer to memory and reads it back. Version 1's row routines (quant_rows.h) are shared with the quantized
// experts (experts.cc) and, without VNNI, version 3 (quant_blocks.cc: GGUF K-quant blocks kept).
#include "linear.h"
#include "quant_rows.h"

namespace {
using namespace hloserve;

// The operands the versions take, checked alike and read at the layer: x [M, K]; qweight, scale
// (and min) in the version's layout, `version` 1 (qweight [L, N, K | K/2], scale [L, N, G]), 2
// ([L, N/16, 16 K | 8 K], [L, N/16, G, 16]) or 4 (bits 5: [L, N/16, 10 K], [L, N/16, K/32, 16]).
// Fills `w` and `M`, or returns an InvalidArgument naming `target` and what is wrong.
ffi::Error read_operands(const char* target, int version, ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer& qweight,
                         ffi::AnyBuffer& scale, ffi::AnyBuffer& min, ffi::Buffer<ffi::S32>& layer, int64_t bits,
                         int64_t group, QuantMatrix& w, int64_t& M) {
  auto fail = [target](const char* why) { return ffi::Error::InvalidArgument(std::string(target) + ": " + why); };
  const int64_t rows = version == 1 ? 1 : 16;
  const bool v2 = rows > 1;
  auto xd = x.dimensions();
  auto qd = qweight.dimensions();
  auto sd = scale.dimensions();
  if (xd.size() != 2 || qd.size() != 3 || sd.size() != (v2 ? 4u : 3u))
    return fail(v2 ? "x must be [M, K], qweight [L, N/16, 16 K | 8 K], scale [L, N/16, G, 16]"
                   : "x must be [M, K], qweight [L, N, K | K/2], scale [L, N, G]");
  if (version == 4 ? (bits != 5 || group != kXBlock) : (bits != 8 && bits != 4))
    return fail(version == 4 ? "bits must be 5 and group 32" : "bits must be 8 or 4");
  M = xd[0];
  const int64_t K = xd[1], L = qd[0], N = qd[1] * rows;
  const int64_t width = bits == 5 ? 10 * K : rows * (bits == 8 ? K : K / 2);   // qweight bytes per row group
  const ffi::DataType want = bits == 8 ? ffi::DataType::S8 : ffi::DataType::U8;
  if (qweight.element_type() != want || qd[2] != width)
    return fail(version == 4 ? "qweight must be u8 [L, N/16, 10 K]"
                : v2 ? "qweight must be s8 [L, N/16, 16 K] (bits 8) or u8 [L, N/16, 8 K] (bits 4)"
                     : "qweight must be s8 [L, N, K] (bits 8) or u8 [L, N, K/2] (bits 4)");
  if (group <= 0 || group % kXBlock || K % group) return fail("group must be a multiple of 32 dividing K");
  const int64_t G = K / group;
  const bool f16 = scale.element_type() == ffi::DataType::F16;
  if ((!f16 && scale.element_type() != ffi::DataType::F32) || sd[0] != L || sd[1] != qd[1] || sd[2] != G ||
      (v2 && sd[3] != 16))
    return fail(v2 ? "scale must be f16 or f32 [L, N/16, K / group, 16]" : "scale must be f16 or f32 [L, N, K / group]");
  const bool asym = min.element_count() != 0;
  if (asym && (min.element_type() != scale.element_type() || min.element_count() != scale.element_count()))
    return fail("min must have scale's dtype and shape, or no elements");
  if (asym && bits != 4) return fail("int8 and int5 weights have no min");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return fail("layer out of range");
  const int64_t per_layer = N * G * (f16 ? 2 : 4);   // bytes of a layer's scales (or mins)
  w = QuantMatrix{static_cast<const uint8_t*>(qweight.untyped_data()) + l * qd[1] * width,
                  static_cast<const char*>(scale.untyped_data()) + l * per_layer,
                  asym ? static_cast<const char*>(min.untyped_data()) + l * per_layer : nullptr,
                  f16, static_cast<int>(bits), N, K, G, group};
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
// elements of one row) and 16 outputs are stored at once, with no horizontal sums. (x: QuantX2,
// quant_rows.h, shared with version 3's kernel in quant_blocks.cc.)

// row group g's scales (or mins) [G, 16] as f32: in place for f32, else widened into `buf`
inline const float* group_scalars(const void* base, bool f16, int64_t g, int64_t G, std::vector<float>& buf) {
  if (!f16) return static_cast<const float*>(base) + g * G * 16;
  buf.resize(G * 16);
  widen(base, true, g * G * 16, G * 16, buf.data());
  return buf.data();
}

// row group g's scales and mins into L1 (common.h's prefetch_bytes), a group ahead of their use,
// where there is such a group: the scales are a stream of their own beside the weights', and read a
// group at a time they waited on DRAM (the f16 scales' widening was 6.5% of a 16-row int8 decode
// step's samples, nearly all on its first load)
inline void prefetch_group_scalars(const QuantMatrix& w, int64_t g, int64_t g1) {
  if (g >= g1) return;
  const int64_t bytes = w.G * 16 * (w.f16 ? 2 : 4);
  prefetch_bytes(w.scale, g * bytes, bytes);
  if (w.min != nullptr) prefetch_bytes(w.min, g * bytes, bytes);
}

// row groups [g0, g1), portably: the integer block sums (the weights as they are, signed), then f32
void quant2_portable(const QuantMatrix& w, const QuantX2& x, int64_t M, int64_t g0, int64_t g1, float* out) {
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
          for (int64_t k = b * kXBlock; k < (b + 1) * kXBlock; ++k) dot += xr[k] * int_of_interleaved(w, n, k);
          total += static_cast<float>(dot) * (ws[(b / per_group) * 16 + n % 16] * x.d[m * B + b]);
        }
        for (int64_t g = 0; wm != nullptr && g < w.G; ++g) total += wm[g * 16 + n % 16] * x.xsum[m * w.G + g];
        out[m * w.N + n] = total;
      }
  }
}

#if defined(__AVX512VNNI__)
// NG consecutive groups of 16 matrix rows (q: the first, gbytes apart; their scales ws[h], mins wm[h]
// or none) times MR rows of x (from m0): per block, int32 sums started at the offset correction, then
// one f32 scaling per row of x; each broadcast of x serves the NG groups' products; outputs 16 NG
// contiguous floats per row of x. PF: block b also prefetches block b of the `nextg` groups from
// `next` (gbytes apart) into L2, so the tile sweeps the next groups' bytes in while it multiplies
template <int BITS, bool SYM4, int MR, int NG, bool PF = false>
inline void quant2_tile(const uint8_t* q, int64_t gbytes, const float* const* ws, const float* const* wm,
                        const QuantX2& x, int64_t m0, int64_t K, int64_t G, int64_t per_group, float* out, int64_t N,
                        const uint8_t* next = nullptr, int nextg = 0) {
  const int64_t B = K / kXBlock;
  constexpr int64_t kBlockBytes = BITS == 8 ? 16 * 32 : BITS == 5 ? 320 : 16 * 16;
  const __m512i flip = _mm512_set1_epi8(BITS == 8 ? static_cast<char>(0x80) : static_cast<char>(0x88));
  const __m512i low = _mm512_set1_epi8(0x0F), five = _mm512_set1_epi8(0x10);
  __m512 facc[NG][MR];
  HLOSERVE_UNROLL
  for (int h = 0; h < NG; ++h)
    HLOSERVE_UNROLL
    for (int j = 0; j < MR; ++j) facc[h][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    __m512i iacc[NG][MR];
    HLOSERVE_UNROLL
    for (int j = 0; j < MR; ++j) {
      const __m512i start = _mm512_set1_epi32(x.start[(m0 + j) * B + b]);
      HLOSERVE_UNROLL
      for (int h = 0; h < NG; ++h) iacc[h][j] = start;
    }
    const uint8_t* qb = q + b * kBlockBytes;
    const int8_t* xb = x.xq.data() + m0 * K + b * kXBlock;
    if constexpr (PF)
      for (int h = 0; h < nextg; ++h) prefetch_bytes<2>(next, h * gbytes + b * kBlockBytes, kBlockBytes);
    if constexpr (BITS == 8) {
      HLOSERVE_UNROLL
      for (int s = 0; s < 8; ++s) {
        __m512i w[NG];
        HLOSERVE_UNROLL
        for (int h = 0; h < NG; ++h) w[h] = _mm512_xor_si512(_mm512_loadu_si512(qb + h * gbytes + s * 64), flip);   // q + 128
        HLOSERVE_UNROLL
        for (int j = 0; j < MR; ++j) {
          int32_t four;
          std::memcpy(&four, xb + j * K + s * 4, 4);
          const __m512i xv = _mm512_set1_epi32(four);
          HLOSERVE_UNROLL
          for (int h = 0; h < NG; ++h) iacc[h][j] = _mm512_dpbusd_epi32(iacc[h][j], w[h], xv);
        }
      }
    } else {   // k-steps of 8: each row's 4 low nibbles against x's first 4 bytes, the high ones the next 4
      HLOSERVE_UNROLL
      for (int s = 0; s < 4; ++s) {
        __m512i lo[NG], hi[NG];
        HLOSERVE_UNROLL
        for (int h = 0; h < NG; ++h) {
          const uint8_t* qh = qb + h * gbytes;
          __m512i v = _mm512_loadu_si512(qh + s * 64);
          if constexpr (BITS == 4 && SYM4) v = _mm512_xor_si512(v, flip);               // q + 8, both nibbles
          lo[h] = _mm512_and_si512(v, low), hi[h] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
          if constexpr (BITS == 5) {   // each byte's fifth bit or'd in by mask: q + 16
            uint64_t bits[2];
            std::memcpy(bits, qh + 256 + s * 16, 16);
            lo[h] = _mm512_mask_add_epi8(lo[h], static_cast<__mmask64>(bits[0]), lo[h], five);
            hi[h] = _mm512_mask_add_epi8(hi[h], static_cast<__mmask64>(bits[1]), hi[h], five);
          }
        }
        HLOSERVE_UNROLL
        for (int j = 0; j < MR; ++j) {
          int32_t a, c;
          std::memcpy(&a, xb + j * K + s * 8, 4);
          std::memcpy(&c, xb + j * K + s * 8 + 4, 4);
          const __m512i av = _mm512_set1_epi32(a), cv = _mm512_set1_epi32(c);
          HLOSERVE_UNROLL
          for (int h = 0; h < NG; ++h) iacc[h][j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(iacc[h][j], lo[h], av), hi[h], cv);
        }
      }
    }
    HLOSERVE_UNROLL
    for (int h = 0; h < NG; ++h)
      scale_sums<MR>(facc[h], iacc[h], _mm512_loadu_ps(ws[h] + (b / per_group) * 16), x.d.data() + m0 * B + b, B);
  }
  HLOSERVE_UNROLL
  for (int h = 0; h < NG; ++h) mins_and_store<MR>(facc[h], wm[h], x.xsum.data() + m0 * G, G, out + 16 * h + m0 * N, N);
}

// Calls of more rows than this (prompt chunks) run int8 and int4 two groups at a time: the default
// model's 256-token chunk, the trees alternated 5 times on a Zen 4 EPYC (2026-12-03), int4 167-250 ->
// 148-194 ms (faster in 5 of 5 pairs), int8 138-183 -> 146-166 (4 of 5); one and 16 decode rows were
// not faster that way (int8 slower in 3 of 3), so they keep one group at a time
constexpr int64_t kTwoGroupRows = 16;

// groups [g, g + NG) times rows [m, M) of x: 6 rows of x a tile for one group, 4 for two (the
// accumulators in registers)
template <int BITS, bool SYM4, int NG>
inline void quant2_groups(const QuantMatrix& w, const QuantX2& x, int64_t m, int64_t M, int64_t g, int64_t g1,
                          float* out, std::vector<float> (&sbuf)[2], std::vector<float> (&mbuf)[2]) {
  constexpr int kRows = NG == 1 ? 6 : 4;
  const int64_t per_group = w.group / kXBlock;
  const int64_t gbytes = BITS == 8 ? 16 * w.K : BITS == 5 ? 10 * w.K : 8 * w.K;   // bytes per group of 16 rows
  const float* ws[NG];
  const float* wm[NG];
  for (int h = 0; h < NG; ++h) {
    ws[h] = group_scalars(w.scale, w.f16, g + h, w.G, sbuf[h]);
    wm[h] = w.min != nullptr ? group_scalars(w.min, w.f16, g + h, w.G, mbuf[h]) : nullptr;
  }
  prefetch_group_scalars(w, g + NG, g1);
  const uint8_t* q = w.q + g * gbytes;
  float* o = out + g * 16;
  // the first tile reads the groups from memory, the later ones from L1/L2: the second one prefetches
  // the next groups of this share (up to NG) into L2 meanwhile
  const int nextg = static_cast<int>(std::min<int64_t>(NG, g1 - g - NG));
  const int64_t second = m + kRows;
  auto tile = [&](auto rows) {
    constexpr int R = decltype(rows)::value;
    if (m == second && nextg > 0)
      quant2_tile<BITS, SYM4, R, NG, true>(q, gbytes, ws, wm, x, m, w.K, w.G, per_group, o, w.N, q + NG * gbytes, nextg);
    else
      quant2_tile<BITS, SYM4, R, NG>(q, gbytes, ws, wm, x, m, w.K, w.G, per_group, o, w.N);
  };
  for (; m + kRows <= M; m += kRows) tile(std::integral_constant<int, kRows>{});
  switch (M - m) {
    case 5: if constexpr (kRows > 5) tile(std::integral_constant<int, 5>{}); break;
    case 4: if constexpr (kRows > 4) tile(std::integral_constant<int, 4>{}); break;
    case 3: tile(std::integral_constant<int, 3>{}); break;
    case 2: tile(std::integral_constant<int, 2>{}); break;
    case 1: tile(std::integral_constant<int, 1>{}); break;
  }
}

// rows [m0, M) of x times row groups [g0, g1): a prompt chunk's int8 and int4 two groups at a time,
// everything else one
template <int BITS, bool SYM4>
void quant2_vnni(const QuantMatrix& w, const QuantX2& x, int64_t m0, int64_t M, int64_t g0, int64_t g1, float* out) {
  std::vector<float> sbuf[2], mbuf[2];
  int64_t g = g0;
  if constexpr (BITS != 5)
    for (; M - m0 > kTwoGroupRows && g + 2 <= g1; g += 2) quant2_groups<BITS, SYM4, 2>(w, x, m0, M, g, g1, out, sbuf, mbuf);
  for (; g < g1; ++g) quant2_groups<BITS, SYM4, 1>(w, x, m0, M, g, g1, out, sbuf, mbuf);
}
#endif

#if defined(__AVX2__) && !defined(__AVX512VNNI__)
// Without VNNI (AVX2 CPUs: AMD Zen 2 / Zen 3): quant2_tile's product with quant_rows.h's AVX2 steps
// (vpmaddubsw and vpmaddwd in place of vpdpbusd), 16 matrix rows as two 256-bit halves. int8 weights
// go in as |w| against x with w's signs (x quantized with offset 0: no flip, no offset correction;
// |x| against w with x's signs, llama.cpp's AVX2 form, gets a checkpoint's -128 wrong); int4 nibbles
// (0..15, sym after the +8 flip) and version 4's 5-bit codes (q + 16, each fifth bit spread to its
// byte) are the unsigned operand as they are, their products summed in int16 over a block (nibbles)
// or two steps (5-bit codes) before one vpmaddwd widens them. The int32 sums are exact, so every
// output is the VNNI path's, bit for bit (the same f32 scaling in the same order). PF: block b also
// prefetches block b of the group at `next` into L2 (quant2_tile's prefetch)
template <int BITS, bool SYM4, int MR, bool PF = false>
inline void quant2_tile_avx2(const uint8_t* q, const float* ws, const float* wm, const QuantX2& x, int64_t m0,
                             int64_t K, int64_t G, int64_t per_group, float* out, int64_t N,
                             const uint8_t* next = nullptr) {
  const int64_t B = K / kXBlock;
  constexpr int64_t kBlockBytes = BITS == 8 ? 16 * 32 : BITS == 5 ? 320 : 16 * 16;
  __m256 facc[MR][2];
  HLOSERVE_UNROLL
  for (int j = 0; j < MR; ++j) facc[j][0] = facc[j][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    __m256i iacc[MR][2];
    HLOSERVE_UNROLL
    for (int j = 0; j < MR; ++j) iacc[j][0] = iacc[j][1] = _mm256_set1_epi32(x.start[(m0 + j) * B + b]);
    const uint8_t* qb = q + b * kBlockBytes;
    const int8_t* xb = x.xq.data() + m0 * K + b * kXBlock;
    if constexpr (PF) prefetch_bytes<2>(next, b * kBlockBytes, kBlockBytes);
    if constexpr (BITS == 8) {
      HLOSERVE_UNROLL
      for (int s = 0; s < 8; ++s) int8_step_avx2<MR>(iacc, qb + s * 64, xb + s * 4, K);
    } else if constexpr (BITS == 5) {
      const __m256i low = _mm256_set1_epi8(0x0F);
      HLOSERVE_UNROLL
      for (int s0 = 0; s0 < 4; s0 += 2) {   // two steps' int16 sums (<= 31,496) widened at once
        __m256i acc[MR][2];
        HLOSERVE_UNROLL
        for (int j = 0; j < MR; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_si256();
        HLOSERVE_UNROLL
        for (int s = s0; s < s0 + 2; ++s) {
          uint32_t bits[4];   // the step's fifth bits: lo nibbles' 64, then hi nibbles' 64, 32 a half
          std::memcpy(bits, qb + 256 + s * 16, 16);
          __m256i lo[2], hi[2];
          HLOSERVE_UNROLL
          for (int h = 0; h < 2; ++h) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + s * 64 + 32 * h));
            lo[h] = _mm256_or_si256(_mm256_and_si256(v, low), fifth_bits(bits[h]));
            hi[h] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), fifth_bits(bits[2 + h]));
          }
          dot_step16_avx2<MR>(acc, lo, hi, xb + s * 8, K);
        }
        widen16_avx2<MR>(iacc, acc);
      }
    } else {
      int4_block_avx2<MR, SYM4>(iacc, qb, xb, K);
    }
    scale_sums_avx2<MR>(facc, iacc, ws + (b / per_group) * 16, x.d.data() + m0 * B + b, B);
  }
  mins_and_store_avx2<MR>(facc, wm, x.xsum.data() + m0 * G, G, out + m0 * N, N);
}

// rows [0, M) of x times row groups [g0, g1), 3 rows of x at a time (12 accumulators of 16 registers)
template <int BITS, bool SYM4>
void quant2_avx2(const QuantMatrix& w, const QuantX2& x, int64_t M, int64_t g0, int64_t g1, float* out) {
  const int64_t per_group = w.group / kXBlock;
  const int64_t gbytes = BITS == 8 ? 16 * w.K : BITS == 5 ? 10 * w.K : 8 * w.K;   // bytes per group of 16 rows
  std::vector<float> sbuf, mbuf;
  for (int64_t g = g0; g < g1; ++g) {
    int64_t m = 0;
    const uint8_t* q = w.q + g * gbytes;
    const float* ws = group_scalars(w.scale, w.f16, g, w.G, sbuf);
    const float* wm = w.min != nullptr ? group_scalars(w.min, w.f16, g, w.G, mbuf) : nullptr;
    float* o = out + g * 16;
    // the second tile prefetches the next group of this share (quant2_groups' prefetch)
    auto tile = [&](auto rows) {
      constexpr int R = decltype(rows)::value;
      if (m == 3 && g + 1 < g1)
        quant2_tile_avx2<BITS, SYM4, R, true>(q, ws, wm, x, m, w.K, w.G, per_group, o, w.N, q + gbytes);
      else
        quant2_tile_avx2<BITS, SYM4, R>(q, ws, wm, x, m, w.K, w.G, per_group, o, w.N);
    };
    for (; m + 3 <= M; m += 3) tile(std::integral_constant<int, 3>{});
    switch (M - m) {
      case 2: tile(std::integral_constant<int, 2>{}); break;
      case 1: tile(std::integral_constant<int, 1>{}); break;
    }
  }
}
#endif

#if defined(__AVX512BW__)
// one group of 16 rows' int4 bytes (version 2: k-steps of 8 elements, k in the low nibble and k + 4
// in the high one) -> int8 bytes in the int8 layout (k-steps of 4 elements): each 64 bytes give 2
// rows. Signed nibbles become two's complement bytes (0..7 -> 0..7, 8..15 -> -8..-1), unsigned ones
// stay 0..15. With GFNI each byte's nibble is moved (and its sign bit copied up) by one affine
// transform over its 8 bits; without it, a mask, a shift and a table lookup.
template <bool SYM4>
inline void widen_int4(const uint8_t* q, int64_t K, int8_t* dst) {
#if defined(__GFNI__)
  // gf2p8affine: output bit i of a byte is input bit src(i), the matrix's byte 7 - i = 1 << src(i)
  const __m512i lo_bits = _mm512_set1_epi64(0x0102040808080808);   // bits 0..3, then bit 3 (sign) copied
  const __m512i hi_bits = _mm512_set1_epi64(SYM4 ? 0x1020408080808080 : 0x1020408000000000);   // bits 4..7
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t s = 0; s < K / 8; ++s) {
    const __m512i v = _mm512_loadu_si512(q + s * 64);
    const __m512i lo = SYM4 ? _mm512_gf2p8affine_epi64_epi8(v, lo_bits, 0) : _mm512_and_si512(v, low);
    _mm512_storeu_si512(dst + 128 * s, lo);
    _mm512_storeu_si512(dst + 128 * s + 64, _mm512_gf2p8affine_epi64_epi8(v, hi_bits, 0));
  }
#else
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i sign = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1));
  for (int64_t s = 0; s < K / 8; ++s) {
    const __m512i v = _mm512_loadu_si512(q + s * 64);
    __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    if constexpr (SYM4) {
      lo = _mm512_shuffle_epi8(sign, lo);
      hi = _mm512_shuffle_epi8(sign, hi);
    }
    _mm512_storeu_si512(dst + 128 * s, lo);
    _mm512_storeu_si512(dst + 128 * s + 64, hi);
  }
#endif
}

#endif

#if defined(__AVX512VNNI__) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
// -- AMX-INT8 (Sapphire Rapids and later) --------------------------------------------------------
//
// A 64-byte k-step of version 2's int8 layout (16 matrix rows x 4 elements) is one row of an AMX-INT8
// B tile, so one 32-element block of 16 matrix rows is an 8 x 64 B tile read where it lies; 16 rows
// of x, one block each, are the 16 x 32 A tile (rows K bytes apart). tdpbssd multiplies signed by
// signed bytes, so no offset is needed: each block's C tile holds the exact int32 sums the VNNI path
// computes (int4: the group's nibbles are first widened to int8 bytes in the int8 layout, signed or
// 0..15). The sums are per block, so each block's C tile is stored, and scaled in f32 as the VNNI
// path does (cvt, mul, fma: the same arithmetic, the same results), the 16 rows' f32 sums kept in
// registers. A tile store costs ~16 cycles (16 x 64 bytes) and is not forwarded to vector loads, so
// the tile unit runs kAmxLead blocks ahead of the scaling.

// tiles 0-3: C (16 x rows x 16 matrix rows, int32); 4-5: A (16 x rows x 32 bytes); 6-7: B (8 x 64 bytes)
inline void amx8_configure() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = t == 4 || t == 5 ? 32 : 64, c.rows[t] = t >= 6 ? 8 : 16;
  asm volatile("" : : "r"(&c) : "memory");   // the stores kept (common.h's amx_configure_16x64)
  _tile_loadconfig(&c);
}

// block b's sums of x (16 rows from xa, K apart) and the block's int8 bytes wb (8 x 64) into C tile
// TC (A tile TA, B tile TB). A macro: GCC's tile intrinsics take the tile numbers as literals.
#define HLOSERVE_AMX8_STEP(TC, TA, TB, b, wb)   \
  do {                                          \
    _tile_zero(TC);                             \
    _tile_loadd(TA, xa + (b) * kXBlock, K);     \
    _tile_loadd(TB, wb, 64);                    \
    _tile_dpbssd(TC, TA, TB);                   \
  } while (0)

// The C tiles of blocks in flight: block b's in C tile b % 4, stored kStoreLag blocks after its
// multiply is issued (a tile store waits for the multiply before it, and the tile unit runs its
// work in order: a store right behind its multiply stalled every block; 5-8% of the path's time at
// 16 rows with the weights in cache, 2026-11-30), into ring[b % kAmxRing], read by the scaling
// kAmxLead blocks after the multiply, so the store has reached L1 when the vector loads read it
// and the tile unit works while the vector units scale. int4 widened block by block (WIDE4 below):
// block b's int8 bytes are written kWideAhead blocks before the tile load reads them (a tile load
// waits for stores to the same bytes to land), into a ring of kWideRing blocks (512 bytes each).
//
// The weights are one sequential stream (a group's blocks side by side, the next group after them),
// yet the tile loads from DRAM left the tile unit waiting: each block's bytes are prefetched into
// L1 kPrefetch blocks ahead (4 KiB of int8); with the store lag 1.26x the int8 path's speed at 16
// rows over SmolLM2's 30 layers of matrices from DRAM, one thread (benchmarks/quant_decode.cc,
// 2026-11-30; 4 and 8 blocks ahead alike, 16 and 32 less). Prefetches past the matrix's end (or
// the widened copy's) read nothing that faults.
constexpr int64_t kAmxRing = 16, kAmxLead = 8, kStoreLag = 3, kWideAhead = 4, kWideRing = 8, kPrefetch = 8;

// How amx8_tile reads a group's weights: int8 bytes where they lie (the int8 layout, or int4 widened
// beforehand for the whole group), or int4 bytes widened block by block as the tiles go (one tile of
// x rows: nothing to share a widened group with; the group's int8 bytes never leave L1's ring)
enum class Wide { kNone, kSym4, kAsym4 };

// one group of 16 matrix rows (w: int8 bytes, or int4 bytes with WIDE4; scales ws [G, 16], mins wm or
// none) times 16 rows of x from m0 (x padded to whole tiles of 16: rows past `rows` are computed,
// never stored)
template <Wide WIDE4>
inline void amx8_tile(const uint8_t* w, const float* ws, const float* wm, const QuantX2& x, int64_t m0, int64_t rows,
                      int64_t K, int64_t G, int64_t per_group, float* out, int64_t N) {
  const int64_t B = K / kXBlock;
  alignas(64) int32_t ring[kAmxRing][256];
  alignas(64) int8_t wide[WIDE4 == Wide::kNone ? 1 : kWideRing][512];
  const int8_t* xa = x.xq.data() + m0 * K;
  const float* d = x.d.data() + m0 * B;
  auto widen = [&](int64_t b) {   // int4 block b (4 k-steps of 8) -> 512 int8 bytes (8 k-steps of 4)
    if constexpr (WIDE4 != Wide::kNone) widen_int4<WIDE4 == Wide::kSym4>(w + b * 256, kXBlock, wide[b % kWideRing]);
  };
  auto prefetch = [&](int64_t b) {   // block b's weight bytes into L1 (past the group: the next one's)
    constexpr int64_t bytes = WIDE4 == Wide::kNone ? 512 : 256;
    prefetch_bytes(w, b * bytes, bytes);
  };
  auto multiply = [&](int64_t b) {   // 4 C tiles in turn, A and B tiles alternating
    const void* wb = WIDE4 == Wide::kNone ? static_cast<const void*>(w + b * 512) : wide[b % kWideRing];
    switch (b % 4) {
      case 0: HLOSERVE_AMX8_STEP(0, 4, 6, b, wb); break;
      case 1: HLOSERVE_AMX8_STEP(1, 5, 7, b, wb); break;
      case 2: HLOSERVE_AMX8_STEP(2, 4, 6, b, wb); break;
      default: HLOSERVE_AMX8_STEP(3, 5, 7, b, wb); break;
    }
  };
  auto store = [&](int64_t b) {
    int32_t* dst = ring[b % kAmxRing];
    switch (b % 4) {
      case 0: _tile_stored(0, dst, 64); break;
      case 1: _tile_stored(1, dst, 64); break;
      case 2: _tile_stored(2, dst, 64); break;
      default: _tile_stored(3, dst, 64); break;
    }
  };
  auto issue = [&](int64_t b) {   // block b multiplied, block b - kStoreLag stored (the last: every one left)
    if (b >= kStoreLag) store(b - kStoreLag);
    prefetch(b + kPrefetch);
    multiply(b);
    if (b == B - 1)
      for (int64_t j = std::max<int64_t>(0, B - kStoreLag); j < B; ++j) store(j);
  };
  constexpr int64_t ahead = WIDE4 == Wide::kNone ? 0 : kWideAhead;
  __m512 facc[16];
  HLOSERVE_UNROLL
  for (int j = 0; j < 16; ++j) facc[j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < std::min(ahead, B); ++b) widen(b);
  for (int64_t b = 0; b < std::min(kAmxLead, B); ++b) {
    if (b + ahead < B) widen(b + ahead);
    issue(b);
  }
  for (int64_t b = 0; b < B; ++b) {
    if (b + kAmxLead + ahead < B) widen(b + kAmxLead + ahead);
    if (b + kAmxLead < B) issue(b + kAmxLead);
    const int32_t* c = ring[b % kAmxRing];
    const __m512 sv = _mm512_loadu_ps(ws + (b / per_group) * 16);
    HLOSERVE_UNROLL
    for (int j = 0; j < 16; ++j)
      facc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * j)),
                                _mm512_mul_ps(sv, _mm512_set1_ps(d[j * B + b])), facc[j]);
  }
  if (rows == 16) return mins_and_store<16>(facc, wm, x.xsum.data() + m0 * G, G, out + m0 * N, N);
  alignas(64) float part[16 * 16];
  mins_and_store<16>(facc, wm, x.xsum.data() + m0 * G, G, part, 16);
  for (int64_t j = 0; j < rows; ++j) std::memcpy(out + (m0 + j) * N, part + 16 * j, 64);
}

// rows [0, MA) of x (whole tiles of 16, x padded to them) times row groups [g0, g1) with AMX, then
// rows [MA, M) with quant2_vnni. int4: one tile of x rows widens each block as the tiles go
// (amx8_tile's WIDE4); more tiles widen the group once into an int8 copy they all read.
template <int BITS, bool SYM4>
void quant2_amx(const QuantMatrix& w, const QuantX2& x, int64_t MA, int64_t M, int64_t g0, int64_t g1, float* out) {
  const int64_t per_group = w.group / kXBlock, K = w.K;
  const int64_t gbytes = BITS == 8 ? 16 * K : 8 * K;
  constexpr Wide kWide4 = BITS == 8 ? Wide::kNone : SYM4 ? Wide::kSym4 : Wide::kAsym4;
  thread_local std::vector<int8_t> wide;   // int4, several tiles of x rows: the group widened to int8 bytes
  if (BITS == 4 && MA > 16) wide.resize(16 * K);
  std::vector<float> sbuf, mbuf;
  amx8_configure();
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* q = w.q + g * gbytes;
    const float* ws = group_scalars(w.scale, w.f16, g, w.G, sbuf);
    const float* wm = w.min != nullptr ? group_scalars(w.min, w.f16, g, w.G, mbuf) : nullptr;
    prefetch_group_scalars(w, g + 1, g1);
    if (BITS == 4 && MA == 16) {
      amx8_tile<kWide4>(q, ws, wm, x, 0, std::min<int64_t>(16, M), K, w.G, per_group, out + g * 16, w.N);
      continue;
    }
    const uint8_t* wq = q;
    if constexpr (BITS == 4) {
      widen_int4<SYM4>(q, K, wide.data());
      wq = reinterpret_cast<const uint8_t*>(wide.data());
    }
    for (int64_t m0 = 0; m0 < MA; m0 += 16)
      amx8_tile<Wide::kNone>(wq, ws, wm, x, m0, std::min<int64_t>(16, M - m0), K, w.G, per_group, out + g * 16, w.N);
  }
  _tile_release();
  if (MA < M) quant2_vnni<BITS, SYM4>(w, x, MA, M, g0, g1, out);
}

// x's rows padded with zeros to MA (whole AMX tiles)
inline void pad_rows(QuantX2& x, int64_t MA, int64_t K, int64_t G) {
  x.xq.resize(MA * K + 64, 0);
  x.d.resize(MA * (K / kXBlock), 0.f);
  x.xsum.resize(MA * G, 0.f);
}
#endif

// The rows of x the AMX tiles take, the rest running the VNNI tiles (benchmarks/quant_amx_kernel.cc,
// docs/quantization.md "AMX-INT8 tiles"): int8, whole tiles of 16, the last one padded from 12 rows
// (at 8 rows a padded tile is slower than VNNI, at 12 faster); int4, whole tiles of 16 from 16 rows
// (one tile of x rows widens the nibbles block by block as the tile unit goes: 0.6-1.0x of the
// VNNI tiles' time at 16 rows, where widening the whole group first lost on long rows; a padded
// tile of 12 rows was slower than VNNI on most shapes)
constexpr int64_t amx_rows(int bits, int64_t M) {
  if (bits == 4) return M / 16 * 16;
  return M / 16 * 16 + (M % 16 >= 12 ? 16 : 0);
}

// versions 2 and 4: the same product, the layer's matrix interleaved by 16 rows (version 4: 5-bit
// values, VNNI tiles at every row count: no AMX path yet)
void quant_linear_v2(ffi::ThreadPool& pool, const float* x, const QuantMatrix& w, int64_t M, float* op) {
  const int64_t NG = w.N / 16;
  const bool sym4 = w.bits == 4 && w.min == nullptr;
#if defined(__AVX2__) && !defined(__AVX512VNNI__)
  constexpr int offset8 = 0;     // quant2_avx2's int8 product: signed weights, no offset
#else
  constexpr int offset8 = 128;
#endif
  QuantX2 xq = quantize_x2(x, M, w.K, w.G, w.group, w.bits == 8 ? offset8 : w.bits == 5 ? 16 : sym4 ? 8 : 0);
  [[maybe_unused]] int64_t MA = 0;   // rows of x the AMX tiles take: whole tiles of 16, the last one padded where it is full enough
#if defined(__AVX512VNNI__) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
  MA = w.bits == 5 ? 0 : amx_rows(w.bits, M);
  if (MA > 0 && !amx_usable()) MA = 0;
  if (MA > M) pad_rows(xq, MA, w.K, w.G);
#endif
  even_shares(pool, NG, [&](int64_t g0, int64_t g1) {
#if defined(__AVX512VNNI__) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
    if (MA > 0) {
      if (w.bits == 8) quant2_amx<8, false>(w, xq, MA, M, g0, g1, op);
      else if (sym4) quant2_amx<4, true>(w, xq, MA, M, g0, g1, op);
      else quant2_amx<4, false>(w, xq, MA, M, g0, g1, op);
      return;
    }
#endif
#if defined(__AVX512VNNI__)
    if (w.bits == 8) quant2_vnni<8, false>(w, xq, 0, M, g0, g1, op);
    else if (w.bits == 5) quant2_vnni<5, false>(w, xq, 0, M, g0, g1, op);
    else if (sym4) quant2_vnni<4, true>(w, xq, 0, M, g0, g1, op);
    else quant2_vnni<4, false>(w, xq, 0, M, g0, g1, op);
#elif defined(__AVX2__)
    if (w.bits == 8) quant2_avx2<8, false>(w, xq, M, g0, g1, op);
    else if (w.bits == 5) quant2_avx2<5, false>(w, xq, M, g0, g1, op);
    else if (sym4) quant2_avx2<4, true>(w, xq, M, g0, g1, op);
    else quant2_avx2<4, false>(w, xq, M, g0, g1, op);
#else
    quant2_portable(w, xq, M, g0, g1, op);
#endif
  });
}

// -- hloserve_quant_linear_v6: version 2's product, prompt chunks in bf16 -------------------------
//
// From `bf16_rows` rows of x on (runtime/artifact/kernels.py QUANT_LINEAR_V6) x and W = q * scale
// (+ min) are rounded to bf16 and multiplied with f32 sums: layer_linear's arithmetic, so the tiles
// run the whole K (AMX-BF16, below; elsewhere linear.h's row routines) where version 2's AMX-INT8
// tiles take 32-element blocks of x (half a tile) with a store and a rescale per block. Each row
// group's matrix is dequantized block by block (into B tiles, or into bf16 rows for the row
// routines); fewer rows run version 2's path.

#if defined(__AVX512BW__)
// the int8 bytes of row group g's block b in version 2's int8 layout (8 k-steps of 64 bytes): where
// they lie, or int4 widened into `wide`
inline const int8_t* block_bytes(const QuantMatrix& w, int64_t g, int64_t b, int8_t* wide) {
  if (w.bits == 8) return reinterpret_cast<const int8_t*>(w.q) + g * 16 * w.K + b * 512;
  const uint8_t* q4 = w.q + g * 8 * w.K + b * 256;
  if (w.min == nullptr) widen_int4<true>(q4, kXBlock, wide);
  else widen_int4<false>(q4, kXBlock, wide);
  return wide;
}
#endif

// block b (32 elements) of row group g dequantized into dst (row i at dst + i * stride): W = q * scale
// (+ min) in f32, rounded to bf16; ws / wm: the group's scales and mins [G, 16] (wm: none if nullptr)
inline void dequant_block(const QuantMatrix& w, int64_t g, int64_t b, const float* ws, const float* wm, uint16_t* dst,
                          int64_t stride) {
  const int64_t gi = b * kXBlock / w.group;
#if defined(__AVX512BW__)
  alignas(64) int8_t wide[512];   // int4: the block widened to version 2's int8 layout
  const int8_t* q8 = block_bytes(w, g, b, wide);
  // elements 4s..4s+3 of row i lie in dword 16 s + i: a gather of rows 2p and 2p + 1 (8 dwords each)
  const __m512i idx = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 1, 17, 33, 49, 65, 81, 97, 113);
  for (int p = 0; p < 8; ++p) {
    const __m512i v = _mm512_i32gather_epi32(_mm512_add_epi32(idx, _mm512_set1_epi32(2 * p)), q8, 4);
    const __m128i part[4] = {_mm512_extracti32x4_epi32(v, 0), _mm512_extracti32x4_epi32(v, 1),
                             _mm512_extracti32x4_epi32(v, 2), _mm512_extracti32x4_epi32(v, 3)};
    for (int h = 0; h < 2; ++h) {
      const int i = 2 * p + h;
      const __m512 sc = _mm512_set1_ps(ws[gi * 16 + i]);
      for (int half = 0; half < 2; ++half) {
        __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(part[2 * h + half])), sc);
        if (wm != nullptr) f = _mm512_add_ps(f, _mm512_set1_ps(wm[gi * 16 + i]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i * stride + 16 * half),
                            round16_bf16(_mm512_castps_si512(f)));
      }
    }
  }
#else
  for (int64_t i = 0; i < 16; ++i)
    for (int64_t k = 0; k < kXBlock; ++k) {
      float f = static_cast<float>(int_of_interleaved(w, g * 16 + i, b * kXBlock + k)) * ws[gi * 16 + i];
      if (wm != nullptr) f += wm[gi * 16 + i];
      dst[i * stride + k] = f32_to_bf16(f);
    }
#endif
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
// The chunk on AMX, the matrix as the tile multiply's B operand: a B tile's row r holds, for each of
// 16 matrix rows, elements 2r and 2r + 1 of a 32-element block (bf16 pairs), which is what version
// 2's int8 layout holds per 64-byte k-step (16 rows x 4 elements: two B rows, its even and its odd
// dwords once widened to bf16), so a block dequantizes with no transposes; x is the A operand, its
// rounded rows as they lie, and the sums come out as out's rows (a C tile stored where it belongs,
// no transposes back). layer_linear's loop has the matrix as A (read in place for decode rows).

// row group g's block b (32 elements) dequantized into one B tile (dst: 16 rows of 32 bf16)
inline void dequant_b_tile(const QuantMatrix& w, int64_t g, int64_t b, const float* ws, const float* wm, uint16_t* dst) {
  const int64_t gi = b * kXBlock / w.group;
  alignas(64) int8_t wide[512];   // int4: the block widened to version 2's int8 layout
  const int8_t* q8 = block_bytes(w, g, b, wide);
  // a k-step's 64 bytes: matrix row n's 4 elements at 4n; quarter j of them (rows 4j..4j + 3) scaled
  // by sq[j]: each row's scale (and min) over its 4 lanes
  const __m512 sv = _mm512_loadu_ps(ws + gi * 16);
  const __m512 mv = wm != nullptr ? _mm512_loadu_ps(wm + gi * 16) : _mm512_setzero_ps();
  __m512 sq[4], mq[4];
  for (int j = 0; j < 4; ++j) {
    const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(4 * j),
                                         _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
    sq[j] = _mm512_permutexvar_ps(idx, sv), mq[j] = _mm512_permutexvar_ps(idx, mv);
  }
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int s = 0; s < 8; ++s) {
    const __m512i v = _mm512_loadu_si512(q8 + 64 * s);
    __m512 f[4];
    f[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(v, 0)));
    f[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(v, 1)));
    f[2] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(v, 2)));
    f[3] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(v, 3)));
    for (int j = 0; j < 4; ++j) {   // W = q * scale (+ min) in f32, as the decomposition
      f[j] = _mm512_mul_ps(f[j], sq[j]);
      if (wm != nullptr) f[j] = _mm512_add_ps(f[j], mq[j]);
    }
    // rounded to bf16 (nearest even; vcvtne2ps2bf16 flushes denormals, as the tile multiply does its inputs)
    const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]), hi = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
    _mm512_store_si512(dst + 64 * s, _mm512_permutex2var_epi32(lo, even, hi));        // B row 2s
    _mm512_store_si512(dst + 64 * s + 32, _mm512_permutex2var_epi32(lo, odd, hi));    // B row 2s + 1
  }
}

// x [M, K] rounded into rows (blocks of 16, zero rows past M), each task's row groups dequantized
// into B tiles, then the tiles (an x block pair, a run of chunks, every matrix tile pair in turn)
void quant_chunk_amx(ffi::ThreadPool& pool, const float* x, const QuantMatrix& w, int64_t M, float* op) {
  const int64_t K = w.K, KC = K / 32, blocks = (M + 15) / 16, N = w.N;
  LineVector<uint16_t> xr(blocks * 16 * K);
  parallel_for(pool, blocks, 1, [&](int64_t g) {
    const int64_t rows = std::min<int64_t>(16, M - 16 * g);
    round_rows(x + 16 * g * K, rows, K, Kind::kBF16, xr.data() + 16 * g * K, K);
    std::memset(xr.data() + (16 * g + rows) * K, 0, (16 - rows) * K * 2);
  });
  amx_tasks(pool, N, K, [&](int64_t t0, int64_t t1) {
    thread_local LineVector<uint16_t> wb;   // kept by the pool's threads from call to call
    thread_local LineVector<float> partial;
    const int64_t tiles = t1 - t0;
    if (wb.size() < static_cast<size_t>(tiles * KC * 512)) wb.resize(tiles * KC * 512);
    if (partial.size() < static_cast<size_t>((tiles + 1) / 2 * 1024)) partial.resize((tiles + 1) / 2 * 1024);
    std::vector<float> sbuf, mbuf;
    for (int64_t t = 0; t < tiles; ++t) {
      const float* ws = group_scalars(w.scale, w.f16, t0 + t, w.G, sbuf);
      const float* wm = w.min != nullptr ? group_scalars(w.min, w.f16, t0 + t, w.G, mbuf) : nullptr;
      for (int64_t c = 0; c < KC; ++c) dequant_b_tile(w, t0 + t, c, ws, wm, wb.data() + (t * KC + c) * 512);
    }
    amx_configure_16x64();
    amx_blocked(blocks, KC, tiles, [&](int64_t g, int64_t c0, int64_t c1, int64_t t, auto nb, auto ma) {
      b_block<decltype(ma)::value, decltype(nb)::value>(xr.data() + 16 * g * K, 32, 2 * K, 16 * K, wb.data() + t * KC * 512, KC, c0, c1,
                                                        16 * g, M, partial.data() + t / 2 * 1024,
                                                        op + 16 * g * N + 16 * (t0 + t), N);
    });
    _tile_release();
  });
}
#endif

// the chunk without AMX: x rounded into rows, each task's row groups dequantized into bf16 rows, then
// linear.h's row routines (AVX512-BF16 tiles, or the products widened to f32)
void quant_chunk_rows(ffi::ThreadPool& pool, const float* x, const QuantMatrix& w, int64_t M, float* op) {
  const int64_t K = w.K, NG = w.N / 16;
  std::vector<uint16_t> xr(M * K);
  parallel_for(pool, (M + 15) / 16, 1, [&](int64_t g) {
    round_rows(x + 16 * g * K, std::min<int64_t>(16, M - 16 * g), K, Kind::kBF16, xr.data() + 16 * g * K, K);
  });
  constexpr int64_t kGroupsPerTask = kLinearRows / 16;
  parallel_for(pool, (NG + kGroupsPerTask - 1) / kGroupsPerTask, 1, [&](int64_t task) {
    const int64_t g0 = task * kGroupsPerTask, g1 = std::min(NG, g0 + kGroupsPerTask);
    thread_local std::vector<uint16_t> rows;
    rows.resize((g1 - g0) * 16 * K);
    std::vector<float> sbuf, mbuf;
    for (int64_t g = g0; g < g1; ++g) {
      const float* ws = group_scalars(w.scale, w.f16, g, w.G, sbuf);
      const float* wm = w.min != nullptr ? group_scalars(w.min, w.f16, g, w.G, mbuf) : nullptr;
      for (int64_t b = 0; b < K / kXBlock; ++b)
        dequant_block(w, g, b, ws, wm, rows.data() + (g - g0) * 16 * K + b * kXBlock, K);
    }
    rows16(Kind::kBF16, rows.data(), K, xr.data(), K, M, 0, (g1 - g0) * 16, op + g0 * 16, w.N);
  });
}

// version 6: from bf16_rows rows of x the bf16 chunk path, below it version 2's
void quant_linear_v6(ffi::ThreadPool& pool, const float* x, const QuantMatrix& w, int64_t M, int64_t bf16_rows,
                     float* op) {
  if (M < bf16_rows) return quant_linear_v2(pool, x, w, M, op);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  if (amx_usable()) return quant_chunk_amx(pool, x, w, M, op);
#endif
  quant_chunk_rows(pool, x, w, M, op);
}

// The versions' FFI handler: kVersion 1, 2 (rows interleaved by 16) or 4 (5-bit values, interleaved)
template <int kVersion>
ffi::Error QuantLinear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer qweight, ffi::AnyBuffer scale,
                       ffi::AnyBuffer min, ffi::Buffer<ffi::S32> layer, int64_t bits, int64_t group,
                       ffi::ResultBuffer<ffi::F32> out) {
  QuantMatrix w;
  int64_t M;
  const char* target = kVersion == 1 ? "hloserve_quant_linear"
                       : kVersion == 2 ? "hloserve_quant_linear_v2" : "hloserve_quant_linear_v4";
  if (ffi::Error e = read_operands(target, kVersion, x, qweight, scale, min, layer, bits, group, w, M); e.failure())
    return e;
  if constexpr (kVersion == 1) quant_linear_v1(pool, x.typed_data(), w, M, out->typed_data());
  else quant_linear_v2(pool, x.typed_data(), w, M, out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

// x, qweight, scale, min, layer: every version's operands
static auto QuantLinearOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>();
}

// bits, group: versions 1, 2 and 4 of hloserve.quant_linear
static auto QuantLinearBinding() {
  return QuantLinearOperands().Attr<int64_t>("bits").Attr<int64_t>("group").Ret<ffi::Buffer<ffi::F32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(hloserve_quant_linear, QuantLinear<1>, QuantLinearBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(hloserve_quant_linear_v2, QuantLinear<2>, QuantLinearBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(hloserve_quant_linear_v4, QuantLinear<4>, QuantLinearBinding());

namespace {
ffi::Error QuantLinearV6(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer qweight, ffi::AnyBuffer scale,
                         ffi::AnyBuffer min, ffi::Buffer<ffi::S32> layer, int64_t bf16_rows, int64_t bits, int64_t group,
                         ffi::ResultBuffer<ffi::F32> out) {
  QuantMatrix w;
  int64_t M;
  if (ffi::Error e = read_operands("hloserve_quant_linear_v6", 2, x, qweight, scale, min, layer, bits, group, w, M);
      e.failure())
    return e;
  quant_linear_v6(pool, x.typed_data(), w, M, bf16_rows, out->typed_data());
  return ffi::Error::Success();
}
}  // namespace

// version 6: version 2's operands and attributes, and bf16_rows
XLA_FFI_DEFINE_HANDLER_SYMBOL(hloserve_quant_linear_v6, QuantLinearV6,
                              QuantLinearOperands()
                                  .Attr<int64_t>("bf16_rows")
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group")
                                  .Ret<ffi::Buffer<ffi::F32>>());
