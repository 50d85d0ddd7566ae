// hloserve_quant_linear_v3: a GGUF K-quant matrix (Q4_K, Q5_K, Q6_K super-blocks kept as the artifact
// stores them: quants in element order, each super-block's header bytes) times int8 activations.
//
// With AVX512-VNNI the product runs as version 2's does (quant_linear.cc: 16 matrix rows per 64-byte
// vpdpbusd, each 32-element block's integer sums kept in int32 and scaled once per 16 rows), over a
// copy made per call of 16 rows at a time: the rows' quant bytes transposed 4 at a time (16 x 16
// dword transposes in registers) into a 16-row scratch the size of L1, and the 16 rows' headers
// decoded once into f32 sub-block scales (and mins) [sub-blocks, 16]. The copy is a layout change only, no
// arithmetic: every product is the same integer sum, scaled as the contract says. Q4_K's bytes hold
// elements 2j (low nibble) and 2j+1 (high), so x is read even-then-odd within each 8 elements;
// Q6_K's sub-blocks of 16 keep one int32 sum per half block. Below 4 rows of x (one request's decode)
// a row loop reads each matrix row where it lies, its headers decoded once per super-block into
// registers. Without VNNI version 1's portable loop (quant_rows.h) runs.
//
// hloserve_quant_linear_v5: the same blocks with their quants interleaved by 16 rows at export, in
// version 2's order (Q4_K: a byte holds elements k and k + 4 of an 8-element step, so x is read in
// its own order): the tiles at every row count on the quants where they lie, only the 16 rows'
// headers decoded per group; with AVX2 and no VNNI the same tiles by quant_rows.h's AVX2 steps;
// without AVX2 the portable loop reads the interleaved bytes (quant_rows.h int_of).
#include "quant_rows.h"

