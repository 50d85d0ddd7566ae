"""Mixture-of-experts GGUF files (llama.cpp's qwen3moe and qwen2moe; exporter/gguf/experts.py, quant.py
stored_experts): loaded as transformers' Qwen3-MoE / Qwen2-MoE, and under `--quantize gguf` their
experts' blocks kept in the `hloserve.quant_experts` composite (F16 stacks: the grouped 16-bit composite).

The files: a tiny random Qwen3MoeForCausalLM (2 layers, hidden 64, 8 experts of 32, top 2; the
Qwen2-MoE one the same with a shared expert of 64 and unnormalized top-2 weights) written
as llama.cpp's converter lays it out (tests/exporter/test_gguf.py _write_gguf: gguf-py's tensor
names, ggml dims [in, out, E] for the expert stacks), its linears, embedding and head Q8_0, its
experts in the type a test names (gguf.quants.quantize), router and norms F32 as llama.cpp keeps
them. References: transformers' own GGUF loader (which reads qwen3moe but does not map
expert_feed_forward_length, so the test passes moe_intermediate_size), the gguf package's
dequantization, and the same quantized model's torch eager forward.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hloserve.exporter.gguf import quant as gguf_quant
from hloserve.exporter.gguf.checkpoint import load_gguf
from hloserve.quantization import modules as qmodules
from hloserve.quantization.schemes import QuantConfig, WeightScheme

from .test_gguf import _write_gguf

E, TOP, MOE_FF, SHARED_FF = 8, 2, 32, 64
# the dense matrices stored Q8_0 (kept exactly under --quantize gguf); router and norms stay F32
_DENSE_Q8 = ("proj.weight", "embed_tokens.weight", "lm_head.weight")


def _hf(arch: str = "qwen3moe"):
    import transformers
    torch.manual_seed(0)
    common = dict(vocab_size=258, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=E, num_experts_per_tok=TOP, moe_intermediate_size=MOE_FF,
                  max_position_embeddings=256, tie_word_embeddings=False, rope_theta=10000.0)
    if arch == "qwen2moe":
        cfg = transformers.Qwen2MoeConfig(**common, shared_expert_intermediate_size=SHARED_FF, norm_topk_prob=False)
        return transformers.Qwen2MoeForCausalLM(cfg).eval()
    if arch == "mixtral":
        del common["num_experts"], common["moe_intermediate_size"]
        cfg = transformers.MixtralConfig(**{**common, "intermediate_size": MOE_FF}, num_local_experts=E)
        return transformers.MixtralForCausalLM(cfg).eval()
    cfg = transformers.Qwen3MoeConfig(**common, head_dim=16, norm_topk_prob=True)
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


def _gguf_state(model) -> dict[str, np.ndarray]:
    """The model's weights under the names llama.cpp's tensor map knows: each layer's fused
    gate_up_proj [E, 2I, H] split into its gate and up stacks, the stacks named NAME.weight; a shared
    expert's gate a vector [H], as llama.cpp writes it."""
    state = {}
    for k, v in model.state_dict().items():
        v = v.detach().numpy()
        if k.endswith("experts.gate_up_proj"):
            base = k[:-len("gate_up_proj")]
            state[base + "gate_proj.weight"], state[base + "up_proj.weight"] = v[:, :MOE_FF], v[:, MOE_FF:]
        elif k.endswith("shared_expert_gate.weight"):
            state[k] = v[0]
        else:
            state[k + (".weight" if k.endswith("experts.down_proj") else "")] = v
    return state


def _moe_metadata(gating: int = 1, shared: bool = False):
    import gguf

    def add(w):
        if shared:
            w.add_expert_shared_feed_forward_length(SHARED_FF)
        w.add_expert_count(E)
        w.add_expert_used_count(TOP)
        w.add_expert_feed_forward_length(MOE_FF)
        if gating != 1:
            w.add_expert_gating_func(gguf.ExpertGatingFuncType(gating))
    return add


