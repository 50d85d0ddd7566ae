// hloserve_paged_attention (v1) and hloserve_paged_attention_v2: attention of each token over its own
// sequence's paged context, read block by block straight from the KV cache (16-bit float bits, f32,
// or int8 / fp8 e4m3 rows with a scale (and zero point) each, dequantized as they are read), only the blocks in use; XLA gathers every sequence's padded context, widened to f32, before
// its dots. Version 2 takes the window as an operand (composite version 2).
#include "paged_attention.h"

namespace {
using namespace hloserve;
using namespace hloserve::paged;

// ---- paged attention ----------------------------------------------------------------------
// q f32[T, KV, G, D]; cache [L, 2, KV, N, BS, R] (R = D, or D + 2 / D + 3 for int8 rows, D + 2 for fp8); layer s32[]; block_tables s32[S, B];
// seq_ids, positions s32[T]; context_lens s32[S] -> out f32[T, KV, G, D].
// Token t sees positions c of its sequence with c <= positions[t], c < context_len and, with a
// window w > 0, c > positions[t] - w; scores are scale * q.k, then softcap * tanh(s / softcap)
// when softcap > 0. A token that sees nothing (padding) gets zeros.

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer cache,
                          ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> block_tables,
                          ffi::Buffer<ffi::S32> seq_ids, ffi::Buffer<ffi::S32> positions,
                          ffi::Buffer<ffi::S32> context_lens, int64_t window, int64_t holds, float scale,
                          float softcap, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto cd = cache.dimensions();
  auto bd = block_tables.dimensions();
  if (qd.size() != 4 || cd.size() != 6 || bd.size() != 2)
    return ffi::Error::InvalidArgument("hloserve_paged_attention: q must be [T,KV,G,D], cache [L,2,KV,N,BS,R]");
  // holds: the cache's own dtype (f32), bf16 / f16 bits (in an s16/u16 buffer), or int8 / fp8 rows (s8)
  if (holds < 0 || holds > static_cast<int64_t>(Kind::kF8E4M3Rows))
    return ffi::Error::InvalidArgument("hloserve_paged_attention: holds must be 0, 1, 2, 3, 4 or 5");
  const Kind kind = static_cast<Kind>(holds);
  int64_t extra = 0;  // elements per cache row past D
  bool rows8 = false;  // 8-bit rows with a scale (s8 storage)
  with_kind(kind, [&](auto k) {
    extra = row_extra<decltype(k)::value>;
    rows8 = scaled_rows<decltype(k)::value>;
  });
  if ((kind == Kind::kF32) != (cache.element_type() == ffi::F32) || rows8 != (cache.element_type() == ffi::S8))
    return ffi::Error::InvalidArgument("hloserve_paged_attention: cache dtype does not match `holds`");
  const int64_t T = qd[0], KV = qd[1], G = qd[2], D = qd[3];
  const int64_t L = cd[0], N = cd[3], BS = cd[4];
  const int64_t R = D + extra;  // elements per cache row
  const int64_t S = bd[0], B = bd[1];
  if (cd[1] != 2 || cd[2] != KV || cd[5] != R)
    return ffi::Error::InvalidArgument("hloserve_paged_attention: cache shape does not match q");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("hloserve_paged_attention: layer out of range");
  const void* cdata = cache.untyped_data();
  const float* qp = q.typed_data();
  float* op = out->typed_data();
  const int32_t* tables = block_tables.typed_data();
  const int32_t* seqs = seq_ids.typed_data();
  const int32_t* pos = positions.typed_data();
  const int32_t* lens = context_lens.typed_data();
  const int64_t head_stride = N * BS * R;  // one (layer, K|V, kv head) plane

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
  // work items: (tile, kv head); a tile is up to chunk_tile_tokens consecutive tokens of one sequence,
  // and never one token of a longer run: a lone token takes `attend`, whose sums run in another order
  // than a tile's, so a prompt token split off a chunk's tail (33 = 32 + 1) would get other bits than
  // in a chunk split otherwise. A run of n >= 2 tokens is cut into tiles of the full size, the last
  // two sharing what is left when that would leave one alone (a token's bits in a tile do not depend
  // on the tile's other tokens).
  const int64_t tile_tokens = chunk_tile_tokens(kind, D, softcap);
  std::vector<int64_t> starts;
  for (int64_t a = 0, b; a < T; a = b) {
    for (b = a + 1; b < T && seqs[b] == seqs[a]; ++b) {}
    for (int64_t t = a; t < b; t += tile_tokens) {
      starts.push_back(t);
      if (b - t == tile_tokens + 1) {              // a full tile would leave one token: share the rest
        starts.push_back(t + (tile_tokens + 1) / 2);
        break;
      }
    }
  }
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
