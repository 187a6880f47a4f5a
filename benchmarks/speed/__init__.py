"""Speed benchmarks: hpcinfer against the tools people would use instead, and its own settings side by side."""
