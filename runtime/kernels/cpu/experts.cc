// hloserve_grouped_experts (16-bit matrices) and hloserve_quant_experts (int8 / int4): a
// mixture-of-experts layer's experts, each expert's matrices read once for the rows routed to it.
// The decomposition (a loop over the experts, each taken one multiplying every row of the step)
// computes E/k times the products when a step's tokens reach most experts.
#include "linear.h"
#include "quant_rows.h"

namespace {
using namespace hloserve;

// ---- grouped experts ------------------------------------------------------------------------
// x f32[T, D]; index s32[T, k], weights f32[T, k]; gate_up [L, E, 2F, D] and down [L, E, D, F]
// 16-bit floats (holds 1: bf16, 2: f16; any 16-bit storage); layer s32[] -> out f32[T, D]:
//   out[t] = sum_j weights[t, j] * down_e . r(silu(g) * u),  [g; u] = gate_up_e . r(x[t]),  e = index[t, j]
// where r rounds to the weights' type; products exact, sums in f32.
//
// The T k (token, slot) pairs are sorted by expert (a counting sort, stable); an expert's pairs are
// then consecutive rows of one product with its matrix, split over the threads by 64 matrix rows
// (tasks of every expert in one pool pass: gate_up, the activation, then down).

struct Groups {
  std::vector<int64_t> start;  // [E + 1]: expert e's pairs are sorted positions [start[e], start[e + 1])
  std::vector<int64_t> pair;   // [T k]: the pair (t k + j) at each sorted position
  std::vector<int64_t> where;  // [T k]: the sorted position of each pair
};

// false when an expert id is outside [0, E)
bool group(const int32_t* index, int64_t pairs, int64_t E, Groups& g) {
  g.start.assign(E + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    if (index[p] < 0 || index[p] >= E) return false;
    ++g.start[index[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) g.start[e + 1] += g.start[e];
  std::vector<int64_t> next(g.start.begin(), g.start.end() - 1);
  g.pair.resize(pairs);
  g.where.resize(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t s = next[index[p]]++;
    g.pair[s] = p;
    g.where[p] = s;
  }
  return true;
}

// (expert, first matrix row) of every task: 64 rows of an expert's matrix of N rows, for each expert
// with pairs
std::vector<std::pair<int64_t, int64_t>> tasks_of(const Groups& g, int64_t N) {
  std::vector<std::pair<int64_t, int64_t>> tasks;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(g.start.size()); ++e)
    if (g.start[e + 1] > g.start[e])
      for (int64_t n = 0; n < N; n += kLinearRows) tasks.emplace_back(e, n);
  return tasks;
}

// out[t] = sum over t's slots j, in slot order, of weights[t, j] * y[the sorted position of pair (t, j)]
void combine(ffi::ThreadPool& pool, const Groups& g, const float* w, int64_t T, int64_t k, int64_t D, const float* y,
             float* o) {
  parallel_for(pool, T, 16, [&](int64_t t) {
    for (int64_t d = 0; d < D; ++d) o[t * D + d] = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      const float wj = w[t * k + j];
      const float* yj = y + g.where[t * k + j] * D;
      for (int64_t d = 0; d < D; ++d) o[t * D + d] += wj * yj[d];
    }
  });
}

// xs [T k, D] = each (token, slot) pair's token row of x [T, D], in sorted order (the f32 rows the
// tile and quantized products take)
inline void sorted_rows(const Groups& g, const float* x, int64_t k, int64_t D, float* xs) {
  for (size_t s = 0; s < g.pair.size(); ++s) std::memcpy(xs + s * D, x + (g.pair[s] / k) * D, D * 4);
}

// a[f] = silu(h[f]) * h[F + f] for one row h [2F] ([gate; up]); a may be h. The logistic from
// e = exp(-|h|) <= 1 (common.h's exp_nonpositive, vectorized: std::exp was a call per element, 3.4%
// of a mixture-of-experts step's samples): 1 / (1 + e) for h >= 0, e / (1 + e) below.
inline void gated(const float* h, int64_t F, float* a) {
#pragma omp simd
  for (int64_t f = 0; f < F; ++f) {
    const float x = h[f], e = exp_nonpositive(-std::fabs(x));
    a[f] = x * ((x >= 0.f ? 1.f : e) / (1.f + e)) * h[F + f];
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// An expert with this many rows or more multiplies them on AMX tiles (linear.cc's routines, its rows
// packed once into 16-row blocks); fewer stay with the row routines, whose one-row path streams the
// matrix at the read rate. A prompt chunk routes tens of rows to each expert: on the row routines
// its experts ran at ~30 GFLOP/s (qwen3-moe-style shape, 256-token chunk, docs/performance.md).
constexpr int64_t kAmxExpertRows = 16;

// the experts' products with kAmxExpertRows rows or more on AMX (bf16 matrices, N whole tiles);
// false where it does not apply (the row routines then do them all)
bool grouped_product_amx(ffi::ThreadPool& pool, Kind kind, const Groups& g, const uint16_t* stack, int64_t N,
                         int64_t K, const uint16_t* xs, int64_t KP, float* out, std::vector<char>& done) {
  if (kind != Kind::kBF16 || N % 16 != 0 || !amx_usable()) return false;
  const int64_t E = static_cast<int64_t>(g.start.size()) - 1, KC = KP / 32;
  std::vector<int64_t> first(E + 1, 0);                            // each expert's first packed block
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = g.start[e + 1] - g.start[e];
    first[e + 1] = first[e] + (rows >= kAmxExpertRows ? (rows + 15) / 16 : 0);
  }
  if (first[E] == 0) return false;
  LineVector<uint16_t> packed(first[E] * 16 * KP);
  parallel_for(pool, first[E], 1, [&](int64_t b) {                // one 16-row block of an expert's rows
    const int64_t e = std::upper_bound(first.begin(), first.end(), b) - first.begin() - 1;
    const int64_t r0 = g.start[e] + 16 * (b - first[e]), rows = std::min<int64_t>(16, g.start[e + 1] - r0);
    const uint16_t* x = xs + r0 * KP;                                // a whole block: packed where it lies
    if (rows < 16) {                                                 // the expert's last block: zeros past its rows
      thread_local std::vector<uint16_t> rowbuf;
      rowbuf.resize(16 * KP);
      std::memcpy(rowbuf.data(), x, rows * KP * 2);
      std::fill(rowbuf.begin() + rows * KP, rowbuf.end(), uint16_t(0));
      x = rowbuf.data();
    }
    linear_amx_pack(x, KP, 1, KC, packed.data() + b * 16 * KP);
  });
  for (int64_t e = 0; e < E; ++e) done[e] = first[e + 1] > first[e];
  auto tasks = tasks_of(g, N);                                       // those of the experts packed above
  tasks.erase(std::remove_if(tasks.begin(), tasks.end(), [&](const auto& t) { return !done[t.first]; }), tasks.end());
  parallel_for(pool, static_cast<int64_t>(tasks.size()), 1, [&](int64_t i) {
    const auto [e, n0] = tasks[i];
    const int64_t s = g.start[e], tiles = (std::min(N, n0 + kLinearRows) - n0) / 16;
    linear_amx_rows(stack + e * N * K, K, packed.data() + first[e] * 16 * KP, KC, g.start[e + 1] - s, n0, tiles,
                    out + s * N, N);
  });
  return true;
}
#endif

// out rows (sorted positions) = xs rows . each expert's matrix [N, K] of `stack` (rows of xs KP apart)
void grouped_product(ffi::ThreadPool& pool, Kind kind, const Groups& g, const uint16_t* stack, int64_t N, int64_t K,
                     const uint16_t* xs, int64_t KP, float* out) {
  std::vector<char> done(g.start.size(), 0);                       // experts already multiplied (AMX)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  grouped_product_amx(pool, kind, g, stack, N, K, xs, KP, out, done);
#endif
  auto tasks = tasks_of(g, N);
  tasks.erase(std::remove_if(tasks.begin(), tasks.end(), [&](const auto& t) { return done[t.first] != 0; }), tasks.end());
  parallel_for(pool, static_cast<int64_t>(tasks.size()), 1, [&](int64_t i) {
    const auto [e, n0] = tasks[i];
    const int64_t s = g.start[e];
    rows16(kind, stack + e * N * K, K, xs + s * KP, KP, g.start[e + 1] - s, n0, std::min(N, n0 + kLinearRows),
           out + s * N, N);
  });
}

// the 16-bit handlers' operand shapes: x [T, D], index and weights [T, k], gate_up [L, E, 2F, D] and
// down [L, E, D, F]
constexpr const char* kRoutedShapes =
    "x must be [T, D], index and weights [T, k], gate_up [L, E, 2F, D] and down [L, E, D, F]";

template <class Dims>
bool routed_shapes(const Dims& xd, const Dims& id, const Dims& wd, const Dims& gd, const Dims& dd) {
  return xd.size() == 2 && id.size() == 2 && wd.size() == 2 && gd.size() == 4 && dd.size() == 4 && id[0] == xd[0] &&
         wd[0] == xd[0] && wd[1] == id[1] && gd[3] == xd[1] && gd[2] % 2 == 0 && dd[0] == gd[0] && dd[1] == gd[1] &&
         dd[2] == xd[1] && dd[3] == gd[2] / 2;
}

ffi::Error GroupedExperts(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> index,
                          ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer gate_up, ffi::AnyBuffer down,
                          ffi::Buffer<ffi::S32> layer, int64_t holds, ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), id = index.dimensions(), wd = weights.dimensions();
  auto gd = gate_up.dimensions(), dd = down.dimensions();
  if (!routed_shapes(xd, id, wd, gd, dd))
    return ffi::Error::InvalidArgument(std::string("hloserve_grouped_experts: ") + kRoutedShapes);
  if (!valid_kind(holds) || static_cast<Kind>(holds) == Kind::kF32)
    return ffi::Error::InvalidArgument("hloserve_grouped_experts: holds must be 1 (bf16) or 2 (f16)");
  const Kind kind = static_cast<Kind>(holds);
  const int64_t T = xd[0], D = xd[1], k = id[1], L = gd[0], E = gd[1], F = gd[2] / 2, P = T * k;
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("hloserve_grouped_experts: layer out of range");
  Groups g;
  if (!group(index.typed_data(), P, E, g))
    return ffi::Error::InvalidArgument("hloserve_grouped_experts: an expert index is outside [0, E)");
  const uint16_t* gu = static_cast<const uint16_t*>(gate_up.untyped_data()) + l * E * 2 * F * D;
  const uint16_t* dn = static_cast<const uint16_t*>(down.untyped_data()) + l * E * D * F;
  // each pair's token row, rounded, in sorted order
  const int64_t DP = (D + 31) / 32 * 32, FP = (F + 31) / 32 * 32;
  Scratch<uint16_t> xs(P * DP);
  for (int64_t s = 0; s < P; ++s) round_rows(x.typed_data() + (g.pair[s] / k) * D, 1, D, kind, xs.data() + s * DP, DP);
  Scratch<float> h(P * 2 * F);
  grouped_product(pool, kind, g, gu, 2 * F, D, xs.data(), DP, h.data());
  // silu(gate) * up, rounded: the rows of the down product
  Scratch<uint16_t> a(P * FP);
  parallel_for(pool, P, 16, [&](int64_t s) {
    float* row = h.data() + s * 2 * F;
    gated(row, F, row);
    round_rows(row, 1, F, kind, a.data() + s * FP, FP);
  });
  Scratch<float> y(P * D);
  grouped_product(pool, kind, g, dn, D, F, a.data(), FP, y.data());
  combine(pool, g, weights.typed_data(), T, k, D, y.data(), out->typed_data());
  return ffi::Error::Success();
}

// ---- grouped experts, the stacks laid out as B tiles ------------------------------------------
// hloserve_grouped_experts_tiles: grouped_experts' operands, attribute and result, for bf16 stacks the
// runtime laid out once at load as the tile multiply's B operand (runtime/kernels/cpu/layouts.py:
// each expert's matrix [N, K] as layer_linear_tiles reads a layer; N a multiple of 16, K of 32).
// Every expert with rows multiplies them through linear.h's B-tile product at any row count, the
// build's as layer_linear_tiles runs it: AMX tiles (b_tiles_product), else AVX512-BF16's outer
// products (b_tiles_pairs), else AVX2's widened to f32 (b_tiles_avx2), else b_tiles_portable; its
// rows packed once per call in 16-row blocks as that product reads them, each matrix tile read as it
// lies, the sums stored as rows. grouped_experts instead copies an expert's matrix into tiles per call
// above 64 rows (AMX only), transposes the sums, and leaves the other experts to the row routines. The
// products are exact and the sums f32 either way (in another order than the row routines': the
// decomposition's bound holds).

// What a matrix tile costs, in rows of products: a tile is read from memory whatever its rows, which
// a decode step's 1-4 rows an expert do not hide; a prompt chunk's tens of rows are bound by the
// products. The experts' tiles are cut into kSharesPerThread pieces of equal cost a thread, handed
// out in turn (ExpertShares), so a pool thread that wakes late takes fewer; 4 and 16 a thread measured
// alike (the mixture-of-experts shape's 1- and 2-token steps, 2026-12-03).
constexpr int64_t kTileReadRows = 16;
constexpr int64_t kSharesPerThread = 4;

// run(share, shares, product) calls product(expert, first tile, end tile) for the tiles of piece
// `share` of `shares`: every expert's N / 16 tiles in order, a tile of expert e costing its rows +
// kTileReadRows, cut into contiguous pieces of equal cost (a tile goes to the piece its cost starts
// in), each cut inside an expert moved up to a multiple of group(its rows), the tiles the product
// runs side by side (no piece leaves a remainder to slower groups of fewer tiles)
struct ExpertShares {
  const Groups& g;
  int64_t tiles;                 // N / 16
  int64_t (*group)(int64_t);     // rows -> tiles side by side
  std::vector<int64_t> cost;     // [E + 1]: the cost of the experts before e

