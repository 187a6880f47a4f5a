"""The generation engine: continuous batching over a paged KV cache.

    scheduler.py, sequence.py, kvcache/block_manager.py, kvcache/windowed_blocks.py
                                                  what runs each step, and where its KV lives (no torch)
    engine.py                                     one step: schedule, stage, run, sample, stop
    runner.py, step_rows.py, staging.py,          the model's forward, its host inputs, CUDA graphs
    decode_graphs.py
    kvcache/pools.py, attention/                  the paged KV pool and attention over it
    sample/                                       the next token of each sequence, n samples, stops
    constrained/                                  grammar-constrained decoding (llguidance)
    engine_stats.py                               what a run's steps did
    hf_engine.py                                  the transformers backend behind the same interface

NOTE: the engine knows nothing of files, jobs, tasks or the command line (a test keeps it so):
the generation task (`tasks/generate/`) feeds it requests and takes its finished sequences.
"""
