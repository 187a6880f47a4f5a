"""Structured output: an answer held to a JSON schema, a regular expression, a choice of strings
or a Lark / GBNF grammar, with llguidance as the grammar engine.

    GrammarSpec (a row's, or the run's)     -> Grammars.problem(spec): a reject reason, or None
    Engine.add                              -> Grammars.matcher(spec): the sequence's own matcher
    each step: StepMasks.start(sampling)    -> the next-token masks, filled on a host thread while
                                               the forward runs
               StepMasks.apply(logits)      -> one masked_fill on the device for the rows that have them
               consume(seq, token)          -> the matcher advances; a grammar that is complete ends
                                               the answer with finish_reason "stop"

NOTE: llguidance over xgrammar, both measured by benchmarks/speed/grammar_engines.py on SmolLM2's
49k vocabulary. xgrammar fills a mask about 10x faster (7 against 75 us a token; 0.4 against
3-5 ms for 64 rows), but llguidance's answers are the ones that hold: xgrammar 0.2.9 lets raw
control bytes into a JSON string with maxLength (invalid JSON) and, built from a `tokenizers`
object, lets special tokens such as <|im_start|> into strings. llguidance also has no Python
dependencies (xgrammar requires transformers, triton, pydantic and tvm-ffi), builds its tokenizer
from the `tokenizers` JSON we load anyway (GGUF files included), compiles a schema in under a
millisecond, and drops the GIL while it fills masks: they are filled beside the forward, which on
every device takes longer than a batch's masks.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from .schema_bounds import versions

KINDS = ("json_schema", "regex", "choice", "grammar")
# NOTE: JSON as json.dumps writes it (", " and ": ", no other whitespace): a model cannot fill its
# answer with whitespace, and the answers look the same whichever model wrote them. A schema's own
# "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_COMPILED = 256  # compiled grammars kept (a run usually has one schema, or a few)


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What an answer must match: `kind` one of KINDS; `text` the schema as JSON, the pattern, the
    choices as a JSON list, or the grammar (Lark, or GBNF: llguidance converts it)."""

    kind: str
    text: str

    @staticmethod
    def of(kind: str, value: Any) -> GrammarSpec:
        """A spec from a row's or the command line's value; ValueError says what is wrong with it."""
        if kind == "json_schema":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise ValueError(f"the JSON schema is not JSON ({exc})") from None
            if not isinstance(value, dict | bool):
                raise ValueError(f"a JSON schema is an object, got {type(value).__name__}")
            return GrammarSpec(kind, json.dumps(value))  # NOTE: key order kept: answers follow the schema's order
        if kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            return GrammarSpec(kind, json.dumps(value))
        if kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{kind} must be a non-empty string")
            return GrammarSpec(kind, value)
        raise ValueError(f"unknown structured output kind {kind!r}")


def spec_from_body(body: dict[str, Any]) -> GrammarSpec | None:
    """The structured output a request asks for, in any of the spellings people send:
    OpenAI's `response_format` (json_schema, json_object), vLLM's `structured_outputs` object and
    its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, and plain rows'
    `json_schema`, `regex`, `choice`, `grammar` columns. More than one is a ValueError."""
    found: list[GrammarSpec] = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_schema":
            inner = fmt.get("json_schema")
            schema = inner.get("schema") if isinstance(inner, dict) else None
            if schema is None:
                raise ValueError("response_format json_schema needs json_schema.schema")
            found.append(GrammarSpec.of("json_schema", schema))
        elif kind == "json_object":
            found.append(GrammarSpec.of("json_schema", {"type": "object"}))
        elif kind != "text":
            raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")
    nested = body.get("structured_outputs")
    if nested is not None and not isinstance(nested, dict):
        raise ValueError("structured_outputs must be an object")
    spellings = (
        (nested or {}, {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}),
        (body, {f"guided_{name}": kind for name, kind in (("json", "json_schema"), *((k, k) for k in KINDS[1:]))}),
        (body, {kind: kind for kind in KINDS}),
    )
    for source, keys in spellings:
        found += [GrammarSpec.of(kind, source[key]) for key, kind in keys.items() if source.get(key) is not None]
    if len(set(found)) > 1:
        raise ValueError("a request asks for more than one structured output")
    return found[0] if found else None


def _grammars(spec: GrammarSpec) -> list[str]:
    """The spec as llguidance grammars to try in turn (a JSON schema: its bounded versions, most
    bounded first, `schema_bounds.versions`); ValueError for a spec that cannot hold an answer."""
    import llguidance

    if spec.kind == "json_schema":
        return [
            llguidance.LLMatcher.grammar_from_json_schema(json.dumps(v), defaults=JSON_OPTIONS)  # type: ignore[arg-type]
            for v in versions(json.loads(spec.text))
        ]
    if spec.kind == "grammar":
        return [llguidance.grammar_from("grammar", spec.text)]  # Lark, or GBNF converted to it
    return [llguidance.grammar_from(spec.kind, spec.text)]  # type: ignore[arg-type]