  ExpertShares(const Groups& groups, int64_t N, int64_t (*tiles_side_by_side)(int64_t))
      : g(groups), tiles(N / 16), group(tiles_side_by_side), cost(groups.start.size(), 0) {
    for (size_t e = 0; e + 1 < g.start.size(); ++e) {
      const int64_t rows = g.start[e + 1] - g.start[e];
      cost[e + 1] = cost[e] + (rows > 0 ? (rows + kTileReadRows) * tiles : 0);
    }
  }
  int64_t pieces(int64_t threads) const { return std::min(kSharesPerThread * std::max<int64_t>(1, threads), cost.back()); }

  template <class Product>
  void run(int64_t share, int64_t shares, Product&& product) const {
    const int64_t lo = cost.back() * share / shares, hi = cost.back() * (share + 1) / shares;
    for (size_t e = 0; e + 1 < g.start.size(); ++e) {
      if (cost[e + 1] <= lo || cost[e] >= hi) continue;          // no rows, or outside the piece
      const int64_t rows = g.start[e + 1] - g.start[e], per = rows + kTileReadRows, u = group(rows);
      auto cut = [&](int64_t at) {                                // the first tile whose cost starts at or past `at`
        const int64_t t = (std::max<int64_t>(at - cost[e], 0) + per - 1) / per;
        return std::min(tiles, (t + u - 1) / u * u);
      };
      const int64_t t0 = cut(lo), t1 = cut(hi);
      if (t1 > t0) product(static_cast<int64_t>(e), t0, t1);
    }
  }
};

// Blocks a thread packs at once: packing a block takes about a microsecond, waking a pool thread
// tens, so a decode step's few blocks are packed where the call runs (with 4: the mixture-of-experts
// shape's 2-token step 1.05x the row routines', 2026-12-03)
constexpr int64_t kPackGrain = 32;

// Each expert's sorted rows of xs [P, K] packed by `pack(x, rows, K, block)` into blocks of 16 rows,
// `elems` elements a block, every element written; first[e] is expert e's first block
template <class T, class Pack>
LineScratch<T> packed_blocks(ffi::ThreadPool& pool, const Groups& g, const float* xs, int64_t K, int64_t elems,
                             std::vector<int64_t>& first, Pack&& pack) {
  const int64_t E = static_cast<int64_t>(g.start.size()) - 1;
  first.assign(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) first[e + 1] = first[e] + (g.start[e + 1] - g.start[e] + 15) / 16;
  LineScratch<T> blocks(first[E] * elems);
  parallel_for(pool, first[E], kPackGrain, [&](int64_t b) {
    const int64_t e = std::upper_bound(first.begin(), first.end(), b) - first.begin() - 1;
    const int64_t r0 = g.start[e] + 16 * (b - first[e]);
    pack(xs + r0 * K, std::min<int64_t>(16, g.start[e + 1] - r0), K, blocks.data() + b * elems);
  });
  return blocks;
}

// out rows (sorted positions) = xs rows [P, K] f32 . each expert's matrix [N, K] of `stack` (B tiles):
// the rows packed as `pack` lays them out (`elems` a block), then the pieces of the experts' tiles
// (ExpertShares, `group` tiles side by side) through product(expert's packed rows, rows, matrix,
// first tile, end tile, out rows) on the pool's threads, begin() and end() around each thread's turn
template <class T, class Pack, class Product, class Begin, class End>
void tile_pieces(ffi::ThreadPool& pool, const Groups& g, const uint16_t* stack, int64_t N, int64_t K, const float* xs,
                 float* out, int64_t elems, int64_t (*group)(int64_t), Pack&& pack, Product&& product, Begin&& begin,
                 End&& end) {
  const ExpertShares work(g, N, group);
  const int64_t pieces = work.pieces(pool.num_threads());
  if (pieces == 0) return;
  std::vector<int64_t> first;
  const auto xb = packed_blocks<T>(pool, g, xs, K, elems, first, pack);
  std::atomic<int64_t> next{0};
  parallel_for(pool, std::min<int64_t>(pieces, std::max<int64_t>(1, pool.num_threads())), 1, [&](int64_t) {
    begin();
    for (int64_t piece; (piece = next.fetch_add(1)) < pieces;)
      work.run(piece, pieces, [&](int64_t e, int64_t t0, int64_t t1) {
        const int64_t s = g.start[e];
        product(xb.data() + first[e] * elems, g.start[e + 1] - s, stack + e * N * K, t0, t1, out + s * N);
      });
    end();
  });
}

[[maybe_unused]] int64_t one_tile(int64_t) { return 1; }

// out rows (sorted positions) = xs rows [P, K] f32 . each expert's matrix [N, K] of `stack` (B tiles)
void grouped_tiles(ffi::ThreadPool& pool, const Groups& g, const uint16_t* stack, int64_t N, int64_t K,
                   const float* xs, float* out) {
  [[maybe_unused]] const int64_t KC = K / 32;
  auto nothing = [] {};
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx_usable()) {
    tile_pieces<uint16_t>(pool, g, stack, N, K, xs, out, KC * 512, one_tile, round_tiles,
        [&](const uint16_t* xt, int64_t M, const uint16_t* wb, int64_t t0, int64_t t1, float* o) {
          b_tiles_product(xt, M, KC, wb, t0, t1, o, N);
        },
        [] { amx_configure_16x64(); }, [] { _tile_release(); });
    return;
  }
#endif
#if defined(__AVX512BF16__)
  tile_pieces<int32_t>(pool, g, stack, N, K, xs, out, KC * 256, b_tiles_pairs_group, pack_pairs,
      [&](const int32_t* xp, int64_t M, const uint16_t* wb, int64_t t0, int64_t t1, float* o) {
        b_tiles_pairs(xp, M, KC, wb, t0, t1, o, N);
      },
      nothing, nothing);
#elif defined(__AVX2__) && defined(__FMA__)
  tile_pieces<float>(pool, g, stack, N, K, xs, out, KC * 512, b_tiles_avx2_group, pack_pairs_f32,
      [&](const float* xp, int64_t M, const uint16_t* wb, int64_t t0, int64_t t1, float* o) {
        b_tiles_avx2(xp, M, KC, wb, t0, t1, o, N);
      },
      nothing, nothing);
#else
  // b_tiles_portable rounds x's rows itself: the rows go as they are (a "block" of 16 rows, K apart)
  tile_pieces<float>(pool, g, stack, N, K, xs, out, 16 * K, one_tile,
      [&](const float* x, int64_t rows, int64_t, float* block) { std::memcpy(block, x, rows * K * 4); },
      [&](const float* x, int64_t M, const uint16_t* wb, int64_t t0, int64_t t1, float* o) {
        b_tiles_portable(x, M, K, wb, t0, t1, o, N);
      },
      nothing, nothing);
#endif
}

