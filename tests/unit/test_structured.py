"""Structured output: answers held to JSON schemas, regular expressions, choices and grammars.

Oracles: `jsonschema` validates the JSON answers, `regex` (partial matching) checks each token
mask against a brute-force walk of a small byte-level vocabulary, `openai`'s types the OpenAI
bodies. The tiny random models' unconstrained output is noise, so every valid answer is the
grammar engine's doing.
"""

from __future__ import annotations

import json
import random
from io import StringIO
from pathlib import Path

import jsonschema
import pytest
import regex
import torch
from openai.types.chat import ChatCompletion
from openai.types.responses import Response
from rich.console import Console

from hpcinfer.engine.constrained.schema_bounds import ANY_NAME, FRACTION_DIGITS, INTEGER_DIGITS, versions
from hpcinfer.engine.constrained.structured import Grammars, GrammarSpec, StepMasks, consume, spec_from_body
from hpcinfer.engine.engine import Engine, EngineConfig
from hpcinfer.engine.sequence import SamplingParams
from hpcinfer.errors import ConfigError
from hpcinfer.models.decoder_checkpoint import load_decoder, load_tokenizer
from hpcinfer.models.decoder_inspect import inspect_decoder
from hpcinfer.models.gguf_tokenizer import byte_alphabet
from tests.fixtures.tiny_gguf import build_tiny_gguf

from ..conftest import generate_config, read_output, run_job, tiny_llama, write_jsonl

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
        {"custom_id": "e", "method": "POST", "url": "/v1/responses",
         "body": {"model": "tiny", "input": "who?", "max_output_tokens": 160,
                  "text": {"format": {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}}}},
    ]  # fmt: skip
    src = write_jsonl(tmp_path / "batch.jsonl", lines)
    run_job(generate_config(src, tmp_path / "out.jsonl", tiny))
    answers = {a["custom_id"]: a for a in read_output(tmp_path / "out.jsonl").to_pylist()}
    response = Response.model_validate(answers.pop("e")["response"]["body"])
    assert response.status == "completed" and response.text.format.type == "json_schema"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)  # Responses' text.format: the same grammar
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


# Every kind of schema the grammar engine takes, by name. Strings are bounded where an answer should
# end within max_tokens; the unbounded ones (any values, a nesting list) may be cut, which is allowed.
LOOP = {"$ref": "#/$defs/loop"}
KINDS = {
    "facts": {"type": "object", "properties": {"population_millions": {"type": "number"},
              "area_km2": {"type": "number"}, "capital": {"type": "string", "maxLength": 12}},
              "required": ["population_millions", "area_km2", "capital"], "additionalProperties": False},
    "number": {"type": "number"},
    "integer": {"type": "integer"},
    "number range": {"type": "number", "minimum": -2.5, "maximum": 7.25},
    "integer above": {"type": "integer", "minimum": 10},
    "number below": {"type": "number", "exclusiveMaximum": 0},
    "multiple of": {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 100},
    "boolean": {"type": "boolean"},
    "null": {"type": "null"},
    "enum": {"enum": ["red", "green", 3, None, True]},
    "const": {"const": {"a": [1, 2]}},
    "string max": {"type": "string", "maxLength": 6},
    "string min max": {"type": "string", "minLength": 2, "maxLength": 4},
    "pattern": {"type": "string", "pattern": "^[a-z]{2,5}-[0-9]{1,3}$"},
    "date": {"type": "string", "format": "date"},
    "array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    "tuple": {"type": "array", "prefixItems": [{"type": "boolean"}, {"type": "number"}], "items": False},
    "numbers": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}, {"type": "null"}]},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}]},
    "types": {"type": ["integer", "null"]},
    "types with string": {"type": ["number", "string"], "maxLength": 3},
    "ref": {"$ref": "#/$defs/point", "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"},
            "y": {"type": "number"}}, "required": ["x", "y"], "additionalProperties": False}}},
    "nested ref": {"type": "object", "properties": {"p": {"$ref": "#/definitions/q"}}, "required": ["p"],
                   "additionalProperties": False,
                   "definitions": {"q": {"$ref": "#/definitions/r"}, "r": {"type": "integer", "maximum": 5}}},
    "list": {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
             "next": {"$ref": "#/$defs/node"}}, "required": ["v"], "additionalProperties": False}}},
    "optional loop": {"type": "object", "properties": {"x": LOOP, "y": {"type": "boolean"}}, "required": ["y"],
                      "additionalProperties": False, "$defs": {"loop": LOOP}},
    "dead end": {"type": "object", "properties": {"s": {"type": "string", "pattern": "[^\\s\\S]"}},
                 "additionalProperties": False},
    "open object": {"type": "object", "properties": {"a": {"type": "integer"}}},
    "json object": {"type": "object"},
    "any array": {"type": "array"},
    "anything": {},
    "record": {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
               "n": {"type": ["integer", "null"]}}, "required": ["tags", "n"], "additionalProperties": False},
}  # fmt: skip