def write_moe_gguf(path: str, model, experts: str, *, gating: int = 1) -> str:
    """`model` as a qwen3moe (qwen2moe, Mixtral's llama) GGUF: the expert stacks of ggml type `experts`,
    dense matrices Q8_0 (F32 with F32 experts: every tensor the model's values)."""
    import gguf
    state = _gguf_state(model)
    raw = {}
    for name, v in state.items():
        kind = experts if ".experts." in name or experts == "F32" else "Q8_0" if name.endswith(_DENSE_Q8) else None
        if kind not in (None, "F32"):
            raw[name] = (gguf.quants.quantize(v, gguf.GGMLQuantizationType[kind]), kind)
    arch = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama"}[model.config.model_type]
    _write_gguf(path, arch, model.config, state, raw=raw, extra=_moe_metadata(gating, arch == "qwen2moe"))
    return path


@pytest.fixture(scope="module")
def hf():
    return _hf()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(kind, arch) -> the arch's model written with its experts in that ggml type (on first use)."""
    folder = tmp_path_factory.mktemp("moe-gguf")
    made: dict[tuple[str, str], str] = {}

    def get(kind: str, arch: str = "qwen3moe") -> str:
        if (kind, arch) not in made:
            made[kind, arch] = write_moe_gguf(str(folder / f"tiny-{arch}-{kind}.gguf"), _hf(arch), kind)
        return made[kind, arch]
    return get


def _transformers_gguf(path: str):
    """transformers' own GGUF loader on the file (moe_intermediate_size and shared_expert_intermediate_size
    given: it does not read them). It has no Mixtral: there, transformers' MixtralForCausalLM with the
    file's values as our reader dequantizes them (compared with the original weights in
    test_mixtral_file_is_the_llama_layout_with_experts)."""
    import transformers
    if "mixtral" in os.path.basename(path):
        ref = _hf("mixtral")
        ref.load_state_dict(load_gguf(path).materialize(reporter=_quiet()))
        return ref
    shared = {"shared_expert_intermediate_size": SHARED_FF} if "qwen2moe" in os.path.basename(path) else {}
    return transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                             moe_intermediate_size=MOE_FF, **shared).eval()


def _quiet():
    from hloserve.runtime.progress import QUIET
    return QUIET