ffi::Error GroupedExpertsTiles(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> index,
                               ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer gate_up, ffi::AnyBuffer down,
                               ffi::Buffer<ffi::S32> layer, int64_t holds, ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), id = index.dimensions(), wd = weights.dimensions();
  auto gd = gate_up.dimensions(), dd = down.dimensions();
  if (!routed_shapes(xd, id, wd, gd, dd))
    return ffi::Error::InvalidArgument(std::string("hloserve_grouped_experts_tiles: ") + kRoutedShapes);
  const int64_t T = xd[0], D = xd[1], k = id[1], L = gd[0], E = gd[1], F = gd[2] / 2, P = T * k;
  if (holds != static_cast<int64_t>(Kind::kBF16) || D % 32 != 0 || F % 32 != 0)
    return ffi::Error::InvalidArgument("hloserve_grouped_experts_tiles: the stacks must hold bf16 (holds 1), D and F "
                                       "multiples of 32 (the runtime lays out no other stacks as tiles)");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("hloserve_grouped_experts_tiles: layer out of range");
  Groups g;
  if (!group(index.typed_data(), P, E, g))
    return ffi::Error::InvalidArgument("hloserve_grouped_experts_tiles: an expert index is outside [0, E)");
  const uint16_t* gu = static_cast<const uint16_t*>(gate_up.untyped_data()) + l * E * 2 * F * D;
  const uint16_t* dn = static_cast<const uint16_t*>(down.untyped_data()) + l * E * D * F;
  Scratch<float> xs(P * D);
  sorted_rows(g, x.typed_data(), k, D, xs.data());
  Scratch<float> h(P * 2 * F), a(P * F), y(P * D);
  grouped_tiles(pool, g, gu, 2 * F, D, xs.data(), h.data());
  parallel_for(pool, P, 16, [&](int64_t s) { gated(h.data() + s * 2 * F, F, a.data() + s * F); });
  grouped_tiles(pool, g, dn, D, F, a.data(), y.data());
  combine(pool, g, weights.typed_data(), T, k, D, y.data(), out->typed_data());
  return ffi::Error::Success();
}

