"""The tasks a run can do, one folder each, each holding a `task.py` with one `registry.Task`:
`embed/` (sentence embeddings), `classify/` (a label per row), `score/` (a cross-encoder's score per
pair), `ner/` (a label per token) and `generate/` (a causal LM's answers). The first four share the
encoder pipeline (embed/job.py); generate runs the engine (hpcinfer/engine).

A task folder holds everything that is the task's own: how a row is parsed, its output rows, the
options it honours and those in its resume fingerprint, its report, its Ray replica and cluster
commit, its tuning. What every task shares lives outside: job/, files/, place/, obs/, ray_engine/,
tune/. The registry (hpcinfer/registry.py) names each task once; nothing shared imports this folder.
"""
