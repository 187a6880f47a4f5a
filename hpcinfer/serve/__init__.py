"""`hpcinfer serve`: a self-hosted OpenAI Batch API (files and batches) over the same job `run` runs."""
