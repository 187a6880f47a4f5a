"""The architecture page's worked example of a new pooling kind, built here as a task folder would
hold it: a head (what a row gives, how its model is built) and a task (which checkpoint it reads,
where its rows go), registered by one line. The toy kind gives each row the length of its mean
token state; it runs through the whole pipeline (sorting, batches, resume fingerprint, output) and
equals transformers' own hidden states, pooled by hand."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from hpcinfer import registry
from hpcinfer.api import run
from hpcinfer.config import RunConfig
from hpcinfer.models.adapter import pool
from hpcinfer.models.batch_model import BatchSteps
from hpcinfer.models.bert import can_pack_for_cpu, pack_for_cpu
from hpcinfer.models.checkpoint import CheckpointInfo, inspect_checkpoint, load_encoder
from hpcinfer.obs.progress import Progress
from hpcinfer.pipeline.task import EncoderTask

from ..conftest import make_texts, read_output, small_config, write_jsonl

# --- what `hpcinfer/tasks/mean_norm/task.py` would hold ---------------------------------------------


@dataclass(frozen=True, slots=True)
class MeanNormHead:
    """models.heads.Head: one value a row, the length of its mean token state."""

    ragged = None

    def width(self, info: CheckpointInfo) -> int:
        return 1

    def load(self, info: CheckpointInfo, device: torch.device, dtype: torch.dtype, cpu_fast_path: bool) -> Any:
        encoder = load_encoder(info).to(device=device, dtype=dtype)
        if cpu_fast_path and can_pack_for_cpu(encoder):
            encoder = pack_for_cpu(encoder)
        return MeanNorm(encoder)


class MeanNorm(BatchSteps):
    output_dim = 1

    def __init__(self, encoder: Any) -> None:
        self.encoder = encoder

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, padded: bool) -> object:
        return self.encoder(ids, lengths, padded)

    def postprocess(self, outputs: object) -> torch.Tensor:
        hidden, token_mask = outputs  # type: ignore[misc]
        return pool(hidden, token_mask, "mean").norm(dim=1, keepdim=True)


class MeanNormTask(EncoderTask):
    """--task mean_norm: any BERT-family encoder; each row's mean token state's length."""

    name = "mean_norm"

    def inspect(self, path: Path, config: RunConfig) -> CheckpointInfo:
        return replace(inspect_checkpoint(path), head=MeanNormHead())

    def fingerprint(self, config: RunConfig) -> dict[str, Any]:
        return {"task": self.name}


TASK = MeanNormTask()

# --- and `registry.TASKS` one line: "mean_norm": "hpcinfer.tasks.mean_norm.task:TASK" --------------


@pytest.fixture()
def registered(monkeypatch):  # noqa: ANN201
    # NOTE: before embed, which claims whatever is left under --task auto
    monkeypatch.setattr(registry, "TASKS", {"mean_norm": f"{__name__}:TASK", **registry.TASKS})


def test_a_new_pooling_kind_is_a_head_a_task_and_a_registry_line(registered, tmp_path, tiny_model):
    texts = make_texts(90, seed=12)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(texts)])
    cfg = replace(small_config(src, tmp_path / "out.parquet", tiny_model), task="mean_norm")
    report = run(cfg, progress=Progress("off"))
    table = read_output(tmp_path / "out.parquet")
    assert report.rows == 90 and report.accounting["balanced"] and report.windows == 1
    got = np.array(table.column("embedding").to_pylist(), np.float32)[:, 0]
    # the oracle: transformers' last hidden states, mean-pooled over the real tokens, their length
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model)
    model = transformers.AutoModel.from_pretrained(tiny_model).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    want = ((hidden * mask).sum(1) / mask.sum(1)).norm(dim=1).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # known by its name; it claims no checkpoint, so --task auto still embeds this one
    assert registry.task_named("mean_norm") is TASK
    assert registry.pick_task(replace(cfg, task="auto")) == "embed"
