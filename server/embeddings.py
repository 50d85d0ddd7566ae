"""Sentence embeddings from an encoder artifact, as its sentence-transformers configuration says.

The artifact's `model["pooling"]` (1_Pooling/config.json of the checkpoint, plus `normalize` from its
modules.json and `max_seq_length` from sentence_bert_config.json) picks the pooling: mean over the
attention mask, CLS token, max, or mean scaled by sqrt(length); then L2 normalization when the
checkpoint has a Normalize module. Texts are tokenized with the artifact's tokenizer (its TextSpec's),
truncated to max_seq_length, padded to the request's longest, and run through the predict batcher.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np
from hloserve.runtime.artifact.manifest import Manifest
from hloserve.runtime.artifact.text import TextSpec

MODES = ("pooling_mode_mean_tokens", "pooling_mode_cls_token", "pooling_mode_max_tokens",
         "pooling_mode_mean_sqrt_len_tokens")


@dataclasses.dataclass(frozen=True)
class Embedder:
    tokenizer: Any                  # tokenizers.Tokenizer
    mode: str                       # one of MODES
    normalize: bool
    max_seq_length: int
    function: str                   # the artifact function returning last_hidden_state
    input_names: tuple[str, ...]

    @classmethod
    def from_artifact(cls, artifact_dir: str, manifest: Manifest) -> "Embedder | None":
        """The embedder an artifact supports, or None (no pooling config or no tokenizer)."""
        import tokenizers
        pooling = manifest.model.get("pooling")
        if not isinstance(pooling, Mapping):
            return None
        tok_path = TextSpec.of(manifest, artifact_dir).tokenizer_path(artifact_dir)
        if tok_path is None:
            return None
        modes = [m for m in MODES if pooling.get(m)]
        fn = next((f for f in manifest.functions.values()
                   if any(t.name == "last_hidden_state" for t in f.outputs)), None)
        if len(modes) != 1 or fn is None:
            return None
        seq_max = next((manifest.symbols[d].max for t in fn.inputs for d in t.shape[1:2]
                        if isinstance(d, str) and d in manifest.symbols), None) or 512
        max_len = min(int(pooling.get("max_seq_length", seq_max)), seq_max)
        tok = tokenizers.Tokenizer.from_file(tok_path)
        tok.no_padding()                        # tokenizer.json may pad every text to a fixed length
        tok.enable_truncation(max_len)
        return cls(tok, modes[0], bool(pooling.get("normalize", False)), max_len, fn.name,
                   tuple(t.name for t in fn.inputs))

    def encode(self, inputs: Sequence[str] | Sequence[Sequence[int]]) -> tuple[dict[str, np.ndarray], int]:
        """Padded model inputs for the texts (or token-id lists) and the number of tokens used;
        ValueError for a token id outside the vocabulary."""
        rows = [list(x) if not isinstance(x, str) else self.tokenizer.encode(x).ids for x in inputs]
        vocab = self.tokenizer.get_vocab_size()
        bad = next((t for r in rows for t in r if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        rows = [r[:self.max_seq_length] for r in rows]
        width = max(len(r) for r in rows)
        ids = np.zeros((len(rows), width), np.int32)
        mask = np.zeros((len(rows), width), np.int32)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = r
            mask[i, :len(r)] = 1
        arrays = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        return {n: arrays[n] for n in self.input_names}, int(mask.sum())

    def pool(self, hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """[batch, seq, dim] hidden states -> [batch, dim] embeddings."""
        h = np.asarray(hidden, np.float32)
        m = mask[..., None].astype(np.float32)
        if self.mode == "pooling_mode_cls_token":
            out = h[:, 0]
        elif self.mode == "pooling_mode_max_tokens":
            out = np.where(m > 0, h, -np.inf).max(axis=1)
        else:
            total, count = (h * m).sum(axis=1), np.maximum(m.sum(axis=1), 1e-9)
            out = total / (np.sqrt(count) if self.mode == "pooling_mode_mean_sqrt_len_tokens" else count)
        if self.normalize:
            out = out / np.maximum(np.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
        return out
