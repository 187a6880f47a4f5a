"""Cross-encoder scoring: a one-label classifier's score per text pair (and OpenAI /v1/score, /v1/rerank)."""
