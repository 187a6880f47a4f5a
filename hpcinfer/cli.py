"""The command line: parse -> config -> api call -> render. Data on files, humans on stderr.

NOTE: only click and the light config modules are imported here; torch, pyarrow and rich are
imported by the command that needs them, so --help, --version and argument errors answer at once.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import replace
from functools import partial, wraps
from typing import TYPE_CHECKING, Any

import click

from . import __version__
from .config import (
    ClusterConfig,
    DeviceConfig,
    InputConfig,
    OutputConfig,
    PipelineConfig,
    PlanConfig,
    RunConfig,
    TokenizeConfig,
)
from .errors import ConfigError, HpcinferError, Interrupted, StageError

if TYPE_CHECKING:
    from rich.console import Console

_DEFAULTS = RunConfig()


def _user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Renders typed errors as one line on stderr with their exit code; no traceback."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Interrupted as exc:
            args = [a for a in sys.argv[1:] if a != "--resume"]
            click.echo(f"hpcinfer: {exc}", err=True)
            click.echo(f"hpcinfer: resume with: {shlex.join(['hpcinfer', *args, '--resume'])}", err=True)
            sys.exit(exc.exit_code)
        except (HpcinferError, StageError) as exc:
            click.echo(f"hpcinfer: error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("hpcinfer: interrupted", err=True)
            sys.exit(130)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="hpcinfer")
def main() -> None:
    """hpcinfer: fast offline batch inference for transformer models."""


def _stderr_console(**kwargs: Any) -> Console:
    from rich.console import Console

    return Console(stderr=True, **kwargs)


def run_options(fn: Callable[..., Any], *, output_required: bool = True) -> Callable[..., Any]:
    """The options of `run`, shared by `profile` (decorators apply bottom-up)."""
    output_help = "Output file: .parquet or .jsonl (id, embedding), in input order."
    if not output_required:
        output_help += " [default: a temporary file, removed afterwards]"
    decorators = [
        click.argument("inputs", nargs=-1, required=True, metavar="INPUT..."),
        click.option("-o", "--output", required=output_required, help=output_help),
        click.option(
            "--output-format",
            type=click.Choice(["auto", "parquet", "jsonl"]),
            default="auto",
            show_default=True,
            help="Output format; auto reads the output suffix.",
        ),
        click.option("--overwrite", is_flag=True, help="Replace the output (and any partial results) if it exists."),
        click.option(
            "--resume",
            is_flag=True,
            help="Continue an interrupted run: skip the windows it committed, finish the rest.",
        ),
        click.option(
            "--on-long",
            type=click.Choice(["truncate", "reject"]),
            default="truncate",
            show_default=True,
            help="A row longer than --max-length is truncated (and counted) or rejected.",
        ),
        click.option(
            "--max-rejects",
            default=None,
            metavar="N|FRACTION",
            help="Stop once more than N rows (or this fraction of rows, e.g. 0.01 or 1%) are rejected.",
        ),
        click.option("--strict", is_flag=True, help="Any rejected row stops the run."),
        click.option(
            "--model",
            default=_DEFAULTS.model,
            show_default=True,
            help="'default' (the packaged all-MiniLM-L6-v2) or a local BERT-family checkpoint directory.",
        ),
        click.option(
            "--text-column",
            default=_DEFAULTS.input.text_column,
            show_default=True,
            help="Column holding the text. Without it, a list-of-int 'input_ids' column is used as is.",
        ),
        click.option(
            "--id-column",
            default=_DEFAULTS.input.id_column,
            show_default=True,
            help="Column holding row ids; when absent, the 0-based row number is the id.",
        ),
        click.option(
            "--input-format",
            type=click.Choice(["auto", "jsonl", "parquet", "openai"]),
            default="auto",
            show_default=True,
            help="Input format; auto reads the suffix and detects OpenAI batch files.",
        ),
        click.option(
            "--max-length",
            type=int,
            default=None,
            help="Truncate to this many tokens [default: the model's max_seq_length, 256 for the default].",
        ),
        click.option(
            "--tokenize-threads",
            type=int,
            default=_DEFAULTS.tokenize.threads,
            show_default=True,
            help="Concurrent tokenizer calls (each call is itself multi-threaded).",
        ),
        click.option(
            "--sort-window",
            type=int,
            default=_DEFAULTS.plan.sort_window,
            show_default=True,
            help="Rows sorted together by length; also the unit in which output is committed.",
        ),
        click.option(
            "--max-batch-tokens",
            type=int,
            default=None,
            help="Token budget per batch, padding included (rows x padded length) "
            f"[default: {PlanConfig.cpu_default_tokens} on CPU, {PlanConfig.cuda_default_tokens} on CUDA].",
        ),
        click.option(
            "--max-batch-size",
            type=int,
            default=_DEFAULTS.plan.max_batch_size,
            show_default=True,
            help="Most rows in one batch.",
        ),
        click.option(
            "--batch-timeout-ms",
            type=float,
            default=None,
            help="Close a batch once its oldest row has waited this long, full or not "
            f"[default: off; {PlanConfig.online_default_timeout_ms:g} ms with --rate].",
        ),
        click.option(
            "--rate",
            type=float,
            default=None,
            metavar="QPS",
            help="Replay the input as an online service would see it: requests arrive at this mean rate "
            "(Poisson, seeded); the report adds per-request latency and whether the pipeline kept up.",
        ),
        click.option(
            "--rate-seed", type=int, default=0, show_default=True, help="Seed of the --rate arrival schedule."
        ),
        click.option(
            "--pad-multiple",
            type=int,
            default=_DEFAULTS.plan.pad_multiple,
            show_default=True,
            help="Padded lengths are rounded up to a multiple of this.",
        ),
        click.option("--device", default=_DEFAULTS.device.device, show_default=True, help="auto, cpu, cuda or cuda:N."),
        click.option(
            "--devices",
            default=None,
            metavar="LIST|all",
            help="Run on several devices, one model replica each: cuda:0,cuda:1 or all (every visible GPU); "
            "cpu,cpu splits the CPU threads. Batches go to the device with the fewest outstanding tokens. "
            "Overrides --device.",
        ),
        click.option(
            "--engine",
            type=click.Choice(["local", "ray"]),
            default=_DEFAULTS.cluster.engine,
            show_default=True,
            help="local: this machine; ray: the same job in Ray Data actors, one model replica each "
            "(pip install 'hpcinfer[ray]').",
        ),
        click.option(
            "--ray-address",
            default=None,
            metavar="ADDR",
            help="With --engine ray: the cluster to join (auto: the one `ray start` made here); "
            "default: start a local Ray instance for the run.",
        ),
        click.option(
            "--replicas",
            type=int,
            default=None,
            help="With --engine ray: model replicas (actors) [default: one per node on CPUs, "
            "one per --gpus-per-replica GPUs].",
        ),
        click.option(
            "--gpus-per-replica",
            type=float,
            default=_DEFAULTS.cluster.gpus_per_replica,
            show_default=True,
            help="With --engine ray: GPUs each replica gets from Ray (0: CPU replicas).",
        ),
        click.option(
            "--dispatch",
            type=click.Choice(["tokens", "round_robin"]),
            default=_DEFAULTS.device.dispatch,
            show_default=True,
            help="With --devices: send each batch to the device with the fewest outstanding tokens, or in turn.",
        ),
        click.option(
            "--dtype",
            type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
            default="auto",
            show_default=True,
            help="Compute dtype; auto is float32 on CPU, bfloat16 on CUDA.",
        ),
        click.option(
            "--streams", type=int, default=_DEFAULTS.device.streams, show_default=True, help="Compute streams on CUDA."
        ),
        click.option(
            "--staging-buffers",
            type=int,
            default=_DEFAULTS.device.staging_buffers,
            show_default=True,
            help="Pinned staging slots (2 = double buffering).",
        ),
        click.option(
            "--cuda-graphs",
            is_flag=True,
            help="Capture the forward as CUDA graphs per (rows, length) bucket and replay them (CUDA only).",
        ),
        click.option("--threads", type=int, default=None, help="CPU threads for compute [default: torch's choice]."),
        click.option(
            "--no-overlap", is_flag=True, help="Run the stages serially, one batch at a time (the reference)."
        ),
        click.option(
            "--queue-depth",
            type=int,
            default=_DEFAULTS.pipeline.queue_depth,
            show_default=True,
            help="Bound of each queue between stages.",
        ),
        click.option(
            "--progress",
            type=click.Choice(["auto", "bar", "log", "off"]),
            default="auto",
            show_default=True,
            help="Progress display on stderr; auto: a bar on a terminal, log lines otherwise.",
        ),
        click.option("--report", "report_path", default=None, help="Also write the report as JSON to this file."),
        click.option(
            "--trace", "trace_path", default=None, help="Write every stage span as a Chrome trace (Perfetto)."
        ),
        click.option(
            "--config",
            "config",
            default=None,
            metavar="RECIPE.toml",
            help="Take options from a recipe file (see recipes/); flags given here override it.",
        ),
        click.option("-q", "--quiet", is_flag=True, help="No summary tables."),
        *_generate_options(),
    ]
    for decorator in reversed(decorators):
        fn = decorator(fn)
    return fn


def _generate_options() -> list[Callable[..., Any]]:
    """Generation options (a `*ForCausalLM` checkpoint); per-row values in the input override them."""
    g = _DEFAULTS.generate
    return [
        click.option(
            "--task",
            type=click.Choice(["auto", "embed", "generate"]),
            default="auto",
            show_default=True,
            help="auto: a *ForCausalLM checkpoint generates, an encoder embeds.",
        ),
        click.option("--max-tokens", type=int, default=g.max_tokens, show_default=True, help="Tokens to generate."),
        click.option("--temperature", type=float, default=g.temperature, show_default=True, help="0: greedy."),
        click.option("--top-p", type=float, default=g.top_p, show_default=True, help="Nucleus sampling mass."),
        click.option("--top-k", type=int, default=g.top_k, show_default=True, help="0: off."),
        click.option("--min-p", type=float, default=g.min_p, show_default=True, help="0: off."),
        click.option("--seed", type=int, default=None, help="Run seed; each row's stream also depends on its row."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option("--ignore-eos", is_flag=True, help="Keep generating past EOS (benchmarks)."),
        click.option("--max-num-seqs", type=int, default=g.max_num_seqs, show_default=True, help="Sequences a step."),
        click.option(
            "--max-num-batched-tokens",
            type=int,
            default=g.max_num_batched_tokens,
            show_default=True,
            help="Tokens a step (decodes + prefill chunks).",
        ),
        click.option("--kv-block-size", type=int, default=g.kv_block_size, show_default=True, help="Tokens a block."),
        click.option(
            "--kv-cache-memory",
            default=None,
            help="KV pool size, e.g. 2GiB, or on CUDA a fraction of free memory [default: 1GiB on CPU, 0.85 on CUDA].",
        ),
        click.option("--no-chunked-prefill", is_flag=True, help="Admit a prompt only when it fits one step."),
        click.option(
            "--window-rows", type=int, default=g.window_rows, show_default=True, help="Rows per committed window."
        ),
        click.option("--no-prefix-cache", is_flag=True, help="Compute every prompt in full (no shared KV blocks)."),
        click.option(
            "--no-prefix-order", is_flag=True, help="Admit a window's prompts in file order, not sorted by prefix."
        ),
        click.option(
            "--priority-column",
            default=g.priority_column,
            show_default=True,
            help="Optional integer column; rows with a higher value are admitted first.",
        ),
        click.option(
            "--attention",
            type=click.Choice(["auto", "torch", "flash-attn"]),
            default=g.attention,
            show_default=True,
            help="Paged attention kernel; auto: flash-attn on CUDA where it can run (--kv-block-size 256), else torch.",
        ),
    ]


def _generate_config(o: dict[str, Any]) -> Any:
    from .config import GenerateConfig

    if "max_num_seqs" not in o:  # a command without the generation options
        return GenerateConfig()
    return GenerateConfig(
        o["max_tokens"],
        o["temperature"],
        o["top_p"],
        o["top_k"],
        o["min_p"],
        o["seed"],
        tuple(o["stop"]),
        o["ignore_eos"],
        o["max_num_seqs"],
        o["max_num_batched_tokens"],
        o["kv_block_size"],
        o["kv_cache_memory"],
        not o["no_chunked_prefill"],
        o["window_rows"],
        not o["no_prefix_cache"],
        not o["no_prefix_order"],
        o["priority_column"],
        o["attention"],
    )


@main.command()
@run_options
@_user_errors
def run(**opts: Any) -> None:
    """Embed every row of INPUT... (JSONL, Parquet, OpenAI batch JSONL; files, directories or globs).

    \b
    Example:
      hpcinfer run sample_data/requests.jsonl -o out.parquet --report report.json
    """
    from .api import run as api_run
    from .obs.render import render

    config = build_run_config(apply_recipe(click.get_current_context(), opts))
    report = api_run(config)
    if not opts["quiet"]:
        render(report, _stderr_console())


def apply_recipe(ctx: click.Context, opts: dict[str, Any]) -> dict[str, Any]:
    """Recipe values fill the options the command line left at their defaults."""
    if not opts.get("config"):
        return opts
    from .recipes import load_recipe

    params = {p.name: p for p in ctx.command.params if p.name}
    recipe = load_recipe(opts["config"], set(params))
    merged = dict(opts)
    for name, value in recipe.items():
        if ctx.get_parameter_source(name) in (None, click.core.ParameterSource.DEFAULT):
            try:
                merged[name] = params[name].type_cast_value(ctx, value)
            except click.BadParameter as exc:
                raise ConfigError(f"key '{name.replace('_', '-')}': {exc.message}", path=opts["config"]) from None
    return merged


def _reject_limits(o: dict[str, Any]) -> tuple[int | None, float | None]:
    """--strict -> (0, None); --max-rejects 100 -> (100, None); 0.01 or 1% -> (None, 0.01)."""
    if o["strict"]:
        return 0, None
    raw = o["max_rejects"]
    if raw is None:
        return None, None
    try:
        if raw.endswith("%"):
            return None, float(raw[:-1]) / 100
        value = float(raw)
    except ValueError:
        raise click.BadParameter(f"{raw!r} is neither a count nor a fraction", param_hint="--max-rejects") from None
    return (int(value), None) if value >= 1 or value == 0 else (None, value)


def build_run_config(o: dict[str, Any]) -> RunConfig:
    return RunConfig(
        input=InputConfig(
            tuple(o["inputs"]),
            o["text_column"],
            o["id_column"],
            o["input_format"],
            rate=o["rate"],
            rate_seed=o["rate_seed"],
        ),
        model=o["model"],
        tokenize=TokenizeConfig(o["max_length"], o["tokenize_threads"], o["on_long"]),
        plan=PlanConfig(
            o["sort_window"], o["max_batch_tokens"], o["max_batch_size"], o["pad_multiple"], o["batch_timeout_ms"]
        ),
        device=DeviceConfig(
            o["device"],
            o["dtype"],
            o["streams"],
            o["staging_buffers"],
            o["cuda_graphs"],
            o["threads"],
            o["devices"],
            o["dispatch"],
        ),
        output=OutputConfig(o["output"], o["output_format"], o["overwrite"], o["resume"], *_reject_limits(o)),
        pipeline=PipelineConfig(not o["no_overlap"], o["queue_depth"], o["progress"]),
        report_path=o["report_path"],
        trace_path=o["trace_path"],
        task=o.get("task", "auto"),
        generate=_generate_config(o),
        cluster=ClusterConfig(o["engine"], o["ray_address"], o["replicas"], o["gpus_per_replica"]),
    )


@main.command()
@partial(run_options, output_required=False)
@click.option("--limit", type=int, default=None, help="Profile only the first N input rows.")
@click.option(
    "--torch-profile",
    "torch_profile",
    default=None,
    metavar="DIR",
    help="Also write a torch.profiler trace (CPU and CUDA activities) of a few batches into DIR.",
)
@_user_errors
def profile(**opts: Any) -> None:
    """Run a job with NVTX ranges around every stage step, for Nsight Systems; write its trace.

    Ranges are named like 'hpcinfer/execute batch=17 rows=64 tokens=8192', on the thread that does
    the work. Prints the nsys command that captures the same job, writes the Chrome trace
    (--trace, default hpcinfer-trace.json) and ends with the per-stage table.

    Without -o the results go to a temporary file, removed at the end: profiling needs no output.

    \b
    Example:
      hpcinfer profile sample_data/requests.parquet --limit 1000 --torch-profile prof/
    """
    import tempfile

    from .api import run
    from .obs.profile import run_profiled
    from .obs.render import render

    opts["trace_path"] = opts["trace_path"] or "hpcinfer-trace.json"
    console = _stderr_console()
    with tempfile.TemporaryDirectory(prefix="hpcinfer-profile-") as scratch:
        if opts["output"] is None:
            opts = {**opts, "output": os.path.join(scratch, "results.parquet"), "overwrite": False, "resume": False}
        config = build_run_config(apply_recipe(click.get_current_context(), opts))
        config = replace(config, input=replace(config.input, limit=opts["limit"]))
        report, notes = run_profiled(run, config, sys.argv[2:], opts["torch_profile"])

    if not opts["quiet"]:
        render(report, console)
    for note in notes:
        console.print(note, highlight=False, soft_wrap=True)


@main.command()
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@click.option(
    "--sample",
    "sample_rows",
    type=int,
    default=None,
    help="Rows in the tuning sample [default: 2000; 512 requests for a causal LM].",
)
@click.option(
    "--scan-rows",
    type=int,
    default=50_000,
    show_default=True,
    help="Rows read (and tokenized) to draw the sample from, stratified over token length.",
)
@click.option("--repeats", type=int, default=3, show_default=True, help="Measured runs per trial; medians are kept.")
@click.option(
    "--warmup-rows",
    type=int,
    default=None,
    help="Rows run before each trial's measured runs [default: 200; 32 for a causal LM, with answers "
    "cut to 16 tokens].",
)
@click.option(
    "--objective",
    type=click.Choice(["rows", "tokens", "latency"]),
    default=None,
    help="Maximise rows/s or tokens/s, or (with --rate) minimise p99 request latency [default: rows; "
    "latency with --rate; generated tokens/s for a causal LM, where latency is refused].",
)
@click.option(
    "--max-p99-ms",
    type=float,
    default=None,
    help="Reject configurations whose p99 latency (per batch; per request with --rate) exceeds this.",
)
@click.option(
    "--max-memory",
    default=None,
    metavar="SIZE",
    help="Reject configurations whose peak memory (device memory on CUDA, RSS on CPU) exceeds this, e.g. 4GiB.",
)
@click.option(
    "--min-gain",
    type=float,
    default=0.05,
    show_default=True,
    help="A change must beat the best so far by this fraction to be taken (and to keep searching that way).",
)
@click.option("--trials", "trials_csv", default=None, metavar="CSV", help="Write every trial to this CSV file.")
@click.option(
    "--write-recipe", "recipe_path", default=None, metavar="TOML", help="Write the best configuration as a recipe."
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the sample draw.")
@click.option("-q", "--quiet", is_flag=True, help="Only the verdict, no live table.")
@_user_errors
def tune(**opts: Any) -> None:
    """Find the fastest configuration for INPUT... on this machine, and write it down as a recipe.

    Draws --sample rows (stratified over token length), then measures the real pipeline on them:
    the token budget coarse-to-fine over powers of two, then the row cap, then (on CUDA) streams
    and staging buffers, and with --rate the batch timeout. Each trial has a warm-up and
    --repeats measured runs (medians). A trial that runs out of memory is marked infeasible.

    A causal LM (or --task generate) is tuned as `run` generates: the sample is read as generation
    requests (prompt, messages, prompt_token_ids or OpenAI batch rows, per-row max_tokens), the
    decoder is loaded once, and each run goes through a fresh engine. It sweeps --max-num-seqs,
    then --max-num-batched-tokens, then --max-num-seqs again around the best, up to what the
    sample and the KV pool (--kv-cache-memory) can use, maximising generated tokens/s; a change
    is taken only if it wins in every repeat by --min-gain. Last it measures prefix caching off
    at the best point and turns it off only if off wins in every repeat by --min-gain. The recipe
    sets max-num-seqs, max-num-batched-tokens and prefix-cache. Give the sampling options
    (--max-tokens, --temperature, ...) that the real run will use. --rate, --objective latency and
    --max-p99-ms are refused.

    \b
    Example:
      hpcinfer tune sample_data/requests.parquet --sample 2000 --write-recipe best.toml --trials trials.csv
      hpcinfer run sample_data/requests.parquet -o out.parquet --config best.toml
      hpcinfer tune prompts.jsonl --model my-llama/ --max-tokens 128 --write-recipe gen.toml
    """
    from rich.console import Console
    from rich.live import Live

    from .tune.command import TuneOptions
    from .tune.command import tune as run_tune
    from .tune.render import trial_line, trial_table, verdict

    # `run`'s own defaults, parsed as click resolves them, then this command's shared options.
    run_defaults = run.make_context("run", ["INPUT", "-o", "unused.parquet"]).params
    base = build_run_config({**run_defaults, **{k: v for k, v in opts.items() if k in run_defaults}, "progress": "off"})
    options = TuneOptions(
        opts["sample_rows"],
        opts["scan_rows"],
        opts["repeats"],
        opts["warmup_rows"],
        opts["objective"],
        opts["max_p99_ms"],
        opts["max_memory"],
        opts["min_gain"],
        opts["seed"],
        opts["trials_csv"],
        opts["recipe_path"],
    )
    console = Console(stderr=True)
    if not console.is_terminal:  # a log file: room for the whole trial table
        console = Console(stderr=True, width=160)
    live_table = console.is_terminal and not opts["quiet"]

    def on_sample(sample: Any) -> None:
        if not opts["quiet"]:
            console.print(f"sample: {sample.describe()}", highlight=False)

    with Live(console=console, auto_refresh=False, transient=False) if live_table else _nothing() as live:

        def on_trial(search: Any, trial: Any, status: str) -> None:
            if live is not None:
                live.update(trial_table(search, status), refresh=True)
            elif trial is not None and not opts["quiet"]:
                console.print(trial_line(search, trial), highlight=False)

        result = run_tune(base.validate(), options, on_sample, on_trial)
        if live is not None:
            live.update(trial_table(result.search), refresh=True)
    if not live_table and not opts["quiet"]:
        console.print(trial_table(result.search))
    for line in verdict(result.search):
        console.print(line, highlight=False)
    if opts["recipe_path"]:
        console.print(f"recipe written: {opts['recipe_path']} (hpcinfer run --config {opts['recipe_path']} ...)")
    if opts["trials_csv"]:
        console.print(f"trials written: {opts['trials_csv']}")


# What is tuned (the model, the input's columns, the device, an arrival rate; for a causal LM the
# sampling defaults and the KV pool) is given exactly as to `run`: the very same option objects,
# placed before -q.
_TUNED_AS_IN_RUN = (
    "model",
    "text_column",
    "id_column",
    "input_format",
    "max_length",
    "tokenize_threads",
    "device",
    "devices",
    "dtype",
    "threads",
    "rate",
    "rate_seed",
    "task",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "ignore_eos",
    "kv_block_size",
    "kv_cache_memory",
    "no_chunked_prefill",
    "window_rows",
    "no_prefix_order",
    "priority_column",
)
tune.params[-1:-1] = [p for p in run.params if p.name in _TUNED_AS_IN_RUN]


class _nothing:  # noqa: N801 - a context manager standing in for Live when there is no terminal
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