// ---- quantized experts -----------------------------------------------------------------------
// The same layer with int8 / int4 stacks (quantization/schemes.py, row by row): gate_up qweight
// [L, E, 2F, D | D/2] and scales (mins) [L, E, 2F, D / group], down [L, E, D, F | F/2] and
// [L, E, D, F / group]. Each product is quant_linear's version 1 (quant_rows.h): the rows routed to
// an expert quantized per 32-element block as Q8_0, exact integer block sums, scaled in f32; the
// activation silu(g) * u is computed in f32 and quantized the same way for down.

// One stack of expert matrices: expert (l, e)'s QuantMatrix is `w` moved by (l E + e) matrices
struct QuantStack {
  QuantMatrix w;      // expert (0, 0)
  int64_t E = 0;
  int64_t qbytes = 0, sbytes = 0;   // bytes per matrix of qweight, of scale (and min)

  QuantMatrix expert(int64_t l, int64_t e) const {
    QuantMatrix m = w;
    const int64_t i = l * E + e;
    m.q += i * qbytes;
    m.scale = static_cast<const char*>(w.scale) + i * sbytes;
    if (m.min != nullptr) m.min = static_cast<const char*>(w.min) + i * sbytes;
    return m;
  }
};

// a stack [L, E, N, K | K/2] with scales (mins) [L, E, N, K / group], checked; false (and `why`) when not
bool read_stack(ffi::AnyBuffer& q, ffi::AnyBuffer& scale, ffi::AnyBuffer& min, int64_t bits, int64_t group, int64_t L,
                int64_t E, int64_t N, int64_t K, QuantStack& st, std::string& why) {
  auto qd = q.dimensions(), sd = scale.dimensions();
  const int64_t qrow = bits == 8 ? K : K / 2;
  const ffi::DataType want = bits == 8 ? ffi::DataType::S8 : ffi::DataType::U8;
  if (group <= 0 || group % kXBlock || K % group) return why = "group must be a multiple of 32 dividing the rows", false;
  const int64_t G = K / group;
  if (qd.size() != 4 || q.element_type() != want || qd[0] != L || qd[1] != E || qd[2] != N || qd[3] != qrow)
    return why = "qweight must be s8 [L, E, N, K] (bits 8) or u8 [L, E, N, K/2] (bits 4)", false;
  const bool f16 = scale.element_type() == ffi::DataType::F16;
  if ((!f16 && scale.element_type() != ffi::DataType::F32) || sd.size() != 4 || sd[0] != L || sd[1] != E ||
      sd[2] != N || sd[3] != G)
    return why = "scales must be f16 or f32 [L, E, N, K / group]", false;
  const bool asym = min.element_count() != 0;
  if (asym && (bits == 8 || min.element_type() != scale.element_type() || min.element_count() != scale.element_count()))
    return why = "mins must have the scales' dtype and shape (int4 only), or no elements", false;
  st.w = QuantMatrix{static_cast<const uint8_t*>(q.untyped_data()), scale.untyped_data(),
                     asym ? min.untyped_data() : nullptr, f16, static_cast<int>(bits), N, K, G, group};
  st.E = E;
  st.qbytes = N * qrow;
  st.sbytes = N * G * (f16 ? 2 : 4);
  return true;
}

