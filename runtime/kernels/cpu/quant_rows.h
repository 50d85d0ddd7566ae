// Weight-only int8 / int4 matrices times int8 activations, row by row: what the quantized kernels
// share (quant_linear.cc: one layer's matrix, versions 1 and 3; experts.cc: each expert's matrices
// for the rows routed to it). AVX512-VNNI where the CPU has it, exact integer loops elsewhere.
#pragma once

#include "common.h"

namespace hloserve {
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

// GGUF K-quant block types (runtime/artifact/kernels.py Block: ggml's type ids); 0: none
enum Block : int64_t { kPlain = 0, kQ4K = 12, kQ5K = 13, kQ6K = 14 };

// One layer's matrix, in any version's layout (quant_linear.cc's read_operands / read_blocks fill
// it; experts.cc one expert's)
struct QuantMatrix {
  const uint8_t* q;   // the layer's qweight bytes: v1 [N, K] s8 or [N, K/2] u8, v2 interleaved by 16 rows
  const void* scale;  // v1 [N, G], v2 [N / 16, G, 16]; f16 or f32; v3: the super-block headers [N, K/256 * H] u8
  const void* min;    // like scale, or nullptr (symmetric); v3: the headers too where the blocks have mins
  bool f16;           // scale / min dtype
  int bits;
  int64_t N, K, G, group;
  int64_t block = kPlain;
  bool rows16 = false;  // v5: a K-quant matrix's quants interleaved by 16 rows as v2's (headers row by row)
};

// the integer value of element k of matrix row n in version 2's interleaved layout (and version 5's
// quants; int4 two's complement without mins, unsigned with them or in K-quant blocks); version 4's
// 5-bit values: the block's nibble byte, then its fifth bit in the step's mask
inline int int_of_interleaved(const QuantMatrix& w, int64_t n, int64_t k) {
  if (w.bits == 5) {
    const uint8_t* blk = w.q + (n / 16) * 10 * w.K + (k / 32) * 320;
    const int64_t s = k / 8 % 4, lane = (n % 16) * 4 + k % 4, half = k % 8 < 4 ? 0 : 1;
    const uint8_t b = blk[s * 64 + lane];
    const int nib = half ? (b >> 4) : (b & 0xF);
    const int high = (blk[256 + s * 16 + half * 8 + lane / 8] >> (lane % 8)) & 1;
    return (nib | (high << 4)) - 16;
  }
  if (w.bits == 8)
    return reinterpret_cast<const int8_t*>(w.q)[((n / 16) * (w.K / 4) + k / 4) * 64 + (n % 16) * 4 + k % 4];
  const uint8_t b = w.q[((n / 16) * (w.K / 8) + k / 8) * 64 + (n % 16) * 4 + k % 4];
  const int v = (k % 8) < 4 ? (b & 0xF) : (b >> 4);
  return w.min == nullptr && w.block == kPlain && v > 7 ? v - 16 : v;
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
#elif defined(__F16C__)
  for (; i + 8 <= count; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
  for (; i < count; ++i) dst[i] = f16_to_f32(h[i]);
}

#if (defined(__AVX512BW__) && defined(__AVX512VL__)) || defined(__AVX2__)
// one Q4_K / Q5_K super-block header h -> its 8 scales d * sc_j (and mins -(dmin * m_j), when `min` is
// given), as block_row's scalar loop computes them: bytes 0-7 of r hold sc_j, 8-15 m_j, gathered by
// one shuffle (sc_j, m_j for j < 4: their bytes' low 6 bits; j >= 4: a nibble and 2 high bits)
inline void block_header(const uint8_t* h, float* scale, float* min) {
  const __m128i H = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h));
  const __m128i a = _mm_shuffle_epi8(H, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m128i top = _mm_shuffle_epi8(H, _mm_setr_epi8(0, 0, 0, 0, 4, 5, 6, 7, 0, 0, 0, 0, 8, 9, 10, 11));
  const __m128i two = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(top, 6), _mm_set1_epi8(3)), 4);   // (s >> 6) << 4
  const __m128i nib = _mm_set1_epi8(0x0F);
  const __m128i low6 = _mm_and_si128(a, _mm_set1_epi8(63));
  const __m128i sc_hi = _mm_or_si128(_mm_and_si128(a, nib), two);
  const __m128i m_hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), nib), two);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  __m128i r = _mm_mask_blend_epi8(0x00F0, low6, sc_hi);
  r = _mm_mask_blend_epi8(static_cast<__mmask16>(0xF000), r, m_hi);
