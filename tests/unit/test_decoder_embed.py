"""Decoder embedders (Qwen3-Embedding and the like) in the embedding pipeline, against
sentence-transformers loading the same checkpoint (its Transformer module on `AutoModel`, its
Pooling module's `lasttoken` / `mean`, its Normalize module)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from hpcinfer.config import RunConfig
from hpcinfer.registry import pick_task
from tests.fixtures.tiny_decoder import add_sentence_transformers_files, build_tiny_decoder

from ..conftest import make_texts, run_job, small_config, write_jsonl

TEXTS = make_texts(48, seed=9)
EXTRA = {"Qwen2ForCausalLM": {}, "Qwen3ForCausalLM": {"head_dim": 24}, "LlamaForCausalLM": {"tie": True}}


@pytest.fixture(scope="module", params=sorted(EXTRA))
def embedder(request, tmp_path_factory):
    arch = request.param
    extra = dict(EXTRA[arch])
    path = build_tiny_decoder(tmp_path_factory.mktemp(arch) / "m", arch, seed=5, **extra)
    return arch, add_sentence_transformers_files(path, "last", normalize=True, max_seq_length=64)


def _st(model) -> SentenceTransformer:
    """sentence-transformers on the checkpoint, with its tokenizer.json as hpcinfer reads it.

    NOTE: for a qwen2 / qwen3 model_type, transformers' AutoTokenizer builds its own Qwen2
    tokenizer class over the files, which splits the tiny checkpoints' WordPiece vocabulary
    differently; a real Qwen checkpoint's tokenizer.json is its BPE, read the same by both."""
    import transformers

    st = SentenceTransformer(str(model), device="cpu")
    st[0].processor = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(model / "tokenizer.json"), pad_token="[PAD]", model_max_length=st.max_seq_length
    )
    return st


def _ours(tmp_path, model, **embed) -> np.ndarray:
    tmp_path.mkdir(exist_ok=True)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS)])
    _, table = run_job(small_config(src, tmp_path / "out.parquet", model, embed=embed))
    return np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)


def test_last_token_embeddings_equal_sentence_transformers(tmp_path, embedder, one_torch_thread):
    arch, model = embedder
    assert pick_task(RunConfig(model=str(model))) == "embed"  # a *ForCausalLM with sentence-transformers files
    theirs = _st(model).encode(TEXTS, batch_size=16, convert_to_numpy=True)
    ours = _ours(tmp_path, model)
    assert ours.shape == theirs.shape == (len(TEXTS), 64)
    assert np.abs(ours - theirs).max() <= 1e-5, arch
    # mean pooling and Matryoshka dimensions over the same decoder, as the options set them
    ours = _ours(tmp_path / "mean", model, pooling="mean", dimensions=16)
    theirs = _st(add_sentence_transformers_files(model, "mean", max_seq_length=64)).encode(
        TEXTS, batch_size=16, truncate_dim=16, normalize_embeddings=True, convert_to_numpy=True
    )
    add_sentence_transformers_files(model, "last", max_seq_length=64)  # NOTE: the module's checkpoint, as it was
    assert np.abs(ours - theirs).max() <= 1e-5, arch


def test_a_bare_decoder_checkpoint_embeds(tmp_path, one_torch_thread):
    """A `*Model` checkpoint (no LM head, no `model.` prefix), no sentence-transformers files:
    last-token pooling by default, unnormalised, as the bare `AutoModel` gives it."""
    import torch
    import transformers

    path = build_tiny_decoder(tmp_path / "causal", "Qwen2ForCausalLM", seed=2)
    bare = transformers.AutoModel.from_pretrained(path).eval()
    bare.save_pretrained(tmp_path / "bare")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "bare" / name).write_bytes((path / name).read_bytes())
    assert json.loads((tmp_path / "bare" / "config.json").read_text())["architectures"] == ["Qwen2Model"]
    assert pick_task(RunConfig(model=str(tmp_path / "bare"))) == "embed"
    ours = _ours(tmp_path, tmp_path / "bare")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.no_padding()  # NOTE: MiniLM's tokenizer.json pads to 128 unless told not to
    for i in (0, 7, 31):
        ids = tokenizer.encode(TEXTS[i]).ids
        with torch.no_grad():
            hidden = bare(torch.tensor([ids])).last_hidden_state[0, -1].numpy()
        assert np.abs(ours[i] - hidden).max() <= 1e-4


def test_a_causal_lm_without_sentence_transformers_files_still_generates(tmp_path):
    path = build_tiny_decoder(tmp_path / "m", "LlamaForCausalLM", seed=1)
    assert pick_task(RunConfig(model=str(path))) == "generate"
