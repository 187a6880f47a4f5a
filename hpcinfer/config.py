"""One frozen configuration tree, built once at the CLI (flags > recipe file > defaults).

Nothing below the CLI reads environment variables or mutates these objects; `auto` values are
resolved once, in `api.run`, into the `Resolved*` values that stages receive.

A field's choices and lower bound are its metadata (`choice`, `at_least`): `RunConfig.validate`
checks them and the command line offers them (cli/options.py), so they are written once. Each task
has its section for what only it reads (`classify`, `sparse`; `embed` is the embed task's,
`generate` generation's); what the whole encoder pipeline reads is in `tokenize`, `plan`, `pipeline`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, ClassVar

from .errors import ConfigError

# --int8-kernel: auto, or a library with 8-bit or 7-bit activations (models/int8.Int8Kernel names)
INT8_KERNELS = ("auto", "onednn", "fbgemm", "onednn-7bit", "fbgemm-7bit")
# --precision: how embeddings are written (sentence-transformers' quantize_embeddings precisions, and float16)
PRECISIONS = ("float32", "float16", "int8", "uint8", "binary", "ubinary")
# --output-value: a vector per row, or (as sentence-transformers' encode(output_value=...)) one per token
OUTPUT_VALUES = ("sentence_embedding", "token_embeddings")
POOLING_MODES = ("cls", "mean", "max", "mean_sqrt_len", "last")  # models/adapter.pool's


def choice(default: Any, choices: tuple[Any, ...], flag: str | None = None) -> Any:
    """A field whose value must be one of `choices` (None passes where it is the default)."""
    return field(default=default, metadata={"choices": tuple(choices), "flag": flag})


def at_least(default: Any, minimum: float, flag: str | None = None) -> Any:
    """A field whose value must be `minimum` or more (None passes where it is the default)."""
    return field(default=default, metadata={"min": minimum, "flag": flag})


def field_rules(config: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted field, value, metadata) of every field of the tree that declares a choice or a bound."""
    found = []
    for f in fields(config):
        value = getattr(config, f.name)
        if is_dataclass(value):
            found += field_rules(value, f"{prefix}{f.name}.")
        elif "choices" in f.metadata or "min" in f.metadata:
            found.append((f"{prefix}{f.name}", value, f.metadata))
    return found


def flag_of(path: str, metadata: Any) -> str:
    """The command-line flag of a field: its own (`flag`), else `--` and its name, dashed."""
    return metadata.get("flag") or "--" + path.rsplit(".", 1)[-1].replace("_", "-")


@dataclass(frozen=True, slots=True)
class InputConfig:
    paths: tuple[str, ...] = ()
    text_column: str = "text"
    id_column: str = "id"
    prompt_column: str | None = None  # embedding: a column whose text goes before the row's (its own prompt)
    image_column: str | None = None  # embedding: each row's image (a path, URI or bytes), not its text
    image_files: bool = True  # rows may name image files and URIs (off: inline images only, as serve runs)
    pair_columns: tuple[str, ...] = ()  # --task score: the two text columns of a pair (query, document)
    input_format: str = choice("auto", ("auto", "jsonl", "parquet", "openai"))
    read_block_rows: int = at_least(2048, 1)  # rows per record batch handed to the tokenizer
    read_chunk_bytes: int = 1 << 20  # JSONL is read in chunks of this size (a longer line spans several)
    limit: int | None = None  # read only this many input rows (profiling, sampling)
    rate: float | None = None  # replay requests at this mean rate (Poisson arrivals), per second
    rate_seed: int = 0


@dataclass(frozen=True, slots=True)
class TokenizeConfig:
    """How the encoder pipeline turns a row's text into tokens (every pooling task reads it)."""

    max_length: int | None = at_least(None, 2)  # None: the model's sentence-transformers max_seq_length
    threads: int = at_least(1, 1, "--tokenize-threads")  # concurrent tokenizer calls (each is multi-threaded)
    on_long: str = choice("truncate", ("truncate", "reject"))
    prompt: str | None = None  # text put before every row's text ("query: ")
    prompt_name: str | None = None  # a prompt the checkpoint names (config_sentence_transformers.json)


