"""One request's state through the engine: tokens, progress, blocks, sampling parameters, timing.

Torch-free: the scheduler and block manager read and write these as plain ints and lists.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .constrained.structured import GrammarSpec

PENDING = -1  # a sampled token still on its way from the device (the engine runs a step ahead)
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs allows
MAX_N = 128  # samples per prompt (OpenAI allows 128)
MAX_BEAMS = 32  # beam search: beams per prompt


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling. temperature 0 is greedy; top_k 0 and top_p 1 and min_p 0 are off."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Penalties (penalties.py), applied to the logits before greedy or sampled choice:
    repetition_penalty: float = 1.0  # transformers': a seen token's logit / p if > 0, * p if < 0 (prompt too)
    presence_penalty: float = 0.0  # OpenAI's: minus this once a token is in the answer
    frequency_penalty: float = 0.0  # OpenAI's: minus this per time a token is in the answer
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: when given, no other token may be chosen
    bad_words: tuple[tuple[int, ...], ...] = ()  # vLLM's, as token ids: these sequences never end the answer
    lora: int = 0  # the LoRA adapter that answers (--lora's order, from 1); 0: the base model
    beam_width: int = 1  # > 1: beam search (engine/beam.py), the best of this many beams answers
    length_penalty: float = 1.0  # beam search: a hypothesis scores its log-probability / length ** this
    min_tokens: int = 0  # EOS and stop_token_ids are barred until the answer has this many tokens
    logprobs: int | None = None  # each answer token's log-probability, and this many alternatives (0..20)
    n: int = 1  # answers to the prompt: prefilled once, its KV blocks shared by the n samples
    prompt_logprobs: int | None = None  # each prompt token's log-probability, and this many alternatives
    structured: GrammarSpec | None = None  # the answer must match it (structured.py)
    # A vision-language request's images (models.vlm.Media): their vectors replace the embeddings of
    # the prompt's image tokens; their digest keys its prefix-cache blocks
    media: Any = field(default=None, compare=False)

    def problem(self) -> str | None:
        """Why these parameters are invalid (a reject reason), or None."""
        if self.max_tokens < 1:
            return f"max_tokens must be >= 1, got {self.max_tokens}"
        if not self.repetition_penalty > 0:
            return f"repetition_penalty must be > 0, got {self.repetition_penalty}"
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                return f"{name} must be in [-2, 2], got {getattr(self, name)}"
        if any(not -100 <= bias <= 100 for _, bias in self.logit_bias):
            return "logit_bias values must be in [-100, 100]"
        if not 0 <= self.min_tokens <= self.max_tokens:
            return f"min_tokens must be in [0, max_tokens], got {self.min_tokens}"
        if not 1 <= self.n <= MAX_N:
            return f"n must be in [1, {MAX_N}], got {self.n}"
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            return f"logprobs (top_logprobs) must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            return f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
        if not self.temperature >= 0:
            return f"temperature must be >= 0, got {self.temperature}"
        if not 0 < self.top_p <= 1:
            return f"top_p must be in (0, 1], got {self.top_p}"
        if self.top_k < 0:
            return f"top_k must be >= 0, got {self.top_k}"
        if not 0 <= self.min_p <= 1:
            return f"min_p must be in [0, 1], got {self.min_p}"
        if not 1 <= self.beam_width <= MAX_BEAMS:
            return f"beam_width must be in [1, {MAX_BEAMS}], got {self.beam_width}"
        if self.beam_width > 1 and (
            not self.greedy or self.n > 1 or self.penalized or self.structured is not None
            or self.logprobs is not None or self.prompt_logprobs is not None or self.stop
        ):  # fmt: skip
            return (
                "beam_width > 1 (beam search ranks the model's own log-probabilities): not with temperature > 0, "
                "n > 1, penalties, logit_bias, allowed_token_ids, bad_words, min_tokens, structured output, logprobs "
                "or stop strings"
            )
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty, bias or minimum length changes this request's logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
            or bool(self.allowed_token_ids)
            or bool(self.bad_words)
            or self.min_tokens > 0
        )


@dataclass(slots=True, eq=False)
class Sequence:
    """`tokens` is prompt + generated; `num_computed` of them have K/V in the cache.

    NOTE: after a preemption `num_computed` drops to 0 and the generated tokens are recomputed as
    part of a longer prompt; `num_prompt` never changes, so completions stay what was sampled.
    """

    seq_id: int
    tokens: list[int]
    params: SamplingParams
    tag: Any = None  # the caller's handle (a row, a window)
    num_prompt: int = 0
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks, in order
    # With paged windows (kvcache/windowed_blocks.py): each group of sliding-window layers' blocks,
    # beside `block_table`; those before `window_from` have left every window and are freed.
    local_tables: list[list[int]] = field(default_factory=list)
    window_from: int = 0
    priority: int = 0  # higher is admitted first
    num_cached: int = 0  # prompt tokens served from the prefix cache at its first admission
    status: Status = Status.WAITING
    finish_reason: str | None = None
    preemptions: int = 0
    lora_waits: int = 0  # steps it was passed over in, its adapter not fitting --max-loras (scheduler.py)
    arrival_s: float = 0.0
    first_token_s: float | None = None
    finish_s: float | None = None
    error: str | None = None  # finish_reason "error": why it could not run (the job makes it a reject)
    stop_text_cut: int | None = None  # characters of the decoded completion to keep after a stop string
    # Its last token (maybe still PENDING) ends it by length: nothing more is scheduled for it.
    draining: bool = False
    # With params.logprobs: per answer token, (its log-probability, [(token id, log-probability)] of the best)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    grammar: Any = None  # with params.structured: its llguidance matcher, advanced token by token
    # With params.prompt_logprobs: per prompt token after the first, (its log-probability, its rank,
    # [(token id, log-probability)] of the best), filled as its prefill chunks run
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]] | None] = field(default_factory=list)
    # finish_reason "stop" by an EOS or stop token id, which is then not part of the answer's text
    # (a stop string or a complete grammar ends it with its last token kept)
    stop_token: bool = False
    # n samples (params.n > 1): sample i > 0 is a fork of sample 0 made when sample 0 draws its first
    # token; sample 0's `samples` lists all of them, once they exist, in sample order.
    sample_index: int = 0
    samples: list[Sequence] | None = None
    parent: Sequence | None = None
    # Speculative decoding (speculate.py): proposals riding at the end of `tokens` for one step, and
    # the model's choice at each position of the chunk that verified them.
    draft: int = 0
    verify: list[int] = field(default_factory=list)  # greedy: the model's choice at each position
    verify_logits: Any = None  # sampled: the logits at each position [1 + draft, vocab]

    def __post_init__(self) -> None:
        if not self.num_prompt:
            self.num_prompt = len(self.tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_completion(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def completion(self) -> list[int]:
        return self.tokens[self.num_prompt :]

    @property
    def remaining(self) -> int:
        """Tokens still to put through the model before the next one can be sampled."""
        return len(self.tokens) - self.num_computed

    @property
    def all_samples(self) -> list[Sequence]:
        """The request's samples (itself alone with n = 1)."""
        return self.samples or [self]

    @property
    def answer_tokens(self) -> int:
        """Completion tokens of all its samples."""
        return sum(s.num_completion for s in self.all_samples)

    @property
    def done_s(self) -> float:
        """When its last sample finished."""
        return max(s.finish_s or 0.0 for s in self.all_samples)

    @property
    def forks_due(self) -> int:
        """Samples still to fork from this sequence when it draws its first token."""
        return self.params.n - 1 if self.samples is None and self.sample_index == 0 else 0

    @property
    def is_decode(self) -> bool:
        return self.num_computed == len(self.tokens) - 1 and self.num_completion > 0
