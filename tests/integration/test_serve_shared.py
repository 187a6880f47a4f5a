"""`hpcinfer serve` as a team shares it: one owner per batch state change (a cancel racing the runner
finalizes once), the defects a review found (each test fails on the server before this one), OpenAI's
fields and limits, streamed uploads with a quota, a model kept loaded between batches.

The server runs in this process (Starlette's TestClient under the official `openai` client, the real
batch runner and job on a tiny decoder), so a test can pause the runner at a point of a batch's life
or make the disk fail; test_serve.py drives a server in its own process.
"""

from __future__ import annotations

import errno
import json
import os
import random
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types import Batch, FileObject
from starlette.testclient import TestClient

from hpcinfer.api import run as run_job
from hpcinfer.cli.commands import batch_run_config
from hpcinfer.errors import HpcinferError
from hpcinfer.models.shelf import ModelShelf
from hpcinfer.registry import pick_task, task_named
from hpcinfer.serve import runner as runner_module
from hpcinfer.serve.app import ServeSettings, build_app
from hpcinfer.serve.command import sweep, taken_hosts
from hpcinfer.serve.runner import BatchRunner
from hpcinfer.serve.state import FINAL, BatchRow, FileRow, State
from tests.fixtures.tiny_decoder import build_tiny_decoder

KEY = "sk-shared"
ENDED = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_decoder(tmp_path_factory.mktemp("decoder") / "m", "LlamaForCausalLM", seed=5)


class Local:
    """The server's app, state and runner in this process; `client()` is the `openai` client on it."""

    def __init__(
        self,
        model: Path,
        data_dir: Path,
        *,
        start: bool = True,
        run: Callable[..., Any] = run_job,
        max_key_bytes: int = 0,
        host: str | None = None,
        recipe: Path | None = None,
        keys: tuple[str, ...] = (KEY,),
    ) -> None:
        self.data_dir = data_dir
        data_dir.mkdir(parents=True, exist_ok=True)
        base = batch_run_config(str(model), str(recipe) if recipe else None)
        self.state = State(data_dir)
        sweep(data_dir, self.state)
        endpoints = task_named(pick_task(base)).endpoints
        hosts = taken_hosts(host, ()) if host else None
        settings = ServeSettings(data_dir, str(model), endpoints, keys, 200_000_000, 50_000, max_key_bytes, hosts)
        self.runner = BatchRunner(self.state, data_dir, base, 50_000, ModelShelf(1), run=run)
        app = build_app(settings, self.state, self.runner)
        self.http = TestClient(app, base_url="http://testserver", raise_server_exceptions=False)
        if start:
            self.runner.start()

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=self.http, max_retries=0)

    def close(self) -> None:
        self.runner.close()
        self.http.close()
        self.state.close()

    def files_on_disk(self) -> set[str]:
        return {p.name for p in (self.data_dir / "files").iterdir()}


@pytest.fixture()
def local(decoder, tmp_path):
    server = Local(decoder, tmp_path / "state")
    yield server
    server.close()


def chat_line(i: int, **body: Any) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"say {i}"}], "max_tokens": 3, **body}
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def upload(client: openai.OpenAI, lines: list, name: str = "in.jsonl") -> FileObject:
    data = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()
    return client.files.create(file=(name, data), purpose="batch")


def create(client: openai.OpenAI, file_id: str, **extra: Any) -> Batch:
    return client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                 **extra)  # fmt: skip


def wait_for(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...] = ENDED, timeout: float = 120) -> Batch:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.02)
    raise AssertionError(f"batch {batch_id} stayed {batch.status}")


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]


