"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral): top-k routing, experts run grouped by expert.

Each token's router picks `top_k` experts (softmax over the router's logits in float32, the top
k, renormalised where the family does); each expert then runs once per step on every token routed
to it (one gate/up and one down matmul over the gathered rows), never token by token, and its
weighted output is added back to those tokens. Experts run in ascending order, each adding its
share with `index_add_`, as transformers does, so a token's sum is taken in the same order. Where
a step gives each expert a few rows (decoding, in bfloat16 on a CPU), all experts run as one
batched matmul instead (`MoE._batch_width`).

The expert weights are held stacked ([experts, 2 x intermediate, hidden] and [experts, hidden,
intermediate]): the loader stacks a checkpoint's per-expert tensors once (decoder_checkpoint.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import int8_kernels
from .bert import onednn_bfloat16
from .int8_kernels import cpu_has_bfloat16

# The batched form gives every expert the same number of row slots: twice a step's mean rows per
# expert (a busier expert's rows beyond them run on their own after), and only while that fills
# no expert's matmul on its own: measured (bfloat16, 32 experts of 512, 640 hidden) batched 1.6x
# the loop at 32 rows an expert, 1.25x at 64, 0.88x at 96. It reads every expert's weights, so
# it needs most of them busy: an idle expert's share of the batch costs ~0.4 of a busy one's loop.
SLOTS_PER_MEAN_ROW = 2.0
MOST_SLOTS = 80
LEAST_BUSY = 0.5


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

    def experts_batched(self, x: torch.Tensor) -> torch.Tensor:
        """Every expert's MLP at once over its padded rows, x [experts, hidden, rows] (columns are
        rows) -> [experts, hidden, rows]: two batched matmuls, weights on the left."""
        gate, up = torch.bmm(self.gate_up, x).chunk(2, dim=1)
        return torch.bmm(self.down, self.act(gate).mul_(up))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden]: each expert once, over the rows routed to it.

        NOTE: the routed rows are gathered once, sorted by expert (each expert's rows are then one
        contiguous slice), and added back with one `index_add_` in that order: a token's shares
        still sum in ascending expert order, as transformers' expert-by-expert loop adds them.
        """
        experts, weights = self.route(h)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=self.router.shape[0])
        tokens = order // self.top_k
        share = weights.reshape(-1)[order]
        width = self._batch_width(h, counts)
        if width:
            return self._forward_batched(h, flat[order], counts, width, tokens, share)
        routed = h.index_select(0, tokens)
        out_rows = torch.empty_like(routed)
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if count == 0:
                continue
            rows = slice(start, start + count)
            self.expert(expert, routed[rows], out_rows[rows])
            start += count
        return self._add_shares(h, out_rows, tokens, share)

    @staticmethod
    def _add_shares(h: torch.Tensor, out_rows: torch.Tensor, tokens: torch.Tensor, share: torch.Tensor) -> torch.Tensor:
        """Each routed row's output [rows sorted by expert, hidden] times its share, added to its
        token: one `index_add_`, so a token's shares sum in ascending expert order."""
        weighted = (out_rows * share[:, None]).to(h.dtype)
        return torch.zeros_like(h).index_add_(0, tokens, weighted)

    @staticmethod
    def may_batch(device: torch.device, dtype: torch.dtype) -> bool:
        """Whether a step may take the batched form on `device` in `dtype` (`_batch_width`); where it
        may not, the experts always run one by one.

        NOTE: only where the CPU has bfloat16 instructions (AVX-512 BF16, AMX), which the batched
        form was measured on: oneDNN also takes bfloat16 on AVX-512 CPUs without them, emulated, and
        there the batch ran at 0.45x the loop (Xeon model 106, 128 decode rows, bench_moe.py)."""
        return device.type == "cpu" and dtype == torch.bfloat16 and onednn_bfloat16() and cpu_has_bfloat16()

    @staticmethod
    def column_major_pays(device: torch.device, dtype: torch.dtype) -> bool:
        """Whether the loader lays the experts out column-major (`column_major`) for `device` and `dtype`:
        float32 on the CPU, where MKL computes the products, on an Intel CPU.

        NOTE: MKL picks its kernels by the CPU's vendor, and the layout's gain is its kernels': on
        an Intel Xeon (model 106) the [in, out] memory ran a 16-row expert product 4.6x faster and
        the whole layer 1.48x (bench_moe.py); on an AMD EPYC (Zen 4) the same products ran at
        0.75-1.08x (16 rows on 640 x 1,024: 216 us against 185) and the layer at 0.89x, so there the
        checkpoint's layout is kept. bfloat16 keeps it everywhere (0.93x emulated, 1.05x on AVX-512
        BF16). The choice is the machine's, not a timing's, so a run's sums do not vary between runs."""
        return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkl.is_available()
                and int8_kernels.cpu_vendor() == "GenuineIntel")  # fmt: skip

    def column_major(self) -> None:
        """The experts' weights kept as the same [out, in] tensors with their memory laid out [in,
        out], for the CPU's expert-by-expert loop.

        NOTE: MKL then runs each expert's `x @ W^T` as a plain product of x and W's memory, where
        with [out, in] memory it transposes W, and it does that badly at a decode step's few rows:
        measured (float32, 2 threads, MKL 2024.2) 4.6x faster at 16 rows on 640 x 1,024 and 5.9x on
        512 x 640, 1.5-2.9x at 8 and 32 rows, even at 128 (benchmarks/speed/bench_moe.py); the sums
        are the same bits from 16 rows up and within float32 rounding below. In bfloat16 (emulated on
        that CPU) the loop was 0.93x on them, so the loader lays out float32 experts only.
        """
        with torch.no_grad():
            for name in ("gate_up", "down"):
                weight = getattr(self, name)
                laid = weight.detach().transpose(1, 2).contiguous().transpose(1, 2)
                setattr(self, name, nn.Parameter(laid, requires_grad=weight.requires_grad))

    @staticmethod
    def _batch_width(h: torch.Tensor, counts: torch.Tensor) -> int:
        """The row slots each expert gets in one batched matmul over all experts, or 0: expert by
        expert.

        NOTE: measured on CPUs (benchmarks/speed/bench_moe.py, and bench_decoders.py's MoE step):
        in bfloat16, where oneDNN runs batched matmuls on AMX / AVX-512 BF16, a decode step's few
        rows per expert run 2.2-2.6x faster batched (each expert's own matmul is too small to use
        the cores); in float32 MKL's per-expert matmuls are as fast as the padded batch, so the
        loop is kept (float16 is not measured: it keeps the loop too), and so it is where oneDNN has
        no bfloat16 kernels: emulated, the batch's padding would only add work.
        """
        if not MoE.may_batch(h.device, h.dtype):
            return 0
        if int((counts > 0).sum()) < LEAST_BUSY * counts.numel():
            return 0
        width = min(int(counts.max()), math.ceil(SLOTS_PER_MEAN_ROW * int(counts.sum()) / counts.numel()))
        return width if width <= MOST_SLOTS else 0

    def _forward_batched(
        self,
        h: torch.Tensor,
        expert_of: torch.Tensor,
        counts: torch.Tensor,
        width: int,
        tokens: torch.Tensor,
        share: torch.Tensor,
    ) -> torch.Tensor:
        """The batched form: the routed rows (sorted by expert) laid into [experts, width] slots,
        zeros where an expert has fewer; every expert in one matmul; a busier expert's rows beyond
        its slots then on their own; each row's share added back in ascending expert order (one
        `index_add_` over the rows sorted by expert)."""
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(expert_of.numel(), device=h.device) - starts[expert_of]
        fits = slot < width
        routed = h.index_select(0, tokens)
        x = h.new_zeros(counts.numel(), h.shape[1], width)
        x[expert_of[fits], :, slot[fits]] = routed[fits]
        y = torch.empty_like(routed)
        y[fits] = self.experts_batched(x)[expert_of[fits], :, slot[fits]]
        for expert, (start, count) in enumerate(zip(starts.tolist(), counts.tolist(), strict=True)):
            if count > width:
                self.expert(expert, routed[start + width : start + count], y[start + width : start + count])
        return self._add_shares(h, y, tokens, share)


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

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        return (up.clamp(-self.limit, self.limit) + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def expert(self, expert: int, x: torch.Tensor, out: torch.Tensor) -> None:
        gate, up = F.linear(x, self.gate_up[expert], self.gate_up_bias[expert]).chunk(2, dim=-1)
        torch.matmul(self.glu(gate, up), self.down[expert].t(), out=out)
        out.add_(self.down_bias[expert])

    def experts_batched(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = torch.baddbmm(self.gate_up_bias[:, :, None], self.gate_up, x).chunk(2, dim=1)
        return torch.baddbmm(self.down_bias[:, :, None], self.down, self.glu(gate, up))


__all__ = ["GptOssMoE", "MoE"]
