"""compressed-tensors checkpoints (what llm-compressor writes) as a source: their quantized weights kept.

    config.py       quantization_config -> Plan (each config group's WeightArgs); one-line refusals of
                    what hloserve cannot keep as it is (fp8, nvfp4, sparsity, g_idx, static activations, ...)
    checkpoint.py   open_checkpoint: the directory's tensors; the quantized modules' integers and scales
                    in hloserve's stored layout (no float round trip), the rest as a float state dict

exporter/sources.py exports such a directory through the generic LLM step (exporter/llm/hf_causal.py),
the module swap taking each quantized module's stored tensors (QuantRequest.stored).
"""
