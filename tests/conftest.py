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


@pytest.fixture(autouse=True)
def no_claim_left_beating():
    """A claim's heartbeat thread that outlives its test is a claim never released or marked torn
    (in the code or in the test); it keeps writing through fsspec's shared filesystem instances and
    disturbs later tests (a CI run saw one overwrite a takeover and inflate another test's count)."""
    import threading
    import time

    def beating() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("zeroshard-claim-") and t.is_alive()}

    before = beating()
    yield
    deadline = time.monotonic() + 2.0  # a beat in flight finishes; its thread then returns
    while (left := beating() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        pytest.fail(f"claim heartbeat left running after the test: {sorted(t.name for t in left)}")


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

    # Only slow tests run DeepSpeed live (docs/TESTING.md), so the default tier never waits for the build.
    if importlib.util.find_spec("deepspeed") is None or not any(
            "deepspeed" in item.nodeid and item.get_closest_marker("slow") for item in session.items):
        return
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    _deepspeed_op_build = subprocess.Popen([sys.executable, "-c", _BUILD_DEEPSPEED_OP], env=env,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pytest_sessionfinish(session: pytest.Session) -> None:
    distributed = sys.modules.get("distributed")  # the rank pools: atexit is not run in every xdist worker
    if distributed is not None:
        distributed.shutdown_pools()
    if _deepspeed_op_build is not None:
        try:
            _deepspeed_op_build.wait(timeout=600)
        except subprocess.TimeoutExpired:
            _deepspeed_op_build.kill()


# [Note: test tiers]
# Every test file says which tier it belongs to with a module constant, TIER, by the rule in
# docs/TESTING.md (what the test starts and how long it takes):
#   "default" - the README's test command (`tools/dev.sh test`): none of its tests is slow;
#   "slow"    - every test of the file is marked slow (`tools/dev.sh test --all`, and CI);
#   "mixed"   - the file marks its slow tests itself with @pytest.mark.slow.
# A file without a valid TIER stops the collection: no test drifts into a tier by omission.
# `exclusive` (orthogonal to the tier) marks a test that measures the machine's time or memory
# and must not share it: tools/dev.sh runs those after the parallel pass, one at a time.
TIERS = ("default", "slow", "mixed")
DEFAULT_TIER_BUDGET_S = 10.0  # a default-tier test over this is reported at the end of the run
_over_budget: list[tuple[str, float]] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module if isinstance(item, pytest.Function) else None
        if module is None:
            continue
        tier = getattr(module, "TIER", None)
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.fspath}: TIER = {tier!r}; each test file declares "
                                    f"TIER = one of {TIERS} (docs/TESTING.md)")
        if tier == "slow":
            item.add_marker(pytest.mark.slow)
        elif tier == "default" and item.get_closest_marker("slow") is not None:
            raise pytest.UsageError(f"{item.nodeid} is marked slow in a file of TIER = 'default': "
                                    "make the file 'mixed' (docs/TESTING.md)")


def pytest_runtest_setup(item: pytest.Item) -> None:
    import distributed  # tests/ is on sys.path: the rank harness enforces the default tier's rank count

    distributed.default_tier_test = None if item.get_closest_marker("slow") else item.nodeid


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.duration > DEFAULT_TIER_BUDGET_S and "slow" not in report.keywords:
        _over_budget.append((report.nodeid, report.duration))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _over_budget:
        terminalreporter.section(f"default-tier tests over {DEFAULT_TIER_BUDGET_S:.0f} s (docs/TESTING.md: "
                                 "make them faster or mark them slow)")
        for nodeid, seconds in sorted(_over_budget, key=lambda item: -item[1]):
            terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")
