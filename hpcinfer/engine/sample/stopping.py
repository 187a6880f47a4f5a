"""Why a sequence ends at a token: the one rule of both engines (engine.py, hf_engine.py)."""

from __future__ import annotations

from collections.abc import Callable, Container

from ..constrained.structured import consume
from ..sequence import Sequence


def stop_reason(
    seq: Sequence, at: int, eos: Container[int], decode: Callable[[list[int]], str] | None, max_model_len: int
) -> str | None:
    """The finish reason, "stop" or "length", when the token at `at` ends `seq` (EOS or a stop token,
    a complete grammar, a stop string, max_tokens, the context), else None; a stop token or string
    is noted on `seq`.

    NOTE: an answer held to a grammar ends "stop" only where the grammar is complete: EOS or a stop
    token id ends it only there (the mask lets EOS in only there; a stop token id elsewhere is text
    the grammar allowed), a dead end ends it "length" (structured.consume), and stop strings are
    refused with a grammar (requests.py)."""
    params, token, grammar = seq.params, seq.tokens[at], seq.grammar
    stops = (token in eos and not params.ignore_eos) or token in params.stop_token_ids
    if stops and (grammar is None or grammar.is_accepting()):
        seq.stop_token = True
        return "stop"
    if grammar is not None and (reason := consume(grammar, token)) is not None:
        return reason  # "stop": the grammar is complete, nothing but EOS could follow
    if params.stop and decode is not None:
        text = decode(seq.tokens[seq.num_prompt : at + 1])
        cuts = [i for i in (text.find(s) for s in params.stop) if i >= 0]
        if cuts:
            seq.stop_text_cut = min(cuts)
            return "stop"
    if at + 1 - seq.num_prompt >= params.max_tokens or at + 1 >= max_model_len:
        return "length"
    return None


__all__ = ["stop_reason"]
