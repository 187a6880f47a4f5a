"""Observing a run: progress, per-stage timing, traces, latency, NVTX ranges, the report's JSON and tables."""