@dataclass(frozen=True, slots=True)
class EmbedConfig:
    """--task embed: what an embedding is, where the checkpoint's sentence-transformers files leave a choice."""

    pooling: str | None = choice(None, POOLING_MODES)  # None: the checkpoint's
    normalize: bool | None = None  # L2-normalise; None: as the checkpoint's modules say
    dimensions: int | None = at_least(None, 1)  # keep the first N dimensions (Matryoshka), then normalise
    precision: str = choice("float32", PRECISIONS)  # as written (tasks/embed/precision.py)
    calibration: str | None = None  # int8/uint8 ranges: a .npy of embeddings or [2, dim] ranges, or an output
    output_value: str = choice("sentence_embedding", OUTPUT_VALUES)  # tasks/embed/token_embeddings.py


@dataclass(frozen=True, slots=True)
class ClassifyConfig:
    """--task classify."""

    all_scores: bool = False  # every label's probability too, not only the best


@dataclass(frozen=True, slots=True)
class SparseConfig:
    """--task sparse."""

    max_active_dims: int = at_least(0, 0)  # each row's k largest entries; 0: the checkpoint's, or all


@dataclass(frozen=True, slots=True)
class PlanConfig:
    sort_window: int = at_least(100_000, 1)
    max_batch_tokens: int | None = at_least(None, 1)  # rows x padded length, padding included; None: per device
    # NOTE: on CPU ~2k-token batches are as fast per token as larger ones and hold less memory;
    # a GPU needs large batches to fill it.
    cpu_default_tokens: ClassVar[int] = 2048
    cuda_default_tokens: ClassVar[int] = 16_384
    max_batch_size: int = at_least(512, 1)
    pad_multiple: int = at_least(8, 1)
    # Close a batch once its oldest row has waited this long; None: off, or 20 ms under --rate.
    batch_timeout_ms: float | None = None
    online_default_timeout_ms: ClassVar[float] = 20.0


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    device: str = "auto"  # auto | cpu | cuda | cuda:N | simulated
    dtype: str = choice("auto", ("auto", "float32", "bfloat16", "float16"))
    # none | int8 (CPU) | auto (int8 where faster and close enough) | fp8 (generation)
    quantize: str = choice("none", ("none", "int8", "auto", "fp8"))
    min_cosine: float = 0.99  # --quantize int8|auto / tune: int8 only with at least this cosine to float32
    # auto (the fastest accurate one) | onednn | fbgemm, optionally -7bit (models/int8.py)
    int8_kernel: str = choice("auto", INT8_KERNELS)
    streams: int = at_least(1, 1)
    staging_buffers: int = at_least(2, 1)
    cuda_graphs: bool = False
    threads: int | None = None  # CPU intra-op threads; None keeps torch's default
    cpu_affinity: str = "off"  # off | auto | COMPUTE[/TOKENIZE[/HOST]] core lists (place/affinity.py)
    devices: str | None = None  # several devices, one replica each: "cuda:0,cuda:1", "all", "cpu,cpu"
    # which replica gets a batch: fewest outstanding tokens, or round_robin
    dispatch: str = choice("tokens", ("tokens", "round_robin"))
    # Circuit breakers (place/breaker.py), per device with --devices and per replica on Ray, both
    # tasks: failures within the window that open a breaker, its cool-down, and the time after
    # which a step (a batch, a window's progress) is a hang.
    breaker_failures: int = 2
    breaker_window: float = 600.0
    breaker_cooldown: float = 30.0
    step_timeout: float | None = 600.0
    # --tp N: the decoder split across N devices, one process per rank (generation)
    tensor_parallel: int = at_least(1, 1, "--tp")


@dataclass(frozen=True, slots=True)
class OutputConfig:
    path: str = ""
    output_format: str = choice("auto", ("auto", "parquet", "jsonl"))
    overwrite: bool = False
    resume: bool = False
    max_rejects: int | None = None  # stop once more rows than this are rejected (0: --strict)
    max_reject_fraction: float | None = None  # or once this share of input rows is rejected
    # Checkpoint finished rows at least this often (seconds of work), so a kill loses no more;
    # None: DEFAULT_COMMIT_EVERY_S on the local engine; 0: off (only whole windows are committed).
    commit_every: float | None = None
    DEFAULT_COMMIT_EVERY_S: ClassVar[float] = 30.0
    # an object-store output's lease: another host may take it this long after a crash
    lease_s: float = at_least(60.0, 3, "--lease-seconds")

    @property
    def commit_every_s(self) -> float:
        """The checkpoint interval in seconds; 0 when off."""
        return self.DEFAULT_COMMIT_EVERY_S if self.commit_every is None else self.commit_every


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    overlap: bool = True  # False: the serial reference twin
    queue_depth: int = at_least(4, 1)  # bound of every inter-stage queue (in items)
    progress: str = choice("auto", ("auto", "bar", "log", "off"))


