"""Tensor parallelism: a Llama-family decoder split Megatron-style across the ranks of a process group."""
