"""What a generation run settles before its first step, the same for the local job, a Ray replica and tune:
its devices and dtype, the tokenizer, the request reader with the run's sampling defaults, the
engine's budgets, and the options that enter its resume fingerprint."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from ...config import GenerateConfig, RunConfig
from ...device import accelerators, dtype_for
from ...engine.constrained.structured import Grammars, GrammarSpec
from ...engine.engine import EngineConfig
from ...engine.hf_engine import row_problem
from ...engine.kvcache.pools import kv_storage, parse_kv_memory
from ...engine.sequence import SamplingParams
from ...errors import ConfigError
from ...files.fingerprint import fingerprint
from ...models.decoder_inspect import DecoderInfo, inspect_decoder
from ...models.lora import adapter_digest, parse_loras
from ...models.registry import resolve_model_path
from ...place.devices import parse_devices
from .chat import ChatRenderer
from .requests import RequestReader


def generation_devices(config: RunConfig) -> tuple[list[torch.device], torch.dtype]:
    """--devices (one engine each) or --device; all of one kind, cpu or cuda."""
    if config.device.devices:
        names = parse_devices(config.device.devices)
    else:
        name = config.device.device
        names = [accelerators.default_kind()] if name == "auto" else [name]
    for name in names:
        if not (name == "cpu" or name.startswith("cuda")):
            raise ConfigError(f"generation runs on cpu or cuda, not {name!r}")
    devices = [torch.device(name) for name in names]
    if len({d.type for d in devices}) > 1:
        raise ConfigError(f"--devices: one kind of device per run (got {', '.join(names)})")
    return devices, dtype_for(config.device.dtype, devices[0])


def first_device(config: RunConfig) -> tuple[torch.device, torch.dtype]:
    """The one device a single engine runs on: a tune trial or a Ray actor takes the first of --devices,
    since every device gets the same per-device budgets."""
    devices, dtype = generation_devices(config)
    return devices[0], dtype


def run_decoder_info(config: RunConfig) -> DecoderInfo:
    """The checkpoint's facts, its context capped by --max-model-len (positions, the KV pool's
    longest sequence and the longest prompt follow); a cap past the checkpoint's context is refused."""
    info = inspect_decoder(resolve_model_path(config.model), native=config.backend != "transformers")
    cap = config.generate.max_model_len
    if cap is None:
        return info
    own = info.config.max_model_len
    if not 2 <= cap <= own:
        raise ConfigError(f"--max-model-len {cap}: the checkpoint's context is {own} tokens (give 2..{own})")
    return replace(info, config=replace(info.config, context_cap=cap))


# The run's options that are a row's sampling parameters too (same name): a new one is a field of
# both and its sampler code. NOTE: not `seed`: the run's seed is where each row's own stream starts.
ROW_DEFAULTS = tuple(
    f.name for f in fields(SamplingParams) if f.name in {g.name for g in fields(GenerateConfig)} - {"seed"}
)
# Those the resume fingerprint has named since before this list existed, by position
_FINGERPRINTED = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "ignore_eos", "n"}
_FINGERPRINTED |= {"repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens"}


def sampling_defaults(config: RunConfig) -> SamplingParams:
    """What a row that sets none of its own sampling parameters gets."""
    given = {name: getattr(config.generate, name) for name in ROW_DEFAULTS}
    given["stop"] = tuple(given["stop"])
    params = SamplingParams(**given, structured=structured_default(config))
    if (problem := params.problem()) is not None:
        name = problem.split(" ", 1)[0]
        raise ConfigError(problem.replace(name, "--" + name.replace("_", "-"), 1))
    return params


def structured_default(config: RunConfig) -> GrammarSpec | None:
    """--json-schema FILE, --regex, --choice or --grammar FILE: the run's structured output."""
    g = config.generate
    given = {
        "--json-schema": ("json_schema", g.json_schema, True),
        "--regex": ("regex", g.regex, False),
        "--choice": ("choice", list(g.choice) or None, False),
        "--grammar": ("grammar", g.grammar, True),
    }
    given = {flag: spec for flag, spec in given.items() if spec[1] is not None}
    if len(given) > 1:
        raise ConfigError(f"give one of {', '.join(given)}: an answer follows one structured output")
    if not given:
        return None
    flag, (kind, value, is_file) = next(iter(given.items()))
    if is_file:
        try:
            value = Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{flag}: cannot read {value} ({exc})") from None
    try:
        return GrammarSpec.of(kind, value)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from None


