"""Shared fixtures: a real local S3 endpoint (moto's server in a subprocess, as s3fs's own tests
do) and small checkpoints made through the public format API."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """Start tools/s3_server.py on a free 127.0.0.1 port; point AWS_* at it for this session."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "tools" / "s3_server.py"), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline().strip()
        if not line.startswith("S3 endpoint "):
            raise RuntimeError(f"moto server did not start: {line!r}")
        endpoint = line.split()[-1]
        saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                                "AWS_DEFAULT_REGION")}
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                          AWS_DEFAULT_REGION="us-east-1")
        yield endpoint
    finally:
        proc.kill()
        proc.wait(timeout=10)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh, empty bucket: returns its s3:// URL."""
    import boto3

    name = f"zs-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    yield f"s3://{name}"


@pytest.fixture
def s3_client(s3_endpoint):
    import boto3

    return boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")


@pytest.fixture
def bytes_read(monkeypatch) -> list[int]:
    """Every storage read of interop/torch_zip.py (the bytes of tensors, not of zip directories or
    pickles), in elements of uint8: the tests of streaming imports count them."""
    from zeroshard.interop import torch_zip

    read: list[int] = []
    original = torch_zip.Source.read_into

    def counting(self, tensor, offset):
        read.append(tensor.numel())
        original(self, tensor, offset)

    monkeypatch.setattr(torch_zip.Source, "read_into", counting)
    return read


# DeepSpeed compiles a C++ op (its CPU shared-memory all-reduce, into ~/.cache/torch_extensions)
# the first time one of its process groups starts on a machine: 27 s alone here, 65-75 s in CI
# beside the other tests, inside whichever DeepSpeed test comes first. When DeepSpeed tests are
# collected, the op is built in the background from the start; a launch that comes first waits
# on torch's build lock. The session waits for the build at its end rather than kill it, which
# would leave that lock behind for the next run.
_deepspeed_op_build: subprocess.Popen | None = None
_BUILD_DEEPSPEED_OP = """
from deepspeed.accelerator import get_accelerator
import deepspeed.ops
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
    builder.load(verbose=False)
"""


def pytest_collection_finish(session: pytest.Session) -> None:
    global _deepspeed_op_build
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None or not any("deepspeed" in item.nodeid for item in session.items):
        return
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    _deepspeed_op_build = subprocess.Popen([sys.executable, "-c", _BUILD_DEEPSPEED_OP], env=env,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _deepspeed_op_build is not None:
        try:
            _deepspeed_op_build.wait(timeout=600)
        except subprocess.TimeoutExpired:
            _deepspeed_op_build.kill()
