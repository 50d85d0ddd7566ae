"""Model zoo: small random-init transformers models, ONE artifact each, three shapes, vs torch eager.

Each row exports a model through `sources.hf_entry` (or, with `from_directory`,
`save_pretrained` + `sources.load_source(dir)`, the HF-directory path) with
dynamic batch and, for text, sequence (waveforms: encoder frames), loads the
artifact with `hloserve.runtime.load`, and compares every shape in `shapes`
against the HF model run eagerly in torch on the same inputs.

Tolerance: f32 atol 1e-4, rtol 0, unless a row says why it differs. Each
reference output must be far above its tolerance (std > 100 * atol), so a
row cannot pass by comparing near-zero tensors.

Models that torch.export itself cannot capture belong in NOT_EXPORTABLE with
the reason. None today: every model tried is in ROWS. What the zoo found and
fixed: GPT-2 failed in core-ATen decomposition until SDPA was kept whole
(capture.py); wav2vec2 needed linalg_vector_norm (weight norm) and a `frames`
dim (torch.export cannot prove stride guards over a free waveform length,
see sources.hf_entry); BEiT needed upsample_bilinear2d.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping

import numpy as np
import pytest
import torch

ATOL = 1e-4  # f32, per the exporter issue
BATCH = (1, 8)  # every row's batch range
SEQ = (1, 64)   # text rows' sequence range (also max_position_embeddings)

# special token ids inside the tiny vocabularies (transformers warns on ids >= vocab_size)
_TOK = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_TEXT = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=SEQ[1], **_TOK)


# -- config factories: () -> (random-init model, config) --------------------
def _bert():
    from transformers import BertConfig, BertModel
    c = BertConfig(**_TEXT)
    return BertModel(c), c


def _distilbert():
    from transformers import DistilBertConfig, DistilBertModel
    c = DistilBertConfig(vocab_size=128, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                         max_position_embeddings=SEQ[1], pad_token_id=0)
    return DistilBertModel(c), c


def _roberta():
    from transformers import RobertaConfig, RobertaModel
    # positions start after padding_idx (1): max_position_embeddings must cover seq + 2
    c = RobertaConfig(**{**_TEXT, "pad_token_id": 1, "bos_token_id": 0, "max_position_embeddings": SEQ[1] + 2})
    return RobertaModel(c), c


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    c = GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ[1], bos_token_id=1, eos_token_id=2)
    return GPT2LMHeadModel(c), c


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    c = LlamaConfig(**_TEXT, num_key_value_heads=2)  # grouped-query attention
    return LlamaForCausalLM(c), c


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM
    c = MistralConfig(**_TEXT, num_key_value_heads=2, sliding_window=None)
    return MistralForCausalLM(c), c


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    c = Qwen2Config(**_TEXT, num_key_value_heads=2)
    return Qwen2ForCausalLM(c), c


def _t5_encoder():
    from transformers import T5Config, T5EncoderModel
    c = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, **_TOK)
    return T5EncoderModel(c), c


def _vit():
    from transformers import ViTConfig, ViTModel
    c = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  image_size=32, patch_size=8)
    return ViTModel(c), c


def _resnet():
    from transformers import ResNetConfig, ResNetForImageClassification
    c = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)
    return ResNetForImageClassification(c), c


def _convnext():
    from transformers import ConvNextConfig, ConvNextForImageClassification
    c = ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10, image_size=32)
    return ConvNextForImageClassification(c), c


def _mobilenet_v2():
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification
    # the default init (std 0.02) shrinks activations to ~1e-26 over 17 conv layers; 0.25 gives logits std ~0.7
    c = MobileNetV2Config(depth_multiplier=0.25, image_size=32, num_labels=10, initializer_range=0.25)
    return MobileNetV2ForImageClassification(c), c


def _whisper_encoder():
    from transformers import WhisperConfig, WhisperModel
    c = WhisperConfig(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, num_mel_bins=16,
                      max_source_positions=32, decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64,
                      vocab_size=128, decoder_start_token_id=1, **_TOK)
    return WhisperModel(c).get_encoder(), c


def _wav2vec2():
    from transformers import Wav2Vec2Config, Wav2Vec2Model
    # conv encoder: receptive field 20 samples, hop 10, so samples = 10 * frames + 10
    c = Wav2Vec2Config(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                       num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)
    return Wav2Vec2Model(c), c


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    # sliding window 16 < seq 33 and 64: local and global layers differ; logit soft-capping on
    c = Gemma2Config(**_TEXT, num_key_value_heads=2, head_dim=8, sliding_window=16)
    return Gemma2ForCausalLM(c), c


def _bloom():
    from transformers import BloomConfig, BloomForCausalLM
    c = BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=4, **_TOK)  # ALiBi positions
    return BloomForCausalLM(c), c


def _deberta_v2():
    from transformers import DebertaV2Config, DebertaV2Model
    c = DebertaV2Config(**_TEXT)  # disentangled relative-position attention (gathers over seq)
    return DebertaV2Model(c), c


def _swin():
    from transformers import SwinConfig, SwinModel
    c = SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4)
    return SwinModel(c), c


def _beit():
    from transformers import BeitConfig, BeitModel
    # relative position bias, resized with bilinear interpolation (upsample_bilinear2d)
    c = BeitConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
                   patch_size=8, use_relative_position_bias=True)
    return BeitModel(c), c


def _ast():
    from transformers import ASTConfig, ASTModel
    c = ASTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, num_mel_bins=16,
                  max_length=32, patch_size=8)
    return ASTModel(c), c


# -- the table ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Row:
    """One model of the zoo.

    Attributes:
      name: test id.
      make: () -> (random-init model, config).
      shapes: per shape, symbol values, e.g. {"batch": 3, "seq": 33}; dims not named
        keep the size of hf_entry's example input (image size, mel bins).
      atol: absolute tolerance (rtol 0); `why` says why when it is not ATOL.
      from_directory: export save_pretrained's directory through load_source (the CLI path).
      slow: mark the row `slow` (more than ~20 s on 2 cores; no row needs it today, the heaviest,
        mobilenet-v2, takes ~10 s CPU).
    """
    name: str
    make: Callable[[], tuple[torch.nn.Module, Any]]
    shapes: tuple[Mapping[str, int], ...]
    atol: float = ATOL
    why: str = ""
    from_directory: bool = False
    slow: bool = False


def _text(*bs):
    return tuple({"batch": b, "seq": s} for b, s in bs)


def _batch(*bs):
    return tuple({"batch": b} for b in bs)


TEXT_SHAPES = _text((1, 7), (3, 33), (8, 64))
ROWS = (
    Row("bert", _bert, TEXT_SHAPES),
    Row("distilbert", _distilbert, TEXT_SHAPES),
    Row("roberta", _roberta, TEXT_SHAPES),
    Row("gpt2", _gpt2, TEXT_SHAPES, from_directory=True),
    Row("llama", _llama, TEXT_SHAPES),
    Row("mistral", _mistral, TEXT_SHAPES),
    Row("qwen2", _qwen2, TEXT_SHAPES),
    Row("t5-encoder", _t5_encoder, TEXT_SHAPES),
    Row("vit", _vit, _batch(1, 3, 8)),
    Row("resnet", _resnet, _batch(1, 3, 8)),
    Row("convnext", _convnext, _batch(1, 3, 8)),
    Row("mobilenet-v2", _mobilenet_v2, _batch(1, 3, 8)),
    Row("whisper-encoder", _whisper_encoder, _batch(1, 3, 8)),
    Row("wav2vec2", _wav2vec2, tuple({"batch": b, "frames": f} for b, f in ((1, 2), (3, 17), (8, 40)))),
    Row("gemma2", _gemma2, TEXT_SHAPES),
    Row("bloom", _bloom, TEXT_SHAPES),
    Row("deberta-v2", _deberta_v2, TEXT_SHAPES),
    Row("swin", _swin, _batch(1, 3, 8)),
    Row("beit", _beit, _batch(1, 3, 8)),
    Row("ast", _ast, _batch(1, 3, 8)),
)
# name -> why torch.export cannot capture it (models tried and left out of ROWS)
NOT_EXPORTABLE: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class Exported:
    """A row's artifact, loaded, beside the eager model and entry point it came from."""
    model: torch.nn.Module        # the eager reference (the exported weights)
    entry: Any                    # hloserve.exporter.export.EntryPoint
    loaded: Any                   # hloserve.runtime.LoadedModel
    manifest: Mapping[str, Any]   # manifest.json as written


