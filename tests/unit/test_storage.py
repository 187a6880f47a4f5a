"""Paths and URIs: which is which, how a URI is shown, a store whose package is missing, and when a
lease left by another run is stale."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from hpcinfer.config import InputConfig, RunConfig
from hpcinfer.errors import ConfigError, InputError
from hpcinfer.files import storage
from hpcinfer.files.folder import is_dataset, parts_location, rejects_location
from hpcinfer.files.lease import _stale
from hpcinfer.files.sources import expand_paths
from hpcinfer.pipeline.read import Reader


def test_uris_and_local_paths_are_told_apart():
    assert (
        storage.is_remote("s3://bucket/x.jsonl") and storage.is_remote("gs://b/k") and storage.is_remote("abfs://c/k")
    )
    assert not storage.is_remote("/data/x.jsonl") and not storage.is_remote("x.jsonl")
    assert (
        not storage.is_remote("file:///data/x.jsonl") and storage.local_path("file:///data/x.jsonl") == "/data/x.jsonl"
    )
    assert not storage.is_remote("C:/data/x.jsonl")  # NOTE: a drive letter is no scheme ("://" is)


def test_a_uri_is_shown_without_its_user_and_password():
    assert storage.shown("s3://AKIA:hunter2@bucket/key.jsonl") == "s3://bucket/key.jsonl"
    assert storage.shown("s3://bucket/a@b.jsonl") == "s3://bucket/a@b.jsonl"  # an @ in a key is the key's
    assert storage.shown("https://host/in.jsonl?X-Amz-Signature=abc") == "https://host/in.jsonl"


def test_a_store_error_loses_any_url_query_it_quotes():
    exc = FileNotFoundError("https://host/x.jsonl?X-Amz-Signature=abc")
    assert "abc" not in storage.failure(exc) and "https://host/x.jsonl" in storage.failure(exc)


def test_where_an_outputs_parts_and_rejects_go():
    assert parts_location("s3://b/out.parquet") == "s3://b/out.parquet.parts"
    assert is_dataset("s3://b/out/") and parts_location("s3://b/out/") == "s3://b/out/"
    assert rejects_location("s3://b/out/") == "s3://b/out.rejects.jsonl"
    assert not is_dataset("out/")  # a local output is a file


def test_file_uris_read_as_local_paths(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    (tmp_path / "b.jsonl").write_text('{"text": "three"}\n')
    assert expand_paths((f"file://{tmp_path}/*.jsonl",)) == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    reader = Reader(InputConfig((f"file://{tmp_path}/",)), window_rows=10)
    texts = [t for block in reader.produce() for t in block.texts]
    assert texts == ["one", "two", "three"]


def test_a_store_whose_package_is_missing_says_which_extra_brings_it():
    # NOTE: fsspec's own refusal when gcsfs is absent, as it raises it
    missing = storage.StorageUnavailable("gs", ImportError("Please install gcsfs to access Google Storage"))
    assert storage.failure(missing) == (
        "no filesystem for gs:// (Please install gcsfs to access Google Storage); pip install 'hpcinfer[gcs]'"
    )
    with pytest.raises(InputError) as caught:  # a protocol no package provides, through the whole path
        expand_paths(("nosuchstore://bucket/in.jsonl",))
    assert str(caught.value).startswith("nosuchstore://bucket/in.jsonl: cannot list (no filesystem for nosuchstore://")


def test_storage_options_must_be_a_json_object_and_are_reported_by_name_only():
    from hpcinfer.config import flatten

    with pytest.raises(ConfigError, match="not JSON"):
        RunConfig(storage_options="{endpoint").validate()
    with pytest.raises(ConfigError, match="a JSON object"):
        RunConfig(storage_options="[1]").validate()
    flat = flatten(RunConfig(storage_options=json.dumps({"secret": "hunter2", "endpoint_url": "http://x"})))
    assert flat["storage_options"] == ["endpoint_url", "secret"]
    assert "hunter2" not in json.dumps(flat)


def test_a_lease_is_stale_once_expired_or_its_holder_on_this_host_is_gone():
    here, now = socket.gethostname(), time.time()
    assert not _stale({"host": "elsewhere", "pid": 1, "expires": now + 60})
    assert _stale({"host": "elsewhere", "pid": 1, "expires": now - 1})
    assert not _stale({"host": here, "pid": os.getpid(), "expires": now + 60})
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert _stale({"host": here, "pid": gone.pid, "expires": now + 60})
    assert _stale({"not": "a lease"})
