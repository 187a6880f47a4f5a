"""What a generation step costs the device and the host, checked on CPU with a modelled asynchronous device.

On CUDA a forward only launches kernels and returns; the host waits for them when sampling reads
the tokens back. Host clocks would then book the forward's compute as sampling. These tests put a
device clock behind the engine's step timer and a launch-only forward in front of it.
"""

from __future__ import annotations

import time

import pytest
import torch

from hpcinfer.engine.engine import Engine, EngineConfig
from hpcinfer.engine.sequence import SamplingParams
from hpcinfer.engine.staging import StepStaging
from hpcinfer.models.decoder_checkpoint import load_decoder
from hpcinfer.models.decoder_inspect import inspect_decoder
from hpcinfer.models.registry import load_tokenizer
from tests.fixtures.tiny_decoder import build_tiny_decoder

from ..conftest import make_texts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FORWARD_S, SAMPLING_S = 0.03, 0.002  # device time of each step's forward and sampling


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, one_torch_thread):
    path = build_tiny_decoder(tmp_path_factory.mktemp("step"), "LlamaForCausalLM", seed=5)
    model = load_decoder(inspect_decoder(path), torch.device("cpu"), torch.float32)
    tokenizer = load_tokenizer(path, 256)
    return model, [tokenizer.encode(t).ids for t in make_texts(6, seed=1)], tokenizer


class AsyncDevice:
    """A device clock: work is queued at launch and done by `now`; the host waits only when it reads."""

    def __init__(self) -> None:
        self.queued = 0.0  # device seconds of work launched so far

    def launch(self, seconds: float) -> None:
        self.queued += seconds

    def read_back(self) -> None:
        """The host waits for everything launched (sampling's tokens.tolist() on CUDA)."""
        time.sleep(self.queued - getattr(self, "waited", 0.0))
        self.waited = self.queued


class DeviceMarks:
    """The engine's step timer over AsyncDevice: a mark is the device time when the work before it is done."""

    def __init__(self, device: AsyncDevice) -> None:
        self.device = device

    def mark(self) -> float:
        return self.device.queued

    def seconds(self, start: float, end: float) -> float:
        return end - start


def test_the_step_split_is_device_time_not_host_time(tiny):
    model, prompts, tokenizer = tiny
    engine = Engine(model, EngineConfig(max_num_seqs=8, kv_cache_memory=8 << 20))
    device = AsyncDevice()
    run, sample, start = engine.runner.run, engine.sampler.sample_on_device, engine.readback.start

    def launch_only_forward(plan, ahead=None):  # noqa: ANN001, ANN202
        device.launch(FORWARD_S)
        return run(plan, ahead)

    def launch_only_sampling(logits, seqs):  # noqa: ANN001, ANN202
        device.launch(SAMPLING_S)
        return sample(logits, seqs)

    def readback_that_waits(tokens):  # noqa: ANN001, ANN202
        pending = start(tokens)

        class Waits:
            def values(self) -> list[int]:
                device.read_back()
                return pending.values()

        return Waits()

    engine.runner.run, engine.sampler.sample_on_device = launch_only_forward, launch_only_sampling
    engine.readback.start = readback_that_waits
    engine.timer = DeviceMarks(device)
    engine.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    stats = engine.stats
    assert stats.steps >= 4
    assert stats.model_s == pytest.approx(stats.steps * FORWARD_S, rel=1e-6)
    assert stats.sample_s == pytest.approx(stats.steps * SAMPLING_S, rel=1e-6)


class ScribbledStaging(StepStaging):
    """Copies to a separate buffer even on the CPU, then scribbles the host one, as the next step would."""

    def send(self, arrays):  # noqa: ANN001, ANN201
        views = super().send(arrays)
        self.host.fill_(7)  # valid ids and slots, wrong ones: a device read of the host buffer changes tokens
        return views


def test_every_step_input_reaches_the_device_in_one_copy(tiny):
    model, prompts, tokenizer = tiny
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, kv_cache_memory=32 << 10, block_size=4)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [s.completion for s in Engine(model, config).generate(prompts, params)]
    engine = Engine(model, config)
    engine.runner.staging = staging = ScribbledStaging(torch.device("cpu"), 16, copy=True)  # grows as it goes
    got = [s.completion for s in engine.generate(prompts, params)]
    assert got == want
    stats = engine.stats
    assert stats.preemptions > 0 and stats.continued_chunks > 0  # mixed steps, chunks, recomputation
    assert staging.uploads == stats.steps  # one copy a step
    assert staging.host.numel() > 16


def _outcome(seqs) -> list[tuple]:  # noqa: ANN001
    return [(s.completion, s.finish_reason, s.stop_text_cut) for s in seqs]


@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(max_num_seqs=6, max_num_batched_tokens=64, kv_cache_memory=8 << 20),
        # preemption (recomputation), chunked prefill, prefix cache hits
        EngineConfig(max_num_seqs=6, max_num_batched_tokens=20, kv_cache_memory=40 << 10, block_size=4),
        EngineConfig(max_num_seqs=6, max_num_batched_tokens=64, kv_cache_memory=8 << 20, cuda_graphs=True),
    ],
    ids=["plain", "preempting-chunked", "static-decode"],
)
def test_a_step_ahead_gives_the_step_by_step_tokens_and_stops(tiny, config, monkeypatch):
    from dataclasses import replace

    from hpcinfer.engine.staging import InFlightTokens

    model, prompts, tokenizer = tiny
    shared = prompts[0][:9]
    prompts = [*prompts, *(shared + p[1:4] for p in prompts[1:4])]  # shared prefixes for the cache
    first = Engine(model, config).generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    greedy = [s.completion for s in first]
    # stops drawn from what the model says, so that they do end sequences mid-answer
    params = []
    for i, answer in enumerate(greedy):
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(max_tokens=20, stop_token_ids=(answer[7],)))
        elif kind == 1:
            params.append(SamplingParams(max_tokens=20, stop=(tokenizer.decode(answer[5:7]),)))
        elif kind == 2:
            params.append(SamplingParams(max_tokens=3 + i, temperature=1.0, top_p=0.9, seed=i))
        else:
            params.append(SamplingParams(max_tokens=20, temperature=0.8, top_k=20))  # unseeded: from the run's seed
    fills = []
    fill = InFlightTokens.fill
    monkeypatch.setattr(InFlightTokens, "fill", lambda self, ids, rows: fills.append(1) or fill(self, ids, rows))
    decode = tokenizer.decode
    step_by_step = Engine(model, replace(config, ahead=False), decode=decode)
    want = _outcome(step_by_step.generate(prompts, params))
    assert not fills
    ahead = Engine(model, replace(config, ahead=True), decode=decode)
    got = _outcome(ahead.generate(prompts, params))
    assert got == want
    assert len(fills) > 10  # decodes really took their input from the step still in flight
    assert {r for _, r, _ in got} == {"stop", "length"}
    assert ahead.blocks.num_used == 0 and not ahead.has_work
    if config.kv_cache_memory == 40 << 10:
        assert ahead.stats.preemptions > 0 and ahead.stats.continued_chunks > 0 and ahead.stats.cached_tokens > 0