#else   // the same bytes by SSE4.1's byte blends (AVX2 CPUs)
  __m128i r = _mm_blendv_epi8(low6, sc_hi, _mm_setr_epi8(0, 0, 0, 0, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0));
  r = _mm_blendv_epi8(r, m_hi, _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -1, -1, -1, -1));
#endif
  auto half = [](const uint8_t* p) { return f16_to_f32(static_cast<uint16_t>(p[0] | (p[1] << 8))); };
  const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(r));
  _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_set1_ps(half(h)), sc));
  if (min == nullptr) return;
  const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(r, 8)));
  const __m256 prod = _mm256_mul_ps(_mm256_set1_ps(half(h + 2)), m);
  _mm256_storeu_ps(min, _mm256_xor_ps(prod, _mm256_set1_ps(-0.f)));   // -(dmin * m_j)
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VL__)

// block_header for four headers h[0..3] (anywhere) at once, one per 128-bit lane: out[i] holds header
// i's 8 scales d * sc_j (lanes 0-7) and its 8 mins -(dmin * m_j) (lanes 8-15), block_header's values.
// The same shuffles in 512 bits: one header unpacked by this form in lane 0 made version 3's one-row
// loop 7% slower on an AMD EPYC (22.5 -> 24.1 us a Q4_K matrix, 2026-12-01), so block_header keeps its own.
template <int I>
inline __m512 header_lane(__m512i r, const uint8_t* h) {
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(r, I)));
  int32_t dm;
  std::memcpy(&dm, h, 4);                                               // d, dmin (f16)
  const __m512 both = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                            _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(dm))));
  const __m512 sign = _mm512_castsi512_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, INT32_MIN, INT32_MIN, INT32_MIN,
                                                            INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN));
  return _mm512_xor_ps(_mm512_mul_ps(both, v), sign);                  // [d sc_j, -(dmin m_j)]
}

inline void block_headers4(const uint8_t* const h[4], __m512 out[4]) {
  __m512i H = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h[0])));
  H = _mm512_inserti32x4(H, _mm_loadu_si128(reinterpret_cast<const __m128i*>(h[1])), 1);
  H = _mm512_inserti32x4(H, _mm_loadu_si128(reinterpret_cast<const __m128i*>(h[2])), 2);
  H = _mm512_inserti32x4(H, _mm_loadu_si128(reinterpret_cast<const __m128i*>(h[3])), 3);
  const __m512i a = _mm512_shuffle_epi8(H, _mm512_broadcast_i32x4(_mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15)));
  const __m512i top = _mm512_shuffle_epi8(H, _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 4, 5, 6, 7, 0, 0, 0, 0, 8, 9, 10, 11)));
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i two = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(top, 6), _mm512_set1_epi8(3)), 4);
  const __m512i low6 = _mm512_and_si512(a, _mm512_set1_epi8(63));
  const __m512i sc_hi = _mm512_or_si512(_mm512_and_si512(a, nib), two);
  const __m512i m_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), nib), two);
  __m512i r = _mm512_mask_blend_epi8(0x00F000F000F000F0ull, low6, sc_hi);
  r = _mm512_mask_blend_epi8(0xF000F000F000F000ull, r, m_hi);
  out[0] = header_lane<0>(r, h[0]), out[1] = header_lane<1>(r, h[1]);
  out[2] = header_lane<2>(r, h[2]), out[3] = header_lane<3>(r, h[3]);
}
#endif

// row n's sub-block scales d * sc_j (and mins -(dmin * m_j), when `min` is given) of a K-quant
// matrix, decoded from its super-block headers (Q4_K / Q5_K: [d | dmin | 12 bytes of 6-bit sc, m];
// Q6_K: [16 s8 sc | d]); exact in f32, as the composite's decomposition computes them
inline void block_row(const QuantMatrix& w, int64_t n, float* scale, float* min) {
  const int64_t nb = w.K / 256, head = w.block == kQ6K ? 18 : 16;
  const uint8_t* h = static_cast<const uint8_t*>(w.scale) + n * nb * head;
  auto half = [](const uint8_t* p) { return f16_to_f32(static_cast<uint16_t>(p[0] | (p[1] << 8))); };
  for (int64_t b = 0; b < nb; ++b, h += head) {
#if (defined(__AVX512BW__) && defined(__AVX512VL__)) || defined(__AVX2__)
    if (w.block != kQ6K) {   // the 12 bytes of 6-bit sc_j, m_j unpacked in one register, then widened
      block_header(h, scale + b * 8, min != nullptr ? min + b * 8 : nullptr);
      continue;
    }
#endif
    if (w.block == kQ6K) {
      const float d = half(h + 16);
#if defined(__AVX512F__)
      const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))));
      _mm512_storeu_ps(scale + b * 16, _mm512_mul_ps(_mm512_set1_ps(d), sc));
