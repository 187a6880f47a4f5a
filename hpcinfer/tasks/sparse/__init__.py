"""Sparse (SPLADE) embeddings: a vocabulary-wide vector per row, written as its non-zero entries."""
