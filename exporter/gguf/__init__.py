"""GGUF files (llama.cpp's format) as a source: read in place, as a Hugging Face-style checkpoint.

    checkpoint.py   load_gguf: metadata, tensor infos and tokenizer -> GGUFCheckpoint (config, tensors,
                    tokenizer.json, chat template); hf_config, write_hf_directory
    tensor.py       GGUFTensor: one tensor's stored blocks, their fields and exact dequantization
    quant.py        a file's own blocks as hloserve's quantized layout (no float round trip)
    tokenizer.py    a GGUF vocabulary -> a `tokenizers` tokenizer.json; chat-template rendering
"""
