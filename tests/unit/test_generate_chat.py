"""Chat rendering equals transformers' apply_chat_template; a template cannot reach Python."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from hpcinfer.models.decoder_inspect import inspect_decoder
from hpcinfer.tasks.generate.chat import ChatError, ChatRenderer
from tests.fixtures.tiny_decoder import build_tiny_decoder

CHATML = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "the quick brown fox"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "  what is a  KV cache? "},
        {"role": "assistant", "content": "blocks of keys and values"},
        {"role": "user", "content": "and paging? {{ not a template }}"},
    ],
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_decoder(tmp_path_factory.mktemp("chat"))


@pytest.mark.parametrize("template", ["own", "chatml"])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_render_equals_apply_chat_template(checkpoint, template, messages):
    if template == "chatml":
        cfg = json.loads((checkpoint / "tokenizer_config.json").read_text())
        cfg["chat_template"] = CHATML
        (checkpoint / "tokenizer_config.json").write_text(json.dumps(cfg))
    info = inspect_decoder(checkpoint)
    hf = PreTrainedTokenizerFast.from_pretrained(checkpoint)  # the checkpoint's tokenizer.json itself
    ours = ChatRenderer(info.chat_template, info.special_tokens)
    for gen in (True, False):
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.render(messages, add_generation_prompt=gen) == want
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert hf(ours.render(messages), add_special_tokens=False)["input_ids"] == list(ids)


def test_bad_messages_and_template_errors_are_chat_errors():
    ours = ChatRenderer(CHATML, {})
    with pytest.raises(ChatError, match="bad role tool"):
        ours.render([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatError, match="non-empty list"):
        ours.render([])
    with pytest.raises(ChatError, match="role"):
        ours.render([{"content": "no role"}])


def test_template_is_sandboxed():
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatError):
        ChatRenderer(escape, {}).render([{"role": "user", "content": "x"}])
    mutate = "{% set _ = messages.append({'role': 'user'}) %}{{ messages | length }}"
    with pytest.raises(ChatError):
        ChatRenderer(mutate, {}).render([{"role": "user", "content": "x"}])
