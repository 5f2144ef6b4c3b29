"""A moto S3 server on loopback for tests and benchmarks, and fsspec pointed at it in this process.

``moto_s3(buckets)`` yields the environment a subprocess needs to reach the server (the same one
s3fs reads here), with the buckets made. ``deny_reads_under(endpoint, bucket, prefix)`` then turns
the server's authentication on, with a user allowed everything but GetObject under the prefix
(HTTP 403, as a bucket policy would refuse it), and points fsspec at that user's keys.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def moto_s3(buckets: tuple[str, ...], log: IO[bytes] | None = None) -> Iterator[dict[str, str]]:
    """The server (its request log to ``log`` when given), with ``buckets``; the environment and
    fsspec's s3 configuration are restored afterwards."""
    import fsspec

    moto = Path(sys.executable).with_name("moto_server")
    port = free_port()
    proc = subprocess.Popen([str(moto), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=log or subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "FSSPEC_S3_ENDPOINT_URL": endpoint}
    saved_env = {k: os.environ.get(k) for k in env}
    saved_conf = fsspec.config.conf.get("s3")
    os.environ.update(env)
    fsspec.config.conf["s3"] = {"endpoint_url": endpoint}
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        fs, _ = fsspec.core.url_to_fs("s3://" + buckets[0])
        for bucket in buckets:
            fs.mkdir(bucket)
        yield {**os.environ, **env}
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if saved_conf is None:
            fsspec.config.conf.pop("s3", None)
        else:
            fsspec.config.conf["s3"] = saved_conf
        fsspec.AbstractFileSystem.clear_instance_cache()


def deny_reads_under(endpoint: str, bucket: str, prefix: str) -> dict[str, str]:
    """Make a user that may do anything but read objects under ``s3://bucket/prefix``, switch the
    server's authentication on (moto checks IAM policies from then on) and point fsspec at the
    user's keys; returns them as AWS_* variables."""
    import boto3
    import fsspec

    iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test",
                       aws_secret_access_key="test")
    iam.create_user(UserName="reader")
    policy = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": "s3:*", "Resource": "*"},
        {"Effect": "Deny", "Action": "s3:GetObject", "Resource": f"arn:aws:s3:::{bucket}/{prefix}*"}]}
    iam.put_user_policy(UserName="reader", PolicyName="no-reads-under-prefix", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                                  headers={"Content-Type": "text/plain"}), timeout=10).read()
    fsspec.config.conf["s3"] = {"endpoint_url": endpoint, "key": key["AccessKeyId"],
                                "secret": key["SecretAccessKey"]}
    fsspec.AbstractFileSystem.clear_instance_cache()
    return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
