"""An S3-protocol server on loopback for tests and benchmarks (moto's server, in a thread).

:func:`s3_server` starts it on a free ``127.0.0.1`` port, creates a bucket and
yields the endpoint; :func:`loopback_env` is the environment that keeps an S3
client on loopback (dummy credentials, no proxy, no instance metadata), for
this process and for subprocesses it starts. Nothing leaves the machine.

Examples
--------
>>> with s3_server("ckpts") as endpoint:  # doctest: +SKIP
...     gpuckpt.save(state, "s3://ckpts/run/step-1", storage_options=s3_options(endpoint))
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = [
    "LOOPBACK_ENV",
    "UNSET_ENV",
    "copy_prefix",
    "free_port",
    "list_keys",
    "loopback_env",
    "loopback_s3",
    "s3_options",
    "s3_server",
]

LOOPBACK_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}
UNSET_ENV = (
    "AWS_SESSION_TOKEN",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "AWS_PROFILE",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def loopback_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with :data:`LOOPBACK_ENV` set and
    :data:`UNSET_ENV` removed."""
    env = dict(os.environ if base is None else base)
    env.update(LOOPBACK_ENV)
    for k in UNSET_ENV:
        env.pop(k, None)
    return env


def s3_options(endpoint: str, **more: Any) -> dict[str, Any]:
    """``storage_options`` for the server at ``endpoint`` (plain HTTP, dummy credentials)."""
    return {
        "endpoint_url": endpoint,
        "region": "us-east-1",
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
        "allow_http": True,
        **more,
    }


#: moto keeps an object in memory up to this size and spools larger ones to temporary files on
#: this machine's disk (5 MiB by default). The server stands for an object store, whose disks
#: are not this machine's. Measured on a 2-core VM (2026-12-03), a save of 512 MiB cost the
#: server's process 4.4-5.1 CPU seconds with objects in memory, 6.8-7.9 spooled to disk.
IN_MEMORY_OBJECT_BYTES = 1 << 40


def _list_moto_services_once() -> None:
    """moto's server asks, for every request, whether the request's host is one of its service
    packages, by listing its package folder and stat-ing each entry (about 190 system calls a
    request; the S3 fault and fencing tests used 5% less CPU without them, 2026-12-03). The
    folder does not change while a process runs: it is listed once, and the answer kept."""
    from moto import backends

    if getattr(backends.list_of_moto_modules, "listed_once", False):
        return
    names = tuple(backends.list_of_moto_modules())

    def listed() -> Iterable[str]:
        return names

    listed.listed_once = True  # type: ignore[attr-defined]
    backends.list_of_moto_modules = listed


@contextmanager
def s3_server(*buckets: str) -> Iterator[str]:
    """A moto S3 server on loopback with ``buckets`` created; yields its ``http://`` endpoint.

    The server keeps its objects in memory: moto reads ``MOTO_S3_DEFAULT_KEY_BUFFER_SIZE``
    from the environment each time it makes an object, so it is set for this process to
    :data:`IN_MEMORY_OBJECT_BYTES` (unless already set) and stays set. moto's list of its own
    services is made once per process (:func:`_list_moto_services_once`)."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    os.environ.setdefault("MOTO_S3_DEFAULT_KEY_BUFFER_SIZE", str(IN_MEMORY_OBJECT_BYTES))
    _list_moto_services_once()
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        client = boto3.client(
            "s3",
            endpoint_url=url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        for b in buckets:
            client.create_bucket(Bucket=b)
        yield url
    finally:
        server.stop()


@contextmanager
def loopback_s3(*buckets: str) -> Iterator[str]:
    """:func:`s3_server`, with this process's environment set as :func:`loopback_env` sets it
    while the server runs; the variables it touched are restored afterwards."""
    touched = (*LOOPBACK_ENV, *UNSET_ENV)
    saved = {k: os.environ.get(k) for k in touched}
    os.environ.update(LOOPBACK_ENV)
    for k in UNSET_ENV:
        os.environ.pop(k, None)
    try:
        with s3_server(*buckets) as url:
            yield url
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def list_keys(endpoint: str, bucket: str, prefix: str) -> set[str]:
    """The keys under ``prefix`` (a folder: ``/`` is added) in ``bucket``, relative to it."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    prefix = prefix.rstrip("/") + "/"
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"].removeprefix(prefix) for page in pages for o in page.get("Contents", [])}


def copy_prefix(endpoint: str, bucket: str, source: str, targets: Iterable[str]) -> int:
    """Copy every object under the folder ``source`` to each folder of ``targets`` in ``bucket``
    (server-side copies: many checkpoints made from one without saving each); returns the copies made."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    source = source.rstrip("/")
    keys = sorted(list_keys(endpoint, bucket, source))
    n = 0
    for target in targets:
        for key in keys:
            client.copy_object(
                Bucket=bucket,
                Key=f"{target.rstrip('/')}/{key}",
                CopySource={"Bucket": bucket, "Key": f"{source}/{key}"},
            )
            n += 1
    return n
