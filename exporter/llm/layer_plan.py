"""How a decoder's layers run: which consecutive layers are scanned, and by what period.

Layers with equal static signatures (exporter/llm/hf_layers.py: module types, attributes, tensor
shapes and dtypes) can share one traced body. A model whose layers all match is one scan of period
1; one whose layers alternate (Gemma's sliding and global layers, where the window cannot be
data) one scan of a period of several layers. A quantized file can mix the layers' formats in a
pattern of its own along the list: llama.cpp's Q4_K_M gives the FFN down matrices of the first
and last eighth of the layers and of every third layer between more bits (Q6_K, the others
Q4_K), so no period short of the whole list fits, and one scan of that period unrolls the
whole pattern: every layer traced, compiled and passed as its own weight arguments (SmolLM2: 30
bodies, 509 weight arguments a call). `layer_plan` splits the list into consecutive segments of
their own periods instead where that traces fewer bodies.
"""
from __future__ import annotations

import dataclasses


def period_of(signatures: list) -> int:
    """The smallest p such that layer i has layer (i mod p)'s signature for every i."""
    L = len(signatures)
    for p in range(1, L + 1):
        if all(signatures[i] == signatures[i % p] for i in range(L)):
            return p
    return L


@dataclasses.dataclass(frozen=True)
class Segment:
    """Layers start .. start + period * iterations - 1 as one scan: `period` layer bodies, each
    iteration the next `period` layers."""
    start: int
    period: int
    iterations: int

    @property
    def stop(self) -> int:
        return self.start + self.period * self.iterations


def layer_plan(signatures: list) -> list[Segment]:
    """How the layers run: the scanned segments, in order (a layer in none of them runs unrolled).

    The cost of a plan is the layer bodies it traces (a segment's period, one per unrolled
    layer): each is compiled, and each passes its own weight arguments to every call. One
    segment of the smallest period with the last L % period layers unrolled (period_of) is kept
    unless consecutive segments of their own periods (of two iterations or more) cost less,
    fewest segments among those that cost least: SmolLM2's Q4_K_M file, whose FFN down matrices
    are Q6_K in layers 0-2, 5, 8, ..., 23 and 26-29 and Q4_K in the others, is three segments of
    periods 1, 3 and 1 (5 bodies), not one of period 27 and 3 layers unrolled (30 bodies)."""
    L = len(signatures)
    distinct: list = []
    kind = [distinct.index(s) if s in distinct else distinct.append(s) or len(distinct) - 1 for s in signatures]
    p = period_of(signatures)
    # reach[j][q]: the end of the longest run of layers from j in which layer k is layer k - q's kind
    reach = [[0] * (L + 1) for _ in range(L)]
    for j in range(L):
        for q in range(1, L - j + 1):
            k = j + q
            while k < L and kind[k] == kind[k - q]:
                k += 1
            reach[j][q] = k
    # best[i]: (bodies, segments, plan) for the first i layers
    best: list[tuple[int, int, list[Segment]]] = [(0, 0, [])]
    for i in range(1, L + 1):
        cost, n, plan = best[i - 1]
        choice = (cost + 1, n, plan)                                 # layer i - 1 unrolled
        for j in range(i - 1):
            for q in range(1, (i - j) // 2 + 1):
                if (i - j) % q == 0 and reach[j][q] >= i and (best[j][0] + q, best[j][1] + 1) < choice[:2]:
                    choice = (best[j][0] + q, best[j][1] + 1, [*best[j][2], Segment(j, q, (i - j) // q)])
        best.append(choice)
    if best[L][0] < p + L % p:
        return best[L][2]
    return [Segment(0, p, L // p)]


def describe(segments: list[Segment], num_layers: int) -> str:
    """A plan in words (the manifest's `model.llm.layers`)."""
    unrolled = num_layers - sum(g.period * g.iterations for g in segments)
    if len(segments) == 1:
        tail = f", {unrolled} unrolled after it" if unrolled else ""
        return "scan" if segments[0].period == 1 else f"scan (a period of {segments[0].period} layers{tail})"
    parts = [f"layers {g.start}-{g.stop - 1} by {g.period}" for g in segments]
    return f"scan ({len(segments)} segments: {', '.join(parts)}{f', {unrolled} unrolled' if unrolled else ''})"