#elif defined(__AVX2__)
      for (int j = 0; j < 16; j += 8) {
        const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(h + j))));
        _mm256_storeu_ps(scale + b * 16 + j, _mm256_mul_ps(_mm256_set1_ps(d), sc));
      }
#else
      for (int j = 0; j < 16; ++j) scale[b * 16 + j] = d * static_cast<float>(static_cast<int8_t>(h[j]));
#endif
      continue;
    }
    const float d = half(h), dmin = half(h + 2);
    const uint8_t* s = h + 4;
    HLOSERVE_UNROLL
    for (int j = 0; j < 8; ++j) {
      const int sc = j < 4 ? (s[j] & 63) : ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
      const int m = j < 4 ? (s[j + 4] & 63) : ((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
      scale[b * 8 + j] = d * static_cast<float>(sc);
      if (min != nullptr) min[b * 8 + j] = -(dmin * static_cast<float>(m));
    }
  }
}

// row n's G scales (and mins, where the matrix has them and `min` is given) as f32, any layout but v2's
inline void row_scalars(const QuantMatrix& w, int64_t n, float* scale, float* min) {
  if (w.block != kPlain) return block_row(w, n, scale, w.min != nullptr ? min : nullptr);
  if (scale != nullptr) widen(w.scale, w.f16, n * w.G, w.G, scale);
  if (min != nullptr && w.min != nullptr) widen(w.min, w.f16, n * w.G, w.G, min);
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
inline QuantizedX quantize_x(const float* x, int64_t M, const QuantMatrix& w) {
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
  if (w.rows16) return int_of_interleaved(w, n, k);
  if (w.bits == 8) return reinterpret_cast<const int8_t*>(w.q)[n * w.K + k];
  const uint8_t b = w.q[n * (w.K / 2) + k / 2];
  const int v = (k % 2) ? (b >> 4) : (b & 0xF);
  return w.min == nullptr && v > 7 ? v - 16 : v;
}

// the activation value xq of element k of row m (in quantize_x's order)
inline int x_of(const QuantizedX& x, const QuantMatrix& w, int64_t m, int64_t k) {
  const int8_t* row = x.xq.data() + m * w.K;
  return w.bits == 8 ? row[k] : row[(k % 2) * (w.K / 2) + k / 2];
}

// rows [n0, n1): the same integer block sums and f32 scaling, portably (CPUs without AVX512-VNNI)
// (a group of 16, Q6_K's sub-blocks: each x block's sum split in two)
inline void quant_portable(const QuantMatrix& w, const QuantizedX& x, int64_t M, int64_t n0, int64_t n1, float* out) {
  const int64_t B = w.K / kXBlock, piece = std::min<int64_t>(w.group, kXBlock);
  std::vector<int32_t> row(w.K);
  std::vector<float> sc(w.G), mn(w.G);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t k = 0; k < w.K; ++k) row[k] = int_of(w, n, k);
    row_scalars(w, n, sc.data(), mn.data());
    for (int64_t m = 0; m < M; ++m) {
      float total = 0.f;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t k0 = b * kXBlock; k0 < (b + 1) * kXBlock; k0 += piece) {
          int32_t dot = 0;
          for (int64_t k = k0; k < k0 + piece; ++k) dot += x_of(x, w, m, k) * row[k];
          total += static_cast<float>(dot) * (x.d[m * B + b] * sc[k0 / w.group]);
        }
      for (int64_t g = 0; w.min != nullptr && g < w.G; ++g) total += mn[g] * x.xsum[m * w.G + g];
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
// (B a row), or with `sub16` (int8, groups of 16: Q6_K) per 16 elements (B = K / 16 a row)
template <int BITS, int NR, int MR>
inline void vnni_tile(const uint8_t* q, int64_t qstride, const float* ws, const QuantizedX& x, int64_t m0,
                      int64_t K, int64_t B, bool sym4, bool sub16, float* out, int64_t N) {
  const bool offset = BITS == 8 || sym4;
  using Lay = Layout<BITS>;
  __m512 acc[NR][MR];
  HLOSERVE_UNROLL
  for (int i = 0; i < NR; ++i)
    HLOSERVE_UNROLL
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i flip = _mm512_set1_epi8(BITS == 8 ? static_cast<char>(0x80) : 0x08);
  const int64_t blocks = Lay::kElems / kXBlock, chunks = (K + Lay::kElems - 1) / Lay::kElems;
  for (int64_t c = 0, e = 0; e < K; ++c, e += Lay::kElems) {
    // the last chunk of a row may be half a chunk (32 bytes): its other lanes get zero weights
    const int64_t bytes = std::min<int64_t>(64, (K - e) * BITS / 8);
    const __mmask64 valid = bytes == 64 ? ~__mmask64(0) : (__mmask64(1) << bytes) - 1;
    __m512i lo[NR], hi[NR];
    HLOSERVE_UNROLL
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
    HLOSERVE_UNROLL
    for (int i = 0; i < NR; ++i)   // groups of 16: 4 lanes (16 int8 elements) each, per_lane<4>'s spread
      wsv[i] = sub16 ? per_lane<4>(ws + i * B + c * 4) : per_lane<BITS>(ws + i * B + c * blocks);
    HLOSERVE_UNROLL
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
      HLOSERVE_UNROLL
      for (int i = 0; i < NR; ++i) {
        __m512i part = _mm512_dpbusd_epi32(sv, lo[i], xa);
        if constexpr (BITS == 4) part = _mm512_dpbusd_epi32(part, hi[i], xb);
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part), _mm512_mul_ps(wsv[i], dv), acc[i][j]);
      }
    }
  }
  HLOSERVE_UNROLL
  for (int i = 0; i < NR; ++i)
    HLOSERVE_UNROLL
    for (int j = 0; j < MR; ++j) out[(m0 + j) * N + i] = _mm512_reduce_add_ps(acc[i][j]);
}

