"""The three steps every model on the encoder pipeline takes, called as one: `prepare` (ids and
lengths as the model wants them; as they are by default), `forward`, `postprocess` (one float32
row per input row). A model implements `forward` and `postprocess`; the executor may call the
steps one by one (CUDA graphs capture `forward` alone) or the model as a whole."""

from __future__ import annotations

import torch


class BatchSteps:
    def prepare(self, ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ids, lengths

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, padded: bool) -> object:
        raise TypeError(f"{type(self).__name__} defines no forward step")

    def postprocess(self, outputs: object) -> torch.Tensor:
        raise TypeError(f"{type(self).__name__} defines no postprocess step")

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, lengths: torch.Tensor, padded: bool = True) -> torch.Tensor:
        ids, lengths = self.prepare(ids, lengths)
        return self.postprocess(self.forward(ids, lengths, padded))
