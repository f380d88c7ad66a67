"""Issue 51, round 3: a throttled S3 (503 SlowDown) is retried on every request a command makes,
its output then bit-exact and nothing left behind; `zeroshard clean` on a tree with a folder it
cannot read cleans the rest and names that folder."""

import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from zeroshard.cli import main
from zeroshard.format.writer import TensorSpec
from zeroshard.storage.claim import CLAIM_NAME
from zeroshard.storage.owner import host_id

from checkpoints import training_state, write_checkpoint
from s3_fault_proxy import FaultProxy

TIER = "mixed"  # the throttled reshard and every first-try-fails run take 10-20 s

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT_ID = re.compile(rb'"checkpoint_id":\s*"([0-9a-f]{32})"')
RETRY_S = 30.0  # generous: on a busy machine one request may need a few tries


# ---- 1. a throttled S3 ----------------------------------------------------------------------------

@pytest.fixture
def proxy(s3_endpoint):
    p = FaultProxy(s3_endpoint)
    yield p
    p.close()


@pytest.fixture
def source(tmp_path, s3_bucket, s3_client):
    """A local 3-rank checkpoint and the same bytes on S3 (at <bucket>/src). Its 12 MB tensor makes
    the outputs multipart uploads (5 MiB parts, see via)."""
    specs, data = training_state()
    specs.append(TensorSpec("big.weight", "param", "F32", (3_000_000,)))
    data["big.weight"] = torch.arange(3_000_000, dtype=torch.float32)
    local = tmp_path / "src"
    write_checkpoint(str(local), specs, data, 3)
    bucket = s3_bucket[len("s3://"):]
    for f in sorted(local.iterdir()):
        s3_client.put_object(Bucket=bucket, Key=f"src/{f.name}", Body=f.read_bytes())
    return local, s3_bucket, bucket


def via(proxy: FaultProxy) -> list[str]:
    return ["-S", f"endpoint_url={proxy.url}", "-S", "skip_instance_cache=true", "-S", "zeroshard_part_size=5MiB",
            "-S", f"zeroshard_retry_s={RETRY_S:g}"]


def every_third(proxy: FaultProxy) -> None:
    """Every third request through the proxy is answered 503 SlowDown."""
    count, lock = itertools.count(1), threading.Lock()

    def rule(method, path, query):
        with lock:
            return ("status", 503) if next(count) % 3 == 0 else None
    proxy.rule = rule


def first_of_each(proxy: FaultProxy) -> None:
    """The first request of each kind (method, object, query parameter names) is answered 503
    SlowDown: each kind of request the command makes must be retried."""
    seen, lock = set(), threading.Lock()

    def rule(method, path, query):
        kind = (method, path, tuple(sorted(p.split("=")[0] for p in query.split("&") if p)))
        with lock:
            if kind in seen:
                return None
            seen.add(kind)
            return ("status", 503)
    proxy.rule = rule


def objects(client, bucket: str, prefix: str) -> dict[str, bytes]:
    return {item["Key"]: client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
            for item in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])}


