"""`hpcinfer serve` driven by the official `openai` client, as its users' code drives OpenAI's Batch API:
upload, create, poll, download; answers checked with the package's own types; a server killed mid-batch
resumes it exactly once; cancel; bad input answered in OpenAI's error shape while the server keeps serving."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from openai.types import Batch, Completion, CreateEmbeddingResponse, FileObject
from openai.types.chat import ChatCompletion

from hpcinfer.serve.state import BatchRow, FileRow, State
from tests.fixtures.tiny_decoder import build_tiny_decoder

KEY = "sk-test-serve"
CRASH_SERVE = Path(__file__).with_name("crash_serve.py")


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_decoder(tmp_path_factory.mktemp("decoder") / "m", "LlamaForCausalLM", seed=3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`hpcinfer serve` in a process of its own, on a free loopback port."""

    def __init__(self, model: Path, data_dir: Path, *extra: str, keys: str | None = KEY, crash: str = "") -> None:
        """`keys`: HPCINFER_API_KEY (None: unset, the server makes its own); `crash`: a crash_serve.py point."""
        self.model, self.data_dir, self.extra, self.keys, self.crash = model, data_dir, extra, keys, crash
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        args = ["--model", str(self.model), "--port", str(self.port), "--data-dir", str(self.data_dir), *self.extra]
        env = {k: v for k, v in os.environ.items() if k != "HPCINFER_API_KEY"} | {"HF_HUB_OFFLINE": "1"}
        if self.keys is not None:
            env["HPCINFER_API_KEY"] = self.keys
        program = [str(CRASH_SERVE), self.crash] if self.crash else ["-m", "hpcinfer"]
        self.proc = subprocess.Popen([sys.executable, *program, "serve", *args], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stdout.read().decode() if self.proc.stdout else ""
            try:
                request = urllib.request.Request(f"{self.url}/files", headers={"Authorization": f"Bearer {self.key}"})
                urllib.request.urlopen(request, timeout=2).read()
                return self
            except OSError:
                time.sleep(0.2)
        raise AssertionError("the server did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def key(self) -> str:
        """The first key given, else the one the server made (its data folder's api-key file, once written)."""
        if self.keys is not None:
            return self.keys.split(",")[0]
        try:
            return (self.data_dir / "api-key").read_text(encoding="utf-8").strip()
        except OSError:
            return ""

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=key or self.key, max_retries=0, timeout=30)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture()
def server(decoder, tmp_path):
    s = Server(decoder, tmp_path / "state").start()
    yield s
    s.stop()


def chat_line(i: int, **body) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"say {i}"}], "max_tokens": 6, **body}
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


def wait_for(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...], timeout: float = 300) -> Batch:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} stayed {batch.status}")


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]


def test_a_batch_through_the_openai_client(server, tmp_path):
    client = server.client()
    good = [chat_line(i) for i in range(20)]
    bad = [chat_line(20, max_tokens=-1), chat_line(21, messages="not a chat"), chat_line(22, temperature="hot")]
    src = write_lines(tmp_path / "batch.jsonl", good[:7] + bad[:1] + good[7:14] + bad[1:] + good[14:])
    uploaded = client.files.create(file=src.open("rb"), purpose="batch")
    assert isinstance(uploaded, FileObject) and uploaded.bytes == src.stat().st_size and uploaded.purpose == "batch"
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "nightly"})  # fmt: skip
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = wait_for(client, batch.id, ("completed", "failed"))
    assert done.status == "completed", done.errors
    assert done.request_counts.total == 23 and done.request_counts.completed == 20 and done.request_counts.failed == 3
    assert done.completed_at and done.in_progress_at and done.finalizing_at
    answers, errors = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert sorted(a["custom_id"] for a in answers) == sorted(x["custom_id"] for x in good)
    for answer in answers:
        assert answer["response"]["status_code"] == 200 and answer["error"] is None
        ChatCompletion.model_validate(answer["response"]["body"])
    assert sorted(e["custom_id"] for e in errors) == ["req-20", "req-21", "req-22"]
    assert all(e["error"]["code"] and e["error"]["message"] for e in errors)
    listed = client.batches.list(limit=5)
    assert [b.id for b in listed.data] == [batch.id]
    assert {f.id for f in client.files.list().data} >= {uploaded.id, done.output_file_id, done.error_file_id}


