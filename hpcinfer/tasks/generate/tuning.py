"""`hpcinfer tune` on a causal LM: what the tune harness (tune/command.py) needs of this task.

The sample is requests drawn from the input; the decoder is loaded once and each trial runs the
requests through a fresh engine (tune_trial.py); the search walks the engine budgets, then
prefix caching (tune_search.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...config import GenerateConfig, RunConfig
from ...device.threads import set_torch_threads
from ...engine.engine import pool_reserve
from ...engine.kvcache.pools import KVLayout, size_pool
from ...engine.kvcache.windowed_blocks import longest_sequence
from ...errors import ConfigError
from ...models.decoder_checkpoint import load_decoder, load_tokenizer
from ...tune.search import Goal, OnSample, OnTrial, Search, Trial, brief
from . import tune_view
from .setup import engine_config, first_device, request_reader, run_decoder_info
from .tune_search import GenerationSearch, NoisyGoal, generation_space, prefix_line
from .tune_trial import GenerationTrialRunner, RequestSample, draw_requests

if TYPE_CHECKING:
    from ...tune.options import TuneOptions

SAMPLE_ROWS = 512  # requests: enough for two rounds at max-num-seqs 256, minutes not hours a trial
WARMUP_ROWS = 32
TOKEN_FLOOR = 256  # below this, prefill goes in chunks too small to keep the device busy
TOKEN_CEILING = {"cuda": 65_536, "cpu": 16_384}


def check_generation_options(base: RunConfig, objective: str | None, max_p99_ms: float | None) -> str:
    """The objective a generation tune optimises; refuses what it cannot measure."""
    refused = {
        "--rate": base.input.rate is not None,
        "--objective latency": objective == "latency",
        "--max-p99-ms": max_p99_ms is not None,
    }
    for flag in (f for f, given in refused.items() if given):
        raise ConfigError(
            f"{flag}: tune on a causal LM measures throughput on the sample run as a batch "
            "(--objective tokens or rows); per-request latency under --rate is not tuned for generation yet"
        )
    return objective or "tokens"


class GenerateTuning:
    """Generation's `TuneTask`."""

    sample_rows, warmup_rows = SAMPLE_ROWS, WARMUP_ROWS
    recipe_kind = "sampled requests"

    def objective(self, base: RunConfig, opts: TuneOptions) -> str:
        return check_generation_options(base, opts.objective, opts.max_p99_ms)

    def goal(self, goal: Goal) -> Goal:
        return NoisyGoal(goal.objective, goal.max_p99_ms, goal.max_memory_bytes, goal.min_gain)

    def search(self, base: RunConfig, opts: TuneOptions, goal: Goal, on_sample: OnSample, on_trial: OnTrial) -> tuple:
        return search_generation(base, opts, goal, on_sample, on_trial)

    def columns(self) -> list[tuple[str, Callable[[Trial], Any]]]:
        return [
            ("tokens_per_s", lambda t: round(t.tokens_per_s, 1)),
            ("rows_per_s", lambda t: round(t.rows_per_s, 3)),
            ("ttft_p50_ms", lambda t: round(t.ttft_ms, 3)),
            ("tpot_p50_ms", lambda t: round(t.tpot_ms, 3)),
            ("slowest_repeat", lambda t: round(t.low, 3)),  # of the objective
            ("fastest_repeat", lambda t: round(t.high, 3)),
            ("spread", lambda t: round(t.spread, 4)),
            ("prefix_cached_share", lambda t: round(t.cached_share, 4)),
            ("memory_mib", lambda t: round(t.memory_bytes / 2**20, 1)),
        ]

    def recipe(self, best: Trial, base: RunConfig, device: str) -> dict[str, Any]:
        return generation_recipe_values(best, base, device)

    def recipe_notes(self, search: Search, base: RunConfig) -> list[str]:
        assert isinstance(search, GenerationSearch)
        return [f"--max-tokens {base.generate.max_tokens} where a row sets none.", prefix_line(search)]


