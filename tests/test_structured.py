"""Structured output: answers held to JSON schemas, regular expressions, choices and grammars.

Oracles: `jsonschema` validates the JSON answers, `regex` (partial matching) checks each token
mask against a brute-force walk of a small byte-level vocabulary, `openai`'s types the OpenAI
bodies. The tiny random models' unconstrained output is noise, so every valid answer is the
grammar engine's doing.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest
import regex
import torch
from openai.types.chat import ChatCompletion

from hpcinfer.errors import ConfigError
from hpcinfer.models.decoder_checkpoint import inspect_decoder, load_decoder
from hpcinfer.models.gguf_tokenizer import byte_alphabet
from hpcinfer.models.tiny_gguf import build_tiny_gguf
from hpcinfer.tasks.generate.engine import Engine, EngineConfig
from hpcinfer.tasks.generate.sequence import SamplingParams
from hpcinfer.tasks.generate.setup import load_tokenizer
from hpcinfer.tasks.generate.structured import Grammars, GrammarSpec, StepMasks, consume, spec_from_body

from .conftest import generate_config, read_output, run_job, tiny_llama, write_jsonl

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "colour", "ok"],
    "additionalProperties": False,
}
PATTERN = r"[0-9]{3}-[a-z]{2}(x|yz)?"
CHOICES = ["red", "green", "blue", "a longer answer"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama in a GGUF file with a 268-token byte-level BPE vocabulary."""
    return build_tiny_gguf(tmp_path_factory.mktemp("structured") / "tiny.gguf", seed=11)


def _grammars(path: Path) -> tuple[Grammars, object, object]:
    info = inspect_decoder(path)
    tokenizer = load_tokenizer(info)
    return Grammars(tokenizer.to_str(), info.config.vocab_size, info.eos_token_ids), info, tokenizer


def test_masks_equal_a_brute_force_walk_of_the_vocabulary(tiny: Path) -> None:
    """At every state of random walks through a regex and a choice, the tokens the mask allows are
    exactly those whose bytes keep the answer a prefix of a match (EOS: the answer is a match)."""
    grammars, info, tokenizer = _grammars(tiny)
    vocab = info.config.vocab_size
    decoder = {ch: b for b, ch in byte_alphabet().items()}
    pieces = {}
    for token in range(vocab):
        text = tokenizer.id_to_token(token)
        if all(ch in decoder for ch in text) and not text.startswith("<|"):
            pieces[token] = bytes(decoder[ch] for ch in text)
    eos = set(info.eos_token_ids)
    masks = StepMasks(vocab, torch.device("cpu"))
    cases = [
        (GrammarSpec.of("regex", PATTERN), PATTERN.encode()),
        (GrammarSpec.of("choice", CHOICES), b"|".join(regex.escape(c.encode()) for c in CHOICES)),
    ]
    checked = forced = 0
    for spec, oracle in cases:
        for walk in range(6):
            rng = random.Random(walk)
            matcher, answer = grammars.matcher(spec), b""
            while True:
                seq = type("Row", (), {"grammar": matcher})()
                logits = masks.start([seq]).apply(torch.zeros(1, vocab))  # type: ignore[union-attr]
                allowed = set(torch.isfinite(logits[0]).nonzero().flatten().tolist())
                expected = {t for t, b in pieces.items() if regex.fullmatch(oracle, answer + b, partial=True)}
                if regex.fullmatch(oracle, answer):
                    expected |= eos
                left = [c.encode() for c in CHOICES if c.encode().startswith(answer)] if spec.kind == "choice" else []
                if len(left) == 1 and left[0] != answer:
                    # NOTE: where the rest is forced, llguidance allows only its canonical first
                    # token ("on" of "onger", not "o"): the tokenizer's own split of the rest
                    rest = left[0][len(answer) :].decode()
                    expected = {tokenizer.encode(rest, add_special_tokens=False).ids[0]}
                    forced += 1
                assert allowed == expected, (spec, answer)
                checked += 1
                step = rng.choice(sorted(allowed))
                if step in eos:
                    break
                answer += pieces[step]
                if consume(matcher, step):
                    assert regex.fullmatch(oracle, answer)
                    break
    assert checked > 40 and 0 < forced < checked