@dataclass(frozen=True, slots=True)
class GenerateConfig:
    """Generation: default sampling (rows may override it) and the engine's budgets."""

    max_tokens: int = at_least(256, 1)
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None  # None: each row's seed derives from its input row number
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0  # transformers' rule; rows may set their own
    presence_penalty: float = 0.0  # OpenAI's
    frequency_penalty: float = 0.0  # OpenAI's
    min_tokens: int = 0  # EOS barred until the answer is this long
    max_num_seqs: int = at_least(128, 1)
    max_num_batched_tokens: int = at_least(2048, 1)
    kv_block_size: int = at_least(16, 1)
    kv_cache_memory: str | None = None  # bytes ("2GiB") or, on CUDA, a fraction of free memory
    chunked_prefill: bool = True
    window_rows: int = at_least(512, 1)  # input rows per committed window
    prefix_cache: bool = True  # full KV blocks shared across prompts with the same prefix
    prefix_order: bool = True  # admit a window's prompts sorted by token ids (rows sharing a prefix together)
    priority_column: str = "priority"  # optional integer column: higher is admitted first
    # the paged attention kernel, chosen at start-up
    attention: str = choice("auto", ("auto", "torch", "flash-attn", "triton"))
    max_model_len: int | None = None  # cap the context below the checkpoint's (positions, KV pool, prompts)
    # auto (the run's dtype) | fp8 (float8_e4m3fn with per-layer scales)
    kv_cache_dtype: str = choice("auto", ("auto", "fp8"))
    # NOTE: before the `choice` field below, which hides the function of that name
    # none | ngram (prompt lookup) | draft:MODEL (a small model of the same tokenizer): engine/speculate.py
    speculative: str = "none"
    # how a chat answer's reasoning and tool calls are split out of its text (tasks/generate/parsers.py)
    reasoning_parser: str = choice("none", ("none", "deepseek_r1", "qwen3", "gpt_oss"))
    tool_call_parser: str = choice("none", ("none", "hermes", "llama3_json", "mistral"))
    # Structured output for every row that does not ask for its own (at most one of these):
    json_schema: str | None = None  # a JSON schema file
    regex: str | None = None  # a regular expression
    choice: tuple[str, ...] = ()  # the answer is one of these strings
    grammar: str | None = None  # a Lark or GBNF grammar file
    n: int = 1  # samples per prompt; > 1 makes plain output's text and finish_reason lists
    loras: tuple[str, ...] = ()  # NAME=PATH: PEFT LoRA adapters a request may pick (models/lora.py)
    max_loras: int = at_least(0, 0)  # > 0: the most adapters running together and on the device; 0: all
    beam_width: int = 1  # > 1: beam search (engine/beam.py); rows may set their own
    length_penalty: float = 1.0  # beam search: a hypothesis scores its log-probability / length ** this
    num_speculative_tokens: int = at_least(4, 1)  # with --speculative: the most proposals a step


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    engine: str = choice("local", ("local", "ray"))  # ray: the same job in Ray Data actors, one replica each
    ray_address: str | None = None  # None: start a local Ray instance for the run
    replicas: int | None = at_least(None, 1)  # None: one per node on CPUs, one per gpus_per_replica GPUs
    gpus_per_replica: float = at_least(0.0, 0)


