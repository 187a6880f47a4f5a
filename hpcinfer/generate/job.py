"""`hpcinfer run` for a causal LM: requests in, one answer per valid row out, in input order.

    read rows -> requests (tokenize / chat) -> engine (continuous batching) -> windows -> parts

Windows are fixed runs of `--window-rows` input rows. `admission.py` hands their prompts to the
engine (prefix-aware and by priority, or under `--rate` as they arrive). Prompts keep flowing into
the engine across window edges (no drain); a window is committed, atomically and in input order,
once its last sequence has finished. Resume skips committed windows; every row's sampling seed
derives from its input row number (or its own `seed`), so a resumed run writes exactly what an
uninterrupted one would, in whatever order the rows were admitted.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tokenizers import Tokenizer

from ..accounting import settle
from ..config import RunConfig, flatten
from ..errors import ConfigError, ModelError
from ..lock import OutputLock
from ..models.decoder_checkpoint import DecoderInfo, inspect_decoder, is_causal_lm, load_decoder, weight_files
from ..models.registry import resolve_model_path
from ..output import PartStore, _concat_bytes, fingerprint
from ..profile import RangeBackend
from ..progress import Progress
from ..report.timing import Span
from ..report.trace import write_trace
from ..types import Reject
from ..write import RejectCounter, check_output, check_output_state, output_format
from .admission import Admission
from .chat import ChatRenderer
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
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def wants_generation(config: RunConfig) -> bool:
    """--task, or else the checkpoint: a `*ForCausalLM` generates."""
    if config.task != "auto":
        return config.task == "generate"
    return is_causal_lm(resolve_model_path(config.model))


@dataclass(slots=True)
class _Window:
    window_id: int
    first_row: int
    input_rows: int = 0
    pending: int = 0  # sequences still in the engine
    closed: bool = False  # every input row of the window has been read
    results: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)


def _device(config: RunConfig) -> tuple[torch.device, torch.dtype]:
    if config.device.devices:  # NOTE: refused rather than silently run on one device
        raise ConfigError("--devices: generation runs on one device for now (use --device)")
    name = config.device.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if not (name == "cpu" or name.startswith("cuda")):
        raise ConfigError(f"generation runs on cpu or cuda, not {name!r}")
    device = torch.device(name)
    if config.device.dtype == "auto":
        return device, torch.float32 if device.type == "cpu" else torch.bfloat16
    if config.device.dtype not in _DTYPES:
        raise ConfigError(f"--dtype {config.device.dtype!r} (expected auto, float32, bfloat16 or float16)")
    return device, _DTYPES[config.device.dtype]


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
    """Parts of generation rows: Parquet parts are assembled with their own schema, not embeddings'."""

    def _concat_parts(self, tmp: Path) -> None:
        parts = [self.dir / w["part"] for w in self.windows]
        if self.fmt != "parquet":
            _concat_bytes(tmp, parts)
            return
        schema = pq.read_schema(parts[0]) if parts else SCHEMA
        with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
            for part in parts:
                # NOTE: a batch at a time, as embedding parts are, so the end of a run stays flat in RSS.
                for batch in pq.ParquetFile(part).iter_batches(batch_size=4096, use_threads=False):
                    writer.write_table(pa.Table.from_batches([batch]).cast(schema))


