"""The GPU check's Python steps and what they share; benchmarks/gpu_check.sh runs them."""