def check_ended_once(server: Local, batch: Batch, custom_ids: list[str]) -> None:
    """Each request once across the output and error files, their sizes as listed, nothing else on disk."""
    client = server.client()
    answered, failed = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
    assert sorted(a["custom_id"] for a in answered + failed) == sorted(custom_ids)
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (len(custom_ids), len(answered), len(failed))
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id is not None:
            listed = client.files.retrieve(file_id)
            assert listed.bytes == (server.data_dir / "files" / f"{file_id}.jsonl").stat().st_size
    known = {f"{f.id}.jsonl" for f in client.files.list().data}
    assert server.files_on_disk() == known  # no orphan, no half-written .tmp
    assert not (server.data_dir / "batches" / batch.id).exists()  # the job's copy goes with the batch


class Pause:
    """Holds the runner inside `name` (a function of runner.py) until released."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        self.reached, self.release = threading.Event(), threading.Event()
        real = getattr(runner_module, name)

        def paused(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread().name == "hpcinfer-batches":
                self.reached.set()
                assert self.release.wait(60)
            return real(*args, **kwargs)

        monkeypatch.setattr(runner_module, name, paused)


def test_a_cancel_while_the_runner_finalizes_leaves_one_batch_one_set_of_files(local, monkeypatch):
    pause = Pause(monkeypatch, "answer_lines")
    client = local.client()
    lines = [chat_line(i) for i in range(6)]
    batch = create(client, upload(client, lines).id)
    assert pause.reached.wait(60)
    assert client.batches.retrieve(batch.id).status == "finalizing"
    answer: list[Batch] = []
    cancel = threading.Thread(target=lambda: answer.append(client.batches.cancel(batch.id)))
    cancel.start()
    cancel.join(10)
    pause.release.set()
    assert answer and answer[0].status == "finalizing"  # every answer is there: it completes
    done = wait_for(client, batch.id)
    assert done.status == "completed" and done.cancelling_at is None
    check_ended_once(local, done, [x["custom_id"] for x in lines])


def test_a_cancel_while_the_runner_validates_cancels_once(local, monkeypatch):
    pause = Pause(monkeypatch, "check_batch_file")
    client = local.client()
    lines = [chat_line(i) for i in range(5)]
    batch = create(client, upload(client, lines).id)
    assert pause.reached.wait(60)
    assert client.batches.cancel(batch.id).status == "cancelling"  # the runner owns it: it finalizes
    pause.release.set()
    done = wait_for(client, batch.id)
    assert done.status == "cancelled"
    failed = lines_of(client, done.error_file_id)
    assert {f["error"]["code"] for f in failed} == {"batch_cancelled"}
    check_ended_once(local, done, [x["custom_id"] for x in lines])


def test_thirty_cancels_at_random_points_of_a_batchs_life(local):
    client = local.client()
    lines = [chat_line(i, max_tokens=4) for i in range(40)]
    ids = [x["custom_id"] for x in lines]
    file = upload(client, lines)
    assert wait_for(client, create(client, file.id).id).status == "completed"  # NOTE: the model loaded
    start = time.monotonic()
    assert wait_for(client, create(client, file.id).id).status == "completed"
    span = time.monotonic() - start  # NOTE: how long one batch lives
    rng, seen = random.Random(7), {}
    for _ in range(30):
        batch = create(client, file.id)
        time.sleep(rng.uniform(0, span))
        status_then = client.batches.retrieve(batch.id).status
        cancelled = client.batches.cancel(batch.id)  # NOTE: any failure raises: every answer is a 200
        seen[status_then] = seen.get(status_then, 0) + 1
        done = wait_for(client, batch.id)
        assert done.status in ("cancelled", "completed"), done
        assert cancelled.status in ("cancelling", "cancelled", "finalizing", "completed")
        check_ended_once(local, done, ids)
    assert seen.get("in_progress", 0) >= 3, seen  # the cancels landed across the batches' lives


def test_a_batch_of_non_requests_cancelled_before_it_ran(decoder, tmp_path):
    server = Local(decoder, tmp_path / "state", start=False)  # NOTE: no runner: the batch waits in validating
    try:
        client = server.client()
        lines = ["[1]", '"text"', "not json", chat_line(0), chat_line(1), chat_line(1)]
        batch = create(client, upload(client, lines).id)
        done = client.batches.cancel(batch.id)
        assert done.status == "cancelled"
        assert (done.request_counts.total, done.request_counts.failed) == (2, 2)  # the requests that never ran
        assert sorted(f["custom_id"] for f in lines_of(client, done.error_file_id)) == ["req-0", "req-1"]
    finally:
        server.close()


def test_disk_full_while_finalizing_keeps_the_answers(local, monkeypatch):
    monkeypatch.setattr(runner_module, "FINALIZE_RETRY_S", 0.1)
    real_sync, failures = runner_module.fsync_dir, [2]

    def full(folder: Path) -> None:  # NOTE: the renames of the produced files: the finalize's last disk write
        if failures[0] > 0:
            failures[0] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        real_sync(folder)

    monkeypatch.setattr(runner_module, "fsync_dir", full)
    client = local.client()
    lines = [chat_line(i) for i in range(4)]
    done = wait_for(client, create(client, upload(client, lines).id).id)
    assert failures == [0] and done.status == "completed"  # finalized again once the disk took it
    check_ended_once(local, done, [x["custom_id"] for x in lines])


def test_a_job_killed_after_its_output_arrived_is_not_run_again(decoder, tmp_path):
    data = tmp_path / "state"

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the job ran again")

    server = Local(decoder, data, start=False, run=never)
    try:
        client = server.client()
        lines = [chat_line(i) for i in range(3)]
        batch = create(client, upload(client, lines).id)
        server.state.move(batch.id, ("validating",), "in_progress", total=3)
        job = data / "batches" / batch.id
        (job / "output.jsonl.parts").mkdir(parents=True)  # NOTE: killed between the output's rename and the cleanup
        (job / "output.jsonl.parts" / "manifest.json").write_text(json.dumps({"windows": [{"window": 0, "rows": 3}]}))
        answers = [{"id": f"batch_req_{i}", "custom_id": x["custom_id"], "error": None,
                    "response": {"status_code": 200, "body": {"usage": {"prompt_tokens": 5, "completion_tokens": 2}}}}
                   for i, x in enumerate(lines)]  # fmt: skip
        (job / "output.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answers))
        server.runner.start()
        done = wait_for(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 3
        assert (done.usage.input_tokens, done.usage.output_tokens, done.usage.total_tokens) == (15, 6, 21)
    finally:
        server.close()


def test_a_failed_run_names_no_server_path(decoder, tmp_path):
    def broken(*args: Any, **kwargs: Any) -> None:
        raise HpcinferError("cannot read /srv/team/models/weights.bin: the file is damaged")

    server = Local(decoder, tmp_path / "state", run=broken)
    try:
        client = server.client()
        done = wait_for(client, create(client, upload(client, [chat_line(0)]).id).id)
        message = done.errors.data[0].message
        assert done.status == "failed" and "weights.bin" in message and "/srv" not in message
    finally:
        server.close()


def test_validation_reads_utf8_only_and_quotes_values_short(local):
    client = local.client()
    text = "".join(json.dumps(chat_line(i)) + "\n" for i in range(2))
    utf16 = client.files.create(file=("u16.jsonl", text.encode("utf-16")), purpose="batch")
    done = wait_for(client, create(client, utf16.id).id)
    assert done.status == "failed" and "UTF-8" in done.errors.data[0].message
    huge = {**chat_line(0), "url": "/v1/chat/completions" + "x" * 200_000}
    done = wait_for(client, create(client, upload(client, [huge]).id).id)
    assert done.status == "failed" and done.errors.data[0].code == "invalid_url"
    assert len(done.errors.data[0].message) < 200
    assert len(local.http.get(f"/v1/batches/{done.id}", headers={"Authorization": f"Bearer {KEY}"}).content) < 4000


def test_openai_fields_limits_and_ids(local):
    client = local.client()
    lines = [chat_line(i) for i in range(3)]
    file = upload(client, lines)
    with pytest.raises(openai.BadRequestError) as raised:
        client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="48h")
    assert raised.value.body["param"] == "completion_window"
    for body in ({"endpoint": "/v1/chat/completions", "completion_window": "24h"},
                 {"input_file_id": file.id, "endpoint": "/v1/chat/completions"}):  # fmt: skip
        answer = local.http.post("/v1/batches", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "missing_required_parameter"
    with pytest.raises(openai.AuthenticationError) as raised:
        local.client("wrong").files.list()
    assert raised.value.body["type"] == "invalid_request_error" and raised.value.body["code"] == "invalid_api_key"
    for path in ("/v1/files?limit=²", "/v1/batches?limit=²", "/v1/files?order=up"):
        answer = local.http.get(path, headers={"Authorization": f"Bearer {KEY}"})
        assert answer.status_code == 400, path

    first, second = wait_for(client, create(client, file.id).id), wait_for(client, create(client, file.id).id)
    assert first.status == second.status == "completed"
    ids = [a["id"] for b in (first, second) for a in lines_of(client, b.output_file_id)]
    assert len(set(ids)) == 6 and all(i.startswith("batch_req_") for i in ids)  # unique across batches
    answers = lines_of(client, first.output_file_id)
    usage = [a["response"]["body"]["usage"] for a in answers]
    assert first.usage.input_tokens == sum(u["prompt_tokens"] for u in usage) > 0
    assert first.usage.output_tokens == sum(u["completion_tokens"] for u in usage) > 0
    assert first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens
    # NOTE: the model stays loaded: the second batch spent no time loading it
    assert float(first.metadata["hpcinfer_model_load_s"]) > 0 and second.metadata["hpcinfer_model_load_s"] == "0.000"
    assert float(second.metadata["hpcinfer_waited_s"]) >= 0

    running = create(client, file.id)
    with pytest.raises(openai.BadRequestError):  # NOTE: 400, not 409, which the client would retry
        client.files.delete(file.id)
    wait_for(client, running.id)
    everything = client.files.list()
    newest = client.files.list(limit=2)
    assert [f.id for f in newest.data] == [f.id for f in everything.data[:2]] and newest.has_more
    rest = client.files.list(limit=100, after=newest.data[-1].id)
    assert [f.id for f in newest.data + rest.data] == [f.id for f in everything.data] and not rest.has_more
    oldest = client.files.list(order="asc")
    assert [f.id for f in oldest.data] == [f.id for f in reversed(everything.data)]
    assert oldest.data[0].id == file.id


def test_uploads_stream_to_their_file_and_keys_have_a_quota(decoder, tmp_path, monkeypatch):
    import starlette.formparsers

    def spooled(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the upload was spooled to a temporary file first")

    monkeypatch.setattr(starlette.formparsers, "SpooledTemporaryFile", spooled)
    files = tmp_path / "state" / "files"
    files.mkdir(parents=True)
    for stale in ("file-0123456789abcdef01234567.upload", "file-0123456789abcdef01234568.tmp",
                  "file-0123456789abcdef01234569.jsonl"):  # fmt: skip
        (files / stale).write_text("left by a killed server")
    server = Local(decoder, tmp_path / "state", max_key_bytes=3000)
    try:
        assert server.files_on_disk() == set()  # swept at start: nothing names them
        client = server.client()
        big = [chat_line(i, max_tokens=3) for i in range(14)]  # ~1.6 kB
        kept = upload(client, big)
        assert kept.bytes == (files / f"{kept.id}.jsonl").stat().st_size
        assert (files / f"{kept.id}.jsonl").read_bytes() == "".join(json.dumps(x) + "\n" for x in big).encode()
        with pytest.raises(openai.APIStatusError) as raised:
            upload(client, big)
        assert raised.value.status_code == 413 and raised.value.body["code"] == "quota_exceeded"
        assert server.files_on_disk() == {f"{kept.id}.jsonl"}

        real_fsync = os.fsync
        monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
        with pytest.raises(openai.InternalServerError):
            upload(client, [chat_line(0)])
        monkeypatch.setattr(os, "fsync", real_fsync)
        assert server.files_on_disk() == {f"{kept.id}.jsonl"}  # nothing of the failed upload is left
        wrong = server.http.post("/v1/files", content=b"x" * 10, headers={"Authorization": f"Bearer {KEY}",
                                                                           "Content-Type": "text/plain"})  # fmt: skip
        assert wrong.status_code == 400
    finally:
        server.close()


def test_renames_are_made_durable_with_their_folder(local, monkeypatch):
    synced_dirs: list[str] = []
    real_fsync = os.fsync

    def recording(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            synced_dirs.append(threading.current_thread().name)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    client = local.client()
    file = upload(client, [chat_line(0)])
    assert synced_dirs  # the upload's rename
    synced_dirs.clear()
    assert wait_for(client, create(client, file.id).id).status == "completed"
    assert "hpcinfer-batches" in synced_dirs  # the produced files' renames


def test_a_foreign_host_header_and_a_form_body_are_refused(decoder, tmp_path):
    server = Local(decoder, tmp_path / "state", host="127.0.0.1")
    try:
        auth = {"Authorization": f"Bearer {KEY}"}
        rebound = server.http.get("/v1/files", headers=auth)  # NOTE: Host: testserver, as a rebinding page sends
        assert rebound.status_code == 400 and rebound.json()["error"]["code"] == "invalid_host"
        assert server.http.get("/v1/nothing", headers=auth).status_code == 400
        local_host = {**auth, "Host": "127.0.0.1:8000"}
        assert server.http.get("/v1/files", headers=local_host).status_code == 200
        assert server.http.get("/v1/files", headers={**auth, "Host": "localhost"}).status_code == 200
        body = json.dumps({"input_file_id": "file-" + "0" * 24, "endpoint": "/v1/chat/completions",
                           "completion_window": "24h"})  # fmt: skip
        plain = server.http.post("/v1/batches", content=body, headers={**local_host, "Content-Type": "text/plain"})
        assert plain.status_code == 415  # what a cross-site page can send without asking
    finally:
        server.close()


def test_an_ended_batch_is_final_in_the_state(tmp_path):
    state = State(tmp_path)
    state.add_file(FileRow("file-x", "", "x.jsonl", "batch", 1, 0, ""))
    assert state.add_batch(BatchRow("batch_y", "", 0, "file-gone", "/v1/embeddings", "24h", None, 0, "validating",
                                    0, 0)) is None  # fmt: skip  # NOTE: its file deleted meanwhile: no batch
    state.add_batch(BatchRow("batch_x", "", 0, "file-x", "/v1/embeddings", "24h", None, 0, "validating", 0, 0))
    assert state.move("batch_x", ("validating",), "cancelled") is not None
    for status in FINAL:
        assert state.move("batch_x", ("validating", "in_progress", "finalizing", "cancelling"), status) is None
    state.set("batch_x", completed=5)
    assert state.batch("batch_x").completed == 0


def test_a_responses_batch(local):
    from openai.types.responses import Response

    client = local.client()
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
              "body": {"model": "tiny", "input": f"say {i}", "max_output_tokens": 3}} for i in range(4)]  # fmt: skip
    file = upload(client, lines)
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/responses", completion_window="24h")
    done = wait_for(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 4
    responses = [Response.model_validate(a["response"]["body"]) for a in lines_of(client, done.output_file_id)]
    assert done.usage.input_tokens == sum(r.usage.input_tokens for r in responses) > 0
    assert done.usage.output_tokens == sum(r.usage.output_tokens for r in responses) > 0


def test_a_kept_model_and_kv_pool_answer_as_a_fresh_one(local):
    """The second time a batch runs, the model and its KV pool come from the first batches (the pool
    holding their K/V until cleared): its answers are the same bytes."""
    client = local.client()
    small = upload(client, [chat_line(i, max_tokens=6) for i in range(5)])
    large = upload(client, [chat_line(100 + i, max_tokens=24, temperature=0.8, seed=i) for i in range(30)])
    answers = []
    for file in (small, large, small):
        done = wait_for(client, create(client, file.id).id)
        assert done.status == "completed"
        answers.append(
            [(a["custom_id"], a["response"]["body"]["choices"]) for a in lines_of(client, done.output_file_id)]
        )
    assert answers[0] == answers[2]
    kept = local.runner.shelf.kept()
    assert [k[0] for k in kept] == ["decoder", "tokenizer", "kv"]  # the pool the third batch reused


def test_a_finalize_that_fails_but_for_a_full_disk_fails_the_batch(local, monkeypatch):
    def denied(folder: Path) -> None:
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(runner_module, "fsync_dir", denied)
    client = local.client()
    done = wait_for(client, create(client, upload(client, [chat_line(0)]).id).id)
    assert done.status == "failed" and done.errors.data[0].code == "server_error"  # not finalizing forever


def test_uploads_in_flight_count_against_the_quota():
    from hpcinfer.serve.objects import ApiError
    from hpcinfer.serve.upload import InFlight

    book = InFlight()
    book.take("k", 600, stored=0, quota=1000)
    with pytest.raises(ApiError):
        book.take("k", 600, stored=0, quota=1000)  # NOTE: the first is still streaming: both cannot pass
    book.take("other", 600, stored=0, quota=1000)  # another key's own
    book.give_back("k", 600)
    book.take("k", 600, stored=0, quota=1000)


def test_an_open_server_still_refuses_a_cross_site_form_and_a_stale_cursor_pages_nothing(decoder, tmp_path):
    server = Local(decoder, tmp_path / "state", keys=())  # NOTE: --no-auth
    try:
        form = server.http.post("/v1/files", files={"file": ("a.jsonl", b"{}\n")}, data={"purpose": "batch"})
        assert form.status_code == 401  # what a web page's form sends: no Authorization header
        client = server.client("anything")  # NOTE: every API client sends one
        file = upload(client, [chat_line(0)])
        assert client.files.list().data[0].id == file.id
        assert client.files.list(after="file-" + "0" * 24).data == []  # NOTE: not the first page again
        assert client.batches.list(after="batch_" + "0" * 24).data == []
    finally:
        server.close()


def test_a_tenants_chat_brings_its_images_inline_never_a_server_path(tmp_path):
    """A vision-language model served: a data URL image is answered; an image named by a path on the
    server (a real image there) is an error line, never read: a tenant names no server file."""
    import base64
    import io

    from PIL import Image

    from tests.fixtures.tiny_vlm import build_tiny_vlm

    vlm = build_tiny_vlm(tmp_path / "vlm", seed=2)
    buffer = io.BytesIO()
    Image.new("RGB", (30, 40), (200, 30, 30)).save(buffer, "PNG")
    (tmp_path / "server-side.png").write_bytes(buffer.getvalue())
    inline = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()

    def image_chat(i: int, url: str) -> dict:
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is it"}]
        return chat_line(i, messages=[{"role": "user", "content": content}])

    server = Local(vlm, tmp_path / "state")
    try:
        client = server.client()
        lines = [image_chat(0, inline), image_chat(1, str(tmp_path / "server-side.png")),
                 image_chat(2, (tmp_path / "server-side.png").as_uri())]  # fmt: skip
        batch = wait_for(client, create(client, upload(client, lines).id).id)
        assert batch.status == "completed"
        answered = {x["custom_id"] for x in lines_of(client, batch.output_file_id) if x["error"] is None}
        errors = {x["custom_id"]: json.dumps(x) for x in lines_of(client, batch.error_file_id)}
        assert answered == {"req-0"} and set(errors) == {"req-1", "req-2"}
        assert all("inline" in e for e in errors.values())
    finally:
        server.close()
