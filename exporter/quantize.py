"""`--quantize` applied to a Source: quantization's module swap on each entry point's module.

An LLM step quantizes at load instead (exporter/llm/hf_causal.py from_hf_directory: load -> quantize ->
scan -> its LLMSpec), so its layers are swapped while they are still a list and scanned once."""
from __future__ import annotations

from hloserve.quantization.convert import QuantRequest
from hloserve.quantization.schemes import QuantizationError

from .llm.hf_causal import HFStep


def quantize_source(source, request: QuantRequest):
    """Quantize a Source's modules in place (entries sharing a model quantize it once); an LLM step's
    model must have been quantized at load with the same request.

    Returns the source, with source.weight_quant set to the request's record and
    source.model["quantization"] describing the config.
    """
    done: set[int] = set()
    for e in source.entries:
        if e.module is None:
            raise QuantizationError(f"entry {e.name!r} is a pre-captured program (.pt2); --quantize needs the "
                                    f"model's modules: export from a HF directory, GGUF or module:factory")
        if isinstance(e.module, HFStep):
            if source.weight_quant is not request.record:
                raise QuantizationError(f"entry {e.name!r} is an LLM step, which quantizes at load: pass "
                                        f"quantize=QuantRequest(config) to from_hf_directory")
        elif id(e.module) not in done:
            request.apply(e.module)
            done.add(id(e.module))
    if not len(request.record):
        raise QuantizationError(f"--quantize {request.config.spec}: no Linear or Embedding weight was quantized "
                                f"(skip patterns {list(request.config.skip)} matched all, or the model has none)")
    source.weight_quant = request.record
    source.model["quantization"] = request.config.to_json()
    return source