namespace {
using namespace hloserve;

// Version 3's operands: x [M, K] (K a multiple of 256), qweight [L, N, K/2] u8 (Q4_K) or [L, N, K] s8
// (Q5_K, Q6_K), blocks [L, N, K/256 * H] u8 (H: 16, Q6_K 18), read at the layer into `w` (its scale
// and, where the blocks have mins, its min: the headers), or an InvalidArgument naming what is wrong.
// Version 5 (`rows16`): qweight [L, N/16, 16 * row bytes], the quants interleaved by 16 rows.
ffi::Error read_blocks(ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer& qweight, ffi::AnyBuffer& blocks,
                       ffi::Buffer<ffi::S32>& layer, int64_t kind, QuantMatrix& w, int64_t& M, bool rows16 = false) {
  const char* target = rows16 ? "hloserve_quant_linear_v5: " : "hloserve_quant_linear_v3: ";
  auto fail = [target](const char* why) { return ffi::Error::InvalidArgument(std::string(target) + why); };
  if (kind != kQ4K && kind != kQ5K && kind != kQ6K) return fail("kind must be 12 (Q4_K), 13 (Q5_K) or 14 (Q6_K)");
  auto xd = x.dimensions();
  auto qd = qweight.dimensions();
  auto bd = blocks.dimensions();
  if (xd.size() != 2 || qd.size() != 3 || bd.size() != 3)
    return fail("x must be [M, K], qweight [L, N, K/2 | K], blocks [L, N, K/256 * H]");
  M = xd[0];
  const int64_t K = xd[1], L = qd[0], N = bd[1], bits = kind == kQ4K ? 4 : 8, head = kind == kQ6K ? 18 : 16;
  const int64_t qrow = bits == 8 ? K : K / 2;
  if (K % 256) return fail("K must be a multiple of 256 (super-blocks)");
  const ffi::DataType want = bits == 8 ? ffi::DataType::S8 : ffi::DataType::U8;
  if (rows16 ? (qweight.element_type() != want || N % 16 || qd[1] * 16 != N || qd[2] != 16 * qrow)
             : (qweight.element_type() != want || qd[1] != N || qd[2] != qrow))
    return fail(rows16 ? "qweight must be u8 [L, N/16, 8 K] (Q4_K) or s8 [L, N/16, 16 K], N that of blocks"
                       : "qweight must be u8 [L, N, K/2] (Q4_K) or s8 [L, N, K], N that of blocks");
  if (blocks.element_type() != ffi::DataType::U8 || bd[0] != L || bd[1] != N || bd[2] != K / 256 * head)
    return fail("blocks must be u8 [L, N, K/256 * 16] (Q4_K, Q5_K) or [L, N, K/256 * 18] (Q6_K)");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return fail("layer out of range");
  const int64_t group = kind == kQ6K ? 16 : 32;
  const uint8_t* h = static_cast<const uint8_t*>(blocks.untyped_data()) + l * N * (K / 256 * head);
  w = QuantMatrix{static_cast<const uint8_t*>(qweight.untyped_data()) + l * N * qrow, h,
                  kind == kQ6K ? nullptr : h, false, static_cast<int>(bits), N, K, K / group, group, kind, rows16};
  return ffi::Error::Success();
}

#if defined(__AVX512VNNI__) || defined(__AVX2__)
// The per-call operands of the 16-row tiles: x quantized (Q4_K: each 8 elements even then odd) and,
// Q6_K, each half block's offset correction -128 * (sum of its xq) (0 for the AVX2 steps: no offset)
struct KQuantX {
  QuantX2 x;
  std::vector<int32_t> start16;   // [M, K / 16] (Q6_K only)
};

KQuantX quantize_for_blocks(const float* x, int64_t M, const QuantMatrix& w) {
  const int64_t K = w.K, B = K / kXBlock;
  std::vector<float> order;
  if (w.bits == 4 && !w.rows16) {           // the nibbles' order; each 32-element block keeps its elements
                                            // (version 5's bytes hold k and k + 4, version 2's order: x as it is)
    order.resize(M * K);
    for (int64_t i = 0; i < M * K; i += 8)
      for (int64_t j = 0; j < 4; ++j) order[i + j] = x[i + 2 * j], order[i + 4 + j] = x[i + 2 * j + 1];
  }
#if defined(__AVX512VNNI__)
  constexpr int offset8 = 128;   // vpdpbusd: int8 weights made unsigned, q + 128
#else
  constexpr int offset8 = 0;     // the AVX2 steps: signed weights as they are (quant_rows.h int8_step_avx2)
#endif
  KQuantX r{quantize_x2(order.empty() ? x : order.data(), M, K, B, kXBlock, w.bits == 8 ? offset8 : 0), {}};
  if (w.block == kQ6K) {
    r.start16.resize(M * K / 16);
    for (int64_t i = 0; i < M * K / 16; ++i) {
      int32_t sum = 0;
      for (int64_t k = 0; k < 16; ++k) sum += r.x.xq[i * 16 + k];
      r.start16[i] = -offset8 * sum;
    }
  }
  return r;
}
#endif

#if defined(__AVX512VNNI__)

// r[i] = row i of a 16 x 16 matrix of 32-bit elements -> r[c] = its column c (within 128-bit lanes
// by unpacks, then across lanes by two rounds of shuffle_i32x4)
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  HLOSERVE_UNROLL
  for (int a = 0; a < 16; a += 4) {
    t[a] = _mm512_unpacklo_epi32(r[a], r[a + 1]), t[a + 1] = _mm512_unpackhi_epi32(r[a], r[a + 1]);
    t[a + 2] = _mm512_unpacklo_epi32(r[a + 2], r[a + 3]), t[a + 3] = _mm512_unpackhi_epi32(r[a + 2], r[a + 3]);
    r[a] = _mm512_unpacklo_epi64(t[a], t[a + 2]), r[a + 1] = _mm512_unpackhi_epi64(t[a], t[a + 2]);
    r[a + 2] = _mm512_unpacklo_epi64(t[a + 1], t[a + 3]), r[a + 3] = _mm512_unpackhi_epi64(t[a + 1], t[a + 3]);
  }
  HLOSERVE_UNROLL
  for (int c = 0; c < 4; ++c) {   // r[4a + c] lane L: rows 4a..4a+3 of column 4L + c
    t[c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), t[4 + c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);
    t[8 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88), t[12 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
  }
  HLOSERVE_UNROLL
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88), r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xDD);
    r[4 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0x88), r[12 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0xDD);
  }
}

