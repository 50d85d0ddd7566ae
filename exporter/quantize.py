"""`--quantize` applied to a Source: quantization's module swap, on an LLM step's real layers."""
from __future__ import annotations

from hloserve.quantization.convert import QuantRecord, quantize_module
from hloserve.quantization.schemes import QuantConfig, QuantizationError

from .llm.hf_causal import HFStep, quantize_layers, tensor_parallel_dims


def quantize_source(source, config: QuantConfig):
    """Quantize a Source's modules in place (entries sharing a model quantize it once), taking the
    weights it already holds quantized (Source.quantized_weights) as they are.

    Returns the source, with source.weight_quant set to the record and
    source.model["quantization"] describing the config.
    """
    record = QuantRecord()
    done: set[int] = set()
    for e in source.entries:
        if e.module is None:
            raise QuantizationError(f"entry {e.name!r} is a pre-captured program (.pt2); --quantize needs the "
                                    f"model's modules: export from a HF directory, GGUF or module:factory")
        if isinstance(e.module, HFStep):
            if id(e.module.model) not in done:
                quantize_layers(e.module.model, e.module.opts, config, record, source.quantized_weights)
                tp = (source.model.get("llm") or {}).get("tensor_parallel")
                if tp:      # the split the loader named was of the unquantized weights: the scales too now
                    tp["weights"] = tensor_parallel_dims(e.module.model)
            done.add(id(e.module.model))
        elif id(e.module) not in done:
            quantize_module(e.module, config, record)
            done.add(id(e.module))
    if not len(record):
        raise QuantizationError(f"--quantize {config.spec}: no Linear or Embedding weight was quantized "
                                f"(skip patterns {list(config.skip)} matched all, or the model has none)")
    source.weight_quant = record
    source.model["quantization"] = config.to_json()
    return source

