// A prompt chunk's tile of paged attention on AMX tiles (Intel Sapphire Rapids and later), for a bf16
// cache: the tile of attend_tile (paged_attention.h) with q.k and p.v as bf16 tile products summed in
// f32, where attend_tile's f32 FMAs reach ~80 GFLOP/s a core (docs/performance.md). A long prompt's
// attention grows with the square of its length, so this is a large part of a long prefill.
//
// The arithmetic is f32's, as on the other paths: K and V rows are bf16 already (exact in a tile),
// and the f32 operands, the scaled queries and the weights, go in as three bf16 parts each
// (x = hi + mid + lo exactly: 3 x 8 significant bits hold f32's 24), three tile products summed in
// f32 where one would round them to bf16 (the tiles' products are exact and their sums f32). A token
// then computes what the f32 paths compute, up to the order of f32 sums, whether its tile ran here or
// not: a sequence's result does not depend on how it was chunked (a bf16 rounding here made it, by
// ~1e-3, and the prefix tiers' identical greedy text broke at a near tie; CI, 2026-11-29). Every tile
// of two or more tokens takes it (the kernel never makes a tile of one: paged_attention.cc), since
// "up to the order of f32 sums" is not the same bits: with the f32 path for tiles of under 8 tokens,
// a chunk's 2-7-token tail got other bits than the same tokens inside a longer tile, and a prompt's
// K/V depended on where the step's budget cut it.
//
// Layout, rows r = (token, query head) as in attend_tile:
//   S [r][c] = Q [r][d] . K^T        A: Q rows, 3 bf16 parts  B: K^T, 16 positions x 32 dims a tile
//   softmax along c, per row          P [r][c] f32
//   O [r][d] = P [r][c] . V           A: P rows, 3 bf16 parts  B: V, pairs of positions interleaved
// B tiles hold pairs of bf16 of one k index side by side (the "VNNI" layout tdpbf16ps reads).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HLOSERVE_PAGED_AMX 1

