"""`hpcinfer run` for a causal LM: requests in, one answer per valid row out, in input order.

    read rows -> requests (tokenize / chat) -> engine (continuous batching) -> windows -> parts

Windows are fixed runs of `--window-rows` input rows. `admission.py` hands their prompts to the
engine (prefix-aware and by priority, or under `--rate` as they arrive). Prompts keep flowing into
the engine across window edges (no drain); a window is committed, atomically and in input order,
once its last sequence has finished. Resume skips committed windows; every row's sampling seed
derives from its input row number (or its own `seed`), so a resumed run writes exactly what an
uninterrupted one would, in whatever order the rows were admitted.

With `--devices` (cuda:0,cuda:1 | all | cpu,cpu) each device runs an engine of its own on a thread
of its own (devices.py): admission hands each prompt to the engine with the fewest outstanding
tokens, and the finished sequences come back to this one loop, which commits windows as above.
One device keeps the plain loop: no threads.
"""

from __future__ import annotations

import contextlib
import queue
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import torch
from tokenizers import Tokenizer

from ...config import RunConfig, flatten
from ...device import dtype_for
from ...errors import ConfigError, Interrupted, ModelError
from ...files.parts import PartStore, fingerprint, id_array
from ...files.read import estimate_file_rows
from ...job.accounting import settle
from ...job.lock import OutputLock
from ...job.output_checks import check_output, check_output_state, output_format
from ...job.rejects import RejectCounter
from ...job.signals import signals_stop
from ...models.decoder_checkpoint import DecoderInfo, inspect_decoder, load_decoder, weight_files
from ...models.registry import resolve_model_path
from ...obs.profile import RangeBackend
from ...obs.progress import Progress
from ...obs.timing import Span
from ...obs.trace import write_trace
from ...place.devices import device_labels, parse_devices
from ...types import Reject
from .. import pick_task
from .admission import Admission, EngineSink
from .chat import ChatRenderer
from .devices import EnginePool, EngineWorker, combined_stats, device_summary
from .engine import Engine, EngineConfig
from .kv_cache import parse_kv_memory
from .report import GenerateReport, percentiles
from .requests import Request, RequestReader
from .sequence import SamplingParams, Sequence

SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("text", pa.string()),
        ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
    ]
)


def wants_generation(config: RunConfig) -> bool:
    """--task, or else the checkpoint: a `*ForCausalLM` generates."""
    return pick_task(config) == "generate"


@dataclass(slots=True)
class _Window:
    window_id: int
    first_row: int
    input_rows: int = 0
    pending: int = 0  # sequences still in the engine
    closed: bool = False  # every input row of the window has been read
    results: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)


def _devices(config: RunConfig) -> tuple[list[torch.device], torch.dtype]:
    """--devices (one engine each) or --device; all of one kind, cpu or cuda."""
    if config.device.devices:
        names = parse_devices(config.device.devices)
    else:
        name = config.device.device
        names = ["cuda" if torch.cuda.is_available() else "cpu"] if name == "auto" else [name]
    for name in names:
        if not (name == "cpu" or name.startswith("cuda")):
            raise ConfigError(f"generation runs on cpu or cuda, not {name!r}")
    devices = [torch.device(name) for name in names]
    if len({d.type for d in devices}) > 1:
        raise ConfigError(f"--devices: one kind of device per run (got {', '.join(names)})")
    return devices, dtype_for(config.device.dtype, devices[0])


def _device(config: RunConfig) -> tuple[torch.device, torch.dtype]:
    """The one device a single engine runs on: a tune trial or a Ray actor takes the first of --devices,
    since every device gets the same per-device budgets."""
    devices, dtype = _devices(config)
    return devices[0], dtype


def _defaults(config: RunConfig) -> SamplingParams:
    g = config.generate
    params = SamplingParams(
        g.max_tokens, g.temperature, g.top_p, g.top_k, g.min_p, None, tuple(g.stop), (), g.ignore_eos
    )
    if (problem := params.problem()) is not None:
        raise ConfigError(problem.replace("max_tokens", "--max-tokens", 1))
    return params


