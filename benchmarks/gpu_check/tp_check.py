"""Tensor parallelism, measured: memory per rank, the embedding/LM head choice, and greedy agreement.

    python benchmarks/gpu_check/tp_check.py [--device cpu|cuda] [--prompts 64] [--work DIR]

1. memory: a random Llama (hidden 512, 8 layers, vocabulary 30,522, ~56M parameters, float32)
   loaded whole (TP=1) and as 2 shards: each rank's weight bytes and resident memory after loading
   (less the process's resident memory before it), vocabulary-parallel and replicated;
2. the embedding/LM head choice: one forward + logits of a 64-token decode step and a 512-token
   prefill on 2 ranks, vocabulary-parallel (an all-reduce for the embedding, a gather of the
   logits) against replicated (no collective, the whole vocabulary on every rank);
3. `hpcinfer run --tp 2` against `--tp 1` on `--prompts` greedy prompts (16 tokens each): how many
   answers are equal; for each that is not, the TP=1 model's margin between its two best tokens
   where they part (a near-tie).
On CUDA with fewer than 2 GPUs it prints 'skipped: 1 GPU' and succeeds at once (the GPU check's
TP step; its collectives step checks the group's NCCL path on one GPU). The JSON (`--json`) is
written after each part; past `--deadline` the greedy comparison is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # NOTE: runs from a checkout, installed or not

from benchmarks.gpu_check.gpu_results import Deadline, add_deadline, write_json  # noqa: E402
from hpcinfer.models.attention import DenseCausalAttention  # noqa: E402
from hpcinfer.models.decoder_checkpoint import load_decoder  # noqa: E402
from hpcinfer.models.decoder_inspect import inspect_decoder  # noqa: E402
from hpcinfer.parallel.group import Collectives, Rendezvous, end_group, free_port  # noqa: E402
from hpcinfer.parallel.shard_loader import load_shard  # noqa: E402
from hpcinfer.parallel.tp import rss_bytes  # noqa: E402
from tests.fixtures.tiny_decoder import build_tiny_decoder  # noqa: E402

SHAPE = {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 4, "intermediate": 1536, "max_positions": 1024}
TOKENIZER = Path(__file__).resolve().parents[1] / "minilm_tokenizer"


def rank_main(rank: int, world: int, port: int, path: str, device: str, out: str, vocab_parallel: bool) -> None:
    dev = torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # NOTE: else every rank's default stream, and CUDA events, are cuda:0's
    torch.set_num_threads(1)
    rdv = Rendezvous(rank, world, port, 120.0)
    group = rdv.join(dev)
    comm = Collectives(group, dev)
    info, figures = inspect_decoder(Path(path)), {}
    for variant in (vocab_parallel,):  # NOTE: one variant per process: freed memory stays resident
        before = rss_bytes()
        model = load_shard(info, comm, dev, torch.float32, variant)
        memory = {"weight_bytes": model.weight_bytes, "rss_delta_bytes": rss_bytes() - before}
        times = {}
        with torch.inference_mode():
            for name, tokens, rows in (("decode_64", 64, 64), ("prefill_512", 512, 1)):
                ids = torch.randint(0, info.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
                ids, pos = ids.to(dev), torch.arange(tokens, device=dev)
                laps = []
                for _ in range(6):
                    comm_before, t0 = comm.seconds, time.perf_counter()
                    hidden = model(ids, pos, DenseCausalAttention())
                    model.logits(hidden[-rows:])
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    laps.append((time.perf_counter() - t0, comm.seconds - comm_before))
                step = statistics.median(a for a, _ in laps[1:])
                times[name] = {
                    "step_ms": round(step * 1e3, 2),
                    "collective_ms": round(statistics.median(b for _, b in laps[1:]) * 1e3, 2),
                }
        figures["vocab_parallel" if variant else "replicated"] = {**memory, **times}
        del model
        figures[next(iter(figures))]["rss_delta_after_steps_bytes"] = rss_bytes() - before
    Path(out, f"rank{rank}-{int(vocab_parallel)}.json").write_text(json.dumps(figures))
    end_group(group)


def whole_main(_: int, path: str, device: str, out: str) -> None:
    dev = torch.device("cuda:0" if device == "cuda" else "cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    before = rss_bytes()
    whole = load_decoder(inspect_decoder(Path(path)), dev, torch.float32)
    tp1 = {"weight_bytes": sum(p.nbytes for p in whole.parameters()), "rss_delta_bytes": rss_bytes() - before}
    with torch.inference_mode():
        ids = torch.arange(64, device=dev)
        whole.logits(whole(ids, ids, DenseCausalAttention()))
    tp1["rss_delta_after_steps_bytes"] = rss_bytes() - before
    Path(out, "tp1.json").write_text(json.dumps(tp1))


def measure(path: Path, device: str, work: Path) -> dict:
    mp.start_processes(whole_main, (str(path), device, str(work)), nprocs=1, start_method="spawn")
    ranks: list[dict] = [{}, {}]
    for vocab_parallel in (True, False):
        args = (2, free_port(), str(path), device, str(work), vocab_parallel)
        mp.start_processes(rank_main, args, nprocs=2, start_method="spawn")
        for r in range(2):
            ranks[r] |= json.loads((work / f"rank{r}-{int(vocab_parallel)}.json").read_text())
    return {"tp1": json.loads((work / "tp1.json").read_text()), "ranks": ranks}


def agreement(path: Path, device: str, prompts: int, work: Path) -> dict:
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "engineers"]
    words += ["measure", "latency", "of", "every", "step"]
    rows = [
        {"id": i, "prompt": " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(4 + i % 23))}
        for i in range(prompts)
    ]
    src = work / "prompts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = [
        sys.executable,
        "-m",
        "hpcinfer",
        "run",
        str(src),
        "--model",
        str(path),
        "--max-tokens",
        "16",
        "--progress",
        "off",
        "-q",
    ]
    base += ["--device", device, "--kv-cache-memory", "64MiB", "--ignore-eos", "--overwrite"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    walls = {}
    for tp in (1, 2):
        t0 = time.perf_counter()
        done = subprocess.run(
            [*base, "-o", str(work / f"tp{tp}.jsonl"), "--tp", str(tp), "--threads", "2"],
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise SystemExit(f"--tp {tp} failed: {done.stderr[-2000:]}")
        walls[f"tp{tp}_s"] = round(time.perf_counter() - t0, 2)
    one = [json.loads(line) for line in (work / "tp1.jsonl").read_text().splitlines()]
    two = [json.loads(line) for line in (work / "tp2.jsonl").read_text().splitlines()]
    differ = [i for i, (a, b) in enumerate(zip(one, two, strict=True)) if a["text"] != b["text"]]
    return {
        "prompts": prompts,
        "equal": prompts - len(differ),
        "differ": differ,
        "margins": margins(path, rows, differ, two),
        **walls,
    }


def margins(path: Path, rows: list[dict], differ: list[int], two: list[dict]) -> list[float]:
    """TP=1's top-2 logit margin at the first answer token where TP=2 parted from it."""
    if not differ:
        return []
    from hpcinfer.models.decoder_checkpoint import load_tokenizer

    info = inspect_decoder(path)
    model, tok = load_decoder(info, torch.device("cpu"), torch.float32), load_tokenizer(info)
    out = []
    for i in differ:
        prompt = tok.encode(rows[i]["prompt"]).ids
        answer = tok.encode(two[i]["text"], add_special_tokens=False).ids
        seq = list(prompt)
        with torch.inference_mode():
            for token in answer + [None]:
                logits = model.logits(model(torch.tensor(seq), torch.arange(len(seq)), DenseCausalAttention())[-1:])[0]
                top = logits.topk(2)
                if token is None or int(top.indices[0]) != token:
                    out.append(round(float(top.values[0] - top.values[1]), 6))
                    break
                seq.append(token)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    add_deadline(parser)
    args = parser.parse_args(argv)
    deadline = Deadline(args.deadline)

    def save(result: dict) -> None:
        if args.json:
            write_json(args.json, result)

    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print(f"skipped: {torch.cuda.device_count()} GPU")
        save({"status": "skipped", "reason": f"{torch.cuda.device_count()} GPU"})
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="tp-check-"))
    path = work / "llama"
    if not (path / "config.json").is_file():
        build_tiny_decoder(path, "LlamaForCausalLM", tokenizer_dir=TOKENIZER, **SHAPE)
    result: dict = {"status": "running"}
    save(result)
    result["memory_and_time"] = measure(path, args.device, work)
    save(result)
    if not args.prompts:
        result["greedy"] = {"prompts": 0, "equal": 0}
    elif deadline.passed():
        result["greedy"] = {"prompts": 0, "equal": 0, "status": "skipped", "reason": "past the --deadline"}
    else:
        result["greedy"] = agreement(path, args.device, args.prompts, work)
    greedy = result["greedy"]
    ok = greedy["equal"] == greedy["prompts"] or all(m < 1e-3 for m in greedy.get("margins", []))
    result["status"] = "ok" if ok else "failed"
    print(json.dumps(result, indent=1))
    save(result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