// columns [0, cols) of 16 rows of 4-byte elements (row i at rows[i]) into dst: column c's 16 elements
// at dst + c * 64 bytes (a last chunk of under 16 columns read masked)
inline void columns16(const uint8_t* const rows[16], int64_t cols, uint8_t* dst) {
  for (int64_t c0 = 0; c0 < cols; c0 += 16) {
    const int64_t n = std::min<int64_t>(16, cols - c0);
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    __m512i r[16];
    HLOSERVE_UNROLL
    for (int i = 0; i < 16; ++i) r[i] = _mm512_maskz_loadu_epi32(valid, rows[i] + c0 * 4);
    transpose16(r);
    for (int64_t c = 0; c < n; ++c) _mm512_storeu_si512(dst + (c0 + c) * 64, r[c]);
  }
}

#endif

#if defined(__AVX512VNNI__) || defined(__AVX2__)
// rows [n0, n0 + 16) of w (clamped at N - 1): headers16 their headers decoded into ws [S, 16] and wm
// [K/32, 16]; interleave16 also their quants into the interleaved scratch: q, each row's dword s at
// bytes s * 64 + (row % 16) * 4; ws [S, 16] its sub-block scales (S = K / group), wm [K/32, 16] its
// mins; tmp_s, tmp_m: [16, S] each row's as decoded
void headers16(const QuantMatrix& w, int64_t n0, float* ws, float* wm, float* tmp_s, float* tmp_m) {
  const int64_t S = w.G;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if (w.block != kQ6K && n0 + 16 <= w.N) {   // Q4_K / Q5_K: 4 headers a register, the 16 rows transposed in registers
    const int64_t nb = w.K / 256;
    const uint8_t* h = static_cast<const uint8_t*>(w.scale) + n0 * nb * 16;
    for (int64_t b = 0; b < nb; ++b) {
      __m512i r[16];
      HLOSERVE_UNROLL
      for (int g = 0; g < 4; ++g) {
        const uint8_t* hs[4];
        for (int i = 0; i < 4; ++i) hs[i] = h + ((4 * g + i) * nb + b) * 16;
        __m512 o[4];
        block_headers4(hs, o);
        for (int i = 0; i < 4; ++i) r[4 * g + i] = _mm512_castps_si512(o[i]);
      }
      transpose16(r);                                    // r[c]: value c (sc 0-7, then m 0-7) of the 16 rows
      HLOSERVE_UNROLL
      for (int c = 0; c < 8; ++c) {
        _mm512_storeu_si512(ws + (b * 8 + c) * 16, r[c]);
        if (wm != nullptr && w.min != nullptr) _mm512_storeu_si512(wm + (b * 8 + c) * 16, r[8 + c]);
      }
    }
    return;
  }
#endif
  for (int64_t i = 0; i < 16; ++i)
    block_row(w, std::min(n0 + i, w.N - 1), tmp_s + i * S, w.min != nullptr ? tmp_m + i * S : nullptr);
#if defined(__AVX512VNNI__)
  const uint8_t* srows[16];
  const uint8_t* mrows[16];
  for (int64_t i = 0; i < 16; ++i) {
    srows[i] = reinterpret_cast<const uint8_t*>(tmp_s + i * S);
    mrows[i] = reinterpret_cast<const uint8_t*>(tmp_m + i * S);
  }
  columns16(srows, S, reinterpret_cast<uint8_t*>(ws));
  if (w.min != nullptr) columns16(mrows, S, reinterpret_cast<uint8_t*>(wm));
#else
  for (int64_t i = 0; i < 16; ++i)
    for (int64_t c = 0; c < S; ++c) {
      ws[c * 16 + i] = tmp_s[i * S + c];
      if (w.min != nullptr) wm[c * 16 + i] = tmp_m[i * S + c];
    }
#endif
}
#endif

#if defined(__AVX512VNNI__)

void interleave16(const QuantMatrix& w, int64_t n0, uint8_t* q, float* ws, float* wm, float* tmp_s, float* tmp_m) {
  const int64_t qrow = w.bits == 8 ? w.K : w.K / 2;
  const uint8_t* qrows[16];
  for (int64_t i = 0; i < 16; ++i) qrows[i] = w.q + std::min(n0 + i, w.N - 1) * qrow;
  columns16(qrows, qrow / 4, q);
  headers16(w, n0, ws, wm, tmp_s, tmp_m);
}

