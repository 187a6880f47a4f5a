"""LLM generation: continuous batching over a paged KV cache (scheduler, block manager, runner, sampling)."""
