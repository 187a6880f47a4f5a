"""One frozen configuration tree, built once at the CLI (flags > recipe file > defaults).

Nothing below the CLI reads environment variables or mutates these objects; `auto` values are
resolved once, in `api.run`, into the `Resolved*` values that stages receive.
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


@dataclass(frozen=True, slots=True)
class InputConfig:
    paths: tuple[str, ...] = ()
    text_column: str = "text"
    id_column: str = "id"
    prompt_column: str | None = None  # embedding: a column whose text goes before the row's (its own prompt)
    pair_columns: tuple[str, ...] = ()  # --task score: the two text columns of a pair (query, document)
    input_format: str = "auto"  # auto | jsonl | parquet | openai
    read_block_rows: int = 2048  # rows per record batch handed to the tokenizer
    read_chunk_bytes: int = 1 << 20  # JSONL is read in chunks of this size (a longer line spans several)
    limit: int | None = None  # read only this many input rows (profiling, sampling)
    rate: float | None = None  # replay requests at this mean rate (Poisson arrivals), per second
    rate_seed: int = 0


@dataclass(frozen=True, slots=True)
class TokenizeConfig:
    max_length: int | None = None  # None: the model's sentence-transformers max_seq_length
    threads: int = 1  # concurrent tokenizer calls (each call is itself multi-threaded)
    on_long: str = "truncate"  # truncate | reject


@dataclass(frozen=True, slots=True)
class EmbedConfig:
    """What an embedding is, where the checkpoint's sentence-transformers files leave a choice."""

    pooling: str | None = None  # cls | mean | max | mean_sqrt_len | last; None: the checkpoint's
    normalize: bool | None = None  # L2-normalise; None: as the checkpoint's modules say
    dimensions: int | None = None  # keep the first N dimensions (Matryoshka), then normalise if normalising
    prompt: str | None = None  # text put before every row's text ("query: ")
    prompt_name: str | None = None  # a prompt the checkpoint names (config_sentence_transformers.json)
    all_scores: bool = False  # --task classify: every label's probability too, not only the best
    precision: str = "float32"  # float32 | float16 | int8 | uint8 | binary | ubinary (tasks/embed/precision.py)
    calibration: str | None = None  # int8/uint8 ranges: a .npy of embeddings or [2, dim] ranges, or an output
    output_value: str = "sentence_embedding"  # or token_embeddings (tasks/embed/token_embeddings.py)


@dataclass(frozen=True, slots=True)
class PlanConfig:
    sort_window: int = 100_000
    max_batch_tokens: int | None = None  # rows x padded length, padding included; None: per device
    # NOTE: on CPU ~2k-token batches are as fast per token as larger ones and hold less memory;
    # a GPU needs large batches to fill it.
    cpu_default_tokens: ClassVar[int] = 2048
    cuda_default_tokens: ClassVar[int] = 16_384
    max_batch_size: int = 512
    pad_multiple: int = 8
    # Close a batch once its oldest row has waited this long; None: off, or 20 ms under --rate.
    batch_timeout_ms: float | None = None
    online_default_timeout_ms: ClassVar[float] = 20.0


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    device: str = "auto"  # auto | cpu | cuda | cuda:N | simulated
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    quantize: str = "none"  # none | int8 (CPU) | auto (int8 where faster and close enough) | fp8 (generation)
    min_cosine: float = 0.99  # --quantize int8|auto / tune: int8 only with at least this cosine to float32
    int8_kernel: str = "auto"  # auto (the fastest accurate one) | onednn | fbgemm, optionally -7bit (models/int8.py)
    streams: int = 1
    staging_buffers: int = 2
    cuda_graphs: bool = False
    threads: int | None = None  # CPU intra-op threads; None keeps torch's default
    cpu_affinity: str = "off"  # off | auto | COMPUTE[/TOKENIZE[/HOST]] core lists (place/affinity.py)
    devices: str | None = None  # several devices, one replica each: "cuda:0,cuda:1", "all", "cpu,cpu"
    dispatch: str = "tokens"  # which replica gets a batch: fewest outstanding tokens, or round_robin
    # Circuit breakers (place/breaker.py), per device with --devices and per replica on Ray, both
    # tasks: failures within the window that open a breaker, its cool-down, and the time after
    # which a step (a batch, a window's progress) is a hang.
    breaker_failures: int = 2
    breaker_window: float = 600.0
    breaker_cooldown: float = 30.0
    step_timeout: float | None = 600.0
    tensor_parallel: int = 1  # --tp N: the decoder split across N devices, one process per rank (generation)


