"""One generation replica of a cluster run: the local generation engine over the windows it is handed.

A replica loads the decoder and builds its engine (KV pool, sampler) once, then for each unit (one
window of `--window-rows` global input rows) reads the unit's rows with generation's own request
parsing (`RangeRequestReader`: the same row numbers, ids, lines, prompts, sampling parameters and
rejects as a reader of the whole input), admits them as a local run admits a window (`Admission`:
prefix and priority order), runs the engine until the window's last sequence has finished and
hands back its answer rows (`answer_row`, the local output's columns) and rejects. Sampling seeds
come from the row number or the row's own `seed`, never from the batch, so the answers are the
local run's whichever replica ran the window. No Ray here: `actor.py` wraps this.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ...config import RunConfig
from ...device.threads import set_torch_threads
from ...engine.engine import Engine, EngineConfig
from ...engine.runtime.admission import Admission
from ...engine.runtime.devices import step_fault
from ...engine.runtime.loop import EngineSink, run_loop
from ...engine.sequence import Sequence
from ...errors import HpcinferError, InputError
from ...files.ids import IdSet
from ...job.windows import WindowBook
from ...models.decoder_checkpoint import load_decoder, load_tokenizer
from ...models.lora import attach_adapters, parse_loras
from ...models.vlm import VisionTower
from ...parallel.tp import TensorParallel
from ...parallel.tp_groups import replica_engine
from ...place.breaker import DeviceFault
from ...ray_engine.beat import Beat
from ...ray_engine.units import Unit
from ...types import Reject
from .answers import answer_row
from .drafting import draft_info, load_draft
from .requests import Request, RequestReader
from .setup import engine_config, first_device, request_reader, run_decoder_info
from .tally import SequenceTally


@dataclass(slots=True)
class GenerateUnitResult:
    """One unit's answers, rejects and figures; `error` set instead when it failed for the user's reason."""

    window_id: int
    replica: str = ""
    answers: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # in row order
    rejects: list[dict[str, Any]] = field(default_factory=list)  # Reject.to_json, in row order
    input_rows: int = 0
    admitted: list[tuple[int, Any, int | None, str, int]] = field(default_factory=list)  # requests with an id
    read_by_source: dict[str, int] = field(default_factory=dict)
    written_by_source: dict[str, int] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)  # tokens, steps, KV and timing of this unit
    ttft: list[float] = field(default_factory=list)  # seconds, per answer
    tpot: list[float] = field(default_factory=list)
    latency: dict[int, list[float]] = field(default_factory=dict)  # per priority, read -> finished
    started: float = 0.0  # wall clock (time.time), to place the unit on the job's timeline
    finished: float = 0.0
    error: tuple[str, int] | None = None  # (message, exit code)
    fault: str | None = None  # set instead when its device failed: the unit is redone elsewhere


class StepFailed(Exception):
    """An engine step failed for its device's reason (devices.step_fault): the unit is not done."""

    def __init__(self, fault: DeviceFault) -> None:
        super().__init__(fault.error)


class ReplicaSink(EngineSink):
    """The replica's engine as the loop's sink: `beat` before each step (the driver's --step-timeout
    watch), and what a step raises classified by the rule of every engine (devices.step_fault)."""

    def __init__(self, engine: Engine, beat: Callable[[], None]) -> None:
        super().__init__(engine, hook=beat)

    def collect(self, wait: float | None) -> Iterator[tuple[int, list[Sequence]]]:
        try:
            yield from super().collect(wait)
        except Exception as exc:
            raise StepFailed(step_fault(self.engine, exc)) from exc


class RangeRequestReader(RequestReader):
    """Yields the Requests and Rejects of one unit's rows, numbered as a reader of the whole input numbers them.

    Parsing is the whole-input reader's own (`RequestReader._request`); only which rows are read
    differs. `admitted` lists the rows that took their id (answered or rejected later for their
    prompt), so the driver can find ids repeated across windows, which no replica can see.
    """

    def __init__(self, whole: RequestReader, unit: Unit) -> None:
        # NOTE: the whole input's settings and its files' facts, so no file is scanned again per unit
        super().__init__(*whole.arguments, facts=whole.facts)
        self.max_prompt = whole.max_prompt  # NOTE: the engine's context may have lowered it since
        self.counts = {s.path: [0, 0] for s in unit.segments}
        self._seen = IdSet()  # ids repeated within the unit; the driver checks across units
        self.unit = unit
        self.admitted: list[tuple[int, Any, int | None, str, int]] = []

    def produce(self) -> Iterator[Request | Reject]:
        for seg in self.unit.segments:
            self._file_first_row = seg.file_first_row
            self.rows_read = seg.file_first_row + seg.start  # NOTE: global numbering
            for line, obj in self._objects(seg.path, seg):
                row = self.rows_read
                self.rows_read += 1
                self.counts[seg.path][0] += 1
                yield self._request(seg.path, row, line, obj)
            got = self.rows_read - seg.file_first_row - seg.start
            if got != seg.rows:
                raise InputError(
                    f"read {got:,} of the {seg.rows:,} rows expected from row {seg.start:,} (did the file change?)",
                    path=seg.path,
                )

    def _id_taken(self, row: int, row_id: Any, line: int | None, path: str) -> None:
        self.admitted.append((row, row_id, line, path, row - self._file_first_row))