// 16 interleaved matrix rows times MR rows of x (from m0) into out + (m0 + j) * ostride: per block of 32
// (Q6_K: per half block) int32 sums started at the offset correction, scaled once per row of x
template <int BITS, bool SUB16, int MR>
inline void kquant_tile(const uint8_t* q, const float* ws, const float* wm, const KQuantX& kx, int64_t m0, int64_t K,
                        float* out, int64_t ostride) {
  const QuantX2& x = kx.x;
  const int64_t B = K / kXBlock;
  constexpr int64_t kBlockBytes = BITS == 8 ? 16 * 32 : 16 * 16;
  constexpr int kHalves = SUB16 ? 2 : 1, kSteps = BITS == 8 ? 8 / kHalves : 4;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 facc[MR];
  HLOSERVE_UNROLL
  for (int j = 0; j < MR; ++j) facc[j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const int8_t* xb = x.xq.data() + m0 * K + b * kXBlock;
    HLOSERVE_UNROLL
    for (int h = 0; h < kHalves; ++h) {
      __m512i iacc[MR];
      HLOSERVE_UNROLL
      for (int j = 0; j < MR; ++j)
        iacc[j] = _mm512_set1_epi32(SUB16 ? kx.start16[(m0 + j) * 2 * B + 2 * b + h] : x.start[(m0 + j) * B + b]);
      const uint8_t* qb = q + b * kBlockBytes + h * kSteps * 64;
      HLOSERVE_UNROLL
      for (int s = 0; s < kSteps; ++s) {
        const __m512i v = _mm512_loadu_si512(qb + s * 64);
        if constexpr (BITS == 8) {
          const __m512i wv = _mm512_xor_si512(v, flip);                     // q + 128
          HLOSERVE_UNROLL
          for (int j = 0; j < MR; ++j) {
            int32_t four;
            std::memcpy(&four, xb + j * K + (h * kSteps + s) * 4, 4);
            iacc[j] = _mm512_dpbusd_epi32(iacc[j], wv, _mm512_set1_epi32(four));
          }
        } else {                                                             // q as is, [0, 15]
          int4_step<MR>(iacc, v, xb + s * 8, K);
        }
      }
      scale_sums<MR>(facc, iacc, _mm512_loadu_ps(ws + (b * kHalves + h) * 16), x.d.data() + m0 * B + b, B);
    }
  }
  mins_and_store<MR>(facc, wm, x.xsum.data() + m0 * B, B, out + m0 * ostride, ostride);
}

template <int BITS, bool SUB16>
void kquant_rows(const uint8_t* q, const float* ws, const float* wm, const KQuantX& x, int64_t M, int64_t K, float* o,
                 int64_t ostride) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) kquant_tile<BITS, SUB16, 6>(q, ws, wm, x, m, K, o, ostride);
  switch (M - m) {
    case 5: kquant_tile<BITS, SUB16, 5>(q, ws, wm, x, m, K, o, ostride); break;
    case 4: kquant_tile<BITS, SUB16, 4>(q, ws, wm, x, m, K, o, ostride); break;
    case 3: kquant_tile<BITS, SUB16, 3>(q, ws, wm, x, m, K, o, ostride); break;
    case 2: kquant_tile<BITS, SUB16, 2>(q, ws, wm, x, m, K, o, ostride); break;
    case 1: kquant_tile<BITS, SUB16, 1>(q, ws, wm, x, m, K, o, ostride); break;
  }
}

