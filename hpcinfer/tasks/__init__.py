"""The tasks a run can do, one folder each, each holding a `task.py` with one `registry.Task`; the
registry (hpcinfer/registry.py) names each once, and the docs list them from it.

A task folder holds what is the task's own: how a row is parsed, its output rows, the options it
honours and those in its resume fingerprint, its report, its Ray replica and cluster commit, its
tuning. What tasks share lives outside: the encoder pipeline (pipeline/), the generation engine and
its runtime (engine/), job/, files/, place/, obs/, ray_engine/, tune/. No task imports another,
and nothing shared imports this folder.
"""