def search_generation(
    base: RunConfig,
    opts: TuneOptions,
    goal: Goal,
    on_sample: OnSample = None,
    on_trial: OnTrial = None,
) -> tuple[RequestSample, GenerationSearch, str]:
    """Runs the generation search; returns the sample, the search and the device kind."""
    g = base.generate
    info = run_decoder_info(base)
    device, dtype = first_device(base)
    if base.device.threads:
        set_torch_threads(base.device.threads)
    tokenizer = load_tokenizer(info)
    reader = request_reader(base, info, tokenizer)  # NOTE: refuses bad sampling defaults before the model loads
    model = load_decoder(info, device, dtype, base.device.quantize, base.device.int8_kernel)
    engine = engine_config(base)
    # NOTE: sized as each trial's engine sizes its pool; as in `run`, it bounds the prompts too.
    layout = KVLayout.of(model.cfg, g.kv_block_size, dtype, engine.kv_storage, engine.page_windows)
    blocks = size_pool(layout, engine.kv_cache_memory, device, pool_reserve(model, engine))
    # NOTE: one sequence's most (engine.py) in the trial that allows least: a paged window's blocks
    # grow with the prefill chunk, and the trials vary the step budget (no chunk: the whole prompt)
    kv_tokens = longest_sequence(layout, blocks - engine.cuda_graphs, None)
    max_prompt = min(info.config.max_model_len, kv_tokens) - 1
    reader.max_prompt = max_prompt
    assert opts.sample_rows is not None and opts.warmup_rows is not None  # resolved by the harness
    sample = draw_requests(reader, opts.sample_rows, opts.sample_seed, opts.scan_rows, kv_tokens)
    if on_sample is not None:
        on_sample(sample)
    lengths = sample.prompt_lengths
    space = generation_space(
        sample.rows,
        int((lengths + sample.max_tokens).sum()),
        sample.fit_rows,
        TOKEN_FLOOR if g.chunked_prefill else max(TOKEN_FLOOR, int(lengths.max())),
        TOKEN_CEILING[device.type],
    )
    search: GenerationSearch

    def status(params: dict[str, Any], text: str) -> None:
        if on_trial is not None:
            done = f"{len(search.trials)} of at most {space.most_trials} trials done"
            on_trial(search, None, f"{done}; running {brief(params)}: {text}")

    runner = GenerationTrialRunner(
        model,
        engine,
        sample,
        info.eos_token_ids,
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        repeats=opts.repeats,
        warmup_rows=min(opts.warmup_rows, sample.rows),
        window_rows=g.window_rows,
        prefix_order=g.prefix_order,
        objective=goal.objective,
        best_so_far=lambda: slowest_repeat(goal, search.best),
        on_status=status,
    )
    search = GenerationSearch(
        runner,
        goal,
        space,
        on_trial=None if on_trial is None else (lambda trial: on_trial(search, trial, "")),
    )
    search.view = tune_view
    search.run(default_params(g))
    return sample, search, device.type


def slowest_repeat(goal: Goal, best: Trial | None) -> float:
    """What a first repeat must come near to be repeated: the best's slowest repeat, not its
    median, so that one unlucky pass of the best on a shared machine does not settle others."""
    if best is None or goal.score(best) == -float("inf"):
        return 0.0
    return best.low or goal.score(best)


def default_params(g: GenerateConfig) -> dict[str, Any]:
    return {
        "max_num_batched_tokens": g.max_num_batched_tokens,
        "max_num_seqs": g.max_num_seqs,
        "prefix_cache": g.prefix_cache,
    }


def generation_recipe_values(best: Trial, base: RunConfig, device: str) -> dict[str, Any]:
    """The `run` options a generation recipe sets: what was tuned, and what it was tuned under."""
    g, plain = base.generate, GenerateConfig()
    values: dict[str, Any] = {}
    if base.model != "default":
        values["model"] = base.model
    if base.task != "auto":
        values["task"] = base.task
    values["device"] = device
    values["dtype"] = base.device.dtype
    if base.device.threads is not None:
        values["threads"] = base.device.threads
    # NOTE: the pool, block size, prefill mode and windows shape every step: a recipe tuned
    # under them holds only under them.
    if g.kv_cache_memory is not None:
        values["kv_cache_memory"] = g.kv_cache_memory
    if g.kv_block_size != plain.kv_block_size:
        values["kv_block_size"] = g.kv_block_size
    if not g.chunked_prefill:
        values["no_chunked_prefill"] = True
    if g.window_rows != plain.window_rows:
        values["window_rows"] = g.window_rows
    if not g.prefix_order:
        values["no_prefix_order"] = True
    values["max_num_batched_tokens"] = best.params["max_num_batched_tokens"]
    values["max_num_seqs"] = best.params["max_num_seqs"]
    values["prefix_cache"] = best.params["prefix_cache"]  # `run` reads it as --no-prefix-cache
    return values
