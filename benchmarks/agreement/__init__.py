"""Agreement checks: hpcinfer's answers on a real model against a reference (GGUF: transformers; FP8: bfloat16)."""