template <int BITS, int NR>
inline void vnni_rows(const uint8_t* q, int64_t qstride, const float* ws, const QuantizedX& x, int64_t M, int64_t K,
                      int64_t B, bool sym4, bool sub16, float* out, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) vnni_tile<BITS, NR, 4>(q, qstride, ws, x, m, K, B, sym4, sub16, out, N);
  switch (M - m) {
    case 3: vnni_tile<BITS, NR, 3>(q, qstride, ws, x, m, K, B, sym4, sub16, out, N); break;
    case 2: vnni_tile<BITS, NR, 2>(q, qstride, ws, x, m, K, B, sym4, sub16, out, N); break;
    case 1: vnni_tile<BITS, NR, 1>(q, qstride, ws, x, m, K, B, sym4, sub16, out, N); break;
  }
}

// rows [n0, n1) with VNNI: the weights' per-block scales of NR rows at a time, then the tiles, then
// (asymmetric int4) the mins' term
template <int BITS>
void quant_vnni(const QuantMatrix& w, const QuantizedX& x, int64_t M, int64_t n0, int64_t n1, float* out) {
  constexpr int NR = 2;
  const int64_t K = w.K, qstride = BITS == 8 ? K : K / 2;
  const bool sym4 = BITS == 4 && w.min == nullptr, sub16 = w.group == 16;
  const int64_t B = sub16 ? K / 16 : K / kXBlock;      // scales a row in `ws`
  const int64_t per_group = w.group / kXBlock;
  std::vector<float> ws(NR * B + 4, 0.f), corr(w.G), scratch(w.G);   // padded: a half chunk reads 4 scales
  for (int64_t n = n0; n < n1; n += NR) {
    const int64_t rows = std::min<int64_t>(NR, n1 - n);
    for (int64_t i = 0; i < rows; ++i) {               // each group's scale, repeated for its x blocks
      float* wi = ws.data() + i * B;
      if (w.block != kPlain) {                         // K-quants: groups of 32 (one per x block) or 16
        row_scalars(w, n + i, wi, nullptr);
      } else if (per_group == 1) {
        widen(w.scale, w.f16, (n + i) * w.G, w.G, wi);
      } else {
        widen(w.scale, w.f16, (n + i) * w.G, w.G, corr.data());
        for (int64_t g = 0, b = 0; g < w.G; ++g)
          for (int64_t e = 0; e < per_group; ++e) wi[b++] = corr[g];
      }
    }
    const uint8_t* q = w.q + n * qstride;
    if (rows == NR) vnni_rows<BITS, NR>(q, qstride, ws.data(), x, M, K, B, sym4, sub16, out + n, w.N);
    else vnni_rows<BITS, 1>(q, qstride, ws.data(), x, M, K, B, sym4, sub16, out + n, w.N);
    for (int64_t i = 0; w.min != nullptr && i < rows; ++i) {   // the mins: sum_g min_g * (x summed over g)
      row_scalars(w, n + i, w.block != kPlain ? scratch.data() : nullptr, corr.data());
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

// x [M, K] quantized for a product with w: per 32-element block as the contract says (and laid out
// per vpdpbusd lane where the build has VNNI)
inline QuantizedX quantize_for(const float* x, int64_t M, const QuantMatrix& w) {
  QuantizedX xq = quantize_x(x, M, w);
#if defined(__AVX512VNNI__)
  if (w.bits == 8) spread_lanes<8>(xq, M, w.K, 128);
  else spread_lanes<4>(xq, M, w.K, w.min != nullptr ? 0 : 8);
#endif
  return xq;
}

// out[m * w.N + n] = x[m] . w[n] for the matrix rows n in [n0, n1): the instruction path this build has
inline void quant_rows(const QuantMatrix& w, const QuantizedX& x, int64_t M, int64_t n0, int64_t n1, float* out) {
#if defined(__AVX512VNNI__)
  if (w.bits == 8) quant_vnni<8>(w, x, M, n0, n1, out);
  else quant_vnni<4>(w, x, M, n0, n1, out);
#else
  quant_portable(w, x, M, n0, n1, out);
#endif
}

// version 1: x [M, K] times the layer's matrix (read by read_operands) into op [M, N]
inline void quant_linear_v1(ffi::ThreadPool& pool, const float* x, const QuantMatrix& w, int64_t M, float* op) {
  const int64_t N = w.N;
  const QuantizedX xq = quantize_for(x, M, w);
  const int64_t tasks = (N + kLinearRows - 1) / kLinearRows;
  parallel_for(pool, tasks, 1, [&](int64_t task) {
    const int64_t n0 = task * kLinearRows;
    quant_rows(w, xq, M, n0, std::min(N, n0 + kLinearRows), op);
  });
}

// Activations quantized once per call for the interleaved kernels (quant_linear.cc version 2,
// quant_blocks.cc version 3): xq in x's own order, one d and one offset correction per 32-element block
struct QuantX2 {
  std::vector<int8_t> xq;      // [M, K] (+ padding)
  std::vector<float> d;        // [M, B] block scales
  std::vector<int32_t> start;  // [M, B] -offset * (sum of the block's xq): the unsigned weights' correction
  std::vector<float> xsum;     // [M, G] x8 summed over each weight group (the mins' term)
};

// x quantized per 32-element block as Q8_0 (d = max|x| / 127, xq = round_half_even(x / d)), like quantize_x
inline QuantX2 quantize_x2(const float* x, int64_t M, int64_t K, int64_t G, int64_t group, int offset) {
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
#elif defined(__AVX2__)
      __m256 v[4], amax8 = _mm256_setzero_ps();
      const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i), amax8 = _mm256_max_ps(amax8, _mm256_and_ps(v[i], abs_mask));
      __m128 t = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
      t = _mm_max_ps(t, _mm_movehl_ps(t, t));
      d = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t))) / 127.f;
      if (d > 0.f) {
        const __m256 dv = _mm256_set1_ps(d);   // true division and round-to-nearest-even, as the reference
        __m256i q[4], total = _mm256_setzero_si256();
        for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_div_ps(v[i], dv)), total = _mm256_add_epi32(total, q[i]);
        // |q| <= 127: the packs saturate nothing; packs work within 128-bit lanes, so the dwords go back in order
        const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                            _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
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

