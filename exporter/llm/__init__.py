"""Any transformers decoder LLM as hloserve's paged-KV step.

    step.py         the step's calling convention on the export side (StepExportOptions, the contract's
                    entries and spec), the paged cache writes
    hf_causal.py    a Hugging Face causal LM -> the step (from_hf_directory): load, check, scan, export
    hf_layers.py    the modules swapped into the model (16-bit stacks read by the layer_linear composite)
    hf_experts.py   mixtures of experts through transformers' experts interface
    hf_files.py     the tokenizer-side files of a checkpoint (chat template, generation_config.json)
"""
