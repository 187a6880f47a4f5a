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

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from ...config import RunConfig
from ...device import accelerators
from ...device.threads import PROCESS, ThreadGovernor, set_torch_threads
from ...engine.engine import Engine, EngineConfig
from ...engine.hf_engine import WHAT_IS_LOST, transformers_engine
from ...engine.runtime.admission import Admission
from ...engine.runtime.loop import EngineSink, run_loop
from ...engine.runtime.pool import run_on_devices
from ...engine.sequence import Sequence
from ...errors import Interrupted
from ...files.part_format import settle_arrow
from ...files.sources import estimate_file_rows
from ...job.accounting import settle, watch_output
from ...job.claim import claimed, open_store, recorded_fingerprint
from ...job.output_checks import check_output, output_format
from ...job.read_ahead import ReadAhead
from ...job.rejects import RejectCounter
from ...job.signals import signals_stop
from ...job.windows import OpenWindow, WindowBook
from ...models.decoder_checkpoint import load_decoder, load_tokenizer
from ...models.decoder_int8 import INT8_ROWS
from ...models.int8_kernels import resumed_int8, settled_int8
from ...models.lora import adapter_digest, attach_adapters, parse_loras
from ...models.shelf import ModelShelf, shelved
from ...models.vlm import VisionTower
from ...obs.profile import RangeBackend
from ...obs.progress import Progress
from ...parallel.tp import TensorParallel
from ...parallel.tp_groups import close_groups, start_run_groups, tensor_groups
from ...place.affinity import AffinityPlan, device_spec, pin_thread, pinned, resolve_affinity
from ...place.devices import device_labels
from ...registry import pick_task
from .answers import GenerationStore, answer_row, answers_chunk, answers_table, held_answers, with_errors
from .drafting import draft_info, load_draft
from .refusals import refuse_what_cannot_run
from .report import GenerateReport, summarise
from .requests import Request
from .setup import (
    engine_config,
    generation_devices,
    generation_fingerprint,
    media_windows,
    request_reader,
    run_decoder_info,
)
from .tally import SequenceTally, watch_engines


