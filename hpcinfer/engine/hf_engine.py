"""`--backend transformers` for generation: transformers' `AutoModelForCausalLM` as the engine.

The job around it is the native one (reading, chat templates, rejects, windows, resume, output):
only `Engine` is swapped for `HFEngine`, which has the surface the loop and the report read
(`add`, `has_work`, `step`, `stats`, `scheduler.waiting/running`, `cache.nbytes`, `max_model_len`).

What is lost against the native engine, and why this exists at all: it runs architectures the
native decoder does not have, and it is the slow reference the native engine is checked against.
- **Static batches.** A step takes up to --max-num-seqs waiting prompts, left-pads them to the
  longest and runs them until the last one ends (no continuous batching: a finished row's slot
  idles until then). transformers' own KV cache (a `DynamicCache` per batch): no paged KV pool,
  no prefix caching, no chunked prefill, no preemption.
- **Sampling**: greedy, or temperature / top-k / top-p / min-p drawn by the native `Sampler` (the
  same per-row seeded generators, so a seeded row's draws do not depend on its batch); `max_tokens`,
  EOS, stop strings and stop token ids end a row. Penalties, logit bias, `min_tokens`, log-probs,
  `n` > 1 and structured output are refused: a row asking for one is an `invalid_request` reject,
  a run option asking for one (or for the paged cache's options) a one-line error.
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelError
from ..models.hf_load import quiet_from_pretrained
from .engine_stats import EngineStats
from .sample.sampling import Sampler
from .sample.stopping import stop_reason
from .sequence import SamplingParams, Sequence, Status

WHAT_IS_LOST = "static batches, no paged KV cache, continuous batching, prefix caching or chunked prefill"


def row_problem(params: SamplingParams) -> str | None:
    """Why a row's own sampling asks for what this engine lacks (an invalid_request reject), or None."""
    lacks = {
        "log-probabilities": params.logprobs is not None or params.prompt_logprobs is not None,
        "structured output": params.structured is not None,
        "n > 1": params.n != 1,
        "beam search": params.beam_width > 1,
        "penalties, logit_bias, allowed_token_ids, bad_words or min_tokens": params.penalized,
    }
    for what, asked in lacks.items():
        if asked:
            return f"{what} needs hpcinfer's own engine, not --backend transformers"
    return None


@dataclass(slots=True)
class _Queue:
    """What the loop and the profiler ranges read of a scheduler."""

    waiting: deque[Sequence]
    running: list[Sequence]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)


@dataclass(slots=True)
class _NoPool:
    nbytes: int = 0  # transformers' cache lives inside each batch: no pool is reserved