@dataclass(frozen=True, slots=True)
class RunConfig:
    input: InputConfig = field(default_factory=InputConfig)
    model: str = "default"
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    embed: EmbedConfig = field(default_factory=EmbedConfig)
    classify: ClassifyConfig = field(default_factory=ClassifyConfig)
    sparse: SparseConfig = field(default_factory=SparseConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    report_path: str | None = None
    report_html: str = "auto"  # auto (OUTPUT.report.html for a run of a minute or more) | off | a path
    metrics_port: int | None = None  # a Prometheus endpoint on 127.0.0.1 while the run runs
    metrics_linger_s: float = 0.0  # the endpoint stays up this long after the run, for a last scrape
    trace_path: str | None = None
    storage_options: str | None = None  # JSON: what every fsspec filesystem is made with (endpoint, region...)
    task: str = "auto"  # auto (from the checkpoint) | a task registry.TASKS names
    # auto (native where hpcinfer has the architecture, else transformers) | native | transformers
    backend: str = choice("auto", ("auto", "native", "transformers"))
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def storage(self) -> dict[str, Any]:
        """--storage-options as a dict (ConfigError if not a JSON object)."""
        if not self.storage_options:
            return {}
        try:
            value = json.loads(self.storage_options)
        except ValueError as exc:
            raise ConfigError(f"--storage-options is not JSON ({exc.msg} at character {exc.pos})") from None
        if not isinstance(value, dict):
            raise ConfigError('--storage-options must be a JSON object, e.g. \'{"endpoint_url": "http://..."}\'')
        return value

    def validate(self) -> RunConfig:
        for path, value, rule in field_rules(self):  # NOTE: the choices and bounds the fields declare
            if value is None:
                continue
            if "choices" in rule and value not in rule["choices"]:
                raise ConfigError(
                    f"{flag_of(path, rule)} must be one of {', '.join(map(str, rule['choices']))} (got {value!r})"
                )
            if "min" in rule and value < rule["min"]:
                raise ConfigError(f"{flag_of(path, rule)} must be at least {rule['min']:g} (got {value})")
        self.storage()
        if self.metrics_port is not None and not 0 < self.metrics_port < 65536:
            raise ConfigError(f"--metrics-port must be a TCP port, 1 to 65535 (got {self.metrics_port})")
        if self.metrics_linger_s < 0:
            raise ConfigError(f"--metrics-linger must be 0 seconds or more (got {self.metrics_linger_s:g})")
        if self.input.rate is not None and not self.input.rate > 0:
            raise ConfigError(f"--rate must be positive (got {self.input.rate})")
        if self.input.rate is not None and not self.pipeline.overlap:
            raise ConfigError("--rate needs the overlapped pipeline (drop --no-overlap)")
        if self.plan.batch_timeout_ms is not None and not self.plan.batch_timeout_ms > 0:
            raise ConfigError(f"--batch-timeout-ms must be positive (got {self.plan.batch_timeout_ms})")
        if self.output.commit_every is not None and not self.output.commit_every >= 0:
            raise ConfigError(f"--commit-every must be 0 (off) or more seconds (got {self.output.commit_every})")
        if self.output.commit_every and self.cluster.engine == "ray":
            raise ConfigError(
                "--commit-every checkpoints the local engine; on --engine ray a unit (one window) is committed "
                "whole: lower --sort-window or --window-rows to commit more often"
            )
        spec = self.generate.speculative
        if spec not in ("none", "ngram") and not (spec.startswith("draft:") and spec[6:].strip()):
            raise ConfigError(f"--speculative {spec!r}: give none, ngram or draft:MODEL (same tokenizer)")
        if self.output.resume and self.output.overwrite:
            raise ConfigError("--resume and --overwrite contradict each other")
        if not self.input.paths:
            raise ConfigError("no input given")
        if not 0.0 < self.device.min_cosine <= 1.0:
            raise ConfigError(f"--min-cosine must be in (0, 1] (got {self.device.min_cosine})")
        if self.embed.calibration is not None and self.embed.precision not in ("int8", "uint8"):
            raise ConfigError(f"--calibration sets int8/uint8 ranges; --precision {self.embed.precision} has none")
        pair = self.input.pair_columns
        if pair and (len(pair) != 2 or not all(pair) or pair[0] == pair[1]):
            raise ConfigError(f"--pair-columns takes two different column names, as A,B (got {','.join(pair)!r})")
        return self


def resolve_plan(plan: PlanConfig, device_kind: str, rate: float | None = None) -> PlanConfig:
    """Fills the device-dependent token budget and the online batch timeout, once, at start-up."""
    if plan.max_batch_tokens is None:
        tokens = plan.cuda_default_tokens if device_kind == "cuda" else plan.cpu_default_tokens
        plan = replace(plan, max_batch_tokens=tokens)
    if rate is not None and plan.batch_timeout_ms is None:
        plan = replace(plan, batch_timeout_ms=plan.online_default_timeout_ms)
    return plan


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """Config tree -> {'plan.max_batch_tokens': 16384, ...} for reports and fingerprints.

    --storage-options shows as the names of the options given, never their values: they may hold a
    store's credentials, and this goes into reports.
    """
    out: dict[str, Any] = {}
    for f in fields(config):
        value = getattr(config, f.name)
        key = f"{prefix}{f.name}"
        if key == "storage_options" and value:
            out[key] = sorted(config.storage())
        elif is_dataclass(value):
            out.update(flatten(value, key + "."))
        else:
            out[key] = list(value) if isinstance(value, tuple) else value
    return out