#if defined(__AVX512VNNI__)
// The 16-row tiles' shared steps (quant_linear.cc version 2, quant_blocks.cc version 3): one k-step of
// 8 int4 elements of 16 interleaved rows (4 bytes a row: low nibbles against x bytes xb[0..3], high
// ones against xb[4..7]) added to each of MR rows of x's int32 sums (row j's x at xb + j * K)
// (dot_step: the same with the 16 rows' unsigned bytes of the step's first and second 4 elements
// given, lo and hi: int4's nibbles, or version 4's 5-bit codes)
template <int MR>
inline void dot_step(__m512i iacc[MR], __m512i lo, __m512i hi, const int8_t* xb, int64_t K) {
  HLOSERVE_UNROLL
  for (int j = 0; j < MR; ++j) {
    int32_t a, c;
    std::memcpy(&a, xb + j * K, 4);
    std::memcpy(&c, xb + j * K + 4, 4);
    iacc[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(iacc[j], lo, _mm512_set1_epi32(a)), hi, _mm512_set1_epi32(c));
  }
}

template <int MR>
inline void int4_step(__m512i iacc[MR], __m512i v, const int8_t* xb, int64_t K) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  dot_step<MR>(iacc, _mm512_and_si512(v, low), _mm512_and_si512(_mm512_srli_epi16(v, 4), low), xb, K);
}