// groups of 16 rows [g0, g1): each interleaved into this task's scratch, then its tiles; a last,
// partial group is computed whole (its missing rows repeat row N - 1) into `tail` and copied
// (version 5: the quants already interleaved, read where they lie; only the headers decoded)
void kquant_groups(const QuantMatrix& w, const KQuantX& x, int64_t M, int64_t g0, int64_t g1, float* out) {
  const int64_t qrow = w.bits == 8 ? w.K : w.K / 2;
  std::vector<uint8_t> copy(w.rows16 ? 0 : 16 * qrow);
  std::vector<float> ws(16 * w.G), wm(16 * w.G), tmp_s(16 * w.G), tmp_m(16 * w.G), tail;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n0 = g * 16, rows = std::min<int64_t>(16, w.N - n0);
    const uint8_t* q = copy.data();
    if (w.rows16) {
      q = w.q + g * 16 * qrow;
      headers16(w, n0, ws.data(), wm.data(), tmp_s.data(), tmp_m.data());
    } else {
      interleave16(w, n0, copy.data(), ws.data(), wm.data(), tmp_s.data(), tmp_m.data());
    }
    if (rows < 16) tail.assign(M * 16, 0.f);
    float* o = rows < 16 ? tail.data() : out + n0;
    const int64_t stride = rows < 16 ? 16 : w.N;
    const float* mins = w.min != nullptr ? wm.data() : nullptr;
    if (w.block == kQ6K) kquant_rows<8, true>(q, ws.data(), mins, x, M, w.K, o, stride);
    else if (w.bits == 8) kquant_rows<8, false>(q, ws.data(), mins, x, M, w.K, o, stride);
    else kquant_rows<4, false>(q, ws.data(), mins, x, M, w.K, o, stride);
    for (int64_t m = 0; rows < 16 && m < M; ++m) std::memcpy(out + m * w.N + n0, tail.data() + m * 16, rows * 4);
  }
}

// -- below kTileRows rows of x: each matrix row read where it lies, super-block by super-block ------
//
// One request's decode step. Per super-block of NR matrix rows: each row's header decoded once into
// registers (scales and mins), the mins' term one FMA against x's 8 group sums, and the quants by
// 64-byte vpdpbusd steps whose 16 lanes are scaled by the sub-block scale and x's block scale of
// their lane (a permute of the decoded scales), summed across lanes once per row.

// x for the row loop: quantized per 32-element block as the contract says, its bytes in the order
// of the weights' lanes (Q4_K: each 128 elements' evens, then their odds: the low and the high
// nibbles of 64 weight bytes), each lane's block scale d, and (int8 weights, read as q + 128) each
// lane's correction -128 * (sum of its 4 xq)
struct RowX {
  QuantX2 x;                   // d [M, K/32], xsum [M, G]; x.xq in element order
  std::vector<int8_t> xq;      // [M, K] in lane order
  std::vector<float> lanes;    // [M, chunks, 16]
  std::vector<int32_t> start;  // [M, chunks, 16] (int8 weights)
};

RowX quantize_for_rows(const float* x, int64_t M, const QuantMatrix& w) {
  const int64_t K = w.K, B = K / kXBlock, elems = w.bits == 8 ? 64 : 128, chunks = K / elems;
  RowX r{quantize_x2(x, M, K, K / 32, 32, 0), std::vector<int8_t>(M * K), std::vector<float>(M * chunks * 16),
         std::vector<int32_t>(w.bits == 8 ? M * chunks * 16 : 0)};
  const int8_t* src = r.x.xq.data();
  if (w.bits == 8) {
    std::memcpy(r.xq.data(), src, M * K);
  } else {
    for (int64_t i = 0; i < M * K; i += 128)
      for (int64_t k = 0; k < 64; ++k) r.xq[i + k] = src[i + 2 * k], r.xq[i + 64 + k] = src[i + 2 * k + 1];
  }
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < chunks; ++c) {
      const float* d = r.x.d.data() + m * B + c * (elems / kXBlock);
      _mm512_storeu_ps(r.lanes.data() + (m * chunks + c) * 16, w.bits == 8 ? per_lane<8>(d) : per_lane<4>(d));
      if (w.bits != 8) continue;
      const __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(src + m * K + c * 64));
      _mm512_storeu_si512(r.start.data() + (m * chunks + c) * 16, _mm512_mullo_epi32(sum, _mm512_set1_epi32(-128)));
    }
  return r;
}