// out rows (sorted positions) = xs rows [., K] . each expert's matrix of stack `st` at layer l: each
// expert's rows quantized once, then tasks of 64 matrix rows of every expert in one pool pass
void quant_grouped(ffi::ThreadPool& pool, const Groups& g, const QuantStack& st, int64_t l, const float* xs,
                   float* out) {
  const int64_t E = static_cast<int64_t>(g.start.size()) - 1, N = st.w.N, K = st.w.K;
  std::vector<QuantizedX> xq(E);
  parallel_for(pool, E, 1, [&](int64_t e) {
    const int64_t s = g.start[e];
    if (g.start[e + 1] > s) xq[e] = quantize_for(xs + s * K, g.start[e + 1] - s, st.expert(l, e));
  });
  const auto tasks = tasks_of(g, N);
  parallel_for(pool, static_cast<int64_t>(tasks.size()), 1, [&](int64_t i) {
    const auto [e, n0] = tasks[i];
    const int64_t s = g.start[e];
    quant_rows(st.expert(l, e), xq[e], g.start[e + 1] - s, n0, std::min(N, n0 + kLinearRows), out + s * N);
  });
}

ffi::Error QuantExperts(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> index,
                        ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer gate_up, ffi::AnyBuffer gate_up_scale,
                        ffi::AnyBuffer gate_up_min, ffi::AnyBuffer down, ffi::AnyBuffer down_scale,
                        ffi::AnyBuffer down_min, ffi::Buffer<ffi::S32> layer, int64_t bits, int64_t gate_up_group,
                        int64_t down_group, ffi::ResultBuffer<ffi::F32> out) {
  auto fail = [](const std::string& why) { return ffi::Error::InvalidArgument("hloserve_quant_experts: " + why); };
  auto xd = x.dimensions(), id = index.dimensions(), wd = weights.dimensions();
  auto gd = gate_up.dimensions(), dd = down.dimensions();
  if (xd.size() != 2 || id.size() != 2 || wd.size() != 2 || gd.size() != 4 || dd.size() != 4 || id[0] != xd[0] ||
      wd[0] != xd[0] || wd[1] != id[1] || gd[2] % 2)
    return fail("x must be [T, D], index and weights [T, k], gate_up [L, E, 2F, .] and down [L, E, D, .]");
  if (bits != 8 && bits != 4) return fail("bits must be 8 or 4");
  const int64_t T = xd[0], D = xd[1], k = id[1], L = gd[0], E = gd[1], F = gd[2] / 2, P = T * k;
  QuantStack gu, dn;
  std::string why;
  if (!read_stack(gate_up, gate_up_scale, gate_up_min, bits, gate_up_group, L, E, 2 * F, D, gu, why))
    return fail("gate_up: " + why);
  if (!read_stack(down, down_scale, down_min, bits, down_group, L, E, D, F, dn, why)) return fail("down: " + why);
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return fail("layer out of range");
  Groups g;
  if (!group(index.typed_data(), P, E, g)) return fail("an expert index is outside [0, E)");
  std::vector<float> xs(P * D);
  sorted_rows(g, x.typed_data(), k, D, xs.data());
  std::vector<float> h(P * 2 * F), a(P * F), y(P * D);
  quant_grouped(pool, g, gu, l, xs.data(), h.data());
  parallel_for(pool, P, 16, [&](int64_t s) { gated(h.data() + s * 2 * F, F, a.data() + s * F); });
  quant_grouped(pool, g, dn, l, a.data(), y.data());
  combine(pool, g, weights.typed_data(), T, k, D, y.data(), out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

// x, index, weights: what both handlers take first
static auto RoutedRows() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::F32>>();
}

// gate_up, down, layer; holds: both 16-bit handlers
static auto GroupedStacks() {
  return RoutedRows()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Attr<int64_t>("holds")
      .Ret<ffi::Buffer<ffi::F32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(hloserve_grouped_experts, GroupedExperts, GroupedStacks());
XLA_FFI_DEFINE_HANDLER_SYMBOL(hloserve_grouped_experts_tiles, GroupedExpertsTiles, GroupedStacks());

// gate_up, its scales, its mins, down, its scales, its mins, layer; bits and the two groups
XLA_FFI_DEFINE_HANDLER_SYMBOL(hloserve_quant_experts, QuantExperts,
                              RoutedRows()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("gate_up_group")
                                  .Attr<int64_t>("down_group")
                                  .Ret<ffi::Buffer<ffi::F32>>());