// facc[j] += iacc[j] * (16 rows' scales sv * x row j's block scale d[j * stride])
template <int MR>
inline void scale_sums(__m512 facc[MR], const __m512i iacc[MR], __m512 sv, const float* d, int64_t stride) {
  HLOSERVE_UNROLL
  for (int j = 0; j < MR; ++j)
    facc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[j]), _mm512_mul_ps(sv, _mm512_set1_ps(d[j * stride])), facc[j]);
}

// the mins' term (wm [G, 16], or none) added, then 16 outputs stored per row of x (x row j's sums
// over the groups at xsum + j * G, its outputs at out + j * ostride)
template <int MR>
inline void mins_and_store(__m512 facc[MR], const float* wm, const float* xsum, int64_t G, float* out, int64_t ostride) {
  for (int64_t g = 0; wm != nullptr && g < G; ++g) {
    const __m512 mv = _mm512_loadu_ps(wm + g * 16);
    HLOSERVE_UNROLL
    for (int j = 0; j < MR; ++j) facc[j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[j * G + g]), facc[j]);
  }
  HLOSERVE_UNROLL
  for (int j = 0; j < MR; ++j) _mm512_storeu_ps(out + j * ostride, facc[j]);
}
#endif

#if defined(__AVX2__) && !defined(__AVX512VNNI__)
// The same steps without VNNI (AVX2 CPUs: AMD Zen 2 / Zen 3), vpmaddubsw and vpmaddwd in place of
// vpdpbusd, the 16 rows as two 256-bit halves (rows 0-7, 8-15). vpmaddubsw adds two u8 x s8 products
// into a saturating int16: the unsigned operands here (int4 nibbles, 5-bit codes, |int8|) keep each
// pair within +-32,512, so every int32 sum is exact, the VNNI path's.

// 4 unsigned bytes u times 4 signed bytes s, summed per dword
inline __m256i madd4(__m256i u, __m256i s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)); }

// The int16 sums of a step whose unsigned bytes are lo (its first 4 elements) and hi (its second 4),
// added to acc: two vpmaddubsw, one 16-bit add. Exact while every lane stays within int16: a pair of
// 5-bit codes against |x| <= 127 is at most 7,874, a step (lo and hi) 15,748; of nibbles 3,810 and
// 7,620, so four steps of nibbles (30,480) may add up before vpmaddwd widens them
template <int MR>
inline void dot_step16_avx2(__m256i (&acc)[MR][2], const __m256i (&lo)[2], const __m256i (&hi)[2], const int8_t* xb,
                            int64_t K) {
  HLOSERVE_UNROLL
  for (int j = 0; j < MR; ++j) {
    int32_t a, c;
    std::memcpy(&a, xb + j * K, 4);
    std::memcpy(&c, xb + j * K + 4, 4);
    const __m256i av = _mm256_set1_epi32(a), cv = _mm256_set1_epi32(c);
    HLOSERVE_UNROLL
    for (int h = 0; h < 2; ++h)
      acc[j][h] = _mm256_add_epi16(acc[j][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], av),
                                                                _mm256_maddubs_epi16(hi[h], cv)));
  }
}

// iacc += acc's int16 sums widened to int32 (vpmaddwd by ones)
template <int MR>
inline void widen16_avx2(__m256i (&iacc)[MR][2], const __m256i (&acc)[MR][2]) {
  const __m256i ones = _mm256_set1_epi16(1);
  HLOSERVE_UNROLL
  for (int j = 0; j < MR; ++j)
    for (int h = 0; h < 2; ++h) iacc[j][h] = _mm256_add_epi32(iacc[j][h], _mm256_madd_epi16(acc[j][h], ones));
}