def _fingerprint(config: RunConfig, info: DecoderInfo, files: list[str], dtype: torch.dtype) -> dict[str, Any]:
    g = config.generate
    options = {
        "task": "generate",
        "dtype": str(dtype),
        "window_rows": g.window_rows,
        "sampling": [g.max_tokens, g.temperature, g.top_p, g.top_k, g.min_p, g.seed, list(g.stop), g.ignore_eos],
        "weights": [f.name for f in weight_files(info.path)],
        "id_column": config.input.id_column,
    }
    return fingerprint(files, info.path, options)


class _GenerationStore(PartStore):
    """Parts of generation rows: assembled with the answers' schema, not embeddings'."""

    def empty_schema(self) -> pa.Schema:
        return SCHEMA


@dataclass(slots=True)
class _DeviceCounts:
    rows: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    last_step_end: float = 0.0  # perf_counter seconds


class GenerationJob:
    """One run: owns the engines (one per device), the reader, the open windows and the parts directory.

    `step_hooks` maps a device label (cpu, cuda:1, cpu#0) to a callable run before each of that
    engine's steps (slowed or failing devices in tests).
    """

    def __init__(
        self,
        config: RunConfig,
        progress: Progress | None,
        step_hooks: dict[str, Callable[[], None]] | None = None,
    ) -> None:
        self.config = config
        self.fmt = output_format(config.output.path, config.output.output_format)
        check_output(config.output.path)
        self.info = inspect_decoder(resolve_model_path(config.model))
        self.devices, self.dtype = _devices(config)
        self.device = self.devices[0]
        self.labels = device_labels([str(d) for d in self.devices])
        self.step_hooks = step_hooks or {}
        if config.device.cuda_graphs and self.device.type != "cuda":
            raise ConfigError(f"--cuda-graphs needs a CUDA device; generation runs on {self.device} here")
        self.tokenizer = load_tokenizer(self.info)
        if config.device.threads and len(self.devices) == 1:
            torch.set_num_threads(config.device.threads)
        g = config.generate
        self.engine_config = engine_config(config)
        self.max_prompt = self.info.config.max_model_len - 1
        self.reader = request_reader(config, self.info, self.tokenizer)
        files = self.reader.files
        self.store = _GenerationStore(
            config.output.path, self.fmt, 0, _fingerprint(config, self.info, files, self.dtype)
        )
        self.progress = progress or Progress(config.pipeline.progress)
        self.rejects = RejectCounter(config.output.max_rejects, config.output.max_reject_fraction)
        self.report = GenerateReport(
            device=", ".join(self.labels), dtype=str(self.dtype).removeprefix("torch."), model=str(self.info.path)
        )
        self.by_device = [_DeviceCounts() for _ in self.devices]
        self.windows: deque[_Window] = deque()
        self.latency: dict[int, list[float]] = {}  # per priority: read (or arrived) -> finished, seconds
        self.admission = Admission(
            g.window_rows,
            g.max_num_seqs * len(self.devices),  # NOTE: a full batch queued per engine
            g.prefix_order,
            config.input.rate,
            config.input.rate_seed,
            self._window_for,
            self._close_last,
            self._reject,
        )
        self.written_by_source: dict[str, int] = {}
        self.ttft: list[float] = []
        self.tpot: list[float] = []

    def _open(self) -> None:
        output = self.config.output
        committed = self.store.committed()
        check_output_state(output.path, output.overwrite, output.resume, committed)
        self.store.remove_stale_temporaries()
        if output.resume and committed:
            self.store.load()
            self.reader.skip_rows = self.store.rows_committed
            self.reader.remember_ids(self.store.committed_ids())
        else:
            self.store.start_fresh()

    def _window_for(self, row: int) -> _Window:
        wid = row // self.config.generate.window_rows
        if not self.windows or self.windows[-1].window_id != wid:
            if self.windows:
                self.windows[-1].closed = True
            self.windows.append(_Window(wid, max(row, wid * self.config.generate.window_rows)))
        return self.windows[-1]

    def _close_last(self) -> None:
        if self.windows:
            self.windows[-1].closed = True

    def _reject(self, window: _Window, item: Reject) -> None:
        window.rejects.append(item)
        self.rejects.add([item])

    def _finish(self, seq: Sequence, device: int = 0) -> None:
        window, request = seq.tag
        window.pending -= 1
        window.results.append((request.row, self._answer(seq, request)))
        self.written_by_source[request.source] = self.written_by_source.get(request.source, 0) + 1
        self.ttft.append(seq.first_token_s - seq.arrival_s)
        self.latency.setdefault(seq.priority, []).append(seq.finish_s - request.read_s)
        r = self.report
        r.prompt_tokens_cached += seq.num_cached
        if seq.num_completion > 1:
            self.tpot.append((seq.finish_s - seq.first_token_s) / (seq.num_completion - 1))
        r.prompt_tokens += seq.num_prompt
        r.completion_tokens += seq.num_completion
        r.finish_reasons[seq.finish_reason] = r.finish_reasons.get(seq.finish_reason, 0) + 1
        d = self.by_device[device]
        d.rows += 1
        d.prompt_tokens += seq.num_prompt
        d.completion_tokens += seq.num_completion
        self.progress.advance(1, seq.num_completion, device=device)

    def _answer(self, seq: Sequence, request: Request) -> dict[str, Any]:
        return answer_row(seq, request, self.tokenizer, self.config.model)

    def _commit_ready(self) -> None:
        while self.windows and self.windows[0].closed and self.windows[0].pending == 0:
            w = self.windows.popleft()
            w.results.sort(key=lambda item: item[0])
            table = answers_table([answer for _, answer in w.results], self.fmt)
            if "custom_id" in table.column_names:
                self.store.id_column = "custom_id"
            self.store.commit_table(w.window_id, w.first_row, w.input_rows, table, [r.to_json() for r in w.rejects])
            self.rejects.check_fraction(self.store.rows_committed)

    def run(self, stop: threading.Event, ranges: RangeBackend | None = None) -> GenerateReport:
        """The engine loop (or, on several devices, the loop that feeds and drains their engines);
        `ranges` (hpcinfer profile: NVTX) gets one range per engine step."""
        self._open()
        resumed = self.store.rows_written
        self.progress.set_total(max(estimate_file_rows(self.reader.files) - self.reader.skip_rows, 0))
        engines = [self._engine(device) for device in self.devices]
        # NOTE: a KV pool smaller than the model's context bounds the prompts too.
        self.reader.max_prompt = min(self.reader.max_prompt, *(e.max_model_len - 1 for e in engines))
        source = self.reader.produce()
        start = time.perf_counter()
        if len(engines) == 1:
            self._run_one(engines[0], source, stop, ranges)
        else:
            self._run_many(engines, source, stop, ranges)
        if not stop.is_set():
            self.report.accounting = settle(
                ((path, read, resumed) for path, (read, resumed) in self.reader.counts.items()),
                self.written_by_source,
                self.rejects.by_source,
            )
            self.store.assemble()
        return self._summarise(engines, start, resumed)

    def _engine(self, device: torch.device) -> Engine:
        # NOTE: made under its own CUDA device, so nothing of cuda:1's engine lands on cuda:0
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            model = load_decoder(self.info, device, self.dtype)
            return Engine(
                model,
                self.engine_config,
                self.info.eos_token_ids,
                decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
                trace_steps=self.config.trace_path is not None,
            )

    def _run_one(self, engine: Engine, source: Any, stop: threading.Event, ranges: RangeBackend | None) -> None:
        sink, hook, more = EngineSink(engine), self.step_hooks.get(self.labels[0]), True
        while not stop.is_set():
            if more:
                more = self.admission.feed(source, sink)
            if engine.has_work:
                if hook is not None:
                    hook()
                for seq in self._step(engine, ranges):
                    self._finish(seq)
                self.by_device[0].last_step_end = time.perf_counter()
            elif more and (at := self.admission.next_at) is not None:  # --rate: idle until the next arrival
                time.sleep(min(max(0.0, at - time.perf_counter()), 0.05))
            self._commit_ready()
            if not more and not engine.has_work:
                break

    def _run_many(self, engines: list[Engine], source: Any, stop: threading.Event, ranges: RangeBackend | None) -> None:
        """Feeds the engines' threads and commits what they finish; the first device failure stops the run."""
        cpus = sum(d.type == "cpu" for d in self.devices)
        threads = max(1, (self.config.device.threads or torch.get_num_threads()) // cpus) if cpus else None
        outbox: Any = queue.Queue()
        workers = [
            EngineWorker(i, label, engine, outbox, threads, self.step_hooks.get(label), ranges)
            for i, (label, engine) in enumerate(zip(self.labels, engines, strict=True))
        ]
        prefix_block = self.engine_config.block_size if self.engine_config.prefix_cache else None
        pool = EnginePool(workers, self.config.device.dispatch, prefix_block)
        self.progress.set_devices(self.labels)
        more = True
        try:
            pool.start()
            while not stop.is_set():
                if more:
                    more = self.admission.feed(source, pool)
                wait = 0.05
                if more and (at := self.admission.next_at) is not None:  # --rate: no later than the next arrival
                    wait = min(max(0.0, at - time.perf_counter()), wait)
                for device, seqs in pool.finished(wait):
                    for seq in seqs:
                        self._finish(seq, device)
                self._commit_ready()
                if not more and not pool.has_work:
                    break
        finally:
            pool.close()
        for counts, worker in zip(self.by_device, workers, strict=True):
            counts.last_step_end = worker.stats.last_step_end

    @staticmethod
    def _step(engine: Engine, ranges: RangeBackend | None) -> list[Sequence]:
        if ranges is None:
            return engine.step()
        s = engine.scheduler
        ranges.push(f"hpcinfer/engine_step step={engine.stats.steps} running={len(s.running)} waiting={len(s.waiting)}")
        try:
            return engine.step()
        finally:
            ranges.pop()

    def _summarise(self, engines: list[Engine], start: float, resumed: int) -> GenerateReport:
        r, s = self.report, combined_stats([e.stats for e in engines])
        end = time.perf_counter()
        r.wall_s = end - start
        r.rows = self.store.rows_written
        r.rows_resumed = resumed
        r.windows = len(self.store.windows)
        r.rejects = dict(sorted(self.rejects.by_reason.items()))
        r.output = self.config.output.path
        r.steps, r.prefill_tokens, r.decode_tokens = s.steps, s.prefill_tokens, s.decode_tokens
        r.preemptions, r.peak_kv_blocks, r.kv_blocks = s.preemptions, s.peak_blocks, s.num_blocks
        r.kv_block_size, r.kv_cache_bytes = self.engine_config.block_size, sum(e.cache.nbytes for e in engines)
        r.mean_occupancy = round(s.mean_occupancy, 4)
        r.prefix_cache, r.prefill_tokens_saved, r.kv_evictions = (
            self.engine_config.prefix_cache,
            s.cached_tokens,
            s.evictions,
        )
        r.latency_by_priority = {str(p): percentiles(v) for p, v in sorted(self.latency.items(), reverse=True)}
        r.ttft, r.tpot = percentiles(self.ttft), percentiles(self.tpot)
        r.step_time_split = {
            k: round(v, 4)
            for k, v in (
                ("model", s.model_s),
                ("attention_gather", s.gather_s),
                ("sampling", s.sample_s),
                ("host", s.host_s),
            )
        }
        r.devices = device_summary(self.labels, engines, self.by_device, start, end)
        r.config = flatten(self.config)
        if self.config.trace_path:
            several = len(engines) > 1
            spans = [  # NOTE: one track per device
                Span(
                    "engine_step",
                    int(a * 1e9),
                    int(b * 1e9),
                    f"{label}/engine" if several else "engine",
                    {"prefill_tokens": p, "decode_tokens": d},
                )
                for label, engine in zip(self.labels, engines, strict=True)
                for a, b, p, d in engine.stats.step_trace
            ]
            write_trace(sorted(spans, key=lambda span: span.start_ns), self.config.trace_path)
        if self.config.report_path:
            r.write_json(self.config.report_path)
        return r


def answer_row(seq: Sequence, request: Request, tokenizer: Tokenizer, model: str) -> dict[str, Any]:
    """The output row of a finished sequence: ours, or an OpenAI batch answer for an OpenAI request."""
    ids = seq.completion
    if seq.finish_reason == "stop" and seq.stop_text_cut is None:
        ids = ids[:-1]  # the EOS or stop token ends the answer; it is not part of the text
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if seq.stop_text_cut is not None:
        text = text[: seq.stop_text_cut]
    usage = {"prompt_tokens": seq.num_prompt, "completion_tokens": seq.num_completion}
    if not request.openai:  # NOTE: ids keep their kind, as embedding's do (text only where kinds mix)
        return {"id": request.id, "text": text, "finish_reason": seq.finish_reason, **usage}
    chat = request.kind == "chat"
    choice: dict[str, Any] = {"index": 0, "finish_reason": seq.finish_reason, "logprobs": None}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{request.row}",
        "object": "chat.completion" if chat else "text_completion",
        "model": model,
        "choices": [choice],
        "usage": {**usage, "total_tokens": seq.num_prompt + seq.num_completion},
    }
    return {
        "id": f"batch_req_{request.row}",
        "custom_id": request.id,
        "response": {"status_code": 200, "request_id": f"req_{request.row}", "body": body},
        "error": None,
    }