class GenerateReplica:
    """Loads the decoder and builds the engine once; `run(unit)` answers one unit's requests."""

    def __init__(self, config: RunConfig) -> None:
        self.config = replace(config, report_path=None, trace_path=None)
        self.info = run_decoder_info(config)
        device, dtype = first_device(config)
        self.tokenizer = load_tokenizer(self.info)
        self.whole = request_reader(config, self.info, self.tokenizer)
        self.draft = draft_info(config, self.tokenizer)
        vision = self.info.vision

        def make(model: Any, settings: EngineConfig, lora_rows: Any = None) -> Engine:
            return Engine(
                model,
                settings,
                self.info.eos_token_ids,
                decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
                grammars=self.whole.grammars,
                lora_rows=lora_rows,
                draft=load_draft(self.draft, model.norm.device, dtype),
                vision=VisionTower(self.info.path, vision, model.norm.device, dtype) if vision is not None else None,
            )

        # NOTE: one engine for every unit: its KV pool is sized once, and a prefix cached in one
        # window serves the next, as in a local run.
        self.tp: TensorParallel | None = None  # --tp N: this replica is a group, its rank 0 here
        self.tp_threads: int | None = None
        with torch.inference_mode():
            if config.device.tensor_parallel > 1:
                self.engine, self.tp, self.tp_threads = replica_engine(
                    config, self.info, device, dtype, engine_config(config), make
                )
            else:
                model = load_decoder(self.info, device, dtype, config.device.quantize, config.device.int8_kernel)
                loras, g = parse_loras(config.generate.loras), config.generate
                rows = attach_adapters(model, loras, self.info.config, dtype, device, g.max_loras) if loras else None
                self.engine = make(model, engine_config(config), rows)
        self.whole.max_prompt = min(self.whole.max_prompt, self.engine.max_model_len - 1)
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.step_hook: Callable[[], None] | None = None  # before each step: a slowed or failing device (tests)

    def run(self, unit: Unit, beat: Beat | None = None) -> GenerateUnitResult:
        """The unit's answers; `beat.touch()` is called before each engine step (the driver's --step-timeout)."""
        result = GenerateUnitResult(unit.window_id, self.name, started=time.time())
        if self.tp_threads:  # NOTE: the actor set this thread's count for one process; rank 0 has its share
            set_torch_threads(self.tp_threads)
        try:
            with torch.inference_mode():
                self._run(unit, result, beat.touch if beat is not None else None)
        except StepFailed as exc:  # its sequences are dropped: the unit is redone elsewhere, with its seeds
            result.fault = str(exc)
            return result
        except HpcinferError as exc:  # a user's problem: the driver reports it as one line
            result.error = (str(exc), exc.exit_code)
            return result
        result.finished = time.time()
        return result

    def _before_step(self, beat: Callable[[], None] | None) -> None:
        if beat is not None:
            beat()
        if self.step_hook is not None:
            self.step_hook()

    def _run(self, unit: Unit, result: GenerateUnitResult, beat: Callable[[], None] | None = None) -> None:
        g, engine = self.config.generate, self.engine
        book = WindowBook(g.window_rows)  # NOTE: a unit is one window
        reader = RangeRequestReader(self.whole, unit)
        admission = Admission(book, g.max_num_seqs, g.prefix_order, None, 0)
        before = _engine_figures(engine)

        tally = SequenceTally()

        def finished(seq: Sequence, _device: int) -> None:
            window, request = seq.tag
            if seq.finish_reason == "error":  # NOTE: it could not run (the engine said why): a reject
                book.fail(window, request.reject("image_unreadable", seq.error or "it could not run"))
                return
            book.finish(window, request.row, answer_row(seq, request, self.tokenizer, self.config.model))
            tally.add(seq, request.read_s)
            result.written_by_source[request.source] = result.written_by_source.get(request.source, 0) + 1

        run_loop(admission, reader.produce(), ReplicaSink(engine, lambda: self._before_step(beat)), finished)
        book.close()
        [window] = book.complete()  # the unit's every row was read and answered
        assert window.window_id == unit.window_id, "a unit is one window"
        result.answers = sorted(window.results, key=lambda item: item[0])
        result.rejects = [r.to_json() for r in window.rejects]
        result.input_rows = window.input_rows
        result.admitted = reader.admitted
        result.read_by_source = {path: read for path, (read, _) in reader.counts.items()}
        result.figures.update(tally.figures())
        result.ttft, result.tpot, result.latency = tally.ttft, tally.tpot, tally.latency
        result.figures.update(_difference(_engine_figures(engine), before))
        result.figures.update(
            kv_blocks=engine.stats.num_blocks,
            kv_block_size=engine.config.block_size,
            kv_cache_bytes=engine.cache.nbytes,
            peak_kv_blocks=engine.stats.peak_blocks,
            peak_kv_blocks_full_attention=engine.stats.peak_blocks_full_attention,
        )


_ENGINE_FIGURES = (
    ("steps", "steps"),
    ("prefill_tokens", "prefill_tokens"),
    ("decode_tokens", "decode_tokens"),
    ("preemptions", "preemptions"),
    ("oom_splits", "oom_splits"),
    ("constrained_answers", "constrained"),
    ("constrained_cut", "constrained_cut"),
    ("prefill_tokens_saved", "cached_tokens"),
    ("kv_evictions", "evictions"),
    ("occupancy_sum", "occupancy_sum"),
    ("model_s", "model_s"),
    ("attention_gather_s", "gather_s"),
    ("sampling_s", "sample_s"),
    ("host_s", "host_s"),
)


def _engine_figures(engine: Any) -> dict[str, float]:
    """The engine's running totals (they count from its start, over every unit it ran)."""
    return {name: getattr(engine.stats, attr) for name, attr in _ENGINE_FIGURES}


def _difference(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}