// one 64-byte k-step of signed int8 weights (16 rows x 4 elements) at qs: |w| against x with w's
// signs (x lies in -127..127, so its negation is exact; a weight of -128 is 128 unsigned)
template <int MR>
inline void int8_step_avx2(__m256i (&iacc)[MR][2], const uint8_t* qs, const int8_t* xb, int64_t K) {
  const __m256i w[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs)),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32))};
  const __m256i a[2] = {_mm256_abs_epi8(w[0]), _mm256_abs_epi8(w[1])};
  HLOSERVE_UNROLL
  for (int j = 0; j < MR; ++j) {
    int32_t four;
    std::memcpy(&four, xb + j * K, 4);
    const __m256i xv = _mm256_set1_epi32(four);
    HLOSERVE_UNROLL
    for (int h = 0; h < 2; ++h) iacc[j][h] = _mm256_add_epi32(iacc[j][h], madd4(a[h], _mm256_sign_epi8(xv, w[h])));
  }
}

// int4_step's, for a whole 32-element block: its 4 steps of 64 bytes of nibbles at qs (`flip` xor'd
// first: 0x88 makes two's complement nibbles q + 8) summed in int16 and widened once (nine multiplies
// a lane instead of sixteen; dot_step16_avx2 bounds the sums)
template <int MR, bool FLIP = false>
inline void int4_block_avx2(__m256i (&iacc)[MR][2], const uint8_t* qs, const int8_t* xb, int64_t K) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256i acc[MR][2];
  HLOSERVE_UNROLL
  for (int j = 0; j < MR; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_si256();
  HLOSERVE_UNROLL
  for (int s = 0; s < 4; ++s) {
    __m256i lo[2], hi[2];
    HLOSERVE_UNROLL
    for (int h = 0; h < 2; ++h) {
      __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + s * 64 + 32 * h));
      if constexpr (FLIP) v = _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x88)));
      lo[h] = _mm256_and_si256(v, low), hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    dot_step16_avx2<MR>(acc, lo, hi, xb + s * 8, K);
  }
  widen16_avx2<MR>(iacc, acc);
}

// byte i = 0x10 where bit i of m is set, else 0 (version 4's fifth bits: each byte picks its
// mask byte i / 8 by a shuffle within 128-bit lanes, then tests bit i % 8)
inline __m256i fifth_bits(uint32_t m) {
  const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3,
                                        3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i spread = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(m)), pick), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(spread, bit), _mm256_set1_epi8(0x10));
}

// facc[j] += iacc[j] * (16 rows' scales sv * x row j's block scale d[j * stride]) (scale_sums')
template <int MR>
inline void scale_sums_avx2(__m256 (&facc)[MR][2], const __m256i (&iacc)[MR][2], const float* sv, const float* d,
                            int64_t stride) {
  HLOSERVE_UNROLL
  for (int j = 0; j < MR; ++j) {
    const __m256 dj = _mm256_set1_ps(d[j * stride]);
    HLOSERVE_UNROLL
    for (int h = 0; h < 2; ++h)
      facc[j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[j][h]), _mm256_mul_ps(_mm256_loadu_ps(sv + 8 * h), dj),
                                   facc[j][h]);
  }
}

// mins_and_store's
template <int MR>
inline void mins_and_store_avx2(__m256 (&facc)[MR][2], const float* wm, const float* xsum, int64_t G, float* out,
                                int64_t ostride) {
  for (int64_t g = 0; wm != nullptr && g < G; ++g)
    HLOSERVE_UNROLL
    for (int j = 0; j < MR; ++j)
      HLOSERVE_UNROLL
      for (int h = 0; h < 2; ++h)
        facc[j][h] = _mm256_fmadd_ps(_mm256_loadu_ps(wm + g * 16 + 8 * h), _mm256_set1_ps(xsum[j * G + g]), facc[j][h]);
  HLOSERVE_UNROLL
  for (int j = 0; j < MR; ++j) {
    _mm256_storeu_ps(out + j * ostride, facc[j][0]);
    _mm256_storeu_ps(out + j * ostride + 8, facc[j][1]);
  }
}
#endif

}  // namespace hloserve
