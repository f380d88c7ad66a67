"""How long `zeroshard reshard` to S3 takes to fail when connections drop mid-upload, and what it
leaves behind (pending multipart uploads, the output's claim). Issue 17's measurement.

    PYTHONPATH=. python tools/s3_fault_timing.py [--scenario parts|down|hang] [key=value storage options...]

Starts moto's S3 server and the tests' fault proxy (tests/s3_fault_proxy.py), writes an output
(rank files of ~8 MB, 5 MiB parts), then reshards over it with --overwrite through the proxy:
  parts: every part upload's connection dies 100 bytes in; everything else gets through.
  down:  from the first part upload on, every request's connection dies (the network is gone).
  hang:  every part upload is received and never answered.
Default retry settings unless storage options are given (e.g. zeroshard_retry_s=3).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=("parts", "down", "hang"), default="parts")
    parser.add_argument("extra", nargs="*", help="more storage options, key=value")
    args = parser.parse_args()
    import boto3
    import torch

    from zeroshard.format.writer import TensorSpec

    from checkpoints import training_state, write_checkpoint
    from s3_fault_proxy import FaultProxy

    server = subprocess.Popen([sys.executable, str(ROOT / "tools" / "s3_server.py"), "--port", "0",
                               "--bucket", "ckpt"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    endpoint = server.stdout.readline().split()[-1]
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")
    proxy = FaultProxy(endpoint)
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            specs, data = training_state()
            specs.append(TensorSpec("big.weight", "param", "F32", (6_000_000,)))
            data["big.weight"] = torch.arange(6_000_000, dtype=torch.float32)
            write_checkpoint(f"{tmp}/ckpt", specs, data, 3)
            cli = [sys.executable, "-m", "zeroshard.cli", "reshard", "-q"]
            opts = ["-S", "zeroshard_part_size=5MiB"]
            subprocess.run([*cli, f"{tmp}/ckpt", "--to", "2", "-o", "s3://ckpt/out", *opts], check=True)
            down = {"on": False}

            def rule(method: str, path: str, query: str) -> tuple[str, int] | None:
                if method == "PUT" and "partNumber=" in query:
                    down["on"] = True
                    return ("hang", 0) if args.scenario == "hang" else ("drop", 100)
                return ("drop", 0) if down["on"] and args.scenario == "down" else None

            proxy.rule = rule
            extra = [x for kv in args.extra for x in ("-S", kv)]
            start = time.monotonic()
            result = subprocess.run([*cli, "--overwrite", f"{tmp}/ckpt", "--to", "3", "-o", "s3://ckpt/out", *opts,
                                     "-S", f"endpoint_url={proxy.url}", *extra], capture_output=True, text=True)
            took = time.monotonic() - start
            since_fault = time.monotonic() - proxy.faulted_at[0] if proxy.faulted_at else float("nan")
        uploads = client.list_multipart_uploads(Bucket="ckpt").get("Uploads", [])
        claim = [o["Key"] for o in client.list_objects_v2(Bucket="ckpt").get("Contents", [])
                 if o["Key"].endswith(".zeroshard-claim")]
        print(f"scenario {args.scenario}: exit {result.returncode} after {took:.1f} s "
              f"({since_fault:.1f} s after the first fault); "
              f"{len(uploads)} pending multipart uploads; claim left: {claim or 'none'}; "
              f"{sum(1 for r in proxy.requests if r[3])} requests faulted")
        print("output:", result.stdout.strip(), result.stderr.strip()[-2000:])
    finally:
        proxy.close()
        server.kill()


if __name__ == "__main__":
    main()