class HFEngine:
    """Static batches through a `transformers` causal LM; one `step` runs one batch to its end."""

    def __init__(
        self,
        model: Any,
        max_num_seqs: int,
        max_model_len: int,
        eos_token_ids: Any,
        decode: Any,
        seed: int,
        device: torch.device,
        pad_id: int = 0,
    ) -> None:
        self.model, self.max_num_seqs, self.max_model_len = model, max_num_seqs, max_model_len
        self.eos = frozenset(eos_token_ids)
        self.decode, self.device, self.pad_id = decode, device, pad_id
        self.sampler = Sampler(device, seed)
        self.scheduler = _Queue(deque(), [])
        self.stats = EngineStats()
        self.cache = _NoPool()
        self._next_id = 0
        # NOTE: transformers 5 renames the forward's cache argument (`past_key_values` -> `cache`)
        names = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in names else "past_key_values"

    def add(
        self, tokens: list[int], params: SamplingParams, tag: Any = None, seq_id: int | None = None, priority: int = 0
    ) -> Sequence:
        if not 0 < len(tokens) < self.max_model_len:
            raise ValueError(f"a prompt of {len(tokens)} tokens does not fit the context of {self.max_model_len}")
        seq = Sequence(self._next_id if seq_id is None else seq_id, list(tokens), params, tag, priority=priority)
        self._next_id += 1
        seq.arrival_s = time.perf_counter()
        self.scheduler.waiting.append(seq)
        return seq

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Sequence]:
        """Runs prompts to completion; their sequences in prompt order (tests)."""
        seqs = [self.add(p, params) for p in prompts]
        while self.has_work:
            self.step()
        return seqs

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """The next static batch (up to max_num_seqs waiting prompts), run until every row has ended."""
        q = self.scheduler
        batch = [q.waiting.popleft() for _ in range(min(self.max_num_seqs, len(q.waiting)))]
        q.running = batch
        # [B, L] left-padded: every row's last prompt token in the last column
        width = max(s.num_prompt for s in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, s in enumerate(batch):
            ids[i, width - s.num_prompt :] = torch.tensor(s.tokens)
            mask[i, width - s.num_prompt :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        past = None
        live = list(range(len(batch)))
        self.stats.prefill_tokens += sum(s.num_prompt for s in batch)
        while live:
            t1 = time.perf_counter()
            cache = {self._cache_arg: past} if past is not None else {}
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **cache)
            # NOTE: not out.get(..., out.past_key_values): that reads the deprecated attribute every step
            past = out[self._cache_arg] if self._cache_arg in out else out.past_key_values  # noqa: SIM401
            logits = out.logits[:, -1, :].float()
            t2 = time.perf_counter()
            picked = self.sampler.sample(logits[live], [batch[i] for i in live])
            t3 = time.perf_counter()
            next_ids = torch.full((len(batch), 1), self.pad_id, dtype=torch.long)
            now = time.perf_counter()
            for i, token in zip(live, picked, strict=True):
                next_ids[i, 0] = token
                if self._ended(batch[i], token, now):
                    self.sampler.release(batch[i])
            self.stats.steps += 1
            self.stats.decode_tokens += len(live) if self.stats.steps > 1 else 0
            self.stats.occupancy_sum += len(live) / self.max_num_seqs
            alive = torch.zeros((len(batch), 1), dtype=torch.long)
            live = [i for i in live if batch[i].status is not Status.FINISHED]
            alive[live] = 1
            # NOTE: an ended row feeds padding, masked out, until the batch ends (static batching)
            ids, mask = next_ids.to(self.device), torch.cat([mask, alive.to(self.device)], dim=1)
            positions = mask.sum(-1, keepdim=True) - 1
            self.stats.add_times(time.perf_counter() - t3, t2 - t1, 0.0, t3 - t2)
        q.running = []
        return batch

    def _ended(self, seq: Sequence, token: int, now: float) -> bool:
        """Appends `token`; whether it ends `seq` (EOS or a stop token, a stop string, max_tokens, the context)."""
        if seq.first_token_s is None:
            seq.first_token_s = now
        seq.tokens.append(token)
        reason = stop_reason(seq, len(seq.tokens) - 1, self.eos, self.decode, self.max_model_len)
        if reason is None:
            return False
        seq.status, seq.finish_reason, seq.finish_s = Status.FINISHED, reason, now
        return True


def transformers_engine(info: Any, device: torch.device, dtype: torch.dtype, config: Any, tokenizer: Any) -> Any:
    """The job's engine under --backend transformers (an `Engine` stand-in: see the module's note)."""
    model = load_hf_causal_lm(info.path, device, dtype)
    pad = next(iter(info.eos_token_ids), 0)  # NOTE: any id: padded positions are masked out
    return HFEngine(
        model,
        config.max_num_seqs,
        info.config.max_model_len,
        info.eos_token_ids,
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        config.seed,
        device,
        pad,
    )


def load_hf_causal_lm(path: Path, device: torch.device, dtype: torch.dtype) -> Any:
    """The checkpoint as transformers' AutoModelForCausalLM (never its own code: no trust_remote_code)."""
    if not path.is_dir():
        raise ModelError(
            "--backend transformers generates from a checkpoint directory, not a GGUF file", path=str(path)
        )
    try:
        import transformers
    except ImportError:
        raise ModelError("--backend transformers needs the transformers package (pip install transformers)") from None
    try:
        model = quiet_from_pretrained(transformers.AutoModelForCausalLM, path, dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"transformers cannot load it ({exc})", path=str(path)) from None
    return model.to(device).eval().requires_grad_(False)


__all__ = ["WHAT_IS_LOST", "HFEngine", "load_hf_causal_lm", "row_problem", "transformers_engine"]
