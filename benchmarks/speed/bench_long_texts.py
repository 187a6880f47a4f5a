"""Long documents through the embedding model: texts tokenized from the prefix that keeps their
tokens (pipeline/long_text.py) against tokenized whole, and against sentence-transformers, each a
whole process, side by side in one run.

`--docs` documents of 2 to 60 KB (sample_data's texts joined), embedded by the packaged MiniLM
(256 tokens kept of each): `hpcinfer run` as it runs; `hpcinfer run` with the cut turned off (every
text tokenized whole, then truncated: what it did before); `SentenceTransformer.encode` (which
tokenizes whole too). The two hpcinfer outputs must be equal, bit for bit.

    python benchmarks/speed/bench_long_texts.py [--docs 400]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout, installed or not

from benchmarks.common import cpu_line, timed_process  # noqa: E402

WHOLE = (
    "import sys; import hpcinfer.pipeline.long_text as m; "
    "m.TextCutter.for_tokenizer = classmethod(lambda cls, tokenizer, max_length: None); "
    "from hpcinfer.cli import main; sys.argv[0] = 'hpcinfer'; main()"
)
ST = """
import json, sys
from sentence_transformers import SentenceTransformer
from hpcinfer.models.registry import resolve_model_path
texts = [json.loads(line)["text"] for line in open(sys.argv[1])]
SentenceTransformer(str(resolve_model_path("default")), device="cpu").encode(texts, batch_size=int(sys.argv[2]))
"""


def documents(count: int, seed: int = 0) -> list[str]:
    import pyarrow.parquet as pq

    sentences = pq.read_table(ROOT / "sample_data" / "requests.parquet", columns=["text"]).column("text").to_pylist()
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        size, parts = rng.randint(2_000, 60_000), []
        while sum(map(len, parts)) < size:
            parts.append(rng.choice(sentences))
        docs.append(" ".join(parts)[:size])
    return docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=400)
    parser.add_argument("--st-batch-size", type=int, default=32)
    args = parser.parse_args()

    import numpy as np
    import pyarrow.parquet as pq

    print(cpu_line(os.cpu_count() or 1))
    docs = documents(args.docs)
    sizes = [len(doc) for doc in docs]
    print(f"{len(docs)} documents, {sum(sizes) / 1e6:.1f} MB, {min(sizes):,}-{max(sizes):,} characters")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "docs.jsonl"
        src.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)))
        common = [str(src), "--progress", "off", "-q", "--overwrite"]
        cut_s, _ = timed_process([sys.executable, "-m", "hpcinfer", "run", *common, "-o", f"{tmp}/cut.parquet"], env)
        whole_s, _ = timed_process([sys.executable, "-c", WHOLE, "run", *common, "-o", f"{tmp}/whole.parquet"], env)
        st_s, _ = timed_process([sys.executable, "-c", ST, str(src), str(args.st_batch_size)], env)
        cut = np.asarray(pq.read_table(f"{tmp}/cut.parquet").column("embedding").to_pylist())
        whole = np.asarray(pq.read_table(f"{tmp}/whole.parquet").column("embedding").to_pylist())
    assert np.array_equal(cut, whole), "the cut changed an embedding"
    print(f"hpcinfer, long texts cut:        {cut_s:7.2f} s  ({len(docs) / cut_s:7.1f} docs/s)")
    print(f"hpcinfer, every text whole:      {whole_s:7.2f} s  ({len(docs) / whole_s:7.1f} docs/s)")
    print(f"sentence-transformers (batch {args.st_batch_size}): {st_s:7.2f} s  ({len(docs) / st_s:7.1f} docs/s)")
    print(f"ratios: cut / whole {whole_s / cut_s:.2f}x, cut / sentence-transformers {st_s / cut_s:.2f}x; outputs equal")


if __name__ == "__main__":
    main()