def test_completions_and_a_file_that_is_no_batch_file(server, tmp_path):
    client = server.client()
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": f"count {i}", "max_tokens": 4}} for i in range(5)]  # fmt: skip
    uploaded = client.files.create(file=write_lines(tmp_path / "c.jsonl", lines).open("rb"), purpose="batch")
    done = wait_for(client, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                                  completion_window="24h").id, ("completed", "failed"))  # fmt: skip
    assert done.status == "completed" and done.request_counts.completed == 5
    for answer in lines_of(client, done.output_file_id):
        Completion.model_validate(answer["response"]["body"])
    no_id = {"method": "POST", "url": "/v1/completions", "body": {}}
    broken = ["{not json", json.dumps(no_id), json.dumps(lines[0]), json.dumps(lines[0]),
              json.dumps({**lines[1], "url": "/v1/embeddings"})]  # fmt: skip
    uploaded = client.files.create(file=write_lines(tmp_path / "b.jsonl", broken).open("rb"), purpose="batch")
    failed = wait_for(client, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                                    completion_window="24h").id, ("completed", "failed"))  # fmt: skip
    assert failed.status == "failed" and failed.failed_at
    found = {(e.code, e.line) for e in failed.errors.data}
    assert found == {("invalid_json_line", 1), ("missing_required_parameter", 2), ("duplicate_custom_id", 4),
                     ("invalid_url", 5)}  # fmt: skip


def test_bad_requests_are_openai_errors_and_the_server_keeps_serving(decoder, tmp_path):
    server = Server(decoder, tmp_path / "state", "--max-file-bytes", "2000", keys=f"{KEY},sk-other").start()
    try:
        client, other = server.client(), server.client("sk-other")
        src = write_lines(tmp_path / "ok.jsonl", [chat_line(0)])
        cases = [
            (lambda: server.client("wrong-key").files.list(), openai.AuthenticationError, "invalid_api_key"),
            (lambda: client.files.create(file=(tmp_path / "big.jsonl").open("rb"), purpose="batch"),
             openai.APIStatusError, None),
            (lambda: client.batches.create(input_file_id="../../etc/passwd", endpoint="/v1/chat/completions",
                                           completion_window="24h"), openai.NotFoundError, None),
            (lambda: client.files.retrieve("file-" + "0" * 24 + "\n"), openai.NotFoundError, None),
            (lambda: client.files.retrieve("file-" + "0" * 24), openai.NotFoundError, None),
            (lambda: client.batches.create(input_file_id="file-" + "1" * 24, endpoint="/v1/chat/completions",
                                           completion_window="24h"), openai.NotFoundError, None),
            (lambda: client.batches.create(input_file_id=client.files.create(file=src.open("rb"), purpose="batch").id,
                                           endpoint="/v1/embeddings", completion_window="24h"),
             openai.BadRequestError, "invalid_value"),
            (lambda: client.files.create(file=src.open("rb"), purpose="fine-tune"), openai.BadRequestError,
             "invalid_value"),
        ]  # fmt: skip
        (tmp_path / "big.jsonl").write_text(json.dumps(chat_line(1)) * 100, encoding="utf-8")
        for call, kind, code in cases:
            with pytest.raises(kind) as raised:
                call()
            body = raised.value.body
            assert isinstance(body, dict) and body.get("message"), body  # OpenAI's error shape
            if code is not None:
                assert body.get("code") == code, body
        mine = client.files.create(file=src.open("rb"), purpose="batch")  # still serving
        batch = client.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions", completion_window="24h")
        with pytest.raises(openai.NotFoundError):  # another key's file and batch do not exist for this one
            other.files.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            other.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            other.files.content(mine.id)
        assert other.files.list().data == [] and other.batches.list().data == []
        assert mine.id in {f.id for f in client.files.list().data}
    finally:
        server.stop()


