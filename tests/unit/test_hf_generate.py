"""Generation through `--backend transformers` (static batches of transformers' AutoModelForCausalLM
inside hpcinfer's generation job): greedy and seeded answers equal the native engine's on a tiny
random Llama; what the backend lacks is refused by name (a run option: an error; a row: a reject)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from hpcinfer.api import run
from hpcinfer.config import GenerateConfig, InputConfig, OutputConfig, PipelineConfig, RunConfig
from hpcinfer.errors import ConfigError
from hpcinfer.obs.progress import Progress
from tests.fixtures.tiny_decoder import build_tiny_decoder

from ..conftest import make_texts, write_jsonl

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny_decoder(tmp_path_factory.mktemp("hfgen"), "LlamaForCausalLM", seed=11, max_positions=128)


def _config(src, out, model, backend: str, **gen) -> RunConfig:
    return RunConfig(
        input=InputConfig((str(src),)),
        model=str(model),
        output=OutputConfig(str(out)),
        pipeline=PipelineConfig(progress="off"),
        backend=backend,
        generate=GenerateConfig(**{"max_tokens": 10, "window_rows": 4, "max_num_seqs": 3, **gen}),
    )


def _answers(src, tmp_path, model, backend: str, **gen):
    out = tmp_path / f"{backend}.parquet"
    report = run(_config(src, out, model, backend, **gen), progress=Progress("off"))
    return report, pq.read_table(out).to_pylist()


def test_greedy_and_seeded_answers_equal_the_native_engine(tmp_path, llama):
    texts = make_texts(11, seed=12)
    rows = [{"id": f"g{i}", "prompt": t, "max_tokens": 2 + (i * 5) % 11} for i, t in enumerate(texts)]
    rows += [
        {"id": f"s{i}", "prompt": t, "temperature": 0.9, "top_k": 20, "seed": 100 + i} for i, t in enumerate(texts[:4])
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    native_report, native = _answers(src, tmp_path, llama, "native")
    report, ours = _answers(src, tmp_path, llama, "transformers")
    assert [r["id"] for r in ours] == [r["id"] for r in rows]
    assert ours == native  # text, finish_reason and token counts, row for row
    assert {r["finish_reason"] for r in ours} >= {"length"}
    assert (
        report.rows == native_report.rows == len(rows) and report.completion_tokens == native_report.completion_tokens
    )


def test_what_the_backend_lacks_is_refused(tmp_path, llama):
    lines = [
        {"custom_id": "ok", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "a lazy dog", "max_tokens": 4}},
        {"custom_id": "lp", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "a lazy dog", "max_tokens": 4, "logprobs": 2}},
        {"custom_id": "pen", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "a lazy dog", "max_tokens": 4, "presence_penalty": 1.0}},
    ]  # fmt: skip
    src = write_jsonl(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "out.jsonl"
    report = run(_config(src, out, llama, "transformers"), progress=Progress("off"))
    answers = {x["custom_id"]: x for x in map(json.loads, out.read_text().splitlines())}
    assert answers["ok"]["response"]["status_code"] == 200 and report.rows == 1
    assert answers["lp"]["error"] == {
        "code": "invalid_request",
        "message": "log-probabilities needs hpcinfer's own engine, not --backend transformers",
    }
    assert answers["pen"]["error"]["code"] == "invalid_request"
    for option, message in [
        ({"regex": "[a-z]+"}, "structured output"),
        ({"kv_cache_memory": "8MiB"}, "--kv-cache-memory"),
        ({"n": 2}, "--n needs"),
    ]:
        with pytest.raises(ConfigError, match=message) as caught:
            run(_config(src, tmp_path / "x.jsonl", llama, "transformers", **option), progress=Progress("off"))
        assert "static batches, no paged KV cache" in str(caught.value)


def test_an_architecture_without_native_code_generates_as_transformers_does(tmp_path, llama):
    """GPT-2 (learned positions, GELU, no native decoder): --backend transformers answers each prompt
    as transformers' own greedy `generate` does, token for token; the native backend refuses it."""
    import shutil

    import torch
    from tokenizers import Tokenizer
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = tmp_path / "gpt2"
    tokenizer = Tokenizer.from_file(str(llama / "tokenizer.json"))
    tokenizer.no_padding()  # NOTE: the file pads to 128 (it is MiniLM's); prompts are never padded
    eos = tokenizer.token_to_id("[SEP]")
    config = GPT2Config(vocab_size=tokenizer.get_vocab_size(), n_positions=96, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=eos, eos_token_id=eos)  # fmt: skip
    torch.manual_seed(5)
    GPT2LMHeadModel(config).save_pretrained(gpt2)
    shutil.copy(llama / "tokenizer.json", gpt2 / "tokenizer.json")
    texts = [" ".join(t.split()[: 4 + 3 * i]) for i, t in enumerate(make_texts(5, seed=21))]
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": t} for i, t in enumerate(texts)])
    report, ours = _answers(src, tmp_path, gpt2, "transformers", max_tokens=8)
    assert report.rows == len(ours) == 5
    model = GPT2LMHeadModel.from_pretrained(gpt2).eval()
    for row, text in zip(ours, texts, strict=True):
        ids = tokenizer.encode(text).ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=eos)
        completion = out[0, len(ids) :].tolist()
        assert row["text"] == tokenizer.decode(completion, skip_special_tokens=True)
        assert row["completion_tokens"] == len(completion)
    with pytest.raises(Exception, match="unsupported architecture 'GPT2LMHeadModel'"):
        _answers(src, tmp_path, gpt2, "native")
