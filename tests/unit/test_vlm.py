"""Vision-language chats in the paged engine: a tiny random Idefics3 (SmolVLM's family) saved by the
installed transformers answers 32 image chats (images by relative path and as data URLs) greedily,
each answer equal to transformers' `generate` over its own processor; chats about one image share
its prefix blocks, two images never do; a bad image is a reject with its reason."""

from __future__ import annotations

import base64
import io
import json
import random
from pathlib import Path

import pytest
import torch

from hpcinfer.tasks.generate.job import run_generate
from tests.fixtures.tiny_vlm import build_tiny_vlm

from ..conftest import generate_config, write_jsonl

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CHATS, MAX_TOKENS = 32, 8
QUESTIONS = ["what is this", "describe the picture", "which colour is it", "how many things are there"]


@pytest.fixture(scope="module", params=["Idefics3", "SmolVLM"])
def vlm(request, tmp_path_factory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny", seed=3, family=request.param)


def picture(rng: random.Random, fmt: str) -> bytes:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (rng.randint(20, 140), rng.randint(20, 140)), tuple(rng.randrange(256) for _ in range(3)))
    ImageDraw.Draw(image).ellipse([2, 3, 15, 19], fill=tuple(rng.randrange(256) for _ in range(3)))
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


def chat(question: str, url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": question}]}]  # fmt: skip


def transformers_answer(model, processor, tokenizer, question: str, image: bytes, eos: int) -> str:  # noqa: ANN001
    from PIL import Image

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=[[Image.open(io.BytesIO(image))]], return_tensors="pt",
                       add_special_tokens=False)  # fmt: skip
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)[0, inputs["input_ids"].shape[1] :]
    ids = out.tolist()
    ids = ids[: ids.index(eos)] if eos in ids else ids
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_image_chats_equal_transformers_and_share_an_image_prefix(vlm, tmp_path):
    import transformers
    from tokenizers import Tokenizer

    rng = random.Random(11)
    images = [picture(rng, ("PNG", "JPEG")[i % 2]) for i in range(CHATS // 2)]
    (tmp_path / "pics").mkdir()
    rows = []
    for i in range(CHATS):
        k = i // 2  # NOTE: two questions about each image
        if i % 4 < 2:
            (tmp_path / "pics" / f"{k}.img").write_bytes(images[k])
            url = f"pics/{k}.img"
        else:
            url = "data:image/png;base64," + base64.b64encode(images[k]).decode()
        rows.append({"id": f"c{i}", "messages": chat(QUESTIONS[i % 4], url), "max_tokens": MAX_TOKENS})
    src = write_jsonl(tmp_path / "chats.jsonl", rows)
    out = tmp_path / "answers.jsonl"
    report = run_generate(generate_config(src, out, vlm, max_num_seqs=8))
    assert report.rows == CHATS
    got = {r["id"]: r["text"] for r in map(json.loads, out.read_text().splitlines())}
    architecture = json.loads((vlm / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, architecture).from_pretrained(str(vlm)).eval()
    processor = transformers.AutoProcessor.from_pretrained(str(vlm))
    tokenizer = Tokenizer.from_file(str(vlm / "tokenizer.json"))
    eos = processor.tokenizer.eos_token_id
    want = {f"c{i}": transformers_answer(model, processor, tokenizer, QUESTIONS[i % 4], images[i // 2], eos)
            for i in range(CHATS)}  # fmt: skip
    same = sum(got[k] == want[k] for k in want)
    assert same == CHATS, f"{same}/{CHATS} answers equal transformers'"
    assert len({got[f"c{i}"] for i in range(0, CHATS, 2)}) > CHATS // 4  # the images matter
    assert report.prompt_tokens_cached > 0  # the second question about an image reuses its blocks
    # chunks of 8 tokens: an image's 16 tokens span chunks, and the answers stay the same
    chunked = tmp_path / "chunked.jsonl"
    run_generate(generate_config(src, chunked, vlm, max_num_seqs=8, max_num_batched_tokens=8))
    assert {r["id"]: r["text"] for r in map(json.loads, chunked.read_text().splitlines())} == got


def test_bad_images_are_rejects_and_a_text_model_refuses_images(vlm, tmp_path):
    from tests.fixtures.tiny_decoder import build_tiny_decoder

    good = "data:image/png;base64," + base64.b64encode(picture(random.Random(2), "PNG")).decode()
    (tmp_path / "text.png").write_text("not an image")
    rows = [{"id": "ok", "messages": chat("what is this", good), "max_tokens": 2},
            {"id": "missing", "messages": chat("what is this", "nowhere.png")},
            {"id": "web", "messages": chat("what is this", "https://example.com/a.png")},
            {"id": "broken", "messages": chat("what is this", "data:image/png;base64,@@@")},
            {"id": "notimage", "messages": chat("what is this", "text.png")},
            {"id": "device", "messages": chat("what is this", "/dev/zero")},
            {"id": "ftp", "messages": chat("what is this", "ftp://host/a.png")},
            {"id": "plain", "messages": [{"role": "user", "content": "no image here"}], "max_tokens": 2}]  # fmt: skip
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    report = run_generate(generate_config(src, out, vlm))
    assert report.rows == 2
    rejects = {r["id"]: r for r in map(json.loads, Path(f"{out}.rejects.jsonl").read_text().splitlines())}
    assert set(rejects) == {"missing", "web", "broken", "notimage", "device", "ftp"}
    assert "not a regular file" in rejects["device"]["message"] and "ftp://" in rejects["ftp"]["message"]
    assert "nowhere.png" in rejects["missing"]["message"] and "http" in rejects["web"]["message"]
    assert "base64" in rejects["broken"]["message"] and "not an image" in rejects["notimage"]["message"]
    text_model = build_tiny_decoder(tmp_path / "text-model", "LlamaForCausalLM", seed=2)
    plain = run_generate(generate_config(src, tmp_path / "plain.jsonl", text_model))
    refused = [json.loads(x) for x in Path(f"{tmp_path / 'plain.jsonl'}.rejects.jsonl").read_text().splitlines()]
    assert plain.rows == 1 and len(refused) == 7
    assert any("takes text only" in r["message"] for r in refused)
    # --no-image-files (as serve runs a tenant's upload): inline images only
    inline = tmp_path / "inline.jsonl"
    only = run_generate(_no_files(generate_config(src, inline, vlm)))
    named = {r["id"]: r["message"] for r in map(json.loads, Path(f"{inline}.rejects.jsonl").read_text().splitlines())}
    assert only.rows == 2 and "inline" in named["notimage"] and "inline" in named["missing"]


def _no_files(config):  # noqa: ANN001, ANN202
    from dataclasses import replace

    return replace(config, input=replace(config.input, image_files=False))


def test_a_tower_failure_on_one_chats_images_is_that_rows_reject(vlm, tmp_path, monkeypatch):
    """The vision tower failing on one request's images (too many, too large for the device) makes that
    row a reject with the reason; the run goes on and answers the rest."""
    from hpcinfer.models import vlm as vlm_module

    images = [picture(random.Random(k), "PNG") for k in range(4)]
    urls = ["data:image/png;base64," + base64.b64encode(data).decode() for data in images]
    rows = [{"id": f"r{k}", "messages": chat("what is this", url), "max_tokens": 3} for k, url in enumerate(urls)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    import hashlib

    refused = hashlib.sha256(hashlib.sha256(images[2]).digest()).digest()
    features = vlm_module.VisionTower.features

    def failing(self, media):  # noqa: ANN001, ANN202
        if media.digest == refused:
            raise ValueError("out of memory for these images")
        return features(self, media)

    monkeypatch.setattr(vlm_module.VisionTower, "features", failing)
    out = tmp_path / "out.jsonl"
    report = run_generate(generate_config(src, out, vlm))
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["r0", "r1", "r3"]
    [reject] = [json.loads(x) for x in Path(f"{out}.rejects.jsonl").read_text().splitlines()]
    assert reject["id"] == "r2" and reject["reason"] == "image_unreadable" and reject["line"] == 3
    assert "vision tower" in reject["message"] and report.rows == 3 and report.rejects == {"image_unreadable": 1}
