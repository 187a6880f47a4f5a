"""Benchmarks, agreement checks and the GPU check; each script runs by its path (see docs/performance)."""