def test_mixtral_file_is_the_llama_layout_with_experts(files):
    """A "llama" file with routers (llama.cpp's Mixtral): MixtralForCausalLM's config (num_local_experts,
    experts sized by intermediate_size), and with F32 tensors every weight the original model's
    exactly (q/k rows un-permuted, gate and up joined)."""
    path = files("F32", "mixtral")
    ckpt = load_gguf(path)
    c = ckpt.config
    assert (c["model_type"], c["architectures"]) == ("mixtral", ["MixtralForCausalLM"])
    assert (c["num_local_experts"], c["num_experts_per_tok"], c["intermediate_size"]) == (E, TOP, MOE_FF)
    ours = ckpt.materialize(reporter=_quiet())
    want = _hf("mixtral").state_dict()
    assert set(ours) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_config_and_weights_are_transformers_gguf_loaders(files, arch):
    """The experts metadata becomes Qwen3-MoE's (Qwen2-MoE's) config; the router, the expert stacks
    (ggml dims reversed, gate and up joined as gate_up_proj) and Qwen2-MoE's shared expert and its
    gate (a vector in the file, a row in transformers) equal transformers' GGUF loader's weights exactly."""
    from hloserve.runtime.progress import QUIET
    path = files("Q4_1", arch)
    ckpt = load_gguf(path)
    c = ckpt.config
    qwen3 = arch == "qwen3moe"
    want = ("qwen3_moe", ["Qwen3MoeForCausalLM"]) if qwen3 else ("qwen2_moe", ["Qwen2MoeForCausalLM"])
    assert (c["model_type"], c["architectures"]) == want
    assert (c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]) == (E, TOP, MOE_FF)
    assert c["norm_topk_prob"] is qwen3 and c["mlp_only_layers"] == [] and c["head_dim"] == 16
    assert c.get("shared_expert_intermediate_size") == (None if qwen3 else SHARED_FF)
    gate = ckpt.tensors["model.layers.1.mlp.experts.gate_proj"]
    assert (gate.gguf_name, gate.ggml_type, gate.shape) == ("blk.1.ffn_gate_exps.weight", "Q4_1", (E, MOE_FF, 64))
    assert ckpt.tensors["model.layers.1.mlp.experts.down_proj"].shape == (E, 64, MOE_FF)
    assert ckpt.tensors["model.layers.1.mlp.gate.weight"].ggml_type == "F32"
    if not qwen3:
        assert ckpt.tensors["model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, 64)
    ours = ckpt.materialize(reporter=QUIET)
    theirs = _transformers_gguf(path).state_dict()
    assert set(ours) == set(theirs) == set(_hf(arch).state_dict())
    for name, want in theirs.items():
        torch.testing.assert_close(ours[name], want.float(), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("kind,scheme", [
    ("Q8_0", WeightScheme(8, 32, True, "f16")), ("Q5_0", WeightScheme(8, 32, True, "f16")),
    ("Q4_0", WeightScheme(4, 32, True, "f16")), ("Q4_1", WeightScheme(4, 32, False, "f16"))])
def test_expert_blocks_are_kept_bit_exact(files, hf, kind, scheme):
    """stored_experts: every layer's gate_up and down stacks in the block type's scheme, their values
    (dequantized as the quant_experts composite does) the gguf package's dequantization bit for bit."""
    ckpt = load_gguf(files(kind))
    given = gguf_quant.stored_experts(hf, ckpt, QuantConfig.parse("gguf"))
    assert sorted(given) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for name, stacks in given.items():
        want = {"gate_up_proj": np.concatenate([ckpt.tensors[f"{name}.gate_proj"].dequantize(),
                                                ckpt.tensors[f"{name}.up_proj"].dequantize()], axis=1),
                "down_proj": ckpt.tensors[f"{name}.down_proj"].dequantize()}
        for attr, (stored, got_scheme) in stacks.items():
            assert got_scheme == scheme, (attr, got_scheme)
            got = qmodules.dequantize(stored["qweight"], stored["scale"], stored.get("min"), scheme.bits, 32).numpy()
            np.testing.assert_array_equal(got.view(np.uint32), want[attr].view(np.uint32), err_msg=f"{name}.{attr}")


def test_sixteen_bit_and_other_expert_types(files, hf):
    """F16 / BF16 stacks stay 16-bit (their dtype: the grouped composite); a type without a direct
    import (Q5_1) is requantized in --quantize gguf's scheme for other types (int8 g32) from its
    dequantized values, as a dense role of that type is (quant.py _converted)."""
    config = QuantConfig.parse("gguf")
    assert set(gguf_quant.stored_experts(hf, load_gguf(files("F16")), config).values()) == {torch.float16}
    assert set(gguf_quant.stored_experts(hf, load_gguf(files("BF16")), config).values()) == {torch.bfloat16}
    ckpt = load_gguf(files("Q5_1"))
    for name, stacks in gguf_quant.stored_experts(hf, ckpt, config).items():
        stored, scheme = stacks["down_proj"]
        assert scheme == WeightScheme(8, 32, True, "f16")
        want = ckpt.tensors[f"{name}.down_proj"].dequantize()
        got = qmodules.dequantize(stored["qweight"], stored["scale"], None, 8, 32).numpy()
        assert np.abs(got - want).max() <= np.abs(want).max() / 127, name     # half a step of the largest group's


def test_unsupported_routing_is_one_line(hf, tmp_path):
    """A file whose experts transformers' Qwen3-MoE would route otherwise (a sigmoid gate) is refused
    in one line naming the key and the fix."""
    from hloserve.exporter.errors import SourceError
    path = write_moe_gguf(str(tmp_path / "sigmoid.gguf"), hf, "Q8_0", gating=2)
    with pytest.raises(SourceError, match=r"qwen3moe.expert_gating_func = 2; .*softmax") as err:
        load_gguf(path)
    assert "\n" not in str(err.value)


# -- exported ------------------------------------------------------------------------------------------
def _export(path: str, out: str, quantize: str | None = "gguf"):
    """`--quantize gguf` (or another) export, decode only, and the artifact loaded for compare steps."""
    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.sources import load_source
    from hloserve.runtime import load

    src = load_source(path, quantize=quantize)
    export_artifact(out, [e for e in src.entries if e.name == "decode"], source=os.path.basename(path), model=src.model,
                    files=src.files, weight_quant=src.weight_quant)
    mlir = open(os.path.join(out, "functions", "decode.mlir")).read()
    return load(out, buckets={"num_tokens": [1, 8, 64], "num_seqs": [1, 8], "max_blocks": [8]}), mlir


def _eager(ref, ckpt, dtype=None):
    """`ref` quantized as --quantize gguf stores the file (the dense matrices' and the experts' own
    blocks), run eagerly: the torch references of the quant_linear and experts composites."""
    from hloserve.exporter.llm import hf_experts
    from hloserve.quantization.convert import QuantRecord, quantize_module

    eager = copy.deepcopy(ref)
    config = QuantConfig.parse("gguf")
    hf_experts.use_ours(eager)
    quantize_module(eager, config, given=gguf_quant.stored_by_module(eager, ckpt, config))
    hf_experts.quantize_experts(eager, config, QuantRecord(), gguf_quant.stored_experts(eager, ckpt, config))
    return eager


@pytest.mark.slow
@pytest.mark.parametrize("kind,arch", [("Q4_1", "qwen3moe"), ("F16", "qwen3moe"), ("Q4_0", "qwen2moe"),
                                       ("Q8_0", "mixtral")])
def test_exported_experts_keep_the_files_format(files, tmp_path, kind, arch):
    """The file exported with --quantize gguf: Q4_1 (Q4_0) experts one quant_experts composite (int4
    g32 asym (sym), as `hloserve inspect` names them), F16 experts one grouped composite holding their
    f16 values (Qwen2-MoE: its shared expert a dense MLP beside them, Q8_0 kept as int8 g32).
    Decode's last-token logits of 1-, 17- and 40-token prompts within 4e-3 of the same stored model's
    torch eager forward (the composites' torch references over transformers' Qwen3-MoE, the dense
    linears as quant_linear version 6 computes them in the prompts' 64-row step: summation order
    aside, which can flip a bf16 rounding of an activation, 2^-8 of it, where 2e-3 held with int8 blocks
    alone; a wrong expert, scale or row moves them by O(0.1), the logits being O(0.2))."""
    from .test_hf_experts import _last_logits
    path = files(kind, arch)
    out = str(tmp_path / "art")
    model, mlir = _export(path, out)
    quant, grouped = (mlir.count(f'stablehlo.composite "hloserve.{c}"') for c in ("quant_experts", "grouped_experts"))
    assert (quant, grouped) == ((0, 1) if kind == "F16" else (1, 0)), (quant, grouped)
    shown = subprocess.run([sys.executable, "-m", "hloserve.server.cli", "inspect", out], capture_output=True,
                           text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr[-2000:]
    experts = [ln for ln in shown.stdout.splitlines() if "mlp__experts__" in ln]
    if kind != "F16":
        fmt = {"Q4_1": ": int4 g32 asym", "Q4_0": ": int4 g32", "Q8_0": ": int8 g32"}[kind]
        assert len(experts) == 2 and all(ln.endswith(fmt) for ln in experts), experts
    else:
        assert experts == [], experts                                   # 16-bit stacks: not quantized weights
    path_ckpt = load_gguf(path)
    from hloserve.quantization.modules import as_step_of
    from tests.support.quant_contract import step_rows
    with as_step_of(step_rows(64)):   # the prompts' step is the 64-token bucket: version 6's chunks (bf16, or
        #                               version 2's product where this CPU's kernels raise bf16_rows)
        got, eager = _last_logits(model, _eager(_transformers_gguf(path), path_ckpt))
    np.testing.assert_allclose(got, eager, atol=4e-3, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "mixtral"])
def test_dequantized_export_is_transformers_gguf_loader(files, tmp_path, arch):
    """Without --quantize the file's values load as float32 (the experts through the per-expert loop):
    decode's last-token logits within 1e-4 of transformers' GGUF loader on the same file (f32 both:
    summation order only; logits O(0.2), a wrong expert or routing weight moves them by O(0.01) or
    more), and the same greedy tokens."""
    from .test_hf_experts import _last_logits
    path = files("Q4_1", arch)
    model, mlir = _export(path, str(tmp_path / "art"), None)
    assert "hloserve.quant_experts" not in mlir and "hloserve.grouped_experts" not in mlir
    got, want = _last_logits(model, _transformers_gguf(path))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).all()
