"""Where work runs: the devices of a run, and the one dispatch rule (fewest outstanding tokens)."""