class GenerationJob:
    """One run: owns the engine, the reader, the open windows and the parts directory."""

    def __init__(self, config: RunConfig, progress: Progress | None) -> None:
        self.config = config
        self.fmt = output_format(config.output.path, config.output.output_format)
        check_output(config.output.path)
        self.info = inspect_decoder(resolve_model_path(config.model))
        self.device, self.dtype = _device(config)
        if config.device.cuda_graphs and self.device.type != "cuda":
            raise ConfigError(f"--cuda-graphs needs a CUDA device; generation runs on {self.device} here")
        try:
            self.tokenizer = Tokenizer.from_file(str(self.info.path / "tokenizer.json"))
        except Exception as exc:
            raise ModelError(f"cannot load tokenizer ({exc})", path=str(self.info.path)) from None
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        chat = ChatRenderer(self.info.chat_template, self.info.special_tokens) if self.info.chat_template else None
        defaults = _defaults(config)
        if config.device.threads:
            torch.set_num_threads(config.device.threads)
        g = config.generate
        self.engine_config = EngineConfig(
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
        self.max_prompt = self.info.config.max_model_len - 1
        self.reader = RequestReader(
            config.input.paths,
            config.input.id_column,
            self.tokenizer,
            chat,
            defaults,
            self.max_prompt,
            self.info.config.vocab_size,
            g.priority_column,
        )
        files = self.reader.files
        self.store = _GenerationStore(
            config.output.path, self.fmt, 0, _fingerprint(config, self.info, files, self.dtype)
        )
        self.progress = progress or Progress(config.pipeline.progress)
        self.rejects = RejectCounter(config.output.max_rejects, config.output.max_reject_fraction)
        self.report = GenerateReport(
            device=str(self.device), dtype=str(self.dtype).removeprefix("torch."), model=str(self.info.path)
        )
        self.windows: deque[_Window] = deque()
        self.latency: dict[int, list[float]] = {}  # per priority: read (or arrived) -> finished, seconds
        self.admission = Admission(
            g.window_rows,
            g.max_num_seqs,
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

    def _finish(self, seq: Sequence) -> None:
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
        self.progress.advance(1, seq.num_completion)

    def _answer(self, seq: Sequence, request: Request) -> dict[str, Any]:
        ids = seq.completion
        if seq.finish_reason == "stop" and seq.stop_text_cut is None:
            ids = ids[:-1]  # the EOS or stop token ends the answer; it is not part of the text
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if seq.stop_text_cut is not None:
            text = text[: seq.stop_text_cut]
        usage = {"prompt_tokens": seq.num_prompt, "completion_tokens": seq.num_completion}
        if not request.openai:
            row_id = None if request.id is None else str(request.id)
            return {"id": row_id, "text": text, "finish_reason": seq.finish_reason, **usage}
        chat = request.kind == "chat"
        choice: dict[str, Any] = {"index": 0, "finish_reason": seq.finish_reason, "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        body = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{request.row}",
            "object": "chat.completion" if chat else "text_completion",
            "model": self.config.model,
            "choices": [choice],
            "usage": {**usage, "total_tokens": seq.num_prompt + seq.num_completion},
        }
        return {
            "id": f"batch_req_{request.row}",
            "custom_id": request.id,
            "response": {"status_code": 200, "request_id": f"req_{request.row}", "body": body},
            "error": None,
        }

    def _commit_ready(self) -> None:
        while self.windows and self.windows[0].closed and self.windows[0].pending == 0:
            w = self.windows.popleft()
            w.results.sort(key=lambda item: item[0])
            rows = [answer for _, answer in w.results]
            if rows and "custom_id" in rows[0]:
                if self.fmt == "parquet":
                    raise ConfigError("an OpenAI batch input is answered in JSONL: give a .jsonl output")
                self.store.id_column = "custom_id"
                table = pa.Table.from_pylist(rows)
            else:
                table = pa.Table.from_pylist(rows, schema=SCHEMA)
            self.store.commit_table(w.window_id, w.first_row, w.input_rows, table, [r.to_json() for r in w.rejects])
            self.rejects.check_fraction(self.store.rows_committed)

    def run(self, stop: threading.Event, ranges: RangeBackend | None = None) -> GenerateReport:
        """The engine loop; `ranges` (hpcinfer profile: NVTX) gets one range per engine step."""
        self._open()
        resumed = self.store.rows_written
        model = load_decoder(self.info, self.device, self.dtype)
        engine = Engine(
            model,
            self.engine_config,
            self.info.eos_token_ids,
            decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
            trace_steps=self.config.trace_path is not None,
        )
        # NOTE: a KV pool smaller than the model's context bounds the prompts too.
        self.reader.max_prompt = min(self.reader.max_prompt, engine.max_model_len - 1)
        source = self.reader.produce()
        more = True
        start = time.perf_counter()
        while not stop.is_set():
            if more:
                more = self.admission.feed(source, engine)
            if engine.has_work:
                for seq in self._step(engine, ranges):
                    self._finish(seq)
            elif more and (at := self.admission.next_at) is not None:  # --rate: idle until the next arrival
                time.sleep(min(max(0.0, at - time.perf_counter()), 0.05))
            self._commit_ready()
            if not more and not engine.has_work:
                break
        if not stop.is_set():
            self.report.accounting = settle(
                ((path, read, resumed) for path, (read, resumed) in self.reader.counts.items()),
                self.written_by_source,
                self.rejects.by_source,
            )
            self.store.assemble()
        return self._summarise(engine, start, resumed)

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

    def _summarise(self, engine: Engine, start: float, resumed: int) -> GenerateReport:
        r, s = self.report, engine.stats
        r.wall_s = time.perf_counter() - start
        r.rows = self.store.rows_written
        r.rows_resumed = resumed
        r.windows = len(self.store.windows)
        r.rejects = dict(sorted(self.rejects.by_reason.items()))
        r.output = self.config.output.path
        r.steps, r.prefill_tokens, r.decode_tokens = s.steps, s.prefill_tokens, s.decode_tokens
        r.preemptions, r.peak_kv_blocks, r.kv_blocks = s.preemptions, s.peak_blocks, s.num_blocks
        r.kv_block_size, r.kv_cache_bytes = self.engine_config.block_size, engine.cache.nbytes
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
        r.config = flatten(self.config)
        if self.config.trace_path:
            spans = [
                Span("engine_step", int(a * 1e9), int(b * 1e9), "engine", {"prefill_tokens": p, "decode_tokens": d})
                for a, b, p, d in s.step_trace
            ]
            write_trace(spans, self.config.trace_path)
        if self.config.report_path:
            r.write_json(self.config.report_path)
        return r


def run_generate(
    config: RunConfig, *, progress: Progress | None = None, ranges: RangeBackend | None = None
) -> GenerateReport:
    """Generates an answer for every valid input row; see the module docstring."""
    from ..api import Interrupted, _signals_stop

    job = GenerationJob(config, progress)
    stop = threading.Event()
    lock = OutputLock(job.store.dir, config.output.path).acquire()  # one run per output, refused up front
    try:
        with _signals_stop(stop) as interrupted, torch.inference_mode():
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
