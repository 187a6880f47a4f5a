"""The native encoder against Hugging Face transformers, on tiny random checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpcinfer.models.registry import inspect_embedder, load_model, load_tokenizer
from tests.fixtures.tiny import build_tiny_bert

from ..conftest import make_texts


def _padded(tokenizer, texts, multiple=8):
    enc = tokenizer.encode_batch(texts)
    width = -(-max(len(e.ids) for e in enc) // multiple) * multiple
    ids = torch.zeros(len(texts), width, dtype=torch.int32)
    for i, e in enumerate(enc):
        ids[i, : len(e.ids)] = torch.tensor(e.ids)
    return ids, torch.tensor([len(e.ids) for e in enc], dtype=torch.int32)


@pytest.mark.parametrize("pooling", ["mean", "cls", "max", "mean_sqrt_len"])
@pytest.mark.parametrize("prefix", ["", "bert."])
def test_native_encoder_matches_transformers(tmp_path, pooling, prefix):
    transformers = pytest.importorskip("transformers")
    path = build_tiny_bert(tmp_path / "m", pooling=pooling, normalize=pooling == "mean", prefix=prefix)
    info = inspect_embedder(path)
    ours = load_model(info, torch.device("cpu"), torch.float32).embedder
    texts = make_texts(40, seed=5)
    ids, lengths = _padded(load_tokenizer(path, 256), texts)
    got = ours(ids, lengths).numpy()

    hf = transformers.BertModel.from_pretrained(str(path), add_pooling_layer=False).eval()
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    with torch.inference_mode():
        hidden = hf(input_ids=ids.long(), attention_mask=mask).last_hidden_state
    m = mask[..., None].float()
    expected = {
        "mean": (hidden * m).sum(1) / m.sum(1),
        "cls": hidden[:, 0],
        "max": hidden.masked_fill(m == 0, -1e9).amax(1),
        "mean_sqrt_len": (hidden * m).sum(1) / m.sum(1).sqrt(),
    }[pooling]
    if pooling == "mean":
        expected = torch.nn.functional.normalize(expected, dim=1)
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-4, atol=1e-5)


def test_batched_equals_one_row_at_a_time(tiny_model):
    info = inspect_embedder(tiny_model)
    model = load_model(info, torch.device("cpu"), torch.float32).embedder
    ids, lengths = _padded(load_tokenizer(tiny_model, 256), make_texts(12, seed=9))
    batched = model(ids, lengths)
    for i in range(len(ids)):
        n = int(lengths[i])
        alone = model(ids[i : i + 1, :n], lengths[i : i + 1], padded=False)
        torch.testing.assert_close(batched[i : i + 1], alone, rtol=1e-4, atol=1e-5)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    import json

    from hpcinfer.errors import ModelError

    path = build_tiny_bert(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="no native encoder for model_type 'gpt2'"):
        inspect_embedder(path)


def test_pytorch_bin_weights_load_without_pickled_code(tmp_path, tiny_model):
    import shutil

    from safetensors.torch import load_file

    from hpcinfer.errors import ModelError

    path = tmp_path / "bin"
    shutil.copytree(tiny_model, path)
    weights = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    torch.save(weights, path / "pytorch_model.bin")
    ids, lengths = _padded(load_tokenizer(path, 256), ["weights from a .bin file"])
    from_bin = load_model(inspect_embedder(path), torch.device("cpu"), torch.float32).embedder(ids, lengths)
    from_st = load_model(inspect_embedder(tiny_model), torch.device("cpu"), torch.float32).embedder(ids, lengths)
    torch.testing.assert_close(from_bin, from_st)

    class Payload:  # a pickle that would run code when unpickled without weights_only
        def __reduce__(self):  # noqa: ANN204
            return (print, ("executed",))

    torch.save({"x": Payload()}, path / "pytorch_model.bin")
    with pytest.raises(ModelError, match="cannot load weights"):
        load_model(inspect_embedder(path), torch.device("cpu"), torch.float32)


def test_packed_cpu_fast_path_equals_plain_linears(tiny_model):
    info = inspect_embedder(tiny_model)
    fast = load_model(info, torch.device("cpu"), torch.float32).embedder
    plain = load_model(info, torch.device("cpu"), torch.float32, cpu_fast_path=False).embedder
    from hpcinfer.models.bert import PackedLinear

    assert any(isinstance(m, PackedLinear) for m in fast.encoder.modules())
    assert not any(isinstance(m, PackedLinear) for m in plain.encoder.modules())
    ids, lengths = _padded(load_tokenizer(tiny_model, 256), make_texts(30, seed=4))
    torch.testing.assert_close(fast(ids, lengths), plain(ids, lengths), rtol=1e-5, atol=1e-6)


def test_a_bfloat16_model_is_packed_where_onednn_has_bfloat16_kernels(tiny_model):
    """In bfloat16 the linears are oneDNN's where oneDNN takes bfloat16 (its own check: AVX-512
    CPUs), torch's elsewhere; either way the embeddings are the float32 model's to bfloat16's
    precision (8 bits of mantissa: cosine 0.999)."""
    from hpcinfer.models.bert import PackedLinear

    info = inspect_embedder(tiny_model)
    half = load_model(info, torch.device("cpu"), torch.bfloat16).embedder
    full = load_model(info, torch.device("cpu"), torch.float32).embedder
    packed = any(isinstance(m, PackedLinear) for m in half.encoder.modules())
    assert packed == bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    ids, lengths = _padded(load_tokenizer(tiny_model, 256), make_texts(30, seed=4))
    cos = torch.nn.functional.cosine_similarity(half(ids, lengths).float(), full(ids, lengths))
    assert cos.min() >= 0.999


def test_onednn_row_buckets_bound_the_shapes_and_the_padding():
    from hpcinfer.models.bert import bucket_rows

    buckets = [bucket_rows(m) for m in range(1, 65_537)]
    assert all(b >= m for m, b in zip(range(1, 65_537), buckets, strict=True))
    # A handful of shapes per budget doubling, not one per row count: oneDNN keeps a kernel per shape.
    assert len(set(buckets[:2048])) == 32 and len(set(buckets)) <= 32 + 16 * 5
    assert max(b / m for m, b in zip(range(2049, 65_537), buckets[2048:], strict=True)) <= 1.125