@dataclass(frozen=True, slots=True)
class OutputConfig:
    path: str = ""
    output_format: str = "auto"  # auto | parquet | jsonl
    overwrite: bool = False
    resume: bool = False
    max_rejects: int | None = None  # stop once more rows than this are rejected (0: --strict)
    max_reject_fraction: float | None = None  # or once this share of input rows is rejected
    # Checkpoint finished rows at least this often (seconds of work), so a kill loses no more;
    # None: DEFAULT_COMMIT_EVERY_S on the local engine; 0: off (only whole windows are committed).
    commit_every: float | None = None
    DEFAULT_COMMIT_EVERY_S: ClassVar[float] = 30.0
    lease_s: float = 60.0  # an object-store output's lease: another host may take it this long after a crash

    @property
    def commit_every_s(self) -> float:
        """The checkpoint interval in seconds; 0 when off."""
        return self.DEFAULT_COMMIT_EVERY_S if self.commit_every is None else self.commit_every


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    overlap: bool = True  # False: the serial reference twin
    queue_depth: int = 4  # bound of every inter-stage queue (in items)
    progress: str = "auto"  # auto | bar | log | off


@dataclass(frozen=True, slots=True)
class GenerateConfig:
    """Generation: default sampling (rows may override it) and the engine's budgets."""

    max_tokens: int = 256
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
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    kv_block_size: int = 16
    kv_cache_memory: str | None = None  # bytes ("2GiB") or, on CUDA, a fraction of free memory
    chunked_prefill: bool = True
    window_rows: int = 512  # input rows per committed window
    prefix_cache: bool = True  # full KV blocks shared across prompts with the same prefix
    prefix_order: bool = True  # admit a window's prompts sorted by token ids (rows sharing a prefix together)
    priority_column: str = "priority"  # optional integer column: higher is admitted first
    attention: str = "auto"  # auto | torch | flash-attn | triton: the paged attention kernel, chosen at start-up
    max_model_len: int | None = None  # cap the context below the checkpoint's (positions, KV pool, prompts)
    kv_cache_dtype: str = "auto"  # auto (the run's dtype) | fp8 (float8_e4m3fn with per-layer scales)
    # Structured output for every row that does not ask for its own (at most one of these):
    json_schema: str | None = None  # a JSON schema file
    regex: str | None = None  # a regular expression
    choice: tuple[str, ...] = ()  # the answer is one of these strings
    grammar: str | None = None  # a Lark or GBNF grammar file
    n: int = 1  # samples per prompt; > 1 makes plain output's text and finish_reason lists


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    engine: str = "local"  # local | ray: the same job in Ray Data actors, one replica each
    ray_address: str | None = None  # None: start a local Ray instance for the run
    replicas: int | None = None  # None: one per node on CPUs, one per gpus_per_replica GPUs
    gpus_per_replica: float = 0.0


