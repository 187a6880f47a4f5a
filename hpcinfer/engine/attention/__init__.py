"""Attention over the paged KV cache: the torch path (paged.py), the Triton kernel
(triton_kernel.py), and which one a run uses (choice.py)."""
