"""A real S3 API server on loopback for the object-store tests: moto's standalone server
(`moto.server.ThreadedMotoServer`, in this process, on 127.0.0.1 and a free port), reached through
the ordinary client stack (s3fs, boto3) with an endpoint override; nothing is patched.

The credentials are given as storage options (`--storage-options`), never through the environment,
so a test can look for the secret in everything a run writes and prints.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SECRET = "s3cr3t-hpcinfer-never-printed"
KEY = "hpcinfer-test-key"
REGION = "us-east-1"


class LoopbackS3:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.options: dict[str, Any] = {
            "endpoint_url": endpoint,
            "key": KEY,
            "secret": SECRET,
            "client_kwargs": {"region_name": REGION},
        }
        self.options_json = json.dumps(self.options)
        import boto3
        import s3fs

        self.fs = s3fs.S3FileSystem(use_listings_cache=False, **self.options)
        self.client = boto3.client(
            "s3", endpoint_url=endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET, region_name=REGION
        )

    def bucket(self, name: str, versioned: bool = False) -> str:
        self.client.create_bucket(Bucket=name)
        if versioned:
            self.client.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
        return f"s3://{name}"

    def upload(self, local: Path, uri: str) -> str:
        self.fs.put_file(str(local), uri)
        return uri

    def read(self, uri: str) -> bytes:
        return self.fs.cat_file(uri)

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def versions(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """How many times each key was written (a versioned bucket keeps every PUT)."""
        found: dict[str, int] = {}
        pages = self.client.get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=prefix)
        for page in pages:
            for v in page.get("Versions", []):
                found[v["Key"]] = found.get(v["Key"], 0) + 1
        return found


@contextmanager
def loopback_s3() -> Iterator[LoopbackS3]:
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")  # NOTE: no instance-role probe off EC2
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield LoopbackS3(f"http://{host}:{port}")
    finally:
        server.stop()


# A read-only user, said so that it holds whichever IAM action a mock version names a call by: AWS
# maps HeadObject to s3:GetObject and ListObjectsV2 to s3:ListBucket, moto 5.2 asks for
# s3:HeadObject and s3:ListObjectsV2. Reads are allowed by prefix; writes are denied by name and
# also fall outside every allowed prefix, so a new name for a write is still refused.
READ_EVERYTHING = {"Effect": "Allow", "Action": ["s3:Get*", "s3:List*", "s3:Head*"], "Resource": "*"}
WRITES = ["Put", "Create", "Delete", "Upload", "Complete", "Abort", "Copy", "Restore", "Replicate"]
WRITE_NOTHING = {"Effect": "Deny", "Action": [f"s3:{verb}*" for verb in WRITES], "Resource": "*"}


def _check_read_only(endpoint: str, options: dict[str, Any]) -> None:
    """The server refuses the user's write and serves its reads, checked with boto3 itself, so a
    mock that maps calls to actions differently fails here, naming the call, not in the run."""
    import boto3
    import botocore.exceptions

    reader = boto3.client("s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id=options["key"],
                          aws_secret_access_key=options["secret"])  # fmt: skip
    listed = reader.list_objects_v2(Bucket="read-only")
    assert listed.get("KeyCount", 0) >= 1, "the read-only user cannot list its bucket"
    first = listed["Contents"][0]["Key"]
    reader.head_object(Bucket="read-only", Key=first)
    reader.get_object(Bucket="read-only", Key=first, Range="bytes=0-0")["Body"].read()
    try:
        reader.put_object(Bucket="read-only", Key="probe", Body=b"x")
    except botocore.exceptions.ClientError as exc:
        assert exc.response["Error"]["Code"] == "AccessDenied", exc.response["Error"]
    else:
        raise AssertionError("the read-only user could write: the mock's policy check changed")


@contextmanager
def read_only_s3(objects: dict[str, bytes]) -> Iterator[tuple[str, dict[str, Any]]]:
    """A moto server (its own process) that checks credentials: a bucket `read-only` holding
    `objects`, and the storage options of a user who may read it and write nothing. Yields
    (endpoint, options).

    NOTE: moto checks credentials only after its first INITIAL_NO_AUTH_ACTION_COUNT requests, so
    exactly that many set the server up: the user, its key, its policy, the bucket, each object.
    """
    import socket
    import subprocess
    import sys
    import time

    import boto3

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    setup = 4 + len(objects)
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(setup)}
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the moto server did not start") from None
                time.sleep(0.1)
        admin = {"endpoint_url": endpoint, "region_name": REGION, "aws_access_key_id": "setup",
                 "aws_secret_access_key": "setup"}  # fmt: skip
        iam = boto3.client("iam", **admin)
        iam.create_user(UserName="reader")
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        policy = json.dumps({"Version": "2012-10-17", "Statement": [READ_EVERYTHING, WRITE_NOTHING]})
        iam.put_user_policy(UserName="reader", PolicyName="read-only", PolicyDocument=policy)
        client = boto3.client("s3", **admin)
        client.create_bucket(Bucket="read-only")
        for name, data in objects.items():
            client.put_object(Bucket="read-only", Key=name, Body=data)
        options = {"endpoint_url": endpoint, "key": key["AccessKeyId"], "secret": key["SecretAccessKey"],
                   "client_kwargs": {"region_name": REGION}}  # fmt: skip
        _check_read_only(endpoint, options)
        yield endpoint, options
    finally:
        server.kill()
        server.wait()
