"""One protocol for every pooling kind (`Head`): what a row of a checkpoint gives and how its model
is built. The facts a task reads of a checkpoint (`CheckpointInfo`) carry their head, so a model
is one call whatever the kind (`registry.load_model`: `info.head.load(...)`).

Each head sits beside the model it builds: an encoder's token states pooled into one vector
(`adapter.PoolingHead`), a decoder's (`decoder_embedder.DecoderPoolingHead`), a sequence
classifier's label probabilities or a cross-encoder's score (`checkpoint.ClassifierHead`), any of
those through transformers (`hf_backend.TransformersHead`); a task that brings a head of its own
keeps it in its folder (NER's token labels, SPLADE's vocabulary entries, token embeddings) and
sets it when it reads the checkpoint. Adding a pooling kind is a head and a task, not a branch.

A head gives a row either `width(info)` float32 values (a dense vector) or, with a `ragged` spec
(`values.RaggedSpec`), a varying number of items (its width is then 0).
"""

from __future__ import annotations

from typing import Any, Protocol


class Head(Protocol):
    """What a pooling task's model gives per row, and how it is built on a device."""

    @property
    def ragged(self) -> Any:
        """A `values.RaggedSpec` where a row gives ragged items; None where it gives `width` values."""

    def width(self, info: Any) -> int:
        """Dense float32 values per row of the checkpoint `info` (a CheckpointInfo); 0 for ragged items."""

    def load(self, info: Any, device: Any, dtype: Any, cpu_fast_path: bool) -> Any:
        """The model (a `BatchModel`) on `device` in `dtype`; float32 on the CPU takes prepacked
        linears unless `cpu_fast_path` is off."""


__all__ = ["Head"]