def _export(row: Row, out: str) -> Exported:
    import json

    import transformers

    from hloserve import runtime
    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.sources import hf_entry, load_source

    torch.manual_seed(0)
    model, config = row.make()
    model.eval()
    if row.from_directory:
        src_dir = os.path.join(out, "hf")
        model.save_pretrained(src_dir)
        src = load_source(src_dir, llm_step="none")     # the plain forward (a causal LM is otherwise a step)
        entries, meta = src.entries, src.model
        # the reference is what transformers loads from the same directory, not the object we saved
        model = getattr(transformers, meta["architecture"]).from_pretrained(src_dir).eval()
    else:
        entry, meta = hf_entry(model, config, batch=BATCH, seq=SEQ)
        entries = [entry]
    art = os.path.join(out, "art")
    export_artifact(art, entries, source=row.name, model=meta)
    with open(os.path.join(art, "manifest.json")) as f:
        manifest = json.load(f)
    return Exported(model, entries[0], runtime.load(art, cache_dir=None), manifest)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """name -> Exported, each row exported once per module, on first use."""
    done: dict[str, Exported] = {}

    def get(row: Row) -> Exported:
        if row.name not in done:
            done[row.name] = _export(row, str(tmp_path_factory.mktemp(row.name)))
        return done[row.name]
    return get


