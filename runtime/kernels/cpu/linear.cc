// hloserve_layer_linear: a few rows times one layer's 16-bit matrix, read where it lies in the stack
// of all layers; XLA copies the layer out of the stack and then packs (transposes) it for its dot
// kernel, on every call: three passes over the weights where one is needed.
#include "linear.h"

namespace {
using namespace hloserve;

// ---- layer linear ---------------------------------------------------------------------------
// x f32[M, K]; weights [L, N, K] 16-bit floats (holds 1: bf16, 2: f16; any 16-bit storage);
// layer s32[] -> out f32[M, N] = round(x) . weights[layer]^T, products exact, sums in f32
// (the row routines: linear.h).


#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX (Intel Sapphire Rapids and later): a tile multiply does 16 x 16 x 32 bf16 products at
// once, exact, summed in f32 (like vdpbf16ps, denormal inputs and results flushed to zero).
// Computed transposed, out^T [N, M] = W [N, K] . x^T: a tile of the matrix is 16 of its rows,
// 32 elements each, read where they lie (stride K); x is packed once per call in the pair-
// interleaved layout the B operand needs (xp below).

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
  std::vector<uint16_t> xr(M * KP);
  round_rows(xp, M, K, kind, xr.data(), KP);
  const uint16_t* xb = xr.data();
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  // AMX for bf16 matrices whose rows are whole 32-element tiles (the tail of 16-row tiles below)
  const bool amx = kind == Kind::kBF16 && K % 32 == 0 && amx_usable();
  const std::vector<uint16_t> packed = amx ? amx_pack(xb, KP, M, K / 32) : std::vector<uint16_t>();
#endif
  const int64_t tasks = (N + kLinearRows - 1) / kLinearRows;
  parallel_for(pool, tasks, 1, [&](int64_t task) {
    const int64_t n0 = task * kLinearRows, n1 = std::min(N, n0 + kLinearRows);
    int64_t n = n0;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx) {
      const int64_t whole = n0 + (n1 - n0) / 16 * 16;
      if (whole > n0) amx_rows(w, K, packed.data(), K / 32, M, n0, whole, op, N);
      n = whole;
    }
#endif
    rows16(kind, w, K, xb, KP, M, n, n1, op, N);
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
