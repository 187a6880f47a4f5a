"""Image embeddings, whole process, side by side: `hpcinfer run --image-column` against
sentence-transformers' `encode` over the same JPEGs (opened with PIL, as its users do), on a
CLIP-ViT-B/32-shaped checkpoint with random weights; prints images/s, the ratio, hpcinfer's decode
stage share, and the cosine between the two outputs; then the vision tower alone, transformers'
module against hpcinfer's (models/vit.py), on the same batches of pixel values in this process.

    python benchmarks/speed/bench_images.py                     # 2,000 JPEGs of mixed sizes
    python benchmarks/speed/bench_images.py --images 500 --batch-size 32
    python benchmarks/speed/bench_images.py --dtype bfloat16   # both sides in bfloat16 (AMX / AVX-512 BF16 CPUs)
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

from benchmarks.common import cpu_line, timed_process  # noqa: E402

ST_SCRIPT = """
import sys, numpy as np, torch
from PIL import Image
from sentence_transformers import SentenceTransformer
model = SentenceTransformer(sys.argv[1], device="cpu", model_kwargs={"dtype": getattr(torch, sys.argv[5])})
paths = open(sys.argv[2]).read().split()
vectors = model.encode([Image.open(p) for p in paths], batch_size=int(sys.argv[4]), convert_to_tensor=True)
np.save(sys.argv[3], vectors.float().cpu().numpy())
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


def towers(model: Path, batch: int, dtype: str, repeats: int = 5) -> None:
    """Seconds a batch of `batch` images takes through transformers' tower and through hpcinfer's."""
    import time

    import torch
    import transformers

    from hpcinfer.models.clip import tower_class
    from hpcinfer.models.vit_load import native_tower

    torch.set_num_threads(os.cpu_count() or 1)
    transformers.logging.set_verbosity_error()  # NOTE: the text tower's weights, unused here, are no news
    cls, config = tower_class(model, "clip", images=True)

    def load():  # noqa: ANN202
        return cls.from_pretrained(model, config=config).to(getattr(torch, dtype)).eval()

    theirs, ours = load(), native_tower(load(), "clip", cpu_fast_path=True)
    assert ours is not None
    size = config.image_size
    pixels = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0)).to(getattr(torch, dtype))
    seconds = {}
    with torch.inference_mode():
        runs = {"transformers": lambda: theirs(pixel_values=pixels).image_embeds, "hpcinfer": lambda: ours(pixels)}
        for name, tower in runs.items():
            tower()  # NOTE: oneDNN builds its kernels on the first call
            start = time.perf_counter()
            for _ in range(repeats):
                out = tower()
            seconds[name] = (time.perf_counter() - start) / repeats
            seconds[name + " out"] = out
    cos = torch.nn.functional.cosine_similarity(seconds["hpcinfer out"].float(), seconds["transformers out"].float())
    cos = cos.min()
    print(f"vision tower, {batch} images a batch in {dtype}: transformers {seconds['transformers']:.3f} s, "
          f"hpcinfer {seconds['hpcinfer']:.3f} s, ratio {seconds['transformers'] / seconds['hpcinfer']:.2f}x, "
          f"min cosine {cos:.7f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="both sides compute in it")
    args = parser.parse_args()
    import numpy as np
    import pyarrow.parquet as pq

    print(cpu_line(os.cpu_count() or 1))
    print(f"{args.images} JPEGs; CLIP ViT-B/32 shape; {args.dtype} on both sides")
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
                                 str(args.batch_size), args.dtype], env=env)  # fmt: skip
        out, report = work / "out.parquet", work / "report.json"
        ours_s, _ = timed_process([sys.executable, "-m", "hpcinfer", "run", str(rows), "-o", str(out), "--model",
                                   str(model), "--image-column", "image", "--max-batch-size", str(args.batch_size),
                                   "--dtype", args.dtype,
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
        towers(model, args.batch_size, args.dtype)


if __name__ == "__main__":
    main()
