"""Writes tiny random Llama-family GGUF files with `gguf`'s own writer (tests and benchmarks only).

The weights are a random `transformers` model's, laid out as llama.cpp's converter lays them out
(its tensor names, Llama's q/k rows permuted for its rotary kernel) and quantized with `gguf` to
any type it can write; the tokenizer is a small byte-level BPE vocabulary with ChatML control
tokens and a ChatML template, so the file is complete the way a real one is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .gguf_tokenizer import byte_alphabet
from .tiny_decoder import random_causal_lm

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s"), ("r", "e")]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def tiny_vocabulary() -> tuple[list[str], list[int], list[str]]:
    """(tokens, llama.cpp token types, merges): 256 byte tokens, a few merges, three control tokens."""
    tokens = [byte_alphabet()[b] for b in range(256)] + ["".join(pair) for pair in _MERGES] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)
    return tokens, types, [" ".join(pair) for pair in _MERGES]


def tiny_sentencepiece_vocabulary() -> tuple[list[str], list[int], list[float]]:
    """(tokens, types, scores) of a small SentencePiece vocabulary as Llama 2's files hold one:
    <unk>, <s>, </s>, the 256 byte tokens, pieces spelled with ▁ ranked by score, ChatML tokens."""
    pieces = ["▁", *"etaoinshrdlucmfwypvbgkqjxz", "▁t", "he", "▁the", "in", "▁a", "er", "on", "▁s", "re", "at"]
    pieces += ["▁th", "an", "en", "▁w", "▁o", "is", "▁i", "it", "es", "or", "▁c", "ed", "▁b", "ing", "▁f"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, "<|im_start|>", "<|im_end|>"]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces), 3, 3]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0, 0.0]
    return tokens, types, scores


def _permute_rotary(weight: Any, heads: int) -> Any:
    """llama.cpp's converter: each head's rotate-half rows interleaved (the inverse of the reader's)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def build_tiny_gguf(
    path: str | Path,
    architecture: str = "LlamaForCausalLM",
    qtype: str = "F32",
    *,
    hidden: int = 256,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 512,
    max_positions: int = 512,
    rope_theta: float = 10000.0,
    tie: bool = False,
    seed: int = 0,
    tokenizer: str = "gpt2",
) -> Path:
    """Writes a random `architecture` model as a GGUF whose matrices are `qtype`; returns the file.

    Rows must fill whole quantization blocks: 256 (the default hidden size) fits every block size.
    `tokenizer`: "gpt2" (byte-level BPE with merges) or "llama" (SentencePiece pieces and scores).
    """
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    arch = GGUF_ARCH[architecture]
    if tokenizer == "llama":
        tokens, types, scores = tiny_sentencepiece_vocabulary()
        merges: list[str] = []
    else:
        tokens, types, merges = tiny_vocabulary()
    model = random_causal_lm(
        architecture, len(tokens), seed, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=intermediate, max_position_embeddings=max_positions,
        rope_theta=rope_theta, initializer_range=0.1, tie_word_embeddings=tie,
        bos_token_id=tokens.index("<|im_start|>"),
        eos_token_id=tokens.index("<|im_end|>" if tokenizer == "gpt2" else "</s>"),
    )  # fmt: skip
    config = model.config
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    kind = GGMLQuantizationType[qtype]

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    for key, value in {
        "block_count": layers,
        "context_length": max_positions,
        "embedding_length": hidden,
        "feed_forward_length": intermediate,
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
    }.items():
        writer.add_uint32(f"{arch}.{key}", value)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    writer.add_uint32(f"{arch}.attention.key_length", head_dim)
    writer.add_uint32(f"{arch}.attention.value_length", head_dim)
    writer.add_float32(f"{arch}.rope.freq_base", rope_theta)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", float(config.rms_norm_eps))
    writer.add_tokenizer_model(tokenizer)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if tokenizer == "llama":
        writer.add_token_scores(scores)
        writer.add_bos_token_id(tokens.index("<s>"))
        writer.add_eos_token_id(tokens.index("</s>"))
        writer.add_unk_token_id(tokens.index("<unk>"))
    else:
        writer.add_tokenizer_pre("default")
        writer.add_token_merges(merges)
        writer.add_bos_token_id(tokens.index("<|im_start|>"))
        writer.add_eos_token_id(tokens.index("<|im_end|>"))
        writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)

    def put(name: str, array: Any) -> None:
        array = np.ascontiguousarray(array, dtype=np.float32)
        if array.ndim == 2 and kind != GGMLQuantizationType.F32:
            writer.add_tensor(name, quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, array)

    put("token_embd.weight", state["model.embed_tokens.weight"])
    for i in range(layers):
        hf = f"model.layers.{i}."
        for gguf_name, hf_name in (
            ("attn_q", "self_attn.q_proj"),
            ("attn_k", "self_attn.k_proj"),
            ("attn_v", "self_attn.v_proj"),
            ("attn_output", "self_attn.o_proj"),
            ("ffn_gate", "mlp.gate_proj"),
            ("ffn_up", "mlp.up_proj"),
            ("ffn_down", "mlp.down_proj"),
        ):
            for part in ("weight", "bias"):
                tensor = state.get(f"{hf}{hf_name}.{part}")
                if tensor is None:
                    continue
                if arch == "llama" and gguf_name in ("attn_q", "attn_k"):
                    tensor = _permute_rotary(tensor, heads if gguf_name == "attn_q" else kv_heads)
                put(f"blk.{i}.{gguf_name}.{part}", tensor)
        put(f"blk.{i}.attn_norm.weight", state[f"{hf}input_layernorm.weight"])
        put(f"blk.{i}.ffn_norm.weight", state[f"{hf}post_attention_layernorm.weight"])
        for gguf_name, hf_name in (("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm")):
            if f"{hf}{hf_name}.weight" in state:
                put(f"blk.{i}.{gguf_name}.weight", state[f"{hf}{hf_name}.weight"])
    put("output_norm.weight", state["model.norm.weight"])
    if not tie:
        put("output.weight", state["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


__all__ = ["CHATML", "GGUF_ARCH", "build_tiny_gguf", "tiny_sentencepiece_vocabulary", "tiny_vocabulary"]