def test_every_schema_kind_ends_valid_or_cut(tiny: Path, tmp_path: Path, one_torch_thread) -> None:
    """Every answer that ends "stop" is valid against its schema (jsonschema); every other one is
    "length"; the report counts them. Rows that stop at ", " (a stop token id) still end valid."""
    rows = []
    for name, schema in KINDS.items():
        for i in range(6):
            row = {"id": f"{name} {i}", "prompt": f"{name} {i}", "json_schema": schema, "seed": i}
            row.update(temperature=1.0 if i % 2 else 0.0, **({"stop_token_ids": [44]} if i % 3 == 2 else {}))
            rows.append(row)
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    report, table = run_job(generate_config(src, tmp_path / "out.jsonl", tiny, max_tokens=96))
    answers = table.to_pylist()
    assert [a["id"] for a in answers] == [r["id"] for r in rows]
    stops = dict.fromkeys(KINDS, 0)
    for row, answer in zip(rows, answers, strict=True):
        if answer["finish_reason"] == "stop":
            jsonschema.validate(json.loads(answer["text"]), row["json_schema"])
            stops[row["id"].rsplit(" ", 1)[0]] += 1
        else:
            assert answer["finish_reason"] == "length", answer
    cut = sum(a["finish_reason"] == "length" for a in answers)
    assert (report.constrained_answers, report.constrained_cut) == (len(rows), cut)
    assert sum(stops.values()) > 0.75 * len(rows), stops  # most end: the invariant is not vacuous
    numeric = [k for k in KINDS if "number" in json.dumps(KINDS[k]) or "integer" in json.dumps(KINDS[k])]
    assert all(stops[k] for k in numeric if k not in ("open object", "list")), stops
    console = Console(file=StringIO(), width=200)
    report.render(console)
    assert f"of which cut by max_tokens (finish length): {cut}" in console.file.getvalue()