def _concrete(dim: Any, values: Mapping[str, int]) -> int:
    """A torch.export Dim (root or derived, e.g. 10*frames + 10) at the given symbol values."""
    root = getattr(dim, "root", None)
    return dim.fn(_concrete(root, values)) if root is not None else values[dim.__name__]


def _inputs(entry, config, values: Mapping[str, int], seed: int) -> dict[str, torch.Tensor]:
    """Inputs named as the entry point's, shaped by `values`, with padding in the last row of text batches."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, example, dyn in zip(entry.input_names, entry.args, entry.dynamic_shapes or [None] * len(entry.args)):
        shape = [(_concrete(dyn[d], values) if dyn and d in dyn else n) for d, n in enumerate(example.shape)]
        if name == "input_ids":
            out[name] = torch.randint(3, config.vocab_size, shape, generator=g)
        elif name == "attention_mask":
            mask = torch.ones(shape, dtype=example.dtype)
            if shape[0] > 1:
                mask[-1, (shape[1] + 1) // 2:] = 0  # right padding, as tokenizers pad
            out[name] = mask
        elif name == "token_type_ids":
            out[name] = torch.randint(0, config.type_vocab_size, shape, generator=g)
        else:
            out[name] = torch.randn(shape, generator=g, dtype=example.dtype)
    return out


def _cases():
    for row in ROWS:
        for i, values in enumerate(row.shapes):
            label = "-".join(f"{k[0]}{v}" for k, v in values.items())
            yield pytest.param(row, i, id=f"{row.name}-{label}", marks=_marks(row))


def _marks(row: Row) -> tuple:
    return (pytest.mark.slow,) if row.slow else ()


@pytest.mark.parametrize("row,index", list(_cases()))
def test_matches_eager(zoo, row: Row, index: int):
    ex = zoo(row)
    values = row.shapes[index]
    inputs = _inputs(ex.entry, ex.model.config, values, seed=index)
    with torch.no_grad():
        eager = ex.model(**inputs, return_dict=True)
    got = ex.loaded.functions["forward"](**{k: v.numpy() for k, v in inputs.items()})
    for name in ex.entry.output_names:
        want = eager[name].numpy()
        assert float(want.std()) > 100 * row.atol, f"{row.name}: {name} is too close to 0 for atol {row.atol}"
        out = np.asarray(got[name])
        assert out.shape == want.shape, f"{row.name} {dict(values)}: {name} shape {out.shape} != eager {want.shape}"
        np.testing.assert_allclose(out, want, atol=row.atol, rtol=0, err_msg=f"{row.name} {dict(values)}: {name}")


@pytest.mark.parametrize("row", [pytest.param(r, id=r.name, marks=_marks(r)) for r in ROWS])
def test_one_artifact_with_symbolic_dims(zoo, row: Row):
    """The three shapes above ran on ONE artifact: its inputs are symbolic in every dim the row varies."""
    ex = zoo(row)
    symbols = ex.manifest["symbols"]
    varied = {k for values in row.shapes for k in values}
    assert varied <= set(symbols), f"{row.name}: varied dims {sorted(varied)}, artifact symbols {sorted(symbols)}"
    assert symbols["batch"] == {"min": BATCH[0], "max": BATCH[1]} or row.from_directory
    dims = {d for t in ex.manifest["functions"]["forward"]["inputs"] for d in t["shape"] if isinstance(d, str)}
    for k in varied:
        assert any(k in d for d in dims), f"{row.name}: no input is symbolic in {k!r} ({dims})"


def test_table_is_documented():
    for row in ROWS:
        assert row.atol == ATOL or row.why.strip(), f"{row.name}: say why its tolerance is not {ATOL}"
        assert len(row.shapes) == 3 and len({tuple(v.items()) for v in row.shapes}) == 3, row.name
    for name, why in NOT_EXPORTABLE.items():
        assert why.strip(), f"{name}: give the reason torch.export cannot capture it"
        assert name not in {r.name for r in ROWS}