def _rows(count: int) -> list[dict]:
    rows = []
    for i in range(count):
        row: dict = {"id": i, "prompt": f"row {i}: answer please"}
        kind = i % 3
        if kind == 0:
            row["json_schema"] = SCHEMA
        elif kind == 1:
            row["regex"] = PATTERN
        else:
            row["choice"] = CHOICES
        if i % 2:
            row.update(temperature=1.0, top_p=0.95)
        rows.append(row)
    return rows


def _check(row: dict, text: str) -> None:
    if "json_schema" in row:
        jsonschema.validate(json.loads(text), row["json_schema"])
    elif "regex" in row:
        assert regex.fullmatch(row["regex"], text), text
    else:
        assert text in row["choice"], text


def test_every_constrained_answer_is_valid_greedy_and_sampled(tiny: Path, tmp_path: Path, one_torch_thread) -> None:
    rows = _rows(240)
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    report, table = run_job(generate_config(src, tmp_path / "out.jsonl", tiny, max_tokens=160))
    answers = table.to_pylist()
    assert [a["id"] for a in answers] == [r["id"] for r in rows]
    for row, answer in zip(rows, answers, strict=True):
        assert answer["finish_reason"] == "stop", answer
        _check(row, answer["text"])
    # noise without a grammar: the same prompts unconstrained do not come out as JSON
    plain = [{"id": r["id"], "prompt": r["prompt"]} for r in rows[:30:3]]
    src = write_jsonl(tmp_path / "plain.jsonl", plain)
    _, free = run_job(generate_config(src, tmp_path / "plain_out.jsonl", tiny, max_tokens=40))
    assert not any(_parses(t) for t in free.column("text").to_pylist())


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_a_step_ahead_gives_the_same_answers(tiny: Path, one_torch_thread) -> None:
    """Grammar rows make the engine wait for each token; mixed with free rows, the answers are
    those of the step-by-step engine."""
    grammars, info, tokenizer = _grammars(tiny)
    model = load_decoder(info, torch.device("cpu"), torch.float32)
    prompts = [tokenizer.encode(f"prompt {i}").ids for i in range(12)]
    params = [
        SamplingParams(max_tokens=160, temperature=1.0 if i % 2 else 0.0, seed=i,
                       structured=GrammarSpec.of("json_schema", SCHEMA) if i % 3 == 0 else None)
        for i in range(12)
    ]  # fmt: skip
    outputs = []
    for ahead in (False, True):
        config = EngineConfig(max_num_seqs=8, kv_cache_memory=4 << 20, ahead=ahead)
        engine = Engine(model, config, info.eos_token_ids, grammars=grammars)
        outputs.append([s.completion for s in engine.generate(prompts, params)])
    assert outputs[0] == outputs[1]
    for i in range(0, 12, 3):
        jsonschema.validate(json.loads(tokenizer.decode(outputs[0][i])), SCHEMA)


def test_openai_response_format_and_spellings(tiny: Path, tmp_path: Path, one_torch_thread) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "who?"}], "max_tokens": 160}
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {**body, "response_format": fmt}},
        {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
         "body": {**body, "response_format": {"type": "json_object"}}},
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
         "body": {**body, "structured_outputs": {"choice": CHOICES}}},
        {"custom_id": "d", "method": "POST", "url": "/v1/chat/completions", "body": {**body, "guided_regex": PATTERN}},
    ]  # fmt: skip
    src = write_jsonl(tmp_path / "batch.jsonl", lines)
    run_job(generate_config(src, tmp_path / "out.jsonl", tiny))
    answers = {a["custom_id"]: a for a in read_output(tmp_path / "out.jsonl").to_pylist()}
    content = {}
    for key, answer in answers.items():
        completion = ChatCompletion.model_validate(answer["response"]["body"])
        assert completion.choices[0].finish_reason == "stop"
        assert completion.model == "tiny"  # the request's own name for the model, not a local path
        content[key] = completion.choices[0].message.content
    jsonschema.validate(json.loads(content["a"]), SCHEMA)
    assert isinstance(json.loads(content["b"]), dict)
    assert content["c"] in CHOICES
    assert regex.fullmatch(PATTERN, content["d"])