def test_numbers_have_bounded_digits(tiny: Path, tmp_path: Path, one_torch_thread) -> None:
    """With digits favoured over every other token, an unbounded number still ends: at most
    INTEGER_DIGITS before the point and FRACTION_DIGITS after it; the schema's own bounds hold."""
    digits = {str(t): 30.0 for t in range(48, 58)}  # the tiny vocabulary's "0".."9"
    schemas = [KINDS["facts"], KINDS["number"], KINDS["integer"], KINDS["number range"], KINDS["integer above"],
               {"type": "integer", "minimum": 10**18}, KINDS["numbers"], {"type": "array", "maxItems": 3}]  # fmt: skip
    rows = [{"id": k, "prompt": f"n {k}", "json_schema": s, "logit_bias": digits} for k, s in enumerate(schemas)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    _, table = run_job(generate_config(src, tmp_path / "out.jsonl", tiny, max_tokens=160))
    assert table.column("id").to_pylist() == list(range(len(rows)))
    seen = 0
    for row, answer in zip(rows, table.to_pylist(), strict=True):
        assert answer["finish_reason"] == "stop", answer
        jsonschema.validate(json.loads(answer["text"]), row["json_schema"])
        for whole, fraction in regex.findall(r"-?([0-9]+)(?:\.([0-9]+))?", answer["text"]):
            seen += 1
            assert len(whole) <= (20 if row["id"] == 5 else INTEGER_DIGITS) and len(fraction) <= FRACTION_DIGITS
    assert seen >= len(rows)
    longest = max(len(w) for a in table.column("text").to_pylist() for w in regex.findall(r"[0-9]+", a))
    assert longest >= INTEGER_DIGITS  # the bias did push the digits to the cap


def test_schemas_no_finite_value_fits_are_rejects(tiny: Path, tmp_path: Path, one_torch_thread) -> None:
    """A schema that admits no finite value is an invalid_grammar reject, not an empty "stop" answer."""
    loop = {"$defs": {"loop": LOOP}}
    bad = {
        "self": {"$ref": "#/$defs/loop", **loop},
        "root": {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
        "required loop": {"type": "object", "properties": {"x": LOOP}, "required": ["x"], **loop},
        "endless list": {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {"next":
                         {"$ref": "#/$defs/n"}}, "required": ["next"]}}},
        "two types": {"allOf": [{"type": "string"}, {"type": "integer"}]},
        "not": {"not": {}},
        "false": False,
        "no types": {"type": []},
        "min over max": {"type": "integer", "minimum": 5, "maximum": 3},
    }  # fmt: skip
    rows = [{"id": "ok", "prompt": "x", "json_schema": KINDS["facts"]}]
    rows += [{"id": k, "prompt": "x", "json_schema": s} for k, s in bad.items()]
    rows.append({"id": "stop string", "prompt": "x", "json_schema": KINDS["facts"], "stop": ["}"]})
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    report, table = run_job(generate_config(src, tmp_path / "out.jsonl", tiny, max_tokens=96))
    assert table.column("id").to_pylist() == ["ok"]
    rejects = [json.loads(line) for line in Path(f"{tmp_path / 'out.jsonl'}.rejects.jsonl").read_text().splitlines()]
    reasons = {r["id"]: r["reason"] for r in rejects}
    assert reasons == {**dict.fromkeys(bad, "invalid_grammar"), "stop string": "invalid_request"}
    messages = {r["id"]: r["message"] for r in rejects}
    assert "#/$defs/loop would nest without end" in messages["self"]
    assert "#/$defs/n would nest without end" in messages["endless list"]
    assert "no finite JSON value" in messages["not"] and "false" in messages["false"]
    assert "incompatible types" in messages["two types"] and "stop strings" in messages["stop string"]


def test_bounded_versions_keep_the_schema_and_its_order() -> None:
    """The versions tried in turn: the first bounds numbers and any-values, the next only numbers,
    the last is the schema with its empty parts as false; properties keep their order."""
    schema = {"type": "object", "properties": {"b": {"type": "number"}, "a": LOOP}, "$defs": {"loop": LOOP}}
    first, numbers, pruned = versions(schema)
    assert list(first["properties"]) == ["b", "a"] and first["properties"]["a"] is False
    assert first["additionalProperties"] == {"$ref": f"#/$defs/{ANY_NAME}"} and ANY_NAME in first["$defs"]
    bounded = {"type": "number", "exclusiveMinimum": -(10**15), "exclusiveMaximum": 10**15, "multipleOf": 1e-6}
    assert first["properties"]["b"] == numbers["properties"]["b"] == bounded
    assert "additionalProperties" not in numbers and pruned["properties"] == {"b": {"type": "number"}, "a": False}
    # the schema's own bounds: kept, the cap past them, and as many decimals as they are written with
    own = versions({"type": "number", "minimum": 0.1234567, "maximum": 2})[0]
    assert own == {"type": "number", "minimum": 0.1234567, "maximum": 2, "multipleOf": 1e-7}
    assert versions({"type": "integer", "minimum": 1e18})[0]["exclusiveMaximum"] == 10**20
    assert versions({"enum": [1.23456789]})[0] == {"enum": [1.23456789]}