// NR matrix rows from n times MR rows of x from m0 (M rows in all) into out [M, N]
template <int64_t KIND, int NR, int MR>
void kquant_row_tile(const QuantMatrix& w, const RowX& x, int64_t n, int64_t m0, float* out) {
  constexpr int BITS = KIND == kQ4K ? 4 : 8;
  constexpr int64_t kHead = KIND == kQ6K ? 18 : 16, kElems = BITS == 8 ? 64 : 128, kChunks = 256 / kElems;
  const int64_t K = w.K, nb = K / 256, qrow = K * BITS / 8, chunks = K / kElems, G = K / 32;
  const uint8_t* h = static_cast<const uint8_t*>(w.scale) + n * nb * kHead;
  const uint8_t* q = w.q + n * qrow;
  // lane l of step c takes sub-block scale idx[c][l]: Q4_K 4 lanes a sub-block of 32, Q5_K 8, Q6_K 4 (of 16)
  __m512i idx[kChunks];
  HLOSERVE_UNROLL
  for (int c = 0; c < kChunks; ++c)
    idx[c] = _mm512_srli_epi32(_mm512_add_epi32(_mm512_set1_epi32(c * 16),
                                                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
                               KIND == kQ5K ? 3 : 2);
  const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[NR][MR];
  __m256 macc[NR][MR];
  HLOSERVE_UNROLL
  for (int i = 0; i < NR; ++i)
    HLOSERVE_UNROLL
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_setzero_ps(), macc[i][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512 sc[NR];
    HLOSERVE_UNROLL
    for (int i = 0; i < NR; ++i) {
      const uint8_t* hb = h + (i * nb + b) * kHead;
      if constexpr (KIND == kQ6K) {
        const __m512 s = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hb))));
        sc[i] = _mm512_mul_ps(_mm512_set1_ps(f16_to_f32(static_cast<uint16_t>(hb[16] | (hb[17] << 8)))), s);
      } else {
        alignas(32) float s8[8], m8[8];
        block_header(hb, s8, m8);
        sc[i] = _mm512_castps256_ps512(_mm256_load_ps(s8));
        HLOSERVE_UNROLL
        for (int j = 0; j < MR; ++j)
          macc[i][j] = _mm256_fmadd_ps(_mm256_load_ps(m8), _mm256_loadu_ps(x.x.xsum.data() + (m0 + j) * G + b * 8),
                                       macc[i][j]);
      }
    }
    HLOSERVE_UNROLL
    for (int c = 0; c < kChunks; ++c) {
      const int64_t chunk = b * kChunks + c;
      __m512i lo[NR], hi[NR];
      __m512 sl[NR];
      HLOSERVE_UNROLL
      for (int i = 0; i < NR; ++i) {
        const __m512i v = _mm512_loadu_si512(q + i * qrow + chunk * 64);
        if constexpr (BITS == 8) {
          lo[i] = _mm512_xor_si512(v, flip);                                   // q + 128
        } else {
          lo[i] = _mm512_and_si512(v, low), hi[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        sl[i] = _mm512_permutexvar_ps(idx[c], sc[i]);
      }
      HLOSERVE_UNROLL
      for (int j = 0; j < MR; ++j) {
        const int64_t at = (m0 + j) * chunks + chunk;
        const int8_t* xr = x.xq.data() + (m0 + j) * K + chunk * kElems;
        const __m512 dv = _mm512_loadu_ps(x.lanes.data() + at * 16);
        const __m512i xa = _mm512_loadu_si512(xr);
        __m512i start = _mm512_setzero_si512(), xb = _mm512_setzero_si512();
        if constexpr (BITS == 8) start = _mm512_loadu_si512(x.start.data() + at * 16);
        else xb = _mm512_loadu_si512(xr + 64);
        HLOSERVE_UNROLL
        for (int i = 0; i < NR; ++i) {
          __m512i part = _mm512_dpbusd_epi32(start, lo[i], xa);
          if constexpr (BITS == 4) part = _mm512_dpbusd_epi32(part, hi[i], xb);
          acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part), _mm512_mul_ps(sl[i], dv), acc[i][j]);
        }
      }
    }
  }
  HLOSERVE_UNROLL
  for (int i = 0; i < NR; ++i)
    HLOSERVE_UNROLL
    for (int j = 0; j < MR; ++j) {
      const __m256 m = macc[i][j];
      __m128 t = _mm_add_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      t = _mm_add_ps(t, _mm_movehl_ps(t, t));
      t = _mm_add_ss(t, _mm_movehdup_ps(t));
      out[(m0 + j) * w.N + n + i] = _mm512_reduce_add_ps(acc[i][j]) + _mm_cvtss_f32(t);
    }
}

