"""Image embeddings, whole process, side by side: `hpcinfer run --image-column` against
sentence-transformers' `encode` over the same JPEGs (opened with PIL, as its users do), on a
CLIP-ViT-B/32-shaped checkpoint with random weights; prints images/s, the ratio, hpcinfer's decode
stage share, and the cosine between the two outputs.

    python benchmarks/speed/bench_images.py                     # 2,000 JPEGs of mixed sizes
    python benchmarks/speed/bench_images.py --images 500 --batch-size 32
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import lscpu, timed_process  # noqa: E402

ST_SCRIPT = """
import sys, numpy as np
from PIL import Image
from sentence_transformers import SentenceTransformer
model = SentenceTransformer(sys.argv[1], device="cpu")
paths = open(sys.argv[2]).read().split()
vectors = model.encode([Image.open(p) for p in paths], batch_size=int(sys.argv[4]))
np.save(sys.argv[3], vectors)
"""


def build(folder: Path) -> Path:
    import torch
    import transformers

    from tests.fixtures.tiny_clip import _tokenizer

    torch.manual_seed(0)
    transformers.CLIPModel(transformers.CLIPConfig()).eval().save_pretrained(folder)  # ViT-B/32's shape
    transformers.CLIPImageProcessor().save_pretrained(folder)
    _tokenizer(folder, bos=True)
    return folder


def pictures(folder: Path, count: int) -> list[Path]:
    from PIL import Image, ImageDraw

    rng = random.Random(7)
    paths = []
    for i in range(count):
        width, height = rng.choice([(320, 240), (640, 480), (1024, 768), (1600, 1200), (500, 500), (800, 1200)])
        image = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
        pen = ImageDraw.Draw(image)
        for _ in range(12):
            x, y = rng.randrange(width), rng.randrange(height)
            pen.ellipse([x, y, x + rng.randrange(20, width), y + rng.randrange(20, height)],
                        fill=tuple(rng.randrange(256) for _ in range(3)))  # fmt: skip
        path = folder / f"{i}.jpg"
        image.save(path, quality=88)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    import numpy as np
    import pyarrow.parquet as pq

    cpu = lscpu()
    print(f"cpu: {cpu.get('Model name', '?')}, {os.cpu_count()} cores; {args.images} JPEGs; CLIP ViT-B/32 shape")
    with tempfile.TemporaryDirectory(prefix="hpcinfer-bench-images-") as tmp:
        work = Path(tmp)
        model = build(work / "clip")
        (work / "pics").mkdir()
        paths = pictures(work / "pics", args.images)
        listing = work / "paths.txt"
        listing.write_text("\n".join(str(p) for p in paths))
        rows = work / "rows.jsonl"
        rows.write_text("".join(json.dumps({"id": i, "image": f"pics/{p.name}"}) + "\n" for i, p in enumerate(paths)))
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        st_s, _ = timed_process([sys.executable, "-c", ST_SCRIPT, str(model), str(listing), str(work / "st.npy"),
                                 str(args.batch_size)], env=env)  # fmt: skip
        out, report = work / "out.parquet", work / "report.json"
        ours_s, _ = timed_process([sys.executable, "-m", "hpcinfer", "run", str(rows), "-o", str(out), "--model",
                                   str(model), "--image-column", "image", "--max-batch-size", str(args.batch_size),
                                   "--report", str(report), "--progress", "off", "-q"], env=env)  # fmt: skip
        ours = np.asarray(pq.read_table(out).column("embedding").to_pylist(), dtype=np.float32)
        theirs = np.load(work / "st.npy")
        cos = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
        stages = {s["stage"]: s for s in json.loads(report.read_text()).get("stages", [])}
        decode = stages.get("decode", {})
        n = args.images
        print(f"sentence-transformers encode  {st_s:7.1f} s  {n / st_s:7.1f} images/s")
        print(f"hpcinfer run --image-column   {ours_s:7.1f} s  {n / ours_s:7.1f} images/s  ratio {st_s / ours_s:.2f}x")
        print(f"decode stage: {decode}")
        print(f"min cosine to sentence-transformers {cos.min():.7f}")


if __name__ == "__main__":
    main()