def test_spellings_of_a_request() -> None:
    assert spec_from_body({"guided_json": SCHEMA}) == GrammarSpec.of("json_schema", json.dumps(SCHEMA))
    assert spec_from_body({"structured_outputs": {"json": SCHEMA}}) == spec_from_body({"json_schema": SCHEMA})
    assert spec_from_body({"guided_choice": ["a", "b"]}) == GrammarSpec("choice", '["a", "b"]')
    assert spec_from_body({"response_format": {"type": "text"}}) is None
    assert spec_from_body({"prompt": "x"}) is None
    for bad in (
        {"regex": "a", "choice": ["a"]},
        {"response_format": {"type": "yaml"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"choice": []},
        {"choice": ["a", 3]},
        {"json_schema": "{not json"},
        {"json_schema": 3},
        {"structured_outputs": "json"},
    ):
        with pytest.raises(ValueError):
            spec_from_body(bad)


def test_bad_grammars_are_rejects_and_the_run_goes_on(tiny: Path, tmp_path: Path, one_torch_thread) -> None:
    rows = [
        {"id": "ok", "prompt": "fine", "regex": PATTERN},
        {"id": "regex", "prompt": "x", "regex": "(unclosed"},
        {"id": "notjson", "prompt": "x", "json_schema": "{not json"},
        {"id": "badtype", "prompt": "x", "json_schema": {"type": "nonsense"}},
        {"id": "two", "prompt": "x", "regex": "a", "choice": ["a"]},
        {"id": "lark", "prompt": "x", "grammar": "start: undefined_rule"},
        {"id": "format", "prompt": "x", "response_format": {"type": "yaml"}},
        {"id": "gbnf", "prompt": "x", "grammar": 'root ::= "(" [0-9]+ ")"'},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    report, table = run_job(generate_config(src, tmp_path / "out.jsonl", tiny, max_tokens=24))
    assert table.column("id").to_pylist() == ["ok", "gbnf"]
    assert regex.fullmatch(r"\([0-9]+\)", table.column("text").to_pylist()[1])
    rejects = [json.loads(line) for line in Path(f"{tmp_path / 'out.jsonl'}.rejects.jsonl").read_text().splitlines()]
    assert {r["id"]: r["reason"] for r in rejects} == dict.fromkeys(
        ["regex", "notjson", "badtype", "two", "lark", "format"], "invalid_grammar"
    )
    messages = {r["id"]: r["message"] for r in rejects}
    assert "unclosed group" in messages["regex"] and "nonsense" in messages["badtype"]
    assert "not JSON" in messages["notjson"] and "undefined_rule" in messages["lark"]


def test_a_tokenizer_the_engine_cannot_read_rejects_with_its_reason(tmp_path: Path, one_torch_thread) -> None:
    """A WordPiece tokenizer (the tiny Llama's) has no byte-level pieces: rows asking are rejected."""
    path, *_ = tiny_llama(tmp_path / "llama", seed=1, prompts=1, max_length=32, text_seed=0)
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}, {"prompt": "b", "choice": ["x"]}])
    report, table = run_job(generate_config(src, tmp_path / "out.jsonl", path, max_tokens=4))
    assert table.num_rows == 1
    reject = json.loads(Path(f"{tmp_path / 'out.jsonl'}.rejects.jsonl").read_text())
    assert reject["reason"] == "invalid_grammar" and "byte-level BPE or SentencePiece" in reject["message"]


def test_run_defaults_from_the_command_line(tiny: Path, tmp_path: Path, one_torch_thread) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    rows = [{"id": 0, "prompt": "a"}, {"id": 1, "prompt": "b", "choice": CHOICES}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    _, table = run_job(generate_config(src, tmp_path / "out.jsonl", tiny, max_tokens=160, json_schema=str(schema)))
    texts = table.column("text").to_pylist()
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert texts[1] in CHOICES  # a row's own structured output wins
    for bad, message in (
        ({"json_schema": str(tmp_path / "missing.json")}, "cannot read"),
        ({"regex": "a", "choice": ("a",)}, "give one of"),
        ({"regex": "(x"}, "invalid regex"),
    ):
        with pytest.raises(ConfigError, match=message):
            run_job(generate_config(src, tmp_path / "bad.jsonl", tiny, **bad))