// matrix rows [n0, n1) times the M (< kTileRows) rows of x: 4 matrix rows a tile for one row of x, 2 for more
template <int64_t KIND>
void kquant_row_loop(const QuantMatrix& w, const RowX& x, int64_t M, int64_t n0, int64_t n1, float* out) {
  int64_t n = n0;
  if (M == 1) {
    for (; n + 4 <= n1; n += 4) kquant_row_tile<KIND, 4, 1>(w, x, n, 0, out);
    for (; n < n1; ++n) kquant_row_tile<KIND, 1, 1>(w, x, n, 0, out);
    return;
  }
  for (; n + 2 <= n1; n += 2) {
    kquant_row_tile<KIND, 2, 2>(w, x, n, 0, out);
    if (M == 3) kquant_row_tile<KIND, 2, 1>(w, x, n, 2, out);
  }
  for (; n < n1; ++n) {
    kquant_row_tile<KIND, 1, 2>(w, x, n, 0, out);
    if (M == 3) kquant_row_tile<KIND, 1, 1>(w, x, n, 2, out);
  }
}

void kquant_rows_small(ffi::ThreadPool& pool, const float* xf, const QuantMatrix& w, int64_t M, float* op) {
  const RowX x = quantize_for_rows(xf, M, w);
  parallel_for(pool, (w.N + kLinearRows - 1) / kLinearRows, 1, [&](int64_t task) {
    const int64_t n0 = task * kLinearRows, n1 = std::min(w.N, n0 + kLinearRows);
    if (w.block == kQ4K) kquant_row_loop<kQ4K>(w, x, M, n0, n1, op);
    else if (w.block == kQ5K) kquant_row_loop<kQ5K>(w, x, M, n0, n1, op);
    else kquant_row_loop<kQ6K>(w, x, M, n0, n1, op);
  });
}
#endif

#if defined(__AVX2__) && !defined(__AVX512VNNI__)
// Version 5 without VNNI (AVX2 CPUs): kquant_tile's product with quant_rows.h's AVX2 steps (Q5_K /
// Q6_K bytes as |q| against x with q's signs, no offset; Q4_K's nibbles unsigned as they are), every
// row count; the 16 rows' headers decoded per group (block_header's shuffles with SSE4.1 blends,
// then transposed to [sub-blocks, 16]). Version 3 (quants row by row) keeps version 1's loops.
template <int BITS, bool SUB16, int MR>
inline void kquant_tile_avx2(const uint8_t* q, const float* ws, const float* wm, const KQuantX& kx, int64_t m0,
                             int64_t K, float* out, int64_t ostride) {
  const QuantX2& x = kx.x;
  const int64_t B = K / kXBlock;
  constexpr int64_t kBlockBytes = BITS == 8 ? 16 * 32 : 16 * 16;
  constexpr int kHalves = SUB16 ? 2 : 1, kSteps = BITS == 8 ? 8 / kHalves : 4;
  __m256 facc[MR][2];
  HLOSERVE_UNROLL
  for (int j = 0; j < MR; ++j) facc[j][0] = facc[j][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const int8_t* xb = x.xq.data() + m0 * K + b * kXBlock;
    HLOSERVE_UNROLL
    for (int h = 0; h < kHalves; ++h) {
      __m256i iacc[MR][2];
      HLOSERVE_UNROLL
      for (int j = 0; j < MR; ++j) iacc[j][0] = iacc[j][1] = _mm256_setzero_si256();   // no offset to correct
      const uint8_t* qb = q + b * kBlockBytes + h * kSteps * 64;
      if constexpr (BITS == 8) {
        HLOSERVE_UNROLL
        for (int s = 0; s < kSteps; ++s) int8_step_avx2<MR>(iacc, qb + s * 64, xb + (h * kSteps + s) * 4, K);
      } else {
        int4_block_avx2<MR>(iacc, qb, xb, K);
      }
      scale_sums_avx2<MR>(facc, iacc, ws + (b * kHalves + h) * 16, x.d.data() + m0 * B + b, B);
    }
  }
  mins_and_store_avx2<MR>(facc, wm, x.xsum.data() + m0 * B, B, out + m0 * ostride, ostride);
}

// rows of x 3 at a time (12 accumulators of 16 registers)
template <int BITS, bool SUB16>
void kquant_rows_avx2(const uint8_t* q, const float* ws, const float* wm, const KQuantX& x, int64_t M, int64_t K,
                      float* o, int64_t ostride) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) kquant_tile_avx2<BITS, SUB16, 3>(q, ws, wm, x, m, K, o, ostride);
  switch (M - m) {
    case 2: kquant_tile_avx2<BITS, SUB16, 2>(q, ws, wm, x, m, K, o, ostride); break;
    case 1: kquant_tile_avx2<BITS, SUB16, 1>(q, ws, wm, x, m, K, o, ostride); break;
  }
}

