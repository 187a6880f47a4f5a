"""Image embeddings (--image-column) with tiny random CLIP and SigLIP checkpoints saved by the
installed transformers: 200 generated images of varied sizes, modes and formats (RGB, RGBA, L,
palette, CMYK JPEG, PNG, WebP), read by relative path, as Parquet bytes, equal to transformers'
`get_image_features` over its own image processor (min cosine >= 0.9999); missing, corrupt and
truncated files and http(s) URLs are rejects with reasons, the rest in order. Text rows embed into
the same space as `get_text_features` does."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hpcinfer.api import run
from hpcinfer.config import InputConfig, OutputConfig, PipelineConfig, RunConfig, TokenizeConfig
from hpcinfer.errors import ConfigError
from hpcinfer.obs.progress import Progress
from tests.fixtures.tiny_clip import build_tiny_clip

pytestmark = pytest.mark.usefixtures("one_torch_thread")
IMAGES = 200
KINDS = ("RGB", "RGBA", "L", "P", "CMYK")
FORMATS = {"RGB": ("jpg", "png", "webp"), "RGBA": ("png", "webp"), "L": ("jpg", "png"), "P": ("png",), "CMYK": ("jpg",)}


@pytest.fixture(scope="module", params=["clip", "siglip"])
def checkpoint(request, tmp_path_factory) -> Path:
    return build_tiny_clip(tmp_path_factory.mktemp(request.param), request.param, seed=3, image_size=64)


def draw(rng: random.Random, width: int, height: int, mode: str):  # noqa: ANN201
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
    pen = ImageDraw.Draw(image)
    for _ in range(6):
        x, y = rng.randrange(width), rng.randrange(height)
        box = [x, y, min(width - 1, x + rng.randrange(1, width)), min(height - 1, y + rng.randrange(1, height))]
        pen.ellipse(box, fill=tuple(rng.randrange(256) for _ in range(3)))
    if mode == "RGBA":
        pixels = np.array(image.convert("RGBA"))
        pixels[..., 3] = np.linspace(0, 255, width, dtype=np.uint8)[None, :]
        return Image.fromarray(pixels)
    return image.convert(mode) if mode != "P" else image.convert("P", palette=Image.Palette.ADAPTIVE)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> tuple[Path, list[dict]]:
    """200 images under pictures/, and rows naming them (relative paths), with 7 bad rows among them."""
    folder = tmp_path_factory.mktemp("pictures")
    (folder / "pictures").mkdir()
    rng = random.Random(5)
    rows = []
    for i in range(IMAGES):
        mode = KINDS[i % len(KINDS)]
        ext = FORMATS[mode][i % len(FORMATS[mode])]
        size = (rng.randint(16, 420), rng.randint(16, 420)) if i % 20 else (rng.randint(900, 1300), 1000)
        draw(rng, *size, mode).save(folder / "pictures" / f"{i}.{ext}", quality=90)
        rows.append({"id": f"img{i}", "image": f"pictures/{i}.{ext}"})
    (folder / "pictures" / "text.jpg").write_text("not an image")
    from PIL import Image

    Image.new("L", (1, 40_000)).save(folder / "pictures" / "strip.png")  # its resize would be 64 x 2.56M
    whole = (folder / "pictures" / "0.jpg").read_bytes()
    (folder / "pictures" / "cut.jpg").write_bytes(whole[: len(whole) // 3])
    bad = [{"id": "missing", "image": "pictures/nowhere.png"}, {"id": "text", "image": "pictures/text.jpg"},
           {"id": "cut", "image": "pictures/cut.jpg"}, {"id": "web", "image": "https://example.com/a.jpg"},
           {"id": "none", "image": None}, {"id": "strip", "image": "pictures/strip.png"},
           {"id": "fifo", "image": "/dev/zero"}]  # fmt: skip
    for k, row in enumerate(bad):
        rows.insert(17 + 37 * k, row)
    return folder, rows


def expected(checkpoint: Path, folder: Path, rows: list[dict]) -> dict[str, np.ndarray]:
    """transformers' own: the checkpoint's image processor over each image as PIL opens it (grey and
    CMYK made RGB first, as a user hands a 3-channel model its images)."""
    import transformers
    from PIL import Image

    model = transformers.AutoModel.from_pretrained(str(checkpoint)).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(str(checkpoint))
    out = {}
    with torch.no_grad():
        for row in rows:
            image = Image.open(folder / row["image"])
            image = image.convert("RGB") if image.mode in ("L", "CMYK") else image
            features = model.get_image_features(**processor(images=[image], return_tensors="pt"))
            features = features if isinstance(features, torch.Tensor) else features.pooler_output
            out[row["id"]] = features[0].numpy()
    return out


def embed(src: Path, out: Path, checkpoint: Path, **inputs) -> dict:  # noqa: ANN003
    config = RunConfig(
        input=InputConfig((str(src),), image_column="image", **inputs),
        model=str(checkpoint),
        output=OutputConfig(str(out)),
        pipeline=PipelineConfig(progress="off"),
    )
    return run(config, progress=Progress("off"))


def cosines(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> list[float]:
    return [float(g @ want[k] / np.linalg.norm(g) / np.linalg.norm(want[k])) for k, g in got.items()]


def test_images_by_path_equal_transformers_and_bad_ones_are_rejects(checkpoint, pictures, tmp_path):
    folder, rows = pictures
    src = folder / f"rows-{tmp_path.name}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "out.parquet"
    report = embed(src, out, checkpoint)
    table = pq.read_table(out).to_pylist()
    siglip = json.loads((checkpoint / "config.json").read_text())["model_type"] == "siglip"
    # NOTE: a 1 x 40,000 strip: SigLIP resizes it straight to its input size; CLIP's shortest-edge resize would
    # make it 64 x 2.56M pixels, refused
    good = [r for r in rows if r["id"].startswith("img") or (siglip and r["id"] == "strip")]
    assert [r["id"] for r in table] == [r["id"] for r in good]  # every good row, in input order
    want = expected(checkpoint, folder, good)
    got = {r["id"]: np.asarray(r["embedding"], dtype=np.float32) for r in table}
    assert min(cosines(got, want)) >= 0.9999
    rejects = {
        json.loads(line)["id"]: json.loads(line) for line in Path(f"{out}.rejects.jsonl").read_text().splitlines()
    }
    reasons = {k: v["reason"] for k, v in rejects.items()}
    assert reasons == {"missing": "image_missing", "text": "image_unreadable", "cut": "image_unreadable",
                       "web": "image_remote", "none": "image_missing", "fifo": "image_missing",
                       **({} if siglip else {"strip": "image_unreadable"})}  # fmt: skip
    assert "regular file" in rejects["fifo"]["message"]
    assert siglip or "aspect ratio" in rejects["strip"]["message"]
    assert "nowhere.png" in rejects["missing"]["message"]
    assert report.rows == len(good) and "decode" in {s["stage"] for s in report.stages}


def test_image_bytes_in_parquet_equal_their_files(checkpoint, pictures, tmp_path):
    folder, rows = pictures
    good = [r for r in rows if r["id"].startswith("img")][:40]
    table = pa.table({"id": [r["id"] for r in good],
                      "image": [(folder / r["image"]).read_bytes() for r in good]})  # fmt: skip
    src = tmp_path / "bytes.parquet"
    pq.write_table(table, src)
    embed(src, tmp_path / "out.parquet", checkpoint)
    got = {
        r["id"]: np.asarray(r["embedding"], dtype=np.float32)
        for r in pq.read_table(tmp_path / "out.parquet").to_pylist()
    }
    assert list(got) == [r["id"] for r in good]
    assert min(cosines(got, expected(checkpoint, folder, good))) >= 0.9999


def test_texts_embed_into_the_same_space_as_get_text_features(checkpoint, tmp_path):
    import transformers
    from tokenizers import Tokenizer

    texts = ["a photo of a cat", "the red car", "a dog in the house on the tree", "sky", "blue sky of a red house"]
    src = tmp_path / "texts.jsonl"
    src.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    out = tmp_path / "texts.parquet"
    run(RunConfig(input=InputConfig((str(src),)), model=str(checkpoint), output=OutputConfig(str(out)),
                  pipeline=PipelineConfig(progress="off")), progress=Progress("off"))  # fmt: skip
    got = [np.asarray(r["embedding"], dtype=np.float32) for r in pq.read_table(out).to_pylist()]
    model = transformers.AutoModel.from_pretrained(str(checkpoint)).eval()
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    siglip = model.config.model_type == "siglip"
    for text, vector in zip(texts, got, strict=True):
        ids = tokenizer.encode(text).ids
        if siglip:  # NOTE: as SigLIP's processor pads (padding="max_length"), and the tower pools the last place
            ids += [0] * (model.config.text_config.max_position_embeddings - len(ids))
        with torch.no_grad():
            features = model.get_text_features(input_ids=torch.tensor([ids]))
        features = features if isinstance(features, torch.Tensor) else features.pooler_output
        want = features[0].numpy()
        assert float(vector @ want / np.linalg.norm(vector) / np.linalg.norm(want)) >= 0.9999


def test_image_run_mistakes_are_one_line(checkpoint, pictures, tmp_path, tiny_model):
    folder, rows = pictures
    src = folder / "few.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]), encoding="utf-8")
    with pytest.raises(ConfigError, match="image model"):
        embed(src, tmp_path / "a.parquet", tiny_model)  # a text model
    with pytest.raises(ConfigError, match="--max-length"):
        run(RunConfig(input=InputConfig((str(src),), image_column="image"), model=str(checkpoint),
                      output=OutputConfig(str(tmp_path / "b.parquet")), tokenize=TokenizeConfig(max_length=8),
                      pipeline=PipelineConfig(progress="off")), progress=Progress("off"))  # fmt: skip
    from hpcinfer.errors import InputError

    with pytest.raises(InputError, match="no column 'picture'"):
        run(RunConfig(input=InputConfig((str(src),), image_column="picture"), model=str(checkpoint),
                      output=OutputConfig(str(tmp_path / "c.parquet")), pipeline=PipelineConfig(progress="off")),
            progress=Progress("off"))  # fmt: skip


def test_decoded_pixels_follow_the_processor(checkpoint, pictures):
    """The decode stage's uint8 pixels, normalised, are the processor's pixel values (within a level)."""
    import transformers
    from PIL import Image

    from hpcinfer.models.vision import model_pixels, read_image_spec

    folder, rows = pictures
    spec = read_image_spec(checkpoint)
    processor = transformers.AutoImageProcessor.from_pretrained(str(checkpoint))
    for row in [r for r in rows if r["id"].startswith("img")][:30]:
        pixels = np.array(model_pixels(Image.open(folder / row["image"]), spec, exact=True))
        ours = spec.normalise(torch.from_numpy(pixels).reshape(1, -1), torch.float32)
        image = Image.open(folder / row["image"])
        image = image.convert("RGB") if image.mode in ("L", "CMYK") else image
        theirs = processor(images=[image], return_tensors="pt")["pixel_values"]
        step = max(spec.rescale / s for s in spec.std)
        assert (ours - theirs).abs().max() <= 1.01 * step, row["image"]


@pytest.mark.parametrize(
    "packed, dtype", [(True, torch.float32), (False, torch.float32), (True, torch.bfloat16)],
    ids=["onednn", "torch", "onednn-bfloat16"],
)  # fmt: skip
def test_the_native_tower_gives_get_image_features(checkpoint, packed, dtype):
    """hpcinfer's vision transformer (models/vit.py) on transformers' weights: the features of
    `get_image_features` on the same pixel values, packed for the CPU (quick_gelu fused as a scaled
    swish) and not, in float32 and (packed where oneDNN has bfloat16 kernels) in bfloat16; an
    activation it does not know stays on transformers' tower."""
    import transformers

    from hpcinfer.models.bert import PackedLinear, can_pack_for_cpu
    from hpcinfer.models.clip import tower_class
    from hpcinfer.models.vit import VisionTower
    from hpcinfer.models.vit_load import native_tower

    full = transformers.AutoModel.from_pretrained(str(checkpoint)).eval()
    kind = full.config.model_type
    pixels = torch.randn(5, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = full.get_image_features(pixel_values=pixels)
    want = want if isinstance(want, torch.Tensor) else want.pooler_output

    def tower():  # noqa: ANN202
        cls, config = tower_class(checkpoint, kind, images=True)
        return cls.from_pretrained(str(checkpoint), config=config).eval().to(dtype)

    native = native_tower(tower(), kind, cpu_fast_path=packed)
    assert isinstance(native, VisionTower)
    assert isinstance(native.layers[0].ffn_in, PackedLinear) == (packed and can_pack_for_cpu(native))
    assert dtype == torch.bfloat16 or isinstance(native.layers[0].ffn_in, PackedLinear) == packed
    with torch.inference_mode():
        got = native(pixels.to(dtype)).float()
    if dtype == torch.bfloat16:  # NOTE: against transformers' own tower in bfloat16, each rounding alike
        with torch.inference_mode():
            theirs = tower()(pixel_values=pixels.to(dtype))
        theirs = (theirs.image_embeds if kind == "clip" else theirs.pooler_output).float()
        assert torch.nn.functional.cosine_similarity(got, theirs).min() >= 0.9999
        return
    assert torch.nn.functional.cosine_similarity(got, want).min() >= 0.99999
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    unknown = tower()
    (unknown.vision_model if kind == "clip" else unknown).config.hidden_act = "mish"
    assert native_tower(unknown, kind, cpu_fast_path=packed) is None


def test_a_checkpoint_lacking_a_tower_weight_is_one_line(checkpoint, pictures, tmp_path, capfd):
    """The text tower's weights left over on an image run are expected (nothing printed); a weight
    the image tower needs and the checkpoint lacks is a ModelError naming it, not random weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    from hpcinfer.errors import ModelError

    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    weights = load_file(broken / "model.safetensors")
    lost = next(k for k in sorted(weights) if "post_layernorm.weight" in k)
    save_file({k: v for k, v in weights.items() if k != lost}, broken / "model.safetensors", metadata={"format": "pt"})
    folder, rows = pictures
    src = folder / f"lacking-{tmp_path.name}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]), encoding="utf-8")
    capfd.readouterr()
    embed(src, tmp_path / "whole.parquet", checkpoint)
    printed = "".join(capfd.readouterr())
    assert "text_model" not in printed and "UNEXPECTED" not in printed and "Loading weights" not in printed
    with pytest.raises(ModelError, match="lacks weights its .*post_layernorm.weight"):
        embed(src, tmp_path / "out.parquet", broken)


def test_image_and_text_runs_build_their_towers_without_importing_transformers(checkpoint, pictures, tmp_path):
    """The image and text towers are built from the checkpoint's own files (models/vit_load.py,
    models/clip_text.py): importing transformers' CLIP / SigLIP modules took seconds of every run's
    start."""
    import subprocess
    import sys

    folder, rows = pictures
    src = folder / f"fresh-{tmp_path.name}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]), encoding="utf-8")
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(["a red car", "sky"])))
    script = (
        "import sys\n"
        "from hpcinfer.api import run\n"
        "from hpcinfer.config import InputConfig, OutputConfig, PipelineConfig, RunConfig\n"
        "from hpcinfer.obs.progress import Progress\n"
        f"for src, column, out in (({str(src)!r}, 'image', 'images'), ({str(texts)!r}, None, 'texts')):\n"
        f"    config = RunConfig(input=InputConfig((src,), image_column=column), model={str(checkpoint)!r},\n"
        f"        output=OutputConfig({str(tmp_path)!r} + f'/{{out}}.parquet'),\n"
        "        pipeline=PipelineConfig(progress='off'))\n"
        "    report = run(config, progress=Progress('off'))\n"
        "    print(report.rows, report.backend, [m for m in sys.modules if m.split('.')[0] == 'transformers'][:3])\n"
        "from hpcinfer.process_end import end_process  # as the hpcinfer program ends\n"
        "end_process(0)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3", "native", "[]", "2", "native", "[]"]


def test_the_tower_reads_transformers_defaults_and_names_a_missing_layer(checkpoint, tmp_path):
    """Where config.json is silent, the native tower takes transformers' own defaults; a layer the
    config counts and the weights lack is a ModelError naming its first tensor, not a shorter tower."""
    import shutil

    import transformers
    from safetensors.torch import load_file, save_file

    from hpcinfer.errors import ModelError
    from hpcinfer.models.clip_text import TEXT_DEFAULTS
    from hpcinfer.models.vit_load import DEFAULTS, load_vision_tower

    for kind, config in (("clip", transformers.CLIPVisionConfig()), ("siglip", transformers.SiglipVisionConfig())):
        assert {k: getattr(config, k) for k in DEFAULTS[kind]} == DEFAULTS[kind]
    for kind, config in (("clip", transformers.CLIPTextConfig()), ("siglip", transformers.SiglipTextConfig())):
        assert {k: getattr(config, k) for k in TEXT_DEFAULTS[kind]} == TEXT_DEFAULTS[kind]
    raw = json.loads((checkpoint / "config.json").read_text())
    cpu = torch.device("cpu")
    assert load_vision_tower(checkpoint, raw, cpu, torch.float32, cpu_fast_path=False) is not None
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    weights = load_file(broken / "model.safetensors")
    kept = {k: v for k, v in weights.items() if ".encoder.layers.1." not in k or k.startswith("text_model.")}
    save_file(kept, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"lacks weights its vision tower needs: vision_model\.encoder\.layers\.1\."):
        load_vision_tower(broken, raw, cpu, torch.float32, cpu_fast_path=False)


@pytest.mark.parametrize("eos", [5, 2], ids=["eos-token", "legacy-eos-2"])
def test_clip_text_pools_where_transformers_does(eos):
    """CLIP's text tower pools at the first end-of-text token, or, for an old config whose
    eos_token_id is 2, at the largest id (as transformers keeps it): rows where the end-of-text
    token is not the largest id tell the two apart; padding after it changes nothing."""
    import transformers

    from hpcinfer.models.clip_text import TextTower, text_shape, text_state
    from hpcinfer.models.vit_load import adopt, tower_settings

    torch.manual_seed(0)
    config = transformers.CLIPTextConfig(vocab_size=12, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                         num_attention_heads=2, max_position_embeddings=6, projection_dim=4,
                                         eos_token_id=eos, bos_token_id=1, pad_token_id=0)  # fmt: skip
    theirs = transformers.CLIPTextModelWithProjection(config).eval()
    weights = theirs.state_dict()
    settings = tower_settings({"text_config": config.to_dict()}, "text_config", {})
    shape = text_shape("clip", settings, {k: tuple(v.shape) for k, v in weights.items()})
    assert shape is not None and shape.eos == eos
    ours = adopt(TextTower(shape), text_state(weights, shape), torch.device("cpu"), torch.float32, False)
    ids = torch.tensor([[1, 9, 5, 11, 0, 0], [1, 5, 3, 0, 0, 0], [1, 11, 4, 5, 7, 0]])
    lengths = torch.tensor([4, 3, 5])
    mask = (torch.arange(6)[None, :] < lengths[:, None]).long()
    with torch.no_grad():
        want = theirs(input_ids=ids, attention_mask=mask).text_embeds
        got = ours(ids, lengths)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    first, largest = (ids == 5).int().argmax(-1), (ids * mask).argmax(-1)
    assert not torch.equal(first, largest)  # NOTE: the rows do tell the two poolings apart
