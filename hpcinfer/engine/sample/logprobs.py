"""Log-probabilities of a step's sampled tokens, for the requests that ask (`logprobs`).

From the logits the model produced (before penalties and temperature, as vLLM reports them by
default), for the asking rows only: log-softmax on the device, the chosen token's value gathered
by the sampled token (still on the device, a step ahead), the best K with topk. The host reads
them with the step's tokens, already waited for, so asking costs no extra wait.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from ..sequence import Sequence


class StepLogprobs:
    """One step's log-probabilities on the device: row of the step's sampling -> values."""

    def __init__(
        self, rows: list[int], chosen: torch.Tensor, top_values: torch.Tensor, top_ids: torch.Tensor, ks: list[int]
    ) -> None:
        self.rows, self.chosen, self.top_values, self.top_ids, self.ks = rows, chosen, top_values, top_ids, ks

    def on_host(self) -> dict[int, tuple[float, list[tuple[int, float]]]]:
        chosen = self.chosen.tolist()
        values, ids = self.top_values.tolist(), self.top_ids.tolist()
        return {
            row: (chosen[k], list(zip(ids[k][: self.ks[k]], values[k][: self.ks[k]], strict=True)))
            for k, row in enumerate(self.rows)
        }


def step_logprobs(logits: torch.Tensor, seqs: Seq[Sequence], tokens: torch.Tensor) -> StepLogprobs | None:
    """logits [S, vocab] (float32, the model's), tokens [S] sampled on the device; None if no row asks."""
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not rows:
        return None
    ks = [int(seqs[i].params.logprobs or 0) for i in rows]
    index = torch.tensor(rows, device=logits.device)
    logp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    chosen = logp.gather(1, tokens.index_select(0, index).long()[:, None])[:, 0]
    top_values, top_ids = logp.topk(max(max(ks), 1), dim=-1)
    return StepLogprobs(rows, chosen, top_values, top_ids, ks)


__all__ = ["StepLogprobs", "step_logprobs"]