namespace hloserve::paged {

constexpr int64_t kAmxMinTokens = 2;    // a tile of fewer tokens (one: a decode) keeps the f32 path
constexpr int64_t kAmxTileTokens = 32;  // tokens a work item takes (16 on the f32 path): K and V packed once for
                                        // more rows; 32 and 64 measured alike, 16 ~20% slower (one core, 2026-11-29)

constexpr int64_t kParts = 3;           // bf16 parts of an f32 operand (above)

// whether attend_tile hands a bf16 cache's chunk tiles of this head_dim and soft-capping to the AMX tiles
inline bool amx_tiles_apply(int64_t D, float softcap) {
  return D % 32 == 0 && softcap <= 0.f && amx_usable();
}

// C[i][j] = sum over kParts parts p and `steps` k-steps s of A_i(p, s) . B_j(s) for MR row tiles and
// NC column tiles (tiles 0-3 the sums, 4-5 the A tiles, 6-7 the B tiles: each loaded tile is used MR
// or NC times). A_i(p, s) lies at a[i] + p * a_part + s * a_step (rows `sa` bytes apart), B_j(s) at
// b[j] + s * b_step (a VNNI tile, rows 64 bytes apart): each part of A meets the same B tiles. C_ij
// is stored at c[i][j], rows `sc` bytes apart; ACC: added to what c holds (else to zeros).
template <int MR, int NC, bool ACC>
inline void amx_block(const uint16_t* const* a, int64_t sa, int64_t a_part, int64_t a_step, const uint16_t* const* b,
                      int64_t b_step, int64_t steps, float* const (*c)[2], int64_t sc) {
  if constexpr (ACC) {
    _tile_loadd(0, c[0][0], sc);
    if constexpr (NC > 1) _tile_loadd(1, c[0][1], sc);
    if constexpr (MR > 1) _tile_loadd(2, c[1][0], sc);
    if constexpr (MR > 1 && NC > 1) _tile_loadd(3, c[1][1], sc);
  } else {
    _tile_zero(0);
    if constexpr (NC > 1) _tile_zero(1);
    if constexpr (MR > 1) _tile_zero(2);
    if constexpr (MR > 1 && NC > 1) _tile_zero(3);
  }
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(6, b[0] + s * b_step, 64);
    if constexpr (NC > 1) _tile_loadd(7, b[1] + s * b_step, 64);
    for (int64_t p = 0; p < kParts; ++p) {
      _tile_loadd(4, a[0] + p * a_part + s * a_step, sa);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (NC > 1) _tile_dpbf16ps(1, 4, 7);
      if constexpr (MR > 1) {
        _tile_loadd(5, a[1] + p * a_part + s * a_step, sa);
        _tile_dpbf16ps(2, 5, 6);
        if constexpr (NC > 1) _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
  _tile_stored(0, c[0][0], sc);
  if constexpr (NC > 1) _tile_stored(1, c[0][1], sc);
  if constexpr (MR > 1) _tile_stored(2, c[1][0], sc);
  if constexpr (MR > 1 && NC > 1) _tile_stored(3, c[1][1], sc);
}

// C = A . B over whole tiles, A in kParts parts a_part apart: `mt` row tiles (A_i at a + i * a_row),
// `nt` column tiles (B_j at b + j * b_col, k-steps b_step apart), C_ij at c + i * c_row + j * 16
// (floats), in blocks of 2 x 2 tiles; ACC: C += A . B
template <bool ACC>
inline void amx_product(const uint16_t* a, int64_t a_row, int64_t sa, int64_t a_part, int64_t a_step, const uint16_t* b,
                        int64_t b_col, int64_t b_step, int64_t steps, int64_t mt, int64_t nt, float* c, int64_t c_row,
                        int64_t sc) {
  for (int64_t i = 0; i < mt; i += 2)
    for (int64_t j = 0; j < nt; j += 2) {
      const bool two_r = i + 1 < mt, two_c = j + 1 < nt;
      const uint16_t* ai[2] = {a + i * a_row, a + (i + 1) * a_row};
      const uint16_t* bj[2] = {b + j * b_col, b + (j + 1) * b_col};
      float* const cij[2][2] = {{c + i * c_row + j * 16, c + i * c_row + (j + 1) * 16},
                                {c + (i + 1) * c_row + j * 16, c + (i + 1) * c_row + (j + 1) * 16}};
      if (two_r && two_c) amx_block<2, 2, ACC>(ai, sa, a_part, a_step, bj, b_step, steps, cij, sc);
      else if (two_r) amx_block<2, 1, ACC>(ai, sa, a_part, a_step, bj, b_step, steps, cij, sc);
      else if (two_c) amx_block<1, 2, ACC>(ai, sa, a_part, a_step, bj, b_step, steps, cij, sc);
      else amx_block<1, 1, ACC>(ai, sa, a_part, a_step, bj, b_step, steps, cij, sc);
    }
}

// 2^x for x <= 0, 16 lanes: x = n + r, |r| <= 1/2, 2^r by its degree-6 Taylor polynomial in r ln 2
// (relative error < 3e-7), times 2^n; x below -126 gives 0
inline __m512 exp2_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_mul_ps(_mm512_sub_ps(x, n), _mm512_set1_ps(0.693147180559945f));
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// lanes c0 + [0, 16) inside [a, b)
inline __mmask16 seen_lanes(int64_t c0, int64_t a, int64_t b) {
  if (a <= c0 && c0 + 16 <= b) return 0xFFFF;
  const __m512i c = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(c0)),
                                     _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  return _mm512_cmpge_epi32_mask(c, _mm512_set1_epi32(static_cast<int32_t>(a))) &
         _mm512_cmplt_epi32_mask(c, _mm512_set1_epi32(static_cast<int32_t>(b)));
}

inline float bit_cast_float(int32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// bf16 bits (16 of them) -> f32
inline __m512 bf16x16_to_f32(__m256i b) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)); }

// 16 f32 -> their kParts bf16 parts (hi + mid + lo = x exactly: each part rounds what the ones before
// left, which has at most 16 and then 8 significant bits), stored at dst, dst + part, dst + 2 * part
inline void split16_bf16(__m512 x, uint16_t* dst, int64_t part) {
  for (int64_t p = 0; p < kParts; ++p) {
    const __m256i b = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + p * part), b);
    x = _mm512_sub_ps(x, bf16x16_to_f32(b));
  }
}

// The tiles' sizes: kPosTile positions a step (one k-step of p.v), kRowGroup rows (two row tiles) at a time.
constexpr int64_t kPosTile = 64;
constexpr int64_t kRowGroup = 32;

struct AmxScratch {                     // tile operands on whole 64-byte lines (LineVector, common.h)
  LineVector<uint16_t> qa, kt, vt, pb;
  LineVector<float> sb, o;
  std::vector<uint16_t> zeros;
  std::vector<float> m, lv, alpha;
  std::vector<int64_t> ra, rb;
};