def pending(client, bucket: str) -> list[str]:
    return [u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


def run_throttled(proxy: FaultProxy, args: list[str]) -> float:
    started = time.monotonic()
    result = CliRunner().invoke(main, [*args, *via(proxy)])
    took = time.monotonic() - started
    assert result.exit_code == 0, result.output
    faults = [r for r in proxy.requests if r[3]]
    print(f"{args[0]}: {len(proxy.requests)} requests, {len(faults)} answered 503, {took:.1f} s")
    assert len(faults) >= 3  # the faults did happen
    return took


def local_files(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file()}


THROTTLES = [every_third, pytest.param(first_of_each, marks=pytest.mark.slow)]


@pytest.mark.s3
@pytest.mark.parametrize("throttle", THROTTLES)
def test_throttled_consolidate_succeeds_bit_exact_and_leaves_nothing(tmp_path, proxy, source, s3_client, throttle):
    local, url, bucket = source
    assert CliRunner().invoke(main, ["consolidate", "-q", str(local), str(tmp_path / "p.safetensors")]).exit_code == 0
    throttle(proxy)
    run_throttled(proxy, ["consolidate", "-q", f"{url}/src", f"{url}/out/p.safetensors"])
    # bit-exact, and nothing else under the output's prefix: no temp, stage, claim, pending upload
    assert objects(s3_client, bucket, "out/") == {"out/p.safetensors": (tmp_path / "p.safetensors").read_bytes()}
    assert pending(s3_client, bucket) == []


@pytest.mark.s3
@pytest.mark.slow
@pytest.mark.parametrize("throttle", [every_third, first_of_each])
def test_throttled_reshard_succeeds_bit_exact_and_leaves_nothing(tmp_path, proxy, source, s3_client, throttle):
    local, url, bucket = source
    result = CliRunner().invoke(main, ["reshard", "-q", str(local), "--to", "2", "-o", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    throttle(proxy)
    run_throttled(proxy, ["reshard", "-q", f"{url}/src", "--to", "2", "-o", f"{url}/out"])
    got = objects(s3_client, bucket, "out/")
    want = local_files(tmp_path / "r")
    assert sorted(got) == sorted(f"out/{name}" for name in want)  # nothing else under out/
    for name, data in want.items():
        if name.endswith(".safetensors"):  # bit-exact but for the id each new checkpoint draws
            ours, theirs = CHECKPOINT_ID.search(got[f"out/{name}"]), CHECKPOINT_ID.search(data)
            assert len(got[f"out/{name}"]) == len(data) and ours and theirs, name
            assert got[f"out/{name}"].replace(ours.group(1), theirs.group(1)) == data, name
    assert pending(s3_client, bucket) == []
    assert CliRunner().invoke(main, ["verify", "-q", f"{url}/out"]).exit_code == 0


@pytest.mark.s3
@pytest.mark.parametrize("throttle", THROTTLES)
def test_throttled_consolidate_to_hf_folder(tmp_path, proxy, source, s3_client, throttle):
    local, url, bucket = source
    args = ["--max-shard-size", "6MB"]
    result = CliRunner().invoke(main, ["consolidate", "-q", str(local), str(tmp_path / "hf"), *args])
    assert result.exit_code == 0, result.output
    want = local_files(tmp_path / "hf")
    assert len([n for n in want if n.endswith(".safetensors")]) > 1  # a sharded output, with its index
    throttle(proxy)
    run_throttled(proxy, ["consolidate", "-q", f"{url}/src", f"{url}/hf", *args])
    assert objects(s3_client, bucket, "hf/") == {f"hf/{name}": data for name, data in want.items()}
    assert pending(s3_client, bucket) == []


# ---- 2. clean, one folder unreadable ------------------------------------------------------------

def dead_owner() -> str:
    pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout
    return f"{host_id()}.{int(pid)}"


def aged(path: Path, seconds: float) -> Path:
    then = time.time() - seconds
    os.utime(path, (then, then))
    return path


def unprivileged() -> list[str]:
    """A command prefix that runs a process whose folder permissions are enforced: root (as the
    tests run) reads a chmod 000 folder regardless, so it runs as nobody. Skips if none works."""
    if os.geteuid() != 0:
        return []
    for prefix in (["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"],
                   ["runuser", "-u", "nobody", "--"]):
        if shutil.which(prefix[0]) is None:
            continue
        probe = subprocess.run([*prefix, sys.executable, "-c", "import os, zeroshard; print(os.geteuid())"],
                               capture_output=True, text=True, cwd="/", timeout=60)
        if probe.returncode == 0 and probe.stdout.strip() == "65534":
            return prefix
    pytest.skip("no way to run a process as an unprivileged user here (setpriv/runuser missing or failing), "
                "and as root a chmod 000 folder stays readable")


@pytest.fixture
def tree():
    """A tree in /tmp that nobody (uid 65534) may reach and clean: pytest's tmp_path is root's only."""
    top = Path(tempfile.mkdtemp(prefix="zs-clean-", dir="/tmp"))
    os.chmod(top, 0o755)
    yield top / "tree"
    for folder, dirs, _ in os.walk(top):
        for d in dirs:
            os.chmod(os.path.join(folder, d), 0o755)
    shutil.rmtree(top)


def run_clean(prefix: list[str], *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HOME"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([*prefix, sys.executable, "-c", "from zeroshard.cli import main; main()", "clean", *args],
                          capture_output=True, text=True, cwd="/", env=env, timeout=120)


@pytest.mark.parametrize("how", ["no read (000)", "no search (r--)", "inside a stage"])
def test_clean_cleans_what_it_can_reach_and_names_the_unreadable_folder(tree, how):
    prefix = unprivileged()
    dead = dead_owner()
    reachable = tree / "a" / "step-1"
    reachable.mkdir(parents=True)
    temp = reachable / f".zeroshard-tmp-{dead}-abcd1234-rank-00000-of-00002.safetensors"
    temp.write_bytes(b"x" * 100)
    old = tree / ".zeroshard-tmp-ffffffff.1-abcd1234-y"  # another host's, 2 h old
    old.write_bytes(b"y")
    aged(old, 7200)
    stage = tree / "a" / f".zeroshard-tmp-{dead}-ef012345-stage"
    stage.mkdir()
    (stage / "rank-00000-of-00001.safetensors").write_bytes(b"s" * 50)
    locked = tree / "b" / "locked"
    if how == "inside a stage":  # a stage with an unreadable folder: neither its age nor its swap marker known
        locked = tree / "b" / f".zeroshard-tmp-{dead}-01234567-stage" / "sub"
    locked.mkdir(parents=True)
    hidden = locked / f".zeroshard-tmp-{dead}-99999999-model.safetensors"
    hidden.write_bytes(b"z")
    (locked / CLAIM_NAME).write_text("{}")
    if prefix:
        subprocess.run(["chown", "-R", "65534:65534", str(tree)], check=True)
    os.chmod(locked, 0o400 if how == "no search (r--)" else 0o000)

    dry = run_clean(prefix, str(tree), "--older-than", "1h")
    assert dry.returncode == 1, dry.stdout + dry.stderr
    assert "Traceback" not in dry.stderr
    errors = [line for line in dry.stderr.splitlines() if line.startswith("zeroshard: error:")]
    assert errors == [f"zeroshard: error: {locked}: permission denied (not examined: nothing in it was cleaned)"], \
        dry.stderr
    stale = {line.split(": ", 1)[1].split(" (")[0] for line in dry.stdout.splitlines() if line.startswith("stale")}
    assert stale == {str(temp), str(old), str(stage)}, dry.stdout
    assert temp.exists() and stage.exists()  # a dry run removes nothing

    result = run_clean(prefix, str(tree), "--older-than", "1h", "--yes")
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("zeroshard: error:")]
    assert len(errors) == 1 and str(locked) in errors[0] and str(tree) + ":" not in errors[0], result.stderr
    assert "1 folder(s) could not be read" in result.stderr, result.stderr
    removed = {line.split(": ", 1)[1].split(" (")[0] for line in result.stdout.splitlines()
               if line.startswith("removed")}
    assert removed == {str(temp), str(old), str(stage)}, result.stdout
    assert not temp.exists() and not old.exists() and not stage.exists()
    assert hidden.exists() and (locked / CLAIM_NAME).exists()  # not examined: not touched (root sees it)


def test_clean_of_an_unreadable_root_names_it_in_one_line(tree):
    prefix = unprivileged()
    tree.mkdir()
    (tree / f".zeroshard-tmp-{dead_owner()}-abcd1234-x").write_bytes(b"x")
    if prefix:
        subprocess.run(["chown", "-R", "65534:65534", str(tree)], check=True)
    os.chmod(tree, 0o000)
    result = run_clean(prefix, str(tree), "--yes")
    assert result.returncode == 1 and result.stdout == "", result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [f"zeroshard: error: {tree}: permission denied"], result.stderr