// version 5's groups of 16 rows [g0, g1) (N a multiple of 16: the export interleaves only such matrices)
void kquant_groups_avx2(const QuantMatrix& w, const KQuantX& x, int64_t M, int64_t g0, int64_t g1, float* out) {
  const int64_t qrow = w.bits == 8 ? w.K : w.K / 2;
  std::vector<float> ws(16 * w.G), wm(16 * w.G), tmp_s(16 * w.G), tmp_m(16 * w.G);
  const float* mins = w.min != nullptr ? wm.data() : nullptr;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* q = w.q + g * 16 * qrow;
    headers16(w, g * 16, ws.data(), wm.data(), tmp_s.data(), tmp_m.data());
    if (w.block == kQ6K) kquant_rows_avx2<8, true>(q, ws.data(), mins, x, M, w.K, out + g * 16, w.N);
    else if (w.bits == 8) kquant_rows_avx2<8, false>(q, ws.data(), mins, x, M, w.K, out + g * 16, w.N);
    else kquant_rows_avx2<4, false>(q, ws.data(), mins, x, M, w.K, out + g * 16, w.N);
  }
}
#endif

// Below this many rows of x the copy costs more than the tiles save, and the row loop above runs
// (each matrix row read once where it lies). Measured one thread, K 1536, N 2304, Xeon with VNNI,
// 2026-11-29 (against version 1's row loop then): Q6_K rows 1-2 the loops 1.3x faster, 4 even, 8 the
// tiles 1.5x, 16 1.3-2.3x; Q4_K 1-2 even, 4 the tiles 1.2x, 8 1.45x, 16 1.85x.
constexpr int64_t kTileRows = 4;

// the product: 16 rows at a time with VNNI from kTileRows rows of x, version 1's row loops elsewhere
// (version 5: the tiles at every row count, its quants read where they lie)
void quant_linear_v3(ffi::ThreadPool& pool, const float* x, const QuantMatrix& w, int64_t M, float* op) {
#if defined(__AVX512VNNI__)
  if (M < kTileRows && !w.rows16) return kquant_rows_small(pool, x, w, M, op);
  const KQuantX xq = quantize_for_blocks(x, M, w);
  const int64_t NG = (w.N + 15) / 16;
  constexpr int64_t kGroupsPerTask = kLinearRows / 16;
  parallel_for(pool, (NG + kGroupsPerTask - 1) / kGroupsPerTask, 1, [&](int64_t task) {
    const int64_t g0 = task * kGroupsPerTask;
    kquant_groups(w, xq, M, g0, std::min(NG, g0 + kGroupsPerTask), op);
  });
#else
#if defined(__AVX2__)
  if (w.rows16) {
    const KQuantX xq = quantize_for_blocks(x, M, w);
    even_shares(pool, w.N / 16, [&](int64_t g0, int64_t g1) { kquant_groups_avx2(w, xq, M, g0, g1, op); });
    return;
  }
#endif
  quant_linear_v1(pool, x, w, M, op);
#endif
}

template <bool kRows16>
ffi::Error QuantLinearK(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer qweight, ffi::AnyBuffer blocks,
                        ffi::Buffer<ffi::S32> layer, int64_t kind, ffi::ResultBuffer<ffi::F32> out) {
  QuantMatrix w;
  int64_t M;
  if (ffi::Error e = read_blocks(x, qweight, blocks, layer, kind, w, M, kRows16); e.failure()) return e;
  quant_linear_v3(pool, x.typed_data(), w, M, out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

// x, qweight, blocks, layer; kind: versions 3 and 5 (GGUF K-quant blocks; 5: the quants interleaved)
static auto QuantLinearKBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Attr<int64_t>("kind")
      .Ret<ffi::Buffer<ffi::F32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(hloserve_quant_linear_v3, QuantLinearK<false>, QuantLinearKBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(hloserve_quant_linear_v5, QuantLinearK<true>, QuantLinearKBinding());
