"""Sentence embeddings: tokenize -> plan -> stage -> execute -> write, with the pooling of the checkpoint."""
