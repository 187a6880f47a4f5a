"""The generation engine: continuous batching over a paged KV cache.

    scheduler.py, block_manager.py, sequence.py   what runs each step, and where its KV lives (no torch)
    engine.py                                     one step: schedule, stage, run, sample, stop
    runner.py, staging.py, decode_graphs.py       the model's forward, its host inputs, CUDA graphs
    kv_cache.py, attention.py, paged_kernel.py    the paged KV pool and attention over it
    sampling.py, penalties.py, logprobs.py,       the next token of each sequence
    samples.py, stopping.py
    structured.py, schema_bounds.py               grammar-constrained decoding (llguidance)
    engine_stats.py                               what a run's steps did
    hf_engine.py                                  the transformers backend behind the same interface

NOTE: the engine knows nothing of files, jobs, tasks or the command line (a test keeps it so):
the generation task (`tasks/generate/`) feeds it requests and takes its finished sequences.
"""