// attend_tile's tile (same operands; a bf16 cache) on AMX tiles; false where this path does not apply
// (head_dim not a multiple of 32, soft-capping, one token (`attend`'s), or no AMX state from
// the OS): the caller then runs the f32 path.
//
// Positions stream through in steps of kPosTile, flash-attention style: each step's K^T and V tiles
// are packed once and used by every row, and each row keeps a running maximum, sum and output. The
// scores are in base 2 (log2 e is folded into q's scale) and the running maximum is kept on the
// integers, so a row's earlier terms are rescaled by powers of two, exactly: every weight is
// 2^(s - M) with M the row's final integer ceiling of its largest score, whatever the order in which
// the positions came, and the output is normalized by the weights' sum at the end.
inline bool attend_tile_amx(const float* q, float* out, int64_t stride, int64_t ntok, const int64_t* begins,
                            const int64_t* ends, const void* cache, int64_t kbase, int64_t vbase, const int32_t* table,
                            int64_t BS, int64_t D, int64_t G, float scale, float softcap) {
  if (ntok < kAmxMinTokens || !amx_tiles_apply(D, softcap)) return false;
  thread_local AmxScratch w;
  int64_t lo = INT64_MAX, hi = 0;                                        // over tokens that see something
  for (int64_t i = 0; i < ntok; ++i)
    if (ends[i] > begins[i]) lo = std::min(lo, begins[i]), hi = std::max(hi, ends[i]);
  if (hi <= lo) return false;
  const int64_t rows = ntok * G, RP = (rows + 15) / 16 * 16;
  const int64_t JD = D / 32, DT = D / 16;                                // k-steps over d; 16-dim output tiles
  const uint16_t* kc = static_cast<const uint16_t*>(cache);
  w.zeros.assign(D, 0);
  auto row = [&](int64_t base, int64_t p) -> const uint16_t* {           // position p's row, or zeros past hi
    if (p >= hi) return w.zeros.data();
    return kc + base + (static_cast<int64_t>(table[p / BS]) * BS + p % BS) * D;
  };
  // Q: qa[r] = the kParts bf16 parts of q * scale * log2 e, one after the other (D each), rows past `rows` zero
  const int64_t QW = kParts * D;
  w.qa.assign(RP * QW, 0);
  const __m512 qscale = _mm512_set1_ps(scale * 1.44269504088896341f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = q + (r / G) * stride + (r % G) * D;
    for (int64_t d = 0; d < D; d += 16)
      split16_bf16(_mm512_mul_ps(_mm512_loadu_ps(src + d), qscale), w.qa.data() + r * QW + d, D);
  }
  w.o.assign(RP * D, 0.f);
  w.m.assign(RP, -INFINITY);
  w.lv.assign(RP * 16, 0.f);
  w.alpha.resize(RP);
  w.kt.resize(kPosTile / 16 * JD * 512);
  w.vt.resize(kPosTile / 32 * DT * 512);
  w.sb.resize(kRowGroup * kPosTile);
  const int64_t PW = kParts * kPosTile;                                   // a row of P: its parts one after the other
  w.pb.resize(kRowGroup * PW);
  w.ra.resize(RP);
  w.rb.resize(RP);
  int64_t* ra = w.ra.data();
  int64_t* rb = w.rb.data();
  for (int64_t r = 0; r < RP; ++r) {                                     // each row's positions [ra, rb)
    ra[r] = r < rows ? begins[r / G] : 0;
    rb[r] = r < rows ? std::max(ends[r / G], ra[r]) : 0;
  }
  const __m512i pairs = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                         5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  amx_configure_16x64();
  for (int64_t c0 = lo; c0 < hi; c0 += kPosTile) {
    // K^T: kPosTile / 16 x JD tiles, tile (ct, j) row i = dims 32j + 2i, +1 of positions c0 + 16ct + [0, 16)
    for (int64_t ct = 0; ct < kPosTile / 16; ++ct) {
      const char* rp[16];
      for (int i = 0; i < 16; ++i) rp[i] = reinterpret_cast<const char*>(row(kbase, c0 + ct * 16 + i));
      for (int64_t j = 0; j < JD; ++j) {
        const char* rj[16];
        for (int i = 0; i < 16; ++i) rj[i] = rp[i] + j * 64;
        transpose16_rows(rj, w.kt.data() + (ct * JD + j) * 512, 64);
      }
    }
    // V: per 32 positions u, DT tiles: tile (u, dt) row i = positions c0 + 32u + 2i and the next one
    // interleaved over dims 16dt + [0, 16)
    for (int64_t u = 0; u < kPosTile / 32; ++u)
      for (int64_t i = 0; i < 16; ++i) {
        const uint16_t* v0 = row(vbase, c0 + 32 * u + 2 * i);
        const uint16_t* v1 = row(vbase, c0 + 32 * u + 2 * i + 1);
        for (int64_t dt = 0; dt < DT; ++dt) {
          const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + dt * 16)));
          const __m512i b = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + dt * 16)));
          _mm512_storeu_si512(w.vt.data() + ((u * DT + dt) * 16 + i) * 32, _mm512_permutex2var_epi16(a, pairs, b));
        }
      }
    for (int64_t r0 = 0; r0 < RP; r0 += kRowGroup) {
      const int64_t nr = std::min(kRowGroup, RP - r0);                 // 16 or 32 rows
      int64_t ga = INT64_MAX, gb = 0;                                    // does any row see this step?
      for (int64_t r = r0; r < r0 + nr; ++r)
        if (rb[r] > ra[r]) ga = std::min(ga, ra[r]), gb = std::max(gb, rb[r]);
      if (gb <= c0 || ga >= c0 + kPosTile) continue;
      // S [nr][kPosTile] = Q . K^T
      amx_product<false>(w.qa.data() + r0 * QW, 16 * QW, QW * 2, D, 32, w.kt.data(), JD * 512, 512, JD, nr / 16,
                         kPosTile / 16, w.sb.data(), 16 * kPosTile, kPosTile * 4);
      // each row: the running maximum on the integers, probabilities 2^(s - M) as bf16, the sum, the rescale
      for (int64_t i = 0; i < nr; ++i) {
        const int64_t r = r0 + i;
        uint16_t* prow = w.pb.data() + i * PW;
        if (rb[r] <= c0 || ra[r] >= c0 + kPosTile) {
          for (int64_t c = 0; c < PW; c += 32) _mm512_storeu_si512(prow + c, _mm512_setzero_si512());
          w.alpha[r] = 1.f;
          continue;
        }
        const float* srow = w.sb.data() + i * kPosTile;
        __mmask16 seen[kPosTile / 16];
        __m512 sv[kPosTile / 16];
        const __m512 mold = _mm512_set1_ps(w.m[r]);
        __mmask16 above = 0;                                             // any score above the running maximum?
        for (int64_t v = 0; v < kPosTile / 16; ++v) {
          seen[v] = seen_lanes(c0 + 16 * v, ra[r], rb[r]);
          sv[v] = _mm512_loadu_ps(srow + 16 * v);
          above |= _mm512_mask_cmp_ps_mask(seen[v], sv[v], mold, _CMP_GT_OQ);
        }
        float alpha = 1.f;
        if (above) {                                                     // the maximum rises (a row's first step too)
          __m512 top = _mm512_set1_ps(-INFINITY);
          for (int64_t v = 0; v < kPosTile / 16; ++v) top = _mm512_mask_max_ps(top, seen[v], top, sv[v]);
          const float mnew = std::max(w.m[r], std::ceil(_mm512_reduce_max_ps(top)));
          // 2^(m - mnew), a power of two: its bits (0 for the first positions a row sees, m = -inf)
          alpha = w.m[r] == -INFINITY || w.m[r] - mnew < -126.f
                      ? 0.f : bit_cast_float(static_cast<int32_t>(w.m[r] - mnew + 127.f) << 23);
          w.m[r] = mnew;
        }
        const __m512 mv = _mm512_set1_ps(w.m[r]);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t v = 0; v < kPosTile / 16; v += 2) {
          const __m512 e0 = _mm512_maskz_mov_ps(seen[v], exp2_nonpositive16(_mm512_sub_ps(sv[v], mv)));
          const __m512 e1 = _mm512_maskz_mov_ps(seen[v + 1], exp2_nonpositive16(_mm512_sub_ps(sv[v + 1], mv)));
          split16_bf16(e0, prow + 16 * v, kPosTile);
          split16_bf16(e1, prow + 16 * (v + 1), kPosTile);
          sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
        }
        float* lv = w.lv.data() + r * 16;                                // the row's sum, 16 lanes until the end
        _mm512_storeu_ps(lv, _mm512_fmadd_ps(_mm512_loadu_ps(lv), _mm512_set1_ps(alpha), sum));
        w.alpha[r] = alpha;
      }
      // O = O * alpha + P . V (the rows whose maximum rose rescaled first: after a row's first
      // positions, few steps raise it)
      for (int64_t i = 0; i < nr; ++i) {
        if (w.alpha[r0 + i] == 1.f) continue;
        float* o = w.o.data() + (r0 + i) * D;
        const __m512 a = _mm512_set1_ps(w.alpha[r0 + i]);
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), a));
      }
      amx_product<true>(w.pb.data(), 16 * PW, PW * 2, kPosTile, 32, w.vt.data(), 512, DT * 512, kPosTile / 32, nr / 16,
                        DT, w.o.data() + r0 * D, 16 * D, D * 4);
    }
  }
  _tile_release();
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + (r / G) * stride + (r % G) * D;
    const float l = _mm512_reduce_add_ps(_mm512_loadu_ps(w.lv.data() + r * 16));
    const __m512 inv = _mm512_set1_ps(l > 0.f ? 1.f / l : 0.f);
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(w.o.data() + r * D + d), inv));
  }
  return true;
}

}  // namespace hloserve::paged

#endif
