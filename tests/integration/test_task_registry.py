"""The task registry: a task is a folder plus one registry line, `api.run` knows none by name, and an
option the chosen task would not read is refused in one line (on the command line, by its flag)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from hpcinfer import registry
from hpcinfer.api import run
from hpcinfer.config import InputConfig, OutputConfig, RunConfig
from hpcinfer.errors import ConfigError
from hpcinfer.obs.report_json import JsonReport
from tests.fixtures.tiny_decoder import build_tiny_decoder

from ..conftest import write_jsonl


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_decoder(tmp_path_factory.mktemp("decoder") / "m", "LlamaForCausalLM", seed=1)


def chat_batch(path: Path) -> Path:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
    return write_jsonl(path, [line])


def hpcinfer(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcinfer", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_options_generation_ignores_are_refused_by_their_flags(tmp_path, decoder):
    src = chat_batch(tmp_path / "batch.jsonl")
    model = ["--model", str(decoder), "-q"]
    cases = {
        ("--text-column", "body"): "--task generate does not read --text-column: its rows give prompt, messages",
        ("--pooling", "mean"): "--task generate does not read --pooling: pooling, prompts and labels are the encoder",
        ("--no-overlap",): "--task generate does not read --no-overlap: the engine's step loop has no serial twin",
    }
    for args, message in cases.items():
        done = hpcinfer("run", str(src), "-o", "out.jsonl", *model, *args, cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"hpcinfer: error: {message}"), done.stderr
        assert "Traceback" not in done.stderr
        assert not (tmp_path / "out.jsonl").exists()


def test_embedding_an_openai_batch_refuses_a_text_column(tmp_path, tiny_model):
    line = {"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hi", "model": "m"}}
    src = write_jsonl(tmp_path / "batch.jsonl", [line])
    config = RunConfig(input=InputConfig((str(src),), text_column="body"), model=str(tiny_model),
                       output=OutputConfig(str(tmp_path / "o.jsonl")))  # fmt: skip
    with pytest.raises(ConfigError, match="--task embed does not read --text-column: an OpenAI batch file's bodies"):
        run(config)
    plain = write_jsonl(tmp_path / "rows.jsonl", [{"body": "hi"}])  # the same option on plain rows is read
    run(RunConfig(input=InputConfig((str(plain),), text_column="body"), model=str(tiny_model),
                  output=OutputConfig(str(tmp_path / "o.parquet"))))  # fmt: skip
    assert (tmp_path / "o.parquet").is_file()


@dataclass
class EchoReport(JsonReport):
    rows: int = 0


class EchoTask:
    """A task that is only a registry line: counts its input lines."""

    name = "echo"
    endpoints = ()

    def claims(self, checkpoint):
        return None

    def honours(self, config):
        return (*registry.EVERY_TASK, "input.text_column")

    def hints(self):
        return {}

    def settle(self, config):
        return config

    def run(self, config, given):
        return EchoReport(rows=sum(1 for p in config.input.paths for _ in open(p, encoding="utf-8")))

    def cluster(self):
        raise NotImplementedError

    def tuning(self):
        raise NotImplementedError


ECHO = EchoTask()


def test_a_task_is_a_registry_line_and_the_api_runs_it(tmp_path, monkeypatch, tiny_model):
    monkeypatch.setitem(registry.TASKS, "echo", f"{__name__}:ECHO")
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}, {"text": "b"}, {"text": "c"}])
    config = RunConfig(input=InputConfig((str(src),), text_column="text"), model=str(tiny_model), task="echo",
                       output=OutputConfig(str(tmp_path / "o.jsonl")))  # fmt: skip
    assert run(config) == EchoReport(rows=3)
    with pytest.raises(ConfigError, match="--task echo does not read --max-batch-size"):
        run(RunConfig(**{**vars_of(config), "plan": registry.RunConfig().plan.__class__(max_batch_size=7)}))
    with pytest.raises(ConfigError, match="--task must be one of auto, .*echo.*got 'nothing'"):
        run(RunConfig(**{**vars_of(config), "task": "nothing"}))


def vars_of(config: RunConfig) -> dict:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def test_auto_names_the_task_that_claims_the_checkpoint(tmp_path, decoder, tiny_model):
    assert registry.auto_task(RunConfig(model=str(decoder))) == ("generate", "a causal LM")
    assert registry.auto_task(RunConfig(model=str(tiny_model)))[0] == "embed"
    assert json.loads((decoder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