def _compile(tokenizer: Any, spec: GrammarSpec) -> tuple[Any, str | None]:
    """(a matcher at the grammar's start, None), or (None, why llguidance refuses the spec): the
    first of its grammars that compiles; the last one's error (the schema as written) if none does."""
    import llguidance

    matcher, error = None, "no grammar"
    for grammar in _grammars(spec):
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if not matcher.is_error():
            break
        error = matcher.get_error()
    else:
        return None, error
    if matcher.is_stopped() and not matcher.is_accepting():
        return None, "no answer fits it"  # NOTE: a dead end at the start: only EOS, an empty answer, would follow
    return matcher, None


class Grammars:
    """The run's grammar engine: its tokenizer (built once, on the first structured request),
    the compiled grammars, and a fresh matcher for each sequence."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Seq[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: Any = None
        self._tokenizer_problem: str | None = None
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()  # the reader's thread checks, the engines' threads build matchers

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None and self._tokenizer_problem is None:
            import llguidance

            try:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos or None
                )
            except ValueError as exc:
                self._tokenizer_problem = (
                    f"structured output needs a byte-level BPE or SentencePiece tokenizer; this checkpoint's "
                    f"is not one ({exc})"
                )
        return self._tokenizer

    def _template(self, spec: GrammarSpec) -> tuple[Any, str | None]:
        """(a matcher at the grammar's start, None) or (None, why the grammar is refused)."""
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
            tokenizer = self._llg_tokenizer()
            if tokenizer is None:
                return None, self._tokenizer_problem
            try:
                entry = _compile(tokenizer, spec)
            except ValueError as exc:
                entry = (None, str(exc))
            if entry[1] is not None:
                said = " ".join(entry[1].split())  # NOTE: llguidance's messages span lines (a caret under the spot)
                entry = (None, f"invalid {spec.kind.replace('_', ' ')}: {said[:300]}")
            self._compiled[spec] = entry
            if len(self._compiled) > _COMPILED:
                self._compiled.popitem(last=False)
            return entry

    def problem(self, spec: GrammarSpec) -> str | None:
        """Why `spec` cannot constrain an answer (the reject's message), or None."""
        return self._template(spec)[1]

    def matcher(self, spec: GrammarSpec) -> Any:
        """A matcher of its own for one sequence; ValueError for a grammar `problem` refuses."""
        template, problem = self._template(spec)
        if template is None:
            raise ValueError(problem)
        return template.deep_copy()


def consume(matcher: Any, token: int) -> str | None:
    """Advances a sequence's matcher by its sampled token; the answer's finish reason when it ends
    there, else None: "stop" once the grammar is complete, "length" where the answer cannot go on
    and is not complete (a dead end llguidance let it into, or a token that broke the grammar,
    which the mask prevents). NOTE: a constrained answer that ends "stop" matches its grammar."""
    matcher.consume_token(token)
    if matcher.is_error():
        return "length"
    if matcher.is_stopped():
        return "stop" if matcher.is_accepting() else "length"
    return None


class StepMasks:
    """A step's next-token masks: filled by llguidance on a host thread, applied on the device."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        import llguidance

        self.words = (vocab_size + 31) // 32
        self.device = device
        self._executor = llguidance.LLExecutor()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="hpcinfer-grammar")
        self._bits = torch.arange(32, dtype=torch.int32, device=device)
        self.fill_s = 0.0  # host seconds spent filling masks (on their own thread)
        self.wait_s = 0.0  # of which the step waited for, after its forward

    def start(self, sampling: Seq[Any], first_row: int = 0) -> PendingMasks | None:
        """Begins the masks of the sampling rows (numbered from `first_row`) whose sequences have a
        matcher; None if none has."""
        rows = [(row, seq.grammar) for row, seq in enumerate(sampling, first_row) if seq.grammar is not None]
        if not rows:
            return None
        pinned = self.device.type == "cuda"
        bitmask = torch.empty((len(rows), self.words), dtype=torch.int32, pin_memory=pinned)
        future = self._thread.submit(self._fill, [(m, k) for k, (_, m) in enumerate(rows)], bitmask)
        return PendingMasks([row for row, _ in rows], bitmask, future, self)

    def _fill(self, matchers: list[tuple[Any, int]], bitmask: torch.Tensor) -> float:
        import time

        t0 = time.perf_counter()
        self._executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), self.words * 4, bitmask.shape[0])
        return time.perf_counter() - t0

    def close(self) -> None:
        self._thread.shutdown(wait=False)


class PendingMasks:
    def __init__(self, rows: list[int], bitmask: torch.Tensor, future: Future[float], owner: StepMasks) -> None:
        self.rows, self.bitmask, self.future, self.owner = rows, bitmask, future, owner

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [S, vocab] with every token the grammar bars at -inf, in the masked rows (out of place)."""
        import time

        owner = self.owner
        t0 = time.perf_counter()
        owner.fill_s += self.future.result()
        owner.wait_s += time.perf_counter() - t0
        words = self.bitmask.to(owner.device, non_blocking=True)
        allowed = ((words[:, :, None] >> owner._bits) & 1).view(len(self.rows), -1)[:, : logits.shape[1]]
        index = torch.tensor(self.rows, device=logits.device)
        masked = logits.index_select(0, index).masked_fill(allowed == 0, -torch.inf)
        return logits.index_copy(0, index, masked)


__all__ = ["KINDS", "GrammarSpec", "Grammars", "PendingMasks", "StepMasks", "consume", "spec_from_body"]
