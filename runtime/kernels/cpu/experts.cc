// hloserve_grouped_experts: a mixture-of-experts layer's experts, each expert's matrices read once
// for the rows routed to it. The decomposition (a loop over the experts, each taken one multiplying
// every row of the step) computes E/k times the products when a step's tokens reach most experts.
#include "linear.h"

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

// out rows (sorted positions) = xs rows . each expert's matrix [N, K] of `stack` (rows of xs KP apart)
void grouped_product(ffi::ThreadPool& pool, Kind kind, const Groups& g, const uint16_t* stack, int64_t N, int64_t K,
                     const uint16_t* xs, int64_t KP, float* out) {
  const auto tasks = tasks_of(g, N);
  parallel_for(pool, static_cast<int64_t>(tasks.size()), 1, [&](int64_t i) {
    const auto [e, n0] = tasks[i];
    const int64_t s = g.start[e];
    rows16(kind, stack + e * N * K, K, xs + s * KP, KP, g.start[e + 1] - s, n0, std::min(N, n0 + kLinearRows),
           out + s * N, N);
  });
}

ffi::Error GroupedExperts(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> index,
                          ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer gate_up, ffi::AnyBuffer down,
                          ffi::Buffer<ffi::S32> layer, int64_t holds, ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), id = index.dimensions(), wd = weights.dimensions();
  auto gd = gate_up.dimensions(), dd = down.dimensions();
  if (xd.size() != 2 || id.size() != 2 || wd.size() != 2 || gd.size() != 4 || dd.size() != 4 || id[0] != xd[0] ||
      wd[0] != xd[0] || wd[1] != id[1] || gd[3] != xd[1] || gd[2] % 2 || dd[0] != gd[0] || dd[1] != gd[1] ||
      dd[2] != xd[1] || dd[3] != gd[2] / 2)
    return ffi::Error::InvalidArgument("hloserve_grouped_experts: x must be [T, D], index and weights [T, k], "
                                       "gate_up [L, E, 2F, D] and down [L, E, D, F]");
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
  std::vector<uint16_t> xs(P * DP);
  for (int64_t s = 0; s < P; ++s) round_rows(x.typed_data() + (g.pair[s] / k) * D, 1, D, kind, xs.data() + s * DP, DP);
  std::vector<float> h(P * 2 * F);
  grouped_product(pool, kind, g, gu, 2 * F, D, xs.data(), DP, h.data());
  // silu(gate) * up, rounded: the rows of the down product
  std::vector<uint16_t> a(P * FP);
  parallel_for(pool, P, 16, [&](int64_t s) {
    float* row = h.data() + s * 2 * F;
    for (int64_t f = 0; f < F; ++f) row[f] = row[f] / (1.f + std::exp(-row[f])) * row[F + f];
    round_rows(row, 1, F, kind, a.data() + s * FP, FP);
  });
  std::vector<float> y(P * D);
  grouped_product(pool, kind, g, dn, D, F, a.data(), FP, y.data());
  // each token's slots, weighted, added in slot order
  const float* w = weights.typed_data();
  float* o = out->typed_data();
  parallel_for(pool, T, 16, [&](int64_t t) {
    for (int64_t d = 0; d < D; ++d) o[t * D + d] = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      const float wj = w[t * k + j];
      const float* yj = y.data() + g.where[t * k + j] * D;
      for (int64_t d = 0; d < D; ++d) o[t * D + d] += wj * yj[d];
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(hloserve_grouped_experts, GroupedExperts,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("holds")
                                  .Ret<ffi::Buffer<ffi::F32>>());
