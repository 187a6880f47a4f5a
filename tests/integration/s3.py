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
        allow = {"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], "Resource": "*"}
        policy = json.dumps({"Version": "2012-10-17", "Statement": [allow]})
        iam.put_user_policy(UserName="reader", PolicyName="read-only", PolicyDocument=policy)
        client = boto3.client("s3", **admin)
        client.create_bucket(Bucket="read-only")
        for name, data in objects.items():
            client.put_object(Bucket="read-only", Key=name, Body=data)
        options = {"endpoint_url": endpoint, "key": key["AccessKeyId"], "secret": key["SecretAccessKey"],
                   "client_kwargs": {"region_name": REGION}}  # fmt: skip
        yield endpoint, options
    finally:
        server.kill()
        server.wait()
