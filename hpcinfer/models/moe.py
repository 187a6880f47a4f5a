"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral): top-k routing, experts run grouped by expert.

Each token's router picks `top_k` experts (softmax over the router's logits in float32, the top
k, renormalised where the family does); each expert then runs once per step on every token routed
to it (one gate/up and one down matmul over the gathered rows), never token by token, and its
weighted output is added back to those tokens. Experts run in ascending order, each adding its
share with `index_add_`, as transformers does, so a token's sum is taken in the same order.

The expert weights are held stacked ([experts, 2 x intermediate, hidden] and [experts, hidden,
intermediate]): the loader stacks a checkpoint's per-expert tensors once (decoder_checkpoint.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class MoE(nn.Module):
    def __init__(
        self, hidden: int, intermediate: int, experts: int, top_k: int, renormalize: bool, act: Callable
    ) -> None:
        super().__init__()
        self.top_k, self.renormalize, self.act = top_k, renormalize, act
        self.router = nn.Parameter(torch.empty(experts, hidden))
        self.gate_up = nn.Parameter(torch.empty(experts, 2 * intermediate, hidden))
        self.down = nn.Parameter(torch.empty(experts, hidden, intermediate))

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, hidden] -> (expert ids [T, k], their weights [T, k] in float32)."""
        probs = torch.softmax(F.linear(h, self.router).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights

    def expert(self, expert: int, x: torch.Tensor, out: torch.Tensor) -> None:
        """One expert's MLP over its rows x [n, hidden], into out [n, hidden]."""
        gate, up = F.linear(x, self.gate_up[expert]).chunk(2, dim=-1)
        torch.matmul(self.act(gate).mul_(up), self.down[expert].t(), out=out)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden]: each expert once, over the rows routed to it.

        NOTE: the routed rows are gathered once, sorted by expert (each expert's rows are then one
        contiguous slice), and added back with one `index_add_` in that order: a token's shares
        still sum in ascending expert order, as transformers' expert-by-expert loop adds them.
        """
        experts, weights = self.route(h)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=self.router.shape[0]).tolist()
        tokens = order // self.top_k
        routed = h.index_select(0, tokens)
        out_rows = torch.empty_like(routed)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            self.expert(expert, routed[rows], out_rows[rows])
            start += count
        share = weights.reshape(-1)[order]
        weighted = (out_rows * share[:, None]).to(h.dtype)
        return torch.zeros_like(h).index_add_(0, tokens, weighted)


class GptOssMoE(MoE):
    """gpt-oss's experts: the router has a bias and softmaxes the top-k logits only; experts have
    biases and a clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate), gate clamped above at
    `limit`, up to [-limit, limit]. The checkpoint's interleaved gate/up columns are split into
    MoE's gate rows then up rows at load (decoder_checkpoint.py)."""

    def __init__(self, hidden: int, intermediate: int, experts: int, top_k: int, limit: float, alpha: float) -> None:
        super().__init__(hidden, intermediate, experts, top_k, False, F.silu)
        self.limit, self.alpha = limit, alpha
        self.router_bias = nn.Parameter(torch.empty(experts))
        self.gate_up_bias = nn.Parameter(torch.empty(experts, 2 * intermediate))
        self.down_bias = nn.Parameter(torch.empty(experts, hidden))

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, experts = torch.topk(F.linear(h, self.router, self.router_bias), self.top_k, dim=-1)
        return experts, torch.softmax(top, dim=-1)

    def expert(self, expert: int, x: torch.Tensor, out: torch.Tensor) -> None:
        gate, up = F.linear(x, self.gate_up[expert], self.gate_up_bias[expert]).chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        torch.matmul((up.clamp(-self.limit, self.limit) + 1) * glu, self.down[expert].t(), out=out)
        out.add_(self.down_bias[expert])


__all__ = ["GptOssMoE", "MoE"]