@dataclass(frozen=True, slots=True)
class RunConfig:
    input: InputConfig = field(default_factory=InputConfig)
    model: str = "default"
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    embed: EmbedConfig = field(default_factory=EmbedConfig)
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
    backend: str = "native"  # native | transformers (the pooling tasks on any checkpoint transformers loads)
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
        positive = {
            "--max-batch-tokens": self.plan.max_batch_tokens or 1,
            "--max-batch-size": self.plan.max_batch_size,
            "--sort-window": self.plan.sort_window,
            "--pad-multiple": self.plan.pad_multiple,
            "--streams": self.device.streams,
            "--staging-buffers": self.device.staging_buffers,
            "--tokenize-threads": self.tokenize.threads,
            "--queue-depth": self.pipeline.queue_depth,
        }
        for flag, value in positive.items():
            if value < 1:
                raise ConfigError(f"{flag} must be at least 1 (got {value})")
        self.storage()
        if self.output.lease_s < 3:
            raise ConfigError(f"--lease-seconds must be at least 3 (got {self.output.lease_s:g})")
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
        if self.device.dispatch not in ("tokens", "round_robin"):
            raise ConfigError(f"--dispatch must be tokens or round_robin (got {self.device.dispatch!r})")
        if self.tokenize.on_long not in ("truncate", "reject"):
            raise ConfigError(f"--on-long must be truncate or reject (got {self.tokenize.on_long!r})")
        if self.output.commit_every is not None and not self.output.commit_every >= 0:
            raise ConfigError(f"--commit-every must be 0 (off) or more seconds (got {self.output.commit_every})")
        if self.output.commit_every and self.cluster.engine == "ray":
            raise ConfigError(
                "--commit-every checkpoints the local engine; on --engine ray a unit (one window) is committed "
                "whole: lower --sort-window or --window-rows to commit more often"
            )
        if self.output.resume and self.output.overwrite:
            raise ConfigError("--resume and --overwrite contradict each other")
        if self.tokenize.max_length is not None and self.tokenize.max_length < 2:
            raise ConfigError("--max-length must be at least 2")
        if self.cluster.engine not in ("local", "ray"):
            raise ConfigError(f"--engine must be local or ray (got {self.cluster.engine!r})")
        if self.cluster.replicas is not None and self.cluster.replicas < 1:
            raise ConfigError(f"--replicas must be at least 1 (got {self.cluster.replicas})")
        if self.device.tensor_parallel < 1:
            raise ConfigError(f"--tp must be at least 1 (got {self.device.tensor_parallel})")
        if self.cluster.gpus_per_replica < 0:
            raise ConfigError(f"--gpus-per-replica must not be negative (got {self.cluster.gpus_per_replica})")
        if not self.input.paths:
            raise ConfigError("no input given")
        if not 0.0 < self.device.min_cosine <= 1.0:
            raise ConfigError(f"--min-cosine must be in (0, 1] (got {self.device.min_cosine})")
        if self.device.int8_kernel not in INT8_KERNELS:
            kernels = ", ".join(INT8_KERNELS)
            raise ConfigError(f"--int8-kernel must be one of {kernels} (got {self.device.int8_kernel!r})")
        if self.backend not in ("native", "transformers"):
            raise ConfigError(f"--backend must be native or transformers (got {self.backend!r})")
        if self.embed.precision not in PRECISIONS:
            raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)} (got {self.embed.precision!r})")
        if self.embed.calibration is not None and self.embed.precision not in ("int8", "uint8"):
            raise ConfigError(f"--calibration sets int8/uint8 ranges; --precision {self.embed.precision} has none")
        if self.embed.output_value not in OUTPUT_VALUES:
            values = ", ".join(OUTPUT_VALUES)
            raise ConfigError(f"--output-value must be one of {values} (got {self.embed.output_value!r})")
        pair = self.input.pair_columns
        if pair and (len(pair) != 2 or not all(pair) or pair[0] == pair[1]):
            raise ConfigError(f"--pair-columns takes two different column names, as A,B (got {','.join(pair)!r})")
        gen = self.generate
        for flag, value in {
            "--max-num-seqs": gen.max_num_seqs,
            "--max-num-batched-tokens": gen.max_num_batched_tokens,
            "--kv-block-size": gen.kv_block_size,
            "--window-rows": gen.window_rows,
            "--max-tokens": gen.max_tokens,
        }.items():
            if value < 1:
                raise ConfigError(f"{flag} must be at least 1 (got {value})")
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