def wants_generation(config: RunConfig) -> bool:
    """--task, or else the checkpoint: a `*ForCausalLM` generates."""
    return pick_task(config) == "generate"


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
        shelf: ModelShelf | None = None,
    ) -> None:
        self.config = config
        self.shelf = shelf
        self.fmt = output_format(config.output.path, config.output.output_format)
        check_output(config.output.path)
        self.info = run_decoder_info(config)
        self.config = config = media_windows(config, self.info)
        if config.device.quantize == "int8":  # NOTE: one kernel for every engine, and for the output's whole life
            if (recorded := recorded_fingerprint(config.output)) is not None:
                config = replace(config, device=resumed_int8(config.device, recorded))
            self.config = config = replace(config, device=settled_int8(config.device, self.info.config, INT8_ROWS))
        self.devices, self.dtype = generation_devices(config)
        self.tps: list[TensorParallel] = []  # --tp N: rank 0 of each running group
        if config.device.tensor_parallel > 1:  # one engine per group, on its rank 0's device
            self.tp_groups = tensor_groups(config, self.info, self.devices)
            self.devices = [group[0] for group in self.tp_groups]
        self.device = self.devices[0]
        self.labels = device_labels([str(d) for d in self.devices])
        self.step_hooks = step_hooks or {}
        self.loras = parse_loras(config.generate.loras)
        refuse_what_cannot_run(config, self.info, self.device, self.loras)
        self.lora_digests = tuple(adapter_digest(folder) for _, folder in self.loras)
        self.tokenizer = shelved(
            shelf, ("tokenizer", str(self.info.path)), lambda: load_tokenizer(self.info), attached=True
        )
        self.draft = draft_info(config, self.tokenizer)
        if config.device.threads and len(self.devices) == 1:
            set_torch_threads(config.device.threads)
        g = config.generate
        self.engine_config = engine_config(config)
        self.max_prompt = self.info.config.max_model_len - 1
        self.reader = request_reader(config, self.info, self.tokenizer)
        files = self.reader.files
        fp = generation_fingerprint(config, self.info, files, self.dtype)
        self.store = GenerationStore(config.output.path, self.fmt, fp, config.generate.n > 1)
        self.progress = progress or Progress(config.pipeline.progress)
        self.rejects = RejectCounter(config.output.max_rejects, config.output.max_reject_fraction)
        self.report = GenerateReport(
            device=", ".join(self.labels),
            dtype=str(self.dtype).removeprefix("torch."),
            model=str(self.info.path),
            int8_kernel=config.device.int8_kernel if config.device.quantize == "int8" else "",
        )
        self.affinity: AffinityPlan | None = resolve_affinity(
            config.device.cpu_affinity, [device_spec(str(d), d.type) for d in self.devices]
        )
        self.report.cpu_affinity = self.affinity.describe() if self.affinity is not None else ""
        self.by_device = [_DeviceCounts() for _ in self.devices]
        self.breaker_start = 0.0  # perf_counter seconds the breakers' transitions count from
        self.commit_every_s = config.output.commit_every_s  # 0: whole windows only
        self.windows = WindowBook(
            g.window_rows, track_fresh=bool(self.commit_every_s), on_reject=lambda item: self.rejects.add([item])
        )
        self.tally = SequenceTally()  # rows, tokens, finish reasons and latencies of what finished
        self.admission = Admission(
            self.windows,
            g.max_num_seqs * len(self.devices),  # NOTE: a full batch queued per engine
            g.prefix_order,
            config.input.rate,
            config.input.rate_seed,
            held=self._held_row,
        )
        self.held: dict[int, dict[str, Any]] = {}  # a resumed run: answers the checkpoints hold, by input row
        self._last_checkpoint = 0.0
        self.written_by_source: dict[str, int] = {}  # input file -> rows this run answered
        self.held_by_source: dict[str, int] = {}  # input file -> rows a checkpoint answered (resumed)
        self.finished_at: list[tuple[float, int, int]] = []  # (finish time, device, completion tokens)

    def _held_row(self, window: OpenWindow, request: Request) -> bool:
        """A row an interrupted run's checkpoint answered: booked as answered, not run again."""
        answer = self.held.pop(request.row, None)
        if answer is None:
            return False
        self.windows.answered(window, request.row, answer)
        self.held_by_source[request.source] = self.held_by_source.get(request.source, 0) + 1
        return True

    def finish(self, seq: Sequence, device: int = 0) -> None:
        window, request = seq.tag
        if seq.finish_reason == "error":  # NOTE: it could not run (the engine said why): a reject, not an answer
            self.windows.fail(window, request.reject("image_unreadable", seq.error or "it could not run"))
            return
        self.windows.finish(window, request.row, self._answer(seq, request), started=seq.arrival_s)
        self.written_by_source[request.source] = self.written_by_source.get(request.source, 0) + 1
        self.tally.add(seq, request.read_s)
        self.finished_at.append((seq.done_s, device, seq.answer_tokens))
        d = self.by_device[device]
        d.rows += 1
        d.prompt_tokens += seq.num_prompt
        d.completion_tokens += seq.answer_tokens
        self.progress.advance(1, seq.answer_tokens, device=device)

    def _answer(self, seq: Sequence, request: Request) -> dict[str, Any]:
        return answer_row(seq, request, self.tokenizer, self.config.model)

    def commit_ready(self) -> None:
        for w in self.windows.complete():
            rejects = [r.to_json() for r in w.rejects]
            rows = with_errors(w.results, rejects, self.reader.openai_sources)
            table = answers_table(rows, self.fmt, self.store.listed)
            if "custom_id" in table.column_names:
                self.store.id_column = "custom_id"
            self.store.commit_table(w.window_id, w.first_row, w.input_rows, table, rejects, answered=len(w.results))
            self.rejects.check_fraction(self.store.rows_committed)
        if self.commit_every_s and self._checkpoint_due():
            self.checkpoint()

    def _checkpoint_due(self) -> bool:
        """The oldest answer not checkpointed was handed to an engine --commit-every ago (or the last
        checkpoint was, if later): a kill then loses about that much, and the sequences running."""
        oldest = self.windows.oldest_fresh()
        return oldest is not None and time.perf_counter() - max(oldest, self._last_checkpoint) >= self.commit_every_s

    def checkpoint(self) -> None:
        """Keeps the answers finished since the last checkpoint in windows still open (answers.py)."""
        taken = self.windows.take_fresh()
        self.store.checkpoint([(w.window_id, answers_chunk(w.fresh), {"first_row": w.first_row}) for w in taken])
        self._last_checkpoint = time.perf_counter()

    def run(self, stop: threading.Event, ranges: RangeBackend | None = None) -> GenerateReport:
        """The engine loop (or, on several devices, the loop that feeds and drains their engines);
        `ranges` (hpcinfer profile: NVTX) gets one range per engine step."""
        open_store(self.store, self.reader, self.config.output)
        self.held = held_answers(self.store)
        resumed = self.store.rows_written + len(self.held)
        total = estimate_file_rows(self.reader.files) - self.reader.skip_rows - len(self.held)
        self.progress.set_total(max(total, 0))
        engines = self._tp_engines() if self.tp_size > 1 else [self._engine(device) for device in self.devices]
        watch_output(self.progress.meter, self.store, self.rejects, resumed)
        watch_engines(self.progress.meter, engines, self.tally)
        source: Any = None
        try:
            # NOTE: a KV pool smaller than the model's context bounds the prompts too.
            self.reader.max_prompt = min(self.reader.max_prompt, *(e.max_model_len - 1 for e in engines))
            settle_arrow()
            start = time.perf_counter()
            plan = self.affinity
            if len(engines) == 1:
                # NOTE: one engine steps on this thread, whose torch threads (OpenMP's) were started
                # while the model loaded and so carry the old cores: every thread of the process
                # moves to the compute cores, then the tokenizing thread starts on its own. (An
                # engine on a thread of its own ran 0.65x as fast: two OpenMP teams on two cores
                # make libgomp throttle its spinning, and its threads sleep between regions.)
                compute = plan.replicas[0].compute if plan is not None else None
                threads = self.config.device.threads or (len(compute) if compute else None)
                with pinned(compute, threads, whole_process=True):
                    governor = self._governor(compute)
                    sink = EngineSink(engines[0], self.step_hooks.get(self.labels[0]), ranges, governor)
                    source = self._source()
                    run_loop(self.admission, source, sink, self.finish, stop=stop, after=self.commit_ready)
                self.by_device[0].last_step_end = sink.last_step_end
                if governor is not None:
                    self.report.threads = governor.summary()
                    if (line := governor.note()) is not None:
                        self.progress.note(f"hpcinfer: {line}")
            else:
                with pinned(plan.host if plan is not None else None):
                    source = self._source()
                    run_on_devices(self, engines, source, stop, ranges)
            if not stop.is_set():
                held = self.held_by_source
                self.report.accounting = settle(
                    ((path, read, resumed + held.get(path, 0)) for path, (read, resumed) in self.reader.counts.items()),
                    self.written_by_source,
                    self.rejects.by_source,
                )
                self.store.assemble()
            elif self.commit_every_s:
                self.checkpoint()  # NOTE: a stop, unlike a kill, keeps every answer that finished
        finally:
            if isinstance(source, ReadAhead):
                source.close()
            if self.tps:
                steps = [e.stats.steps for e in engines]
                self.report.tensor_parallel = [asdict(f) for f in close_groups(self.tps, steps)]
        return summarise(self, engines, start, resumed)

    def _source(self) -> Any:
        """The requests as read and tokenized: on this thread, or with --cpu-affinity on a thread of
        their own, pinned to the tokenizer's cores and up to a window ahead of the engines."""
        if self.affinity is None:
            return self.reader.produce()
        cores = self.affinity.tokenize
        return ReadAhead(self.reader.produce(), self.config.generate.window_rows, "tokenize", lambda: pin_thread(cores))

    @property
    def tp_size(self) -> int:
        return self.config.device.tensor_parallel

    def _tp_engines(self) -> list[Engine]:
        """Rank 0 of each --tp group: the other ranks started, its shard loaded, its engine mirrored to them."""
        engines, self.tps = start_run_groups(
            self.config, self.info, self.tp_groups, self.dtype, self.engine_config,
            lambda model, config: self._engine(model.embed.weight.device, model, config),
        )  # fmt: skip
        return engines

    def _governor(self, compute: list[int] | None) -> ThreadGovernor | None:
        """The one engine's thread count on the CPU, adapted to other work on its cores (device/threads.py)."""
        if self.device.type != "cpu" or self.config.backend == "transformers":
            return None
        most = len(compute) if compute else (PROCESS.most or torch.get_num_threads())
        return ThreadGovernor(most, self.config.device.threads).start(torch.get_num_threads())

    def _engine(self, device: torch.device, model: Any = None, config: EngineConfig | None = None) -> Engine:
        if self.config.backend == "transformers":
            self.progress.note(f"hpcinfer: --backend transformers generates in {WHAT_IS_LOST}")
            return transformers_engine(self.info, device, self.dtype, self.engine_config, self.tokenizer)
        # NOTE: made under its own CUDA device, so nothing of cuda:1's engine lands on cuda:0
        with accelerators.current(device):
            if model is None:
                d = self.config.device
                key = ("decoder", str(self.info.path), str(device), str(self.dtype), d.quantize, d.int8_kernel)
                # NOTE: a model is kept with the adapters attached to it, on the device or in host memory
                key += (*self.lora_digests, self.config.generate.max_loras) if self.loras else ()
                model = shelved(
                    self.shelf, key, lambda: load_decoder(self.info, device, self.dtype, d.quantize, d.int8_kernel)
                )
            lora_rows = None
            if self.loras:
                lora_rows = getattr(model, "lora_rows", None)  # NOTE: a kept model has its adapters already
                if lora_rows is None:
                    lora_rows = model.lora_rows = attach_adapters(
                        model, self.loras, self.info.config, self.dtype, device, self.config.generate.max_loras
                    )
            # NOTE: one engine on one device may keep its KV pool for the next run (a server's batches)
            single = self.shelf is not None and len(self.devices) == 1 and self.tp_size == 1
            return Engine(
                model,
                config or self.engine_config,
                self.info.eos_token_ids,
                decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
                trace_steps=self.config.trace_path is not None,
                grammars=self.reader.grammars,
                pools=self._kept_pool if single else None,
                lora_rows=lora_rows,
                draft=load_draft(self.draft, device, self.dtype, self.shelf),
                vision=self._vision(device),
            )

    def _vision(self, device: torch.device) -> VisionTower | None:
        """A vision-language model's vision tower on `device` (kept on the shelf beside its decoder)."""
        vision = self.info.vision
        if vision is None:
            return None
        key = ("vision", str(self.info.path), str(device), str(self.dtype))
        return shelved(self.shelf, key, lambda: VisionTower(self.info.path, vision, device, self.dtype))

    def _kept_pool(self, key: Any, make: Callable[[], Any]) -> Any:
        assert self.shelf is not None
        pool = self.shelf.get(("kv", str(self.info.path), *key), make, attached=True)
        # NOTE: an earlier run's engine still in a step (a hung step its run gave up on): a pool of our own
        return make() if pool.stepping else pool


def run_generate(
    config: RunConfig,
    *,
    progress: Progress | None = None,
    ranges: RangeBackend | None = None,
    step_hooks: dict[str, Callable[[], None]] | None = None,
    stop: threading.Event | None = None,
    shelf: ModelShelf | None = None,
) -> GenerateReport:
    """Generates an answer for every valid input row; see the module docstring and GenerationJob.
    `stop`, set by the caller, ends the run between steps as Ctrl-C does; `shelf` keeps the decoder
    loaded for the process's next run."""
    job = GenerationJob(config, progress, step_hooks, shelf)
    stop = stop or threading.Event()
    try:
        with claimed(job.store, config.output), signals_stop(stop) as interrupted, torch.inference_mode():
            report = job.run(stop, ranges)
        if interrupted:
            raise Interrupted(interrupted[0], job.store.rows_done, config.output.path)
        return report
    finally:
        job.progress.close()