def answers_table(rows: list[dict[str, Any]], fmt: str) -> pa.Table:
    """One window's answer rows (input order) as the table of its part (OpenAI answers: by custom_id)."""
    if rows and "custom_id" in rows[0]:
        if fmt == "parquet":
            raise ConfigError("an OpenAI batch input is answered in JSONL: give a .jsonl output")
        return pa.Table.from_pylist(rows)
    columns = {"id": id_array([row["id"] for row in rows])}
    for f in SCHEMA:
        if f.name != "id":
            columns[f.name] = pa.array([row[f.name] for row in rows], f.type)
    return pa.table(columns)


def load_tokenizer(info: DecoderInfo) -> Tokenizer:
    """The checkpoint's tokenizer, with no truncation or padding (prompts are checked, not cut)."""
    try:
        tokenizer = Tokenizer.from_file(str(info.path / "tokenizer.json"))
    except Exception as exc:
        raise ModelError(f"cannot load tokenizer ({exc})", path=str(info.path)) from None
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def request_reader(config: RunConfig, info: DecoderInfo, tokenizer: Tokenizer) -> RequestReader:
    """The run's reader of requests: the checkpoint's chat template, the run's sampling defaults."""
    chat = ChatRenderer(info.chat_template, info.special_tokens) if info.chat_template else None
    return RequestReader(
        config.input.paths,
        config.input.id_column,
        tokenizer,
        chat,
        _defaults(config),
        info.config.max_model_len - 1,
        info.config.vocab_size,
        config.generate.priority_column,
    )


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
    )


def run_generate(
    config: RunConfig,
    *,
    progress: Progress | None = None,
    ranges: RangeBackend | None = None,
    step_hooks: dict[str, Callable[[], None]] | None = None,
) -> GenerateReport:
    """Generates an answer for every valid input row; see the module docstring and GenerationJob."""
    job = GenerationJob(config, progress, step_hooks)
    stop = threading.Event()
    lock = OutputLock(job.store.dir, config.output.path).acquire()  # one run per output, refused up front
    try:
        with signals_stop(stop) as interrupted, torch.inference_mode():
            report = job.run(stop, ranges)
        if interrupted:
            raise Interrupted(interrupted[0], job.store.rows_written, config.output.path)
        return report
    except BaseException:
        if not job.store.committed():  # nothing worth resuming: leave no trace
            shutil.rmtree(job.store.dir, ignore_errors=True)
        raise
    finally:
        lock.release()
        job.progress.close()
