"""The commands: `run` (the job), `profile` (the job under NVTX ranges), `tune` (trials of it), `report`
(the HTML report from a JSON one) and `serve` (OpenAI's Batch API).

`run` prints two lines besides the report (`task_line`, `rejects_line`): which task `--task auto`
picked (before the run starts), and how many rows were rejected and where they went (even with -q).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import click

from .. import __version__
from ..errors import ConfigError, HpcinferError
from .declare import SectionedCommand
from .errors import user_errors
from .options import build_run_config, build_tune_options, with_options

if TYPE_CHECKING:
    from rich.console import Console

    from ..config import RunConfig


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="hpcinfer")
def main() -> None:
    """hpcinfer: fast offline batch inference for transformer models."""


def _stderr_console(**kwargs: Any) -> Console:
    from rich.console import Console

    return Console(stderr=True, **kwargs)


def start_computing(threads: int | None) -> None:
    """What a command that computes settles once, before its model loads: a heap that keeps freed
    memory for the next batch (device/heap.py) and its thread count (device/threads.py)."""
    from ..device.heap import keep_freed_memory
    from ..device.threads import PROCESS

    keep_freed_memory()
    PROCESS.settle(threads)  # NOTE: a busy machine's cores are not ours


def apply_recipe(ctx: click.Context, opts: dict[str, Any]) -> dict[str, Any]:
    """Recipe values fill the options the command line left at their defaults."""
    if not opts.get("config"):
        return opts
    from ..recipes import load_recipe

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


@main.command(cls=SectionedCommand)
@with_options("run")
@user_errors
def run(**opts: Any) -> None:
    """Run every row of INPUT... through the model: embeddings from an encoder, answers from a
    causal LM. INPUT is JSONL, Parquet or an OpenAI batch file; files, directories or globs.

    \b
    Example:
      hpcinfer run sample_data/requests.jsonl -o out.parquet --report report.json
    """
    from ..api import run as api_run
    from ..files import storage
    from ..files.parts import has_commits
    from ..job.output_checks import OutputComplete, check_resume_of_complete
    from ..obs.progress import Progress
    from ..obs.render import render

    config = build_run_config(apply_recipe(click.get_current_context(), opts), "run").validate()
    quiet, output = opts["quiet"], config.output.path
    # NOTE: the task line goes out as the run starts (its inputs and output checked, its model
    # loaded), before any progress line, so a start-up error stays one line
    progress = Progress(config.pipeline.progress, header=None if quiet else task_line(config))
    try:
        storage.configure(config.storage())
        check_resume_of_complete(output, config.output.resume, has_commits(output))  # before loading anything
        start_computing(config.device.threads)
        report = api_run(config, progress=progress)
    except OutputComplete as exc:
        click.echo(f"hpcinfer: {exc}", err=True)
        return
    rejected = rejects_line(report, output)
    if not quiet:
        console = _stderr_console()
        render(report, console)
        if rejected:
            console.print(rejected, highlight=False, soft_wrap=True)
    elif rejected:  # NOTE: even a quiet run says that rows were set aside, and where
        click.echo(f"hpcinfer: {rejected}", err=True)
    if getattr(report, "html_report", "") and config.report_html == "auto":
        click.echo(f"hpcinfer: report: {report.html_report} (--report-html off: none)", err=True)


@main.command(cls=SectionedCommand)
@with_options("profile")
@user_errors
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
    from ..api import run as api_run
    from ..device.heap import keep_freed_memory
    from ..files.scratch import ScratchDir
    from ..obs.profile import run_profiled
    from ..obs.render import render

    opts["trace_path"] = opts["trace_path"] or "hpcinfer-trace.json"
    console = _stderr_console()
    with ScratchDir("profile") as scratch:
        if not opts["output"]:
            opts = {**opts, "output": os.path.join(scratch, "results.parquet"), "overwrite": False, "resume": False}
            if opts.get("report_html") in (None, "auto"):  # NOTE: not beside a scratch output that is removed
                opts["report_html"] = "off"
        config = build_run_config(apply_recipe(click.get_current_context(), opts), "profile")
        keep_freed_memory()  # NOTE: the profiled job's memory as `run`'s
        report, notes = run_profiled(api_run, config, sys.argv[2:], opts["torch_profile"])

    if not opts["quiet"]:
        render(report, console)
    for note in notes:
        console.print(note, highlight=False, soft_wrap=True)


@main.command(cls=SectionedCommand)
@with_options("tune")
@user_errors
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
    from .tune_view import show_tuning

    base = build_run_config(opts, "tune")
    base = replace(base, pipeline=replace(base.pipeline, progress="off"))
    start_computing(base.device.threads)
    show_tuning(base.validate(), build_tune_options(opts), opts)


@main.command("report")
@click.argument("report_json", metavar="REPORT.json", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, metavar="FILE.html", help="The HTML file to write.")
@user_errors
def report(report_json: str, output: str) -> None:
    """Make the HTML report of a run or a tune from its JSON report (`--report`): the same page the
    run itself writes with --report-html, one self-contained file.

    \b
    Example:
      hpcinfer run in.jsonl -o out.parquet --report report.json
      hpcinfer report report.json -o report.html
    """
    from ..obs.html.load import read_report, write_page

    write_page(read_report(report_json), report_json, output)
    click.echo(f"hpcinfer: report: {output}", err=True)


@main.command()
@click.option(
    "--model",
    default="default",
    show_default=True,
    metavar="default|smollm2|DIR|FILE.gguf",
    help="The model every batch runs (its task decides the endpoints served: /v1/chat/completions, "
    "/v1/completions and /v1/responses for a causal LM, /v1/embeddings for an embedder, /v1/score and /v1/rerank for a "
    "cross-encoder).",
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to bind; one other machines can reach needs --api-key.",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    metavar="NAME",
    help="A Host header name taken besides the bound address (a DNS name clients use for it); repeatable. "
    "Requests naming any other host are refused (DNS rebinding).",
)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option(
    "--data-dir",
    default="hpcinfer-serve",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Where the state (SQLite), uploaded and produced files and running batches live; a restart "
    "with the same folder resumes every batch that was running.",
)
@click.option(
    "--api-key",
    envvar="HPCINFER_API_KEY",
    default=None,
    metavar="KEY",
    help="Required as `Authorization: Bearer KEY` on every route; several keys separated by commas, each "
    "seeing only the files and batches it made [env: HPCINFER_API_KEY]. Without it the server makes a key and "
    "keeps it in DATA_DIR/api-key, readable by you only.",
)
@click.option(
    "--no-auth",
    is_flag=True,
    help="Serve without any key (loopback addresses only): every user of this machine can then read and run "
    "every batch. For a single-user machine.",
)
@click.option(
    "--max-file-bytes", default=200_000_000, show_default=True, type=int, help="Largest upload accepted (413 beyond)."
)
@click.option(
    "--max-requests",
    default=50_000,
    show_default=True,
    type=int,
    help="Most requests in one batch file (the batch fails validation beyond).",
)
@click.option(
    "--max-key-bytes",
    default=100_000_000_000,
    show_default=True,
    type=int,
    help="What one key's files (uploads and produced outputs) may hold in all; an upload beyond is refused "
    "(413 quota_exceeded). 0: no quota.",
)
@click.option(
    "--keep-models",
    default=1,
    show_default=True,
    type=click.IntRange(min=0),
    help="Models kept loaded between batches, so a queue of small batches loads the model once; 0 loads it "
    "for every batch (frees its memory between batches).",
)
@click.option(
    "--config",
    "recipe",
    default=None,
    metavar="RECIPE.toml",
    help="`run` options every batch runs with (device, dtype, --max-num-seqs, ...), as a recipe file.",
)
@user_errors
def serve(model: str, host: str, allowed_hosts: tuple[str, ...], port: int, data_dir: str, api_key: str | None,
          no_auth: bool, max_file_bytes: int, max_requests: int, max_key_bytes: int, keep_models: int,
          recipe: str | None) -> None:  # fmt: skip
    """Serve OpenAI's Batch API (files and batches) on this machine: upload a JSONL batch file, create a
    batch, poll it, download its output and error files, with the official `openai` client. Batches run
    one at a time through the same job as `hpcinfer run` (windows committed as they finish), and a
    server killed mid-batch resumes it on restart: every request answered exactly once.

    \b
    Example:
      hpcinfer serve --model smollm2 --data-dir ./batches
      export OPENAI_API_KEY=$(cat ./batches/api-key)
      python -c "from openai import OpenAI; c = OpenAI(base_url='http://127.0.0.1:8000/v1'); ..."
    """
    from pathlib import Path

    from ..serve.command import Access, Limits
    from ..serve.command import serve as run_server

    base = batch_run_config(model, recipe)
    start_computing(base.device.threads)
    keys = tuple(k.strip() for k in (api_key or "").split(",") if k.strip())
    access = Access(keys, no_auth, allowed_hosts)
    limits = Limits(max_file_bytes, max_requests, max_key_bytes)
    run_server(base, host, port, Path(data_dir), access, limits, keep_models)


def batch_run_config(model: str, recipe: str | None) -> RunConfig:
    """The `run` options every batch of a server runs with: the recipe's, on `model`, quiet."""
    from ..recipes import load_recipe
    from .options import declared

    names = {o.name for o in declared("run")}
    values: dict[str, Any] = {name: None for name in names} | {"inputs": ("-",), "strict": False}
    if recipe:
        values.update(load_recipe(recipe, names))
    values["model"] = model
    base = build_run_config(values, "run")
    return replace(base, pipeline=replace(base.pipeline, progress="off"))


def task_line(config: RunConfig) -> str | None:
    """`task: embed (--task auto: an encoder)`; None for a task given, or a model that cannot be
    read (the run then fails on it with its own one-line error)."""
    if config.task != "auto":
        return None
    from ..registry import auto_task

    try:
        task, why = auto_task(config)
    except (HpcinferError, OSError):
        return None
    return f"task: {task} (--task auto: {why})"


def rejects_line(report: Any, output: str) -> str | None:
    """`3 of 5 rows rejected: see out.jsonl.rejects.jsonl` (the path as the output was given); None
    when no row was rejected."""
    from ..files.parts import rejects_path

    books = getattr(report, "accounting", None) or {}
    rejected = books.get("rows_rejected", sum(getattr(report, "rejects", {}).values()))
    if not rejected:
        return None
    read = books.get("rows_read")
    of = f" of {read:,}" if read else ""
    return f"{rejected:,}{of} rows rejected: see {rejects_path(output)}"
