"""Key smoothing of an int8 KV cache (--kv-cache-dtype int8): per layer and KV head, a shift m and a
per-channel scale s, calibrated at export and stored in the artifact as the weight `kv_smooth`
[L, 2, KV, head_dim] (m, then s, in the Hadamard-rotated space the cache holds K in, step.kv_rotation).

The cache stores k' = (k - m) / s and each query is multiplied by s, so scores change only by a
constant per query: q s . (k - m) / s = q . k - q . m, the same for every key a query sees, which
the softmax removes exactly. Without m a row's range covers the keys' shared offset; without s the
channels whose keys vary most set every row's scale. s = sqrt(rms(k - m) / rms(q)) per channel
(SmoothQuant's migration strength 0.5) balances the key error per channel against the query weight
it meets, and is normalised to a mean of 1 per head. V is not smoothed (measured: no gain).

Measured on SmolLM2-135M-Instruct's served path (tests/server/test_kv_cache_int8.py), mean |log-prob
difference| against a bf16 cache: docs/quantization.md, "Quantized KV cache".

The calibration text is the Gettysburg Address (public domain), tokenized by the model's own
tokenizer and run once, eagerly, through the step with a 16-bit cache; the first token (an
attention sink, whose key is unlike the others) is left out of the statistics.
"""
from __future__ import annotations

import logging
import os
from typing import Callable

import torch
from hloserve.runtime.artifact.llm import pack_step

from .step import kv_rotation

log = logging.getLogger(__name__)

KV_SMOOTH = "kv_smooth"     # the step's input (a weight of the artifact) and the model's buffer

CALIBRATION_TEXT = (
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in "
    "Liberty, and dedicated to the proposition that all men are created equal. Now we are engaged in a great "
    "civil war, testing whether that nation, or any nation so conceived and so dedicated, can long endure. We "
    "are met on a great battle-field of that war. We have come to dedicate a portion of that field, as a final "
    "resting place for those who here gave their lives that that nation might live. It is altogether fitting "
    "and proper that we should do this. But, in a larger sense, we can not dedicate -- we can not consecrate -- "
    "we can not hallow -- this ground. The brave men, living and dead, who struggled here, have consecrated it, "
    "far above our poor power to add or detract. The world will little note, nor long remember what we say "
    "here, but it can never forget what they did here. It is for us the living, rather, to be dedicated here to "
    "the unfinished work which they who fought here have thus far so nobly advanced. It is rather for us to be "
    "here dedicated to the great task remaining before us -- that from these honored dead we take increased "
    "devotion to that cause for which they gave the last full measure of devotion -- that we here highly "
    "resolve that these dead shall not have died in vain -- that this nation, under God, shall have a new birth "
    "of freedom -- and that government of the people, by the people, for the people, shall not perish from the "
    "earth.")


def smooth_keys(q: torch.Tensor, k: torch.Tensor, smooth: torch.Tensor | None,
                layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated q [T, H, D] and k [T, KV, D] -> (q s, (k - m) / s) with layer `layer`'s (m, s) of
    `smooth` [L, 2, KV, D]; unchanged when `smooth` is None (other caches, older exports)."""
    if smooth is None:
        return q, k
    T, H, D = q.shape
    KV = k.shape[1]
    ms = torch.index_select(smooth, 0, layer.reshape(1).to(torch.int64))[0]    # [2, KV, D]
    m, s = ms[0], ms[1]
    q = (q.reshape(T, KV, H // KV, D) * s[None, :, None, :]).reshape(T, H, D)
    return q, (k - m[None]) / s[None]


def statistics(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """One layer's (m, s) [2, KV, D] from its rotated queries [T, H, D] and keys [T, KV, D] (token 0
    left out: the attention sink)."""
    T, H, D = q.shape
    KV = k.shape[1]
    k, q = k[1:].double(), q[1:].double().reshape(T - 1, KV, H // KV, D)
    m = k.mean(0)                                                         # [KV, D]
    k_rms = (k - m).square().mean(0).sqrt()                               # [KV, D]
    q_rms = q.square().mean((0, 2)).sqrt()                                # [KV, D]
    tiny = torch.finfo(torch.float32).tiny
    s = (k_rms.clamp(min=tiny) / q_rms.clamp(min=tiny)).sqrt()
    s = s / s.mean(-1, keepdim=True)
    return torch.stack([m, s]).float()


def calibration_ids(path: str, vocab_size: int) -> list[int]:
    """CALIBRATION_TEXT tokenized by the model's tokenizer (its directory's tokenizer.json); where the
    directory has none, the text's bytes modulo `vocab_size` (any token sequence shows the keys' shared
    offset and spread; the model's own tokens show them as served text does)."""
    tok = os.path.join(path, "tokenizer.json")
    if os.path.exists(tok):
        import tokenizers
        return tokenizers.Tokenizer.from_file(tok).encode(CALIBRATION_TEXT).ids
    log.info("int8 KV cache: %s has no tokenizer.json; the key smoothing is calibrated on the text's bytes", path)
    return [b % vocab_size for b in CALIBRATION_TEXT.encode()]


def calibrate(run_step: Callable[..., object], ids: list[int], *, num_layers: int, num_kv_heads: int,
              head_dim: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """`kv_smooth` [L, 2, KV, D] from one eager prefill of `ids` (two tokens or more) through
    `run_step(**inputs, kv_cache=..., observe=...)` (HFStep.run, its cache in the model's dtype), each
    layer's queries and keys observed after RoPE and rotated as the int8 cache's are."""
    L, KV, D = num_layers, num_kv_heads, head_dim
    smooth = torch.empty(L, 2, KV, D)
    rot = kv_rotation(torch.int8, D)
    nb = -(-len(ids) // block_size)
    inputs = {n: torch.from_numpy(a) for n, a in
              pack_step([(ids, 0, list(range(1, nb + 1)))], block_size).items()}
    seen = set()

    def observe(layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        smooth[layer] = statistics(q.float() @ rot, k.float() @ rot)
        seen.add(layer)

    cache = torch.zeros(L, 2, KV, nb + 1, block_size, D, dtype=dtype)
    with torch.no_grad():
        run_step(**inputs, kv_cache=cache, observe=observe)
    if seen != set(range(L)):
        raise RuntimeError(f"key smoothing's calibration saw layers {sorted(seen)} of {L}")
    return smooth
