"""Progress of a generation run: rows out of the input's total, generated tokens/s and an ETA."""

from __future__ import annotations

import io
import re

import pytest

from hpcinfer.config import GenerateConfig, InputConfig, OutputConfig, PipelineConfig, RunConfig
from hpcinfer.obs.progress import Progress
from hpcinfer.tasks.generate.job import run_generate
from tests.fixtures.tiny_decoder import build_tiny_decoder

from ..conftest import make_texts, write_jsonl

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_log_line_counts_rows_against_the_total_with_an_eta(tmp_path):
    ckpt = build_tiny_decoder(tmp_path / "ckpt", seed=2, max_positions=128)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": t} for i, t in enumerate(make_texts(12, seed=1))])
    stream = io.StringIO()
    config = RunConfig(
        input=InputConfig((str(src),)),
        model=str(ckpt),
        output=OutputConfig(str(tmp_path / "out.jsonl")),
        pipeline=PipelineConfig(progress="log"),
        generate=GenerateConfig(max_tokens=4, window_rows=4, kv_cache_memory="4MiB", max_num_seqs=3),
    )
    run_generate(config, progress=Progress("log", stream=stream, log_every_s=0.0))
    lines = stream.getvalue().splitlines()
    assert len(lines) == 12  # one per finished row at log_every_s=0
    assert re.search(r"hpcinfer: 12/12 rows, [\d.,]+ rows/s, [\d,]+ tokens/s, ETA 0 s$", lines[-1]), lines[-1]
    # NOTE: an ETA needs the rate rows keep finishing at, known a second after the first finished
    assert all("/12 rows" in line for line in lines)