def test_no_auth_is_for_loopback_only(decoder, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HPCINFER_API_KEY"}
    args = ["serve", "--model", str(decoder), "--host", "0.0.0.0", "--no-auth", "--data-dir", str(tmp_path / "s")]
    done = subprocess.run([sys.executable, "-m", "hpcinfer", *args], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 2 and "--no-auth" in done.stderr and "Traceback" not in done.stderr


def committed_windows(parts: Path, timeout: float = 180) -> int:
    """Rows in the committed windows of a batch's job, once there are some (the manifest is its commit point)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            windows = json.loads((parts / "manifest.json").read_text(encoding="utf-8")).get("windows", [])
        except (OSError, ValueError):
            windows = []
        if windows:
            return sum(w["rows"] for w in windows)
        time.sleep(0.02)
    raise AssertionError("no window was committed")


def small_windows(tmp_path: Path) -> Path:
    """A recipe of `run` options for every batch: windows of 16 requests, so parts commit early."""
    recipe = tmp_path / "serve.toml"
    recipe.write_text("window-rows = 16\n", encoding="utf-8")
    return recipe


def test_cancel_keeps_what_finished(decoder, tmp_path):
    server = Server(decoder, tmp_path / "state", "--config", str(small_windows(tmp_path))).start()
    try:
        cancel_mid_run(server, tmp_path)
    finally:
        server.stop()


def cancel_mid_run(server: Server, tmp_path: Path) -> None:
    client = server.client()
    lines = [chat_line(i, max_tokens=32) for i in range(2000)]  # NOTE: far longer than the cancel takes to arrive
    uploaded = client.files.create(file=write_lines(tmp_path / "many.jsonl", lines).open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    committed_windows(server.data_dir / "batches" / batch.id / "output.jsonl.parts")
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled", "completed")
    done = wait_for(client, batch.id, ("cancelled", "completed"))
    assert done.status == "cancelled" and done.cancelled_at and done.cancelling_at
    answered, failed = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert 0 < len(answered) < len(lines)
    assert {f["error"]["code"] for f in failed} == {"batch_cancelled"}  # what never ran, as OpenAI lists it
    assert sorted(x["custom_id"] for x in answered + failed) == sorted(x["custom_id"] for x in lines)  # each once
    assert (done.request_counts.completed, done.request_counts.failed) == (len(answered), len(failed))


def test_kill_9_mid_batch_and_a_restart_finish_it_exactly_once(decoder, tmp_path):
    lines = [chat_line(i, max_tokens=24) for i in range(300)]
    src = write_lines(tmp_path / "300.jsonl", lines)
    reference = tmp_path / "reference.jsonl"
    run = [sys.executable, "-m", "hpcinfer", "run", str(src), "-o", str(reference), "--model", str(decoder), "-q"]
    assert subprocess.run(run, capture_output=True, timeout=600).returncode == 0
    state, recipe = tmp_path / "state", small_windows(tmp_path)
    server = Server(decoder, state, "--config", str(recipe)).start()
    client = server.client()
    batch = client.batches.create(input_file_id=client.files.create(file=src.open("rb"), purpose="batch").id,
                                  endpoint="/v1/chat/completions", completion_window="24h")  # fmt: skip
    parts = state / "batches" / batch.id / "output.jsonl.parts"
    committed_windows(parts)
    server.kill()
    manifest = json.loads((parts / "manifest.json").read_text(encoding="utf-8"))
    committed = sum(w["rows"] for w in manifest["windows"])
    assert 0 < committed < 300  # killed mid-batch: the restart has work left and work to keep
    # NOTE: a mark in a committed answer: a restart that resumes keeps it, one that redid the batch would not
    first = parts / manifest["windows"][0]["part"]
    kept = [json.loads(x) for x in first.read_text(encoding="utf-8").splitlines()]
    kept[0]["response"]["body"]["choices"][0]["message"]["content"] = "committed before the kill"
    first.write_text("".join(json.dumps(x) + "\n" for x in kept), encoding="utf-8")
    restarted = Server(decoder, state, "--config", str(recipe)).start()
    try:
        done = wait_for(restarted.client(), batch.id, ("completed", "failed"))
        assert done.status == "completed" and done.request_counts.completed == 300
        answers = lines_of(restarted.client(), done.output_file_id)
    finally:
        restarted.stop()
    assert sorted(a["custom_id"] for a in answers) == sorted(x["custom_id"] for x in lines)  # each exactly once
    marked = [a for a in answers if a["custom_id"] == kept[0]["custom_id"]]
    assert marked[0]["response"]["body"]["choices"][0]["message"]["content"] == "committed before the kill"
    answers = [a for a in answers if a is not marked[0]]

    def comparable(answer: dict) -> tuple:
        body = dict(answer["response"]["body"])
        body.pop("created")  # NOTE: stamped from the input file, a copy of which the server keeps
        return answer["custom_id"], json.dumps(body, sort_keys=True)

    expected = [json.loads(x) for x in reference.read_text(encoding="utf-8").splitlines()]
    expected = [e for e in expected if e["custom_id"] != kept[0]["custom_id"]]
    assert sorted(map(comparable, answers)) == sorted(map(comparable, expected))


def test_embeddings_expiry_live_counts_and_pages(tiny_model, tmp_path):
    recipe = tmp_path / "serve.toml"
    recipe.write_text("sort-window = 8\n", encoding="utf-8")  # NOTE: windows of 8 requests commit early
    server = Server(tiny_model, tmp_path / "state", "--config", str(recipe)).start()
    try:
        client = server.client()
        lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                  "body": {"model": "mini", "input": f"text number {i}"}} for i in range(12)]  # fmt: skip
        src = write_lines(tmp_path / "e.jsonl", lines)
        ids = []
        for _ in range(3):
            file = client.files.create(file=src.open("rb"), purpose="batch")
            ids.append(client.batches.create(input_file_id=file.id, endpoint="/v1/embeddings",
                                             completion_window="24h").id)  # fmt: skip
        for batch_id in ids:
            done = wait_for(client, batch_id, ("completed", "failed"))
            assert done.status == "completed" and done.request_counts.completed == 12
            for answer in lines_of(client, done.output_file_id):
                CreateEmbeddingResponse.model_validate(answer["response"]["body"])
        first = client.batches.list(limit=2)
        assert [b.id for b in first.data] == ids[:0:-1] and first.has_more
        rest = client.batches.list(limit=2, after=first.data[-1].id)
        assert [b.id for b in rest.data] == ids[:1] and not rest.has_more

        text = " ".join(["word"] * 200)
        many = [{"custom_id": f"x{i}", "method": "POST", "url": "/v1/embeddings",
                 "body": {"model": "mini", "input": f"{text} {i}"}} for i in range(12000)]  # fmt: skip
        file = client.files.create(file=write_lines(tmp_path / "many.jsonl", many).open("rb"), purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h")
        committed_windows(server.data_dir / "batches" / batch.id / "output.jsonl.parts")
        live = client.batches.retrieve(batch.id)
        assert live.status == "in_progress" and 0 < live.request_counts.completed < 12000  # counts move as it runs
        # NOTE: the completion window made to pass now, as 24 hours would: the server reads it from its state
        with sqlite3.connect(server.data_dir / "hpcinfer-serve.sqlite3") as db:
            db.execute("UPDATE batches SET expires_at = ? WHERE id = ?", (int(time.time()), batch.id))
        done = wait_for(client, batch.id, ("expired", "completed"))
        assert done.status == "expired" and done.expired_at
        kept, failed = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
        assert 0 < len(kept) < 12000 and done.request_counts.completed == len(kept)
        assert len(failed) == 12000 - len(kept) and {f["error"]["code"] for f in failed} == {"batch_expired"}
    finally:
        server.stop()


def test_a_201_mb_upload_is_refused_at_once(server):
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
    data = line * (201_000_000 // len(line) + 1)
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError) as raised:
        server.client().files.create(file=("big.jsonl", io.BytesIO(data)), purpose="batch")
    assert raised.value.status_code == 413 and "200,000,000 bytes" in raised.value.body["message"]
    assert time.monotonic() - start < 30  # refused by its length, not read first
    assert server.client().files.list().data == []  # nothing kept


def test_the_queue_takes_a_running_batch_first_then_priority_then_age(tmp_path):
    state = State(tmp_path)
    state.add_file(FileRow("file-x", "", "x.jsonl", "batch", 1, 0, ""))
    for name, priority, status in [("old", 0, "validating"), ("urgent", 5, "validating"), ("young", 0, "validating")]:
        state.add_batch(BatchRow(f"batch_{name}", "", 0, "file-x", "/v1/embeddings", "24h", None, priority, status,
                                 0, 0))  # fmt: skip
    assert state.next_batch().id == "batch_urgent"
    assert state.move("batch_young", ("validating",), "in_progress") is not None
    assert state.next_batch().id == "batch_young"  # one left running by a killed server comes first
    assert state.next_batch(skip=frozenset({"batch_young"})).id == "batch_urgent"  # one another thread moves
    state.move("batch_young", ("in_progress",), "completed")
    state.move("batch_urgent", ("validating",), "failed")
    assert state.next_batch().id == "batch_old"
    assert state.request_cancel("batch_old").status == "cancelling"
    assert state.move("batch_old", ("validating",), "in_progress") is None  # a cancel asked for wins
    assert state.move("batch_young", ("in_progress", "finalizing"), "cancelled") is None  # an ended batch stays


def test_one_key_priorities_do_not_starve_another(tmp_path):
    state = State(tmp_path)
    state.add_file(FileRow("file-x", "", "x.jsonl", "batch", 1, 0, ""))
    batches = [("a1", "alice", 9), ("a2", "alice", 9), ("a3", "alice", 9), ("b1", "bob", 0), ("b2", "bob", 0)]
    for name, owner, priority in batches:
        state.add_batch(BatchRow(f"batch_{name}", owner, 0, "file-x", "/v1/embeddings", "24h", None, priority,
                                 "validating", 0, 0))  # fmt: skip
    order = []
    while (batch := state.next_batch()) is not None:
        order.append(batch.id.removeprefix("batch_"))
        state.move(batch.id, ("validating",), "in_progress")
        state.move(batch.id, ("in_progress",), "completed")
    assert order == ["a1", "b1", "a2", "b2", "a3"]  # keys take turns; alice's priority orders alice's batches


def test_a_second_server_on_one_data_dir_is_refused(server, decoder):
    args = ["serve", "--model", str(decoder), "--port", str(free_port()), "--data-dir", str(server.data_dir)]
    done = subprocess.run([sys.executable, "-m", "hpcinfer", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HPCINFER_API_KEY": KEY})  # fmt: skip
    assert done.returncode == 2 and "one server per --data-dir" in done.stderr and "Traceback" not in done.stderr
    assert server.client().files.list().data == []  # the first one still serves


def test_without_a_key_the_server_makes_one_only_its_user_can_read(decoder, tmp_path):
    state = tmp_path / "state"
    server = Server(decoder, state, keys=None).start()
    try:
        key_file = state / "api-key"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        key = key_file.read_text(encoding="utf-8").strip()
        assert len(key) >= 32
        with pytest.raises(openai.AuthenticationError):
            server.client("-").files.list()  # NOTE: what an open server took before: any key at all
        request = urllib.request.Request(f"{server.url}/files")
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(request, timeout=10)
        assert raised.value.code == 401
        assert server.client(key).files.list().data == []
    finally:
        server.stop()
    output = server.proc.stdout.read().decode() if server.proc and server.proc.stdout else ""
    assert str(key_file) in output and key not in output  # how to use it is said; the key is never printed
    again = Server(decoder, state, keys=None).start()  # NOTE: a restart keeps the key its clients hold
    try:
        assert again.client(key).files.list().data == []
    finally:
        again.stop()


@pytest.mark.parametrize("point", ["validating", "job_done", "files_renamed", "ending"])
def test_kill_9_at_each_state_then_a_restart_ends_the_batch_once(decoder, tmp_path, point):
    state = tmp_path / "state"
    crashing = Server(decoder, state, crash=point).start()
    client = crashing.client()
    lines = [chat_line(i, max_tokens=4) for i in range(20)]
    file = client.files.create(file=write_lines(tmp_path / "in.jsonl", lines).open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert crashing.proc.wait(timeout=120) == -signal.SIGKILL  # killed itself at the point
    restarted = Server(decoder, state).start()
    try:
        client = restarted.client()
        done = wait_for(client, batch.id, ("completed", "failed", "cancelled", "expired"))
        assert done.status == "completed" and done.request_counts.completed == 20
        answers = lines_of(client, done.output_file_id)
        assert sorted(a["custom_id"] for a in answers) == sorted(x["custom_id"] for x in lines)  # each once
        assert client.files.retrieve(done.output_file_id).bytes == len(
            client.files.content(done.output_file_id).content
        )
        listed = {f"{f.id}.jsonl" for f in client.files.list().data}
        assert {p.name for p in (state / "files").iterdir()} == listed  # nothing half-written left behind
    finally:
        restarted.stop()