def generation_fingerprint(
    config: RunConfig, info: DecoderInfo, files: list[str], dtype: torch.dtype
) -> dict[str, Any]:
    g = config.generate
    options = {
        "task": "generate",
        "dtype": str(dtype),
        "window_rows": g.window_rows,
        "sampling": [g.max_tokens, g.temperature, g.top_p, g.top_k, g.min_p, g.seed, list(g.stop), g.ignore_eos],
        "weights": [f.name for f in info.weight_files],
        "id_column": config.input.id_column,
    }
    # NOTE: only when they differ from the defaults, so a run started before they existed still resumes
    penalties = [g.repetition_penalty, g.presence_penalty, g.frequency_penalty, g.min_tokens]
    if penalties != [1.0, 0.0, 0.0, 0]:
        options["penalties"] = penalties
    if g.max_model_len is not None:
        options["max_model_len"] = g.max_model_len
    if g.n != 1:
        options["n"] = g.n
    if g.loras:  # NOTE: by name and content: another adapter under the same name is another output
        options["loras"] = [[name, adapter_digest(folder)] for name, folder in parse_loras(g.loras)]
    if (g.reasoning_parser, g.tool_call_parser) != ("none", "none"):
        options["parsers"] = [g.reasoning_parser, g.tool_call_parser]
    default = GenerateConfig()
    newer = {n: getattr(g, n) for n in ROW_DEFAULTS if n not in _FINGERPRINTED and getattr(g, n) != getattr(default, n)}
    if newer:  # NOTE: every row default added since, by name, when set
        options["sampling_defaults"] = newer
    if (spec := structured_default(config)) is not None:
        options["structured"] = [spec.kind, spec.text]
    if (config.device.quantize, g.kv_cache_dtype) != ("none", "auto"):
        options["quantize"] = [config.device.quantize, g.kv_cache_dtype]
    if config.device.quantize == "int8":  # NOTE: settled before: two kernels round differently
        options["int8_kernel"] = config.device.int8_kernel
    if config.backend == "transformers":
        options["backend"] = config.backend
    return fingerprint(files, info.path, options)


def request_reader(config: RunConfig, info: DecoderInfo, tokenizer: Tokenizer) -> RequestReader:
    """The run's reader of requests: the checkpoint's chat template, the run's sampling defaults."""
    chat = ChatRenderer(info.chat_template, info.special_tokens) if info.chat_template else None
    defaults = sampling_defaults(config)
    grammars = Grammars(tokenizer.to_str(), info.config.vocab_size, info.eos_token_ids)
    if defaults.structured is not None and (problem := grammars.problem(defaults.structured)) is not None:
        raise ConfigError(f"structured output: {problem}")
    return RequestReader(
        config.input.paths,
        config.input.id_column,
        tokenizer,
        chat,
        defaults,
        info.config.max_model_len - 1,
        info.config.vocab_size,
        config.generate.priority_column,
        grammars,
        config.generate.max_num_seqs,
        row_problem if config.backend == "transformers" else None,
        (config.generate.reasoning_parser, config.generate.tool_call_parser),
        tuple(item.partition("=")[0].strip() for item in config.generate.loras),
        (str(info.path), info.vision.image_token_id) if info.vision is not None else None,
        config.input.image_files,
    )


MEDIA_WINDOW_ROWS = 64  # a vision-language run's default window: each row read ahead holds its images' pixels


def media_windows(config: RunConfig, info: DecoderInfo) -> RunConfig:
    """A vision-language run reads fewer rows ahead (its window) unless --window-rows says otherwise."""
    if info.vision is None or config.generate.window_rows != GenerateConfig().window_rows:
        return config
    return replace(config, generate=replace(config.generate, window_rows=MEDIA_WINDOW_ROWS))


def engine_config(config: RunConfig) -> EngineConfig:
    """The engine's budgets and switches of a run."""
    g = config.generate
    return EngineConfig(
        max_num_seqs=g.max_num_seqs,
        max_num_batched_tokens=g.max_num_batched_tokens,
        block_size=g.kv_block_size,
        kv_cache_memory=parse_kv_memory(g.kv_cache_memory),
        chunked_prefill=g.chunked_prefill,
        prefix_cache=g.prefix_cache,
        seed=g.seed or 0,
        timed=True,
        cuda_graphs=config.device.cuda_graphs,
        attention=g.attention,
        kv_storage=kv_storage(g.kv_cache_dtype),
        max_loras=g.max_loras,
        speculative_tokens=g.num_speculative_tokens if g.speculative != "none" else 0,
    )
