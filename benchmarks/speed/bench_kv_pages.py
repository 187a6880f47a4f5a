"""The CPU KV pool's pages: an anonymous mapping of its own (4 KiB pages, `kvcache/pools.zeroed`)
against numpy's zeros (which ask for transparent huge pages on arrays over 4 MiB), side by side.

Two measures, each form in a fresh process (a page's first touch is what differs, so nothing is
reused between forms), the forms interleaved `--rounds` times:

1. first touch: a 1 GiB pool written once every 4 KiB, in wall seconds and the system CPU the
   page faults took;
2. the engine: bench_decoders.py's Gemma-3-shaped random checkpoint (640 hidden, 12 layers) answers
   `--prompts` prompts with 64 new tokens each, greedy, float32, its steps alone timed (weights
   loaded first), with the page faults and system CPU of those steps.

On a bare-metal kernel a huge page's fault is a 2 MiB clear (~0.1 ms); on a virtual machine whose
host takes free guest memory back (free page reporting) it also waits on the host, which is where
the forms part.

    python benchmarks/speed/bench_kv_pages.py [--prompts 128] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout, installed or not

from benchmarks.common import cpu_line  # noqa: E402

FORMS = ("mapping", "numpy")


def numpy_zeroed(shape: tuple[int, ...], dtype: object, device: object) -> object:
    """The pool as numpy's zeros give it (calloc, huge pages asked for): the earlier form."""
    import numpy as np
    import torch

    count = 1
    for n in shape:
        count *= n
    raw = np.zeros(count * torch.empty((), dtype=dtype).element_size(), dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


def counters() -> tuple[float, float, int]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), usage.ru_stime, usage.ru_minflt


def since(start: tuple[float, float, int]) -> dict[str, float]:
    now = counters()
    return {"wall": now[0] - start[0], "sys": now[1] - start[1], "faults": now[2] - start[2]}


def child(form: str, measure: str, prompts: int, model_dir: str) -> dict[str, float]:
    import torch

    from hpcinfer.engine.kvcache import pools

    zeroed = pools.zeroed if form == "mapping" else numpy_zeroed
    if measure == "touch":
        pool = zeroed((1 << 28,), torch.float32, torch.device("cpu"))
        start = counters()
        pool[:: 1 << 10] = 1.0  # one float every 4 KiB
        return since(start)
    pools.zeroed = zeroed  # NOTE: the engine's KVCache allocates through the module's name
    from benchmarks.speed.bench_decoders import ROOT as SAMPLE_ROOT
    from hpcinfer.engine.engine import Engine, EngineConfig
    from hpcinfer.engine.sequence import SamplingParams
    from hpcinfer.models.decoder_checkpoint import load_decoder, load_tokenizer
    from hpcinfer.models.decoder_inspect import inspect_decoder

    info = inspect_decoder(Path(model_dir))
    model = load_decoder(info, torch.device("cpu"), torch.float32)
    tokenizer = load_tokenizer(info)
    lines = (SAMPLE_ROOT / "sample_data" / "requests.jsonl").open()
    texts = [json.loads(line)["text"] for line in lines]
    ids = [tokenizer.encode(" ".join(texts[i % len(texts)].split()[:48])).ids for i in range(prompts)]
    engine = Engine(model, EngineConfig(max_num_seqs=128, kv_cache_memory=1 << 30), info.eos_token_ids)
    engine.generate(ids[:4], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    start = counters()
    engine.generate(ids, SamplingParams(max_tokens=64, ignore_eos=True))
    return since(start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)  # form measure prompts model_dir
    args = parser.parse_args()
    if args.child:
        form, measure, prompts, model_dir = args.child
        print(json.dumps(child(form, measure, int(prompts), model_dir)))
        return
    import tempfile

    from benchmarks.speed.bench_decoders import build

    print(cpu_line(os.cpu_count() or 1))
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(f"transparent huge pages: {thp.read_text().strip() if thp.exists() else 'unknown'}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build(Path(tmp), "gemma3")
        results: dict[tuple[str, str], list[dict[str, float]]] = {}
        for _ in range(args.rounds):
            for measure in ("touch", "engine"):
                for form in FORMS:
                    cmd = [sys.executable, __file__, "--child", form, measure, str(args.prompts), str(model_dir)]
                    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                    got = json.loads(out.strip().splitlines()[-1])
                    results.setdefault((measure, form), []).append(got)
                    line = f"{got['wall']:.2f} s, system {got['sys']:.2f} s, {got['faults']:.0f} faults"
                    print(f"{measure} {form}: {line}", flush=True)
    print(f"\nbest of {args.rounds} rounds, each a fresh process:")
    print("| measure | anonymous mapping (4 KiB pages) | numpy zeros (huge pages asked for) | mapping speed-up |")
    print("|---|---|---|---|")
    labels = {"touch": "first touch of 1 GiB", "engine": f"engine, {args.prompts} prompts x 64 tokens"}
    for measure, label in labels.items():
        best = {form: min(results[(measure, form)], key=lambda r: r["wall"]) for form in FORMS}
        cells = [f"{best[f]['wall']:.2f} s (system {best[f]['sys']:.2f} s)" for f in FORMS]
        print(f"| {label} | {cells[0]} | {cells[1]} | {best['numpy']['wall'] / best['mapping']['wall']:.2f}x |")


if __name__ == "__main__":
    main()
