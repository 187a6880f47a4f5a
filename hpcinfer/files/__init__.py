"""Input files and output parts: sources, the streamed reader, ids, lines, arrivals, the crash-safe parts store."""
