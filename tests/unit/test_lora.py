"""LoRA adapters served beside their base (--lora): rows of two PEFT adapters and of the base
interleaved in one job, each answer equal to transformers' greedy answer with that adapter merged
(`peft`'s `merge_and_unload`); the prefix cache never lends one adapter's K/V to another."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpcinfer.errors import ConfigError
from hpcinfer.models.decoder_inspect import inspect_decoder
from hpcinfer.models.lora import LoraRows
from hpcinfer.models.registry import load_tokenizer
from hpcinfer.tasks.generate.job import run_generate
from tests.fixtures.tiny_decoder import build_tiny_decoder

from ..conftest import generate_config, make_texts, write_jsonl

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS, MAX_TOKENS = 32, 10
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_decoder(tmp_path_factory.mktemp("lora") / "base", "LlamaForCausalLM", seed=21)


def make_adapter(base: Path, folder: Path, seed: int) -> Path:
    """A rank-8 PEFT adapter on every projection, its A and B random (so it changes the answers)."""
    import peft
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
    peft.get_peft_model(model, config).save_pretrained(folder)
    return folder


def merged_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], eos: set[int]) -> list[list[int]]:
    import peft
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()
    answers = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(prompt) :]
            ids = out.tolist()
            ends = [i for i, t in enumerate(ids) if t in eos]
            answers.append(ids[: ends[0]] if ends else ids)
    return answers


def test_two_adapters_and_the_base_in_one_job_equal_merged_transformers(base, tmp_path):
    adapters = {"alpha": make_adapter(base, tmp_path / "alpha", 1), "beta": make_adapter(base, tmp_path / "beta", 2)}
    info = inspect_decoder(base)
    tokenizer = load_tokenizer(info.path, 64)
    # NOTE: each prompt runs under every adapter and the base, so their shared prefix blocks would be
    # reused across adapters if the prefix cache did not key by adapter
    prompts = [tokenizer.encode(t).ids[:40] for t in make_texts(PROMPTS, seed=4)]
    picks = (("alpha", "alpha"), ("beta", "beta"), ("base", None))
    rows = [{"id": f"{name}-{i}", "prompt_token_ids": p, "max_tokens": MAX_TOKENS, "lora": lora}
            for i, p in enumerate(prompts) for name, lora in picks]  # fmt: skip
    loras = tuple(f"{name}={folder}" for name, folder in adapters.items())
    out = tmp_path / "out.jsonl"
    report = run_generate(generate_config(write_jsonl(tmp_path / "in.jsonl", rows), out, base, loras=loras))
    assert report.rows == len(rows)
    got = {r["id"]: r["text"] for r in map(json.loads, out.read_text().splitlines())}
    eos = set(info.eos_token_ids)
    for name, adapter in (*adapters.items(), ("base", None)):
        expected = merged_greedy(base, adapter, prompts, eos)
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in expected]
        same = sum(got[f"{name}-{i}"] == text for i, text in enumerate(texts))
        assert same == PROMPTS, f"{name}: {same}/{PROMPTS} answers equal merged transformers'"
    assert sum(got[f"alpha-{i}"] != got[f"base-{i}"] for i in range(PROMPTS)) > PROMPTS // 2  # adapters matter

    # --max-loras 1: the same answers, never two adapters in one step nor on the device together
    seen: list[tuple[int, int]] = []
    original = LoraRows.set

    def watched(self: LoraRows, adapters: list[int], device: torch.device) -> None:
        original(self, adapters, device)
        seen.append((len(set(adapters) - {0}), len(self.resident)))

    bounded = tmp_path / "bounded.jsonl"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LoraRows, "set", watched)
        config = generate_config(tmp_path / "in.jsonl", bounded, base, loras=loras, max_loras=1)
        report = run_generate(config)
    assert report.rows == len(rows) and report.lora["max_loras"] == 1
    assert {r["id"]: r["text"] for r in map(json.loads, bounded.read_text().splitlines())} == got
    assert seen and max(n for n, _ in seen) == 1 and max(r for _, r in seen) == 1
    assert 2 <= report.lora["adapter_loads"] < len(seen)  # each adapter brought back only when needed


def test_lora_mistakes_are_one_line_or_rejects(base, tmp_path):
    adapter = make_adapter(base, tmp_path / "a", 3)
    rows = [{"id": "ok", "prompt": "the fox", "max_tokens": 2, "lora": "a"},
            {"id": "unknown", "prompt": "the fox", "lora": "zeta"}]  # fmt: skip
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    report = run_generate(generate_config(src, tmp_path / "out.jsonl", base, loras=(f"a={adapter}",)))
    assert report.rows == 1 and report.rejects == {"invalid_request": 1}
    assert "zeta" in Path(f"{tmp_path / 'out.jsonl'}.rejects.jsonl").read_text()
    for bad in (("a",), (f"a={tmp_path}",), (f"a={adapter}", f"a={adapter}")):
        with pytest.raises(ConfigError):
            run_generate(generate_config(src, tmp_path / "bad.jsonl", base, loras=bad))
    with pytest.raises(ConfigError, match="--max-loras"):
        run_generate(generate_config(src, tmp_path / "bad.jsonl", base, max_loras=1))
    plain = run_generate(generate_config(src, tmp_path / "plain.jsonl", base))
    assert plain.rows == 0 and plain.rejects == {"invalid_request": 2}  # no --lora: a row asking for one is refused
