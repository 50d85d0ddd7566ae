"""hloserve.quantization: weight-only int8/int4 schemes, lowered by the emitter."""
