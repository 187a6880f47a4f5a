"""Generation requests: input rows -> prompt token ids + SamplingParams, or a Reject.

Reads JSONL, Parquet and OpenAI batch JSONL (`/v1/completions`, `/v1/chat/completions`,
`/v1/responses`: read as the chat it is, responses.py) with the
same path expansion as embedding (`read.expand_paths`). A row has one of `prompt` (text),
`messages` (a chat, rendered with the checkpoint's template) or `prompt_token_ids`, and may
override `max_tokens`, `temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stop`, `stop_token_ids`,
`repetition_penalty`, `presence_penalty`, `frequency_penalty`, `logit_bias`, `allowed_token_ids`,
`min_tokens`, may ask
for structured output (`structured.spec_from_body`: `response_format`, `json_schema`, `regex`,
`choice`, `grammar` and vLLM's spellings; not with `stop` strings), and may carry an integer
priority (`--priority-column`, higher first).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ...engine.constrained.structured import Grammars, spec_from_body
from ...engine.sequence import SamplingParams
from ...errors import InputError
from ...files.ids import IdSet, check_id, id_key, is_unicode
from ...files.lines import CHUNK_BYTES
from ...files.row_source import Segment, jsonl_chunks, parquet_batches
from ...files.sources import expand_paths, json_objects, read_schema
from ...models.vlm import ImagePrompts
from ...types import Reject
from .chat import ChatError, ChatRenderer, content_parts
from .responses import RESPONSES_URL, chat_body, echoed
from .row_params import bad_word_ids, row_params
from .unhonoured import unhonoured

PROMPT_COLUMNS = ("prompt", "messages", "prompt_token_ids")
_ROW_BLOCK = 256  # Parquet rows decoded at a time


@dataclass(slots=True)
class Request:
    """One valid row: what the engine runs and what the writer needs to answer it."""

    row: int  # global input row number
    id: Any
    tokens: list[int]
    params: SamplingParams
    kind: str  # "text" | "chat" | "response": the shape of an OpenAI answer
    openai: bool = False
    source: str = ""  # the input file (accounting)
    priority: int = 0
    read_s: float = 0.0  # when the job read it (perf_counter): the start of its latency
    listed: bool = False  # a run with --n > 1: a plain answer's text and finish_reason are lists
    model: str | None = None  # an OpenAI body's `model`, echoed in its answer
    echo: dict[str, Any] | None = None  # what a /v1/responses answer repeats of its request
    parse: tuple[str, str, bool] | None = None  # a chat answer's (reasoning parser, tool parser, tools given)
    line: int | None = None  # its JSONL line, and its row within its file: where a late reject points
    row_in_file: int | None = None

    def reject(self, reason: str, message: str) -> Reject:
        """This admitted request as a reject (it could not run after all)."""
        return Reject(self.row, self.source, self.line, self.id, reason, message, self.row_in_file)


@dataclass(frozen=True, slots=True)
class InputFacts:
    """What a request reader finds out about its files once, before reading a row."""

    has_ids: dict[str, bool]  # the file carries ids (OpenAI batch files do, in custom_id)
    openai_sources: frozenset[str]  # OpenAI batch files, answered line for line

    @staticmethod
    def scan(files: list[str], id_column: str) -> InputFacts:
        return InputFacts(
            {f: _has_id_column(f, id_column) for f in files}, frozenset(f for f in files if _is_openai_batch(f))
        )


class RequestReader:
    """Streams Requests and Rejects in input order, skipping `skip_rows` already committed rows."""

    def __init__(
        self,
        paths: tuple[str, ...],
        id_column: str,
        tokenizer: Any,
        chat: ChatRenderer | None,
        defaults: SamplingParams,
        max_prompt: int,
        vocab: int,
        priority_column: str = "priority",
        grammars: Grammars | None = None,
        max_n: int = 1 << 30,
        lacks: Callable[[SamplingParams], str | None] | None = None,
        parsers: tuple[str, str] = ("none", "none"),
        loras: tuple[str, ...] = (),
        vision: tuple[str, int] | None = None,
        image_files: bool = True,
        *,
        facts: InputFacts | None = None,
    ) -> None:
        """`max_n`: the most samples a request may ask for (--max-num-seqs: they run together);
        `lacks`: what a row's sampling asks that the run's engine lacks (an invalid_request reject);
        `parsers`: how chat answers' reasoning and tool calls are split out (parsers.py); `loras`:
        the adapters' names (--lora), which an OpenAI body's `model` or a `lora` column picks;
        `vision`: a vision-language model's (folder, image token id): its chats may hold images;
        `facts`: the files' facts, found already (a reader of part of the input: `for_rows`)."""
        self.arguments = (paths, id_column, tokenizer, chat, defaults, max_prompt, vocab, priority_column)
        self.arguments += (grammars, max_n, lacks, parsers, loras, vision, image_files)
        self.image_files = image_files
        self.images = ImagePrompts(Path(vision[0]), vision[1]) if vision is not None else None
        self.parsers = parsers  # (--reasoning-parser, --tool-call-parser)
        self.loras = {name: k + 1 for k, name in enumerate(loras)}  # --lora's names -> adapter index
        self.files = expand_paths(paths)
        for f in self.files:
            if Path(f).suffix.lower() not in (".jsonl", ".json", ".ndjson", ".parquet", ".pq"):
                raise InputError("unknown file type (expected .jsonl or .parquet)", path=f)
        self.id_column = id_column
        self.tokenizer = tokenizer
        self.chat = chat
        self.defaults = defaults
        self.max_prompt = max_prompt
        self.vocab = vocab
        self.priority_column = priority_column
        self.grammars = grammars
        self.max_n = max_n
        self.lacks = lacks
        self.skip_rows = 0
        self.rows_read = 0
        self.openai = False  # set once an OpenAI batch row is seen
        # Per file: (rows read, rows skipped as committed), as the embedding reader counts them.
        self.counts: dict[str, list[int]] = {f: [0, 0] for f in self.files}
        self.facts = facts or InputFacts.scan(self.files, id_column)
        self.has_ids = self.facts.has_ids
        self.openai_sources = self.facts.openai_sources  # answered line for line
        self._seen = IdSet()
        self._file_first_row = 0

    def remember_ids(self, ids: Iterator[Any]) -> None:
        self._seen.update(id_key(i) for i in ids if i is not None)

    def produce(self) -> Iterator[Request | Reject]:
        for path in self.files:
            self._file_first_row = self.rows_read
            for line, obj in self._objects(path):
                row = self.rows_read
                self.rows_read += 1
                self.counts[path][0] += 1
                if row < self.skip_rows:
                    self.counts[path][1] += 1
                    continue
                yield self._request(path, row, line, obj)

    def _id_taken(self, row: int, row_id: Any, line: int | None, path: str) -> None:
        """Called for each row that takes its id (a reader of part of the input remembers them)."""

    def _objects(self, path: str, seg: Segment | None = None) -> Iterator[tuple[int | None, Any]]:
        """(line number, the row's object or a Reject) of the file, or of the segment's rows (row_source.py)."""
        if Path(path).suffix.lower() in (".parquet", ".pq"):
            for batch in parquet_batches(path, _ROW_BLOCK, seg=seg):
                for obj in batch.to_pylist():
                    yield None, obj
            return
        for numbered in jsonl_chunks(path, CHUNK_BYTES, seg):  # NOTE: lines of any length, a BOM, CRLF
            for n, raw in numbered:
                yield n, _parse(raw)

    def _request(self, path: str, row: int, line: int | None, obj: Any) -> Request | Reject:
        def reject(reason: str, message: str, row_id: Any = None) -> Reject:
            shown = row_id if check_id(row_id) is None else repr(row_id)
            return Reject(row, path, line, shown, reason, message, row - self._file_first_row)

        if isinstance(obj, Reject):
            return reject(obj.reason, obj.message)
        openai = "custom_id" in obj and isinstance(obj.get("body"), dict)
        self.openai |= openai
        body = obj["body"] if openai else obj
        # NOTE: as for embedding: a file without the id column takes row numbers; in one with it, a
        # missing id stays null (it never collides with a row number).
        row_id = obj.get("custom_id") if openai else obj.get(self.id_column) if self.has_ids[path] else row
        if (bad_id := check_id(row_id)) is not None:
            return reject(*bad_id, row_id)
        if row_id is not None:  # NOTE: embedding's rule: the first row with an id takes it, whatever its fate
            key = id_key(row_id)
            if key in self._seen:
                return reject("duplicate_id", f"id {row_id!r} appeared before", row_id)
            self._seen.add(key)
            self._id_taken(row, row_id, line, path)
        echo = None
        if openai and obj.get("url") == RESPONSES_URL:
            try:
                echo, body = echoed(body), chat_body(body)
            except (ValueError, TypeError, AttributeError) as exc:
                return reject("invalid_request", str(exc), row_id)
        if (refused := unhonoured(body, tools_read=self.parsers[1] != "none")) is not None:
            return reject("invalid_request", refused, row_id)
        if body.get("use_beam_search") is True and body.get("beam_width") is None:
            # NOTE: vLLM's older spelling: use_beam_search with best_of beams (4 when it gives none)
            body = {**body, "beam_width": body.get("best_of") or 4}
        try:
            structured = spec_from_body(body)
        except ValueError as exc:
            return reject("invalid_grammar", str(exc), row_id)
        try:
            tokens, kind, media = self._tokens(body, path)
            params = row_params(self.defaults, body, self.vocab)
            if media is not None:
                params = replace(params, media=media)
            if (lora := self._lora(obj, body, openai)) != 0:
                params = replace(params, lora=lora)
            if body.get("bad_words") is not None:
                params = replace(params, bad_words=bad_word_ids(body["bad_words"], self.tokenizer))
            if structured is not None:
                params = replace(params, structured=structured)
            priority = obj.get(self.priority_column, body.get(self.priority_column))
            if priority is None:
                priority = 0
            elif isinstance(priority, bool) or not isinstance(priority, int):
                raise ValueError(f"{self.priority_column} must be an integer, got {priority!r}")
        except ChatError as exc:
            return reject("bad_chat", str(exc), row_id)
        except (ValueError, TypeError) as exc:
            return reject("invalid_request", str(exc), row_id)
        except Exception as exc:  # noqa: BLE001 - the tokenizer's own error types are not public
            return reject("tokenize_error", f"the tokenizer refused this prompt ({type(exc).__name__}: {exc})", row_id)
        if (problem := params.problem()) is not None:
            return reject("invalid_sampling", problem, row_id)
        if params.structured is not None and (problem := self._grammar_problem(params)) is not None:
            return reject("invalid_grammar", problem, row_id)
        if params.structured is not None and params.stop:
            # NOTE: a stop string would cut the answer short of its grammar: "stop", yet not valid
            return reject("invalid_request", "stop strings cannot end a structured answer: its grammar does", row_id)
        listed = self.defaults.n > 1
        if params.n > self.max_n:
            return reject("invalid_sampling", f"n {params.n} is more than --max-num-seqs ({self.max_n})", row_id)
        if params.n > 1 and not openai and not listed:
            return reject(
                "invalid_request", "a plain row's n > 1 needs the run's --n > 1 (its answers are lists)", row_id
            )
        if (params.logprobs is not None or params.prompt_logprobs is not None) and not openai:
            return reject("invalid_request", "logprobs are answered in OpenAI batch files (custom_id + body)", row_id)
        if self.lacks is not None and (problem := self.lacks(params)) is not None:
            return reject("invalid_request", problem, row_id)
        if len(tokens) > self.max_prompt:
            return reject("too_long", f"prompt of {len(tokens)} tokens; the context holds {self.max_prompt}", row_id)
        named = (obj["body"] if openai else body).get("model")
        model = named if openai and isinstance(named, str) else None
        if echo is not None:
            kind = "response"
        parse = None
        if kind == "chat" and self.parsers != ("none", "none"):
            parse = (*self.parsers, bool(body.get("tools")))
        return Request(row, row_id, tokens, params, kind, openai, path, priority, listed=listed, model=model, echo=echo,
                       parse=parse, line=line, row_in_file=row - self._file_first_row)  # fmt: skip

    def _lora(self, obj: dict[str, Any], body: dict[str, Any], openai: bool) -> int:
        """The adapter a request picks (0: the base): an OpenAI body by its `model` (a name not
        among --lora's is the base's, as an API names its model freely), a plain row by `lora`."""
        if openai:
            return self.loras.get(body.get("model"), 0) if isinstance(body.get("model"), str) else 0
        chosen = obj.get("lora")
        if chosen is None:
            return 0
        if chosen not in self.loras:
            given = ", ".join(self.loras) or "none (no --lora given)"
            raise ValueError(f"lora {chosen!r} is not one of the run's adapters: {given}")
        return self.loras[chosen]

    def _grammar_problem(self, params: SamplingParams) -> str | None:
        assert params.structured is not None
        if self.grammars is None:
            return "this run has no grammar engine"
        return self.grammars.problem(params.structured)

    def _tokens(self, body: dict[str, Any], path: str) -> tuple[list[int], str, Any]:
        """(prompt token ids, the answer's kind, the chat's images as models.vlm.Media or None)."""
        if body.get("messages") is not None:
            if self.chat is None:
                raise ChatError("the checkpoint has no chat_template")
            messages, images = content_parts(body["messages"], path, self.images is not None, self.image_files)
            text = self.chat.render(messages, tools=body.get("tools"), extra=body.get("chat_template_kwargs"))
            if self.images is not None:
                ids, media = self.images.encode(text, images)
                return ids, "chat", media
            return self.tokenizer.encode(text, add_special_tokens=False).ids, "chat", None
        ids = body.get("prompt_token_ids")
        if ids is not None:
            if not isinstance(ids, list) or not all(isinstance(i, int) and 0 <= i < self.vocab for i in ids):
                raise ValueError(f"prompt_token_ids must be integers in [0, {self.vocab})")
            if not ids:
                raise ValueError("prompt_token_ids is empty")
            return list(ids), "text", None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"a row needs one of {', '.join(PROMPT_COLUMNS)} (a non-empty prompt)")
        if not is_unicode(prompt):
            raise ValueError("the prompt holds a lone surrogate (e.g. an escaped \\ud800), not valid Unicode")
        return self.tokenizer.encode(prompt).ids, "text", None


def _has_id_column(path: str, id_column: str) -> bool:
    """Whether the file carries ids (OpenAI batch files always do, in custom_id)."""
    if Path(path).suffix.lower() in (".parquet", ".pq"):
        return id_column in read_schema(path).names
    return any(id_column in obj or "custom_id" in obj for obj in json_objects(path))


def _is_openai_batch(path: str) -> bool:
    """Whether the file is an OpenAI batch file (its first JSON object has custom_id and body)."""
    if Path(path).suffix.lower() in (".parquet", ".pq"):
        return False
    first = next(iter(json_objects(path, limit=16)), None)
    return first is not None and "custom_id" in first and isinstance(first.get("body"), dict)


def _parse(raw: bytes) -> Any:
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return Reject(0, "", None, None, "invalid_utf8", f"not UTF-8 ({exc.reason} at byte {exc.start})")
    except ValueError as exc:
        return Reject(0, "", None, None, "malformed_json", f"not valid JSON ({exc})")
    if not isinstance(obj, dict):
        return Reject(0, "", None, None, "malformed_json", f"a JSON {type(obj).__name__}, not an object")
    return obj
