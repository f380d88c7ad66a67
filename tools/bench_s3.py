"""Benchmark zeroshard on S3 against a single-stream copy of the same bytes, in the same run.

    python tools/bench_s3.py [--params 20M] [--repeat 5] [--all-variants] [--endpoint http://127.0.0.1:PORT]

Starts tools/s3_server.py (moto's S3, in memory, on 127.0.0.1) unless --endpoint is given,
writes a synthetic checkpoint there (fp32 weights + AdamW state over 4 ranks), then times, each
as its own process, interleaved round by round:

By default moto is started with --lean-ranges (tools/s3_server.py): stock moto reads the whole
object for every ranged GET, which real S3 does not; --stock-moto measures without that.
--latency-ms / --stream-mbps make the server answer like S3 over a network (a delay per request,
each request's body paced): on loopback with no latency one stream already runs at the speed
of moto's Python, which no client-side concurrency can beat.

- single-stream copy: every rank object read with one GET and written with one upload stream
  (s3fs cat_file / pipe_file with max_concurrency=1: one request at a time, as a plain copy does);
- zeroshard consolidate (weights only, S3 -> S3) and reshard 4 -> 3 (everything, S3 -> S3);
- consolidate's and reshard's I/O with their reads handed over up front
  (zeroshard.storage.read_ahead.read_ranges): what CheckpointReader reaches once it plans its
  reads (today it reads piece by piece, and a weight's pieces lie between optimizer states);
- the same two with concurrency turned off (-S zeroshard_read_ahead=1 -S zeroshard_uploads_in_flight=1),
  to show what the concurrency itself brings.

By default only the copy, consolidate and reshard run (--all-variants adds the rest). Throughput is
bytes copied (read once and written once) per second; rounds are interleaved (tools/benchlib.py,
one warm-up round dropped) and the figure is the median and IQR of each round's throughput ratio
to the single-stream copy; raw JSON in tools/results/bench_s3.json. moto is a Python server: the CPU seconds it
spent during each run (from /proc) and the machine's load are printed, since on a small machine
the server, not the client, may set the ceiling.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import benchlib  # noqa: E402

from bench_toolkit import noise_fill, parse_count  # noqa: E402  (shared with the toolkit bench)

BUCKET = "bench"
CLK = os.sysconf("SC_CLK_TCK")


def model_shapes(params: int) -> list[tuple[str, tuple[int, ...]]]:
    """LLM-like shapes (hidden 512, vocab 32000) with about `params` parameters."""
    hidden, vocab = 512, 32000
    shapes = [("embed.weight", (vocab, hidden))]
    per_block = 12 * hidden * hidden + 4 * hidden
    for b in range(max(1, (params - vocab * hidden) // per_block)):
        p = f"blocks.{b}."
        shapes += [(p + "attn.qkv.weight", (3 * hidden, hidden)), (p + "attn.proj.weight", (hidden, hidden)),
                   (p + "mlp.up.weight", (4 * hidden, hidden)), (p + "mlp.down.weight", (hidden, 4 * hidden)),
                   (p + "ln1.weight", (hidden,)), (p + "ln2.weight", (hidden,))]
    return shapes


def build_checkpoint(url: str, params: int, world_size: int, role_major: bool = False) -> dict:
    from zeroshard.format import TensorSpec, build_manifest, commit_checkpoint, rank_contents, write_rank_file
    from zeroshard.storage import Location

    specs = []
    for name, shape in model_shapes(params):
        specs.append(TensorSpec(name, "param", "F32", shape))
        for state in ("exp_avg", "exp_avg_sq"):
            specs.append(TensorSpec(f"optimizer/{state}/{name}", "optimizer", "F32", shape, param=name, state=state))
    if role_major:  # all weights first in every rank file, then each optimizer state
        specs.sort(key=lambda s: (s.role != "param", s.state or ""))
    fill = noise_fill()

    location = Location(url)
    checkpoint_id = uuid.uuid4().hex
    results = [write_rank_file(location, checkpoint_id, r, world_size, rank_contents(specs, world_size, r), fill)
               for r in range(world_size)]
    commit_checkpoint(location, build_manifest(specs, world_size, results, checkpoint_id, zero_stage=3, step=1))
    return {"params": sum(s.numel for s in specs if s.role == "param"),
            "files": [f.name for f in (r.file for r in results)], "total": sum(r.file.size for r in results),
            "weights": sum(s.numel * 4 for s in specs if s.role == "param")}


def single_stream_copy(src: str, dst: str, names: list[str]) -> dict:
    """One GET per object, then one upload stream of the same bytes (sequential parts)."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    got = put = 0.0
    for name in names:
        t = time.perf_counter()
        data = fs.cat_file(f"{src}/{name}", max_concurrency=1)
        got += time.perf_counter() - t
        t = time.perf_counter()
        fs.pipe_file(f"{dst}/{name}", data, max_concurrency=1)
        put += time.perf_counter() - t
    return {"get_s": got, "put_s": put}


def planned_consolidate_io(src: str, dst: str) -> dict:
    """Consolidate's I/O with its reads handed over up front (read_ranges): every weight tensor's
    bytes, rank after rank, in 8 MiB pieces, written to one object. What CheckpointReader can
    reach once it plans its reads (no hashing or header checks here: I/O only)."""
    from zeroshard.format import open_checkpoint
    from zeroshard.storage import AtomicWriter, Location, read_header
    from zeroshard.storage.read_ahead import read_ranges

    location, manifest = open_checkpoint(src)
    headers = {}
    for f in manifest.files:
        with location.open_reader(f.name, f.size) as reader:
            headers[f.name] = read_header(reader, f.size)
    piece = 8 * 1024 * 1024
    plan = [(name, e.begin + at, min(piece, e.end - e.begin - at))
            for t in manifest.tensors.values() if t.role in ("param", "buffer")
            for name, h in headers.items() if (e := h.entries.get(t.name)) is not None
            for at in range(0, e.end - e.begin, piece)]
    folder, name = dst.rsplit("/", 1)
    with AtomicWriter(Location(folder), name, write_behind=True) as out:
        for data in read_ranges(location, plan):
            out.write(data)
    return {"bytes": sum(n for *_, n in plan)}


def planned_reshard_io(src: str, dst: str, world_size: int) -> dict:
    """Reshard's I/O with its reads handed over up front: every output rank's bytes assembled from
    the input fragments (zeroshard.partition arithmetic), one read_ranges over all of them, each
    output rank written to one object. I/O only: no headers, hashes or manifest written."""
    from zeroshard.format import open_checkpoint
    from zeroshard.partition import pieces, shard_range
    from zeroshard.storage import AtomicWriter, Location, read_header
    from zeroshard.storage.read_ahead import read_ranges

    location, manifest = open_checkpoint(src)
    files = sorted(manifest.files, key=lambda f: f.rank)
    headers = []
    for f in files:
        with location.open_reader(f.name, f.size) as reader:
            headers.append(read_header(reader, f.size))
    piece, plan, owner = 8 * 1024 * 1024, [], []
    for rank in range(world_size):
        for t in manifest.tensors.values():
            sources = [shard_range(t.numel, len(files), k) for k in range(len(files))]
            for p in pieces(shard_range(t.numel, world_size, rank), sources):
                begin = headers[p.source].entries[t.name].begin + p.source_offset * t.itemsize
                for at in range(0, p.length * t.itemsize, piece):
                    plan.append((files[p.source].name, begin + at, min(piece, p.length * t.itemsize - at)))
                    owner.append(rank)
    out, writer = Location(dst), None
    try:
        for rank, data in zip(owner, read_ranges(location, plan)):
            if writer is None or writer.rank != rank:
                if writer is not None:
                    writer.__exit__(None, None, None)
                writer = AtomicWriter(out, f"rank-{rank}.bin", write_behind=True).__enter__()
                writer.rank = rank
            writer.write(data)
        writer.__exit__(None, None, None)
    except BaseException as exc:
        if writer is not None:
            writer.__exit__(type(exc), exc, None)
        raise
    return {"bytes": sum(n for *_, n in plan)}


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK  # utime + stime


def timed(cmd: list[str], server: int | None) -> dict:
    """Wall seconds, client CPU seconds and server CPU seconds of one child process."""
    server_before = cpu_seconds(server) if server else 0.0
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{err}")
    return {"wall": wall, "client_cpu": usage.ru_utime + usage.ru_stime,
            "server_cpu": cpu_seconds(server) - server_before if server else float("nan"), "out": out}


def start_server(flags: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, str(ROOT / "tools" / "s3_server.py"), "--port", "0", "--bucket", BUCKET]
                            + flags,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline().strip()
    if not line.startswith("S3 endpoint "):
        proc.kill()
        raise SystemExit(f"moto server did not start: {line!r}")
    return proc, line.split()[-1]


def key(name: str) -> str:
    """A side's JSON key: its name as a word ('reshard 4 -> 3' -> 'reshard_4_3'), so a document
    can bind a figure to it (tests/test_docs_figures.py)."""
    return re.sub(r"\W+", "_", name).strip("_")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="20M", help="model size (default 20M: ~250 MB with AdamW state)")
    parser.add_argument("--repeat", type=int, default=5,
                        help="interleaved rounds after one warm-up (a round costs > 10 s here, so 5)")
    parser.add_argument("--all-variants", action="store_true",
                        help="also time the planned-read I/O and the serial (no concurrency) variants")
    parser.add_argument("--json", default=None, help="result file (default tools/results/bench_s3.json)")
    parser.add_argument("--stock-moto", action="store_true",
                        help="serve ranged GETs as stock moto does (reading the whole object each time)")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="server: delay before each request (S3-like)")
    parser.add_argument("--stream-mbps", type=float, default=0.0, help="server: pace each request's body (S3-like)")
    parser.add_argument("--endpoint", help="an S3 endpoint to use instead of starting moto (bucket 'bench' must exist)")
    parser.add_argument("--role-major", action="store_true",
                        help="lay rank files out weights first, then optimizer states (default: each weight "
                             "followed by its states, as the engine saves)")
    parser.add_argument("--build-only", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--copy-only", nargs=3, metavar=("SRC", "DST", "NAMES"), help=argparse.SUPPRESS)
    parser.add_argument("--planned-only", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    parser.add_argument("--planned-reshard-only", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build_only:
        print(json.dumps(build_checkpoint(args.build_only, parse_count(args.params), 4, args.role_major)))
        return
    if args.planned_reshard_only:
        print(json.dumps(planned_reshard_io(*args.planned_reshard_only, 3)))
        return
    if args.planned_only:
        print(json.dumps(planned_consolidate_io(*args.planned_only)))
        return
    if args.copy_only:
        src, dst, names = args.copy_only
        print(json.dumps(single_stream_copy(src, dst, names.split(","))))
        return

    flags = ([] if args.stock_moto else ["--lean-ranges"]) + ["--latency-ms", str(args.latency_ms),
                                                              "--stream-mbps", str(args.stream_mbps)]
    server, endpoint = (None, args.endpoint) if args.endpoint else start_server(flags)
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")
    pid = server.pid if server else None
    try:
        ckpt = f"s3://{BUCKET}/ckpt"
        t = time.perf_counter()
        build = [sys.executable, __file__, "--build-only", ckpt, "--params", args.params]
        built = json.loads(timed(build + (["--role-major"] if args.role_major else []), pid)["out"])
        print(f"checkpoint: {built['params'] / 1e6:.0f}M params with AdamW state, 4 ranks, "
              f"{built['total'] / 1e6:.0f} MB, "
              f"{'weights first' if args.role_major else 'each weight followed by its states'} "
              f"({built['weights'] / 1e6:.0f} MB of weights), written to {endpoint} in {time.perf_counter() - t:.1f}s")
        print(f"machine: {os.cpu_count()} CPUs, load average at start {os.getloadavg()[0]:.2f}; server: "
              + ("given" if args.endpoint else "tools/s3_server.py " + " ".join(flags)))
        zs = [sys.executable, "-m", "zeroshard.cli"]
        serial = ["-S", "zeroshard_read_ahead=1", "-S", "zeroshard_uploads_in_flight=1"]
        jobs = {
            "single-stream copy": ([sys.executable, __file__, "--copy-only", ckpt, f"s3://{BUCKET}/copy",
                                    ",".join(built["files"])], built["total"]),
            "consolidate": (zs + ["consolidate", "-q", "--overwrite", ckpt, f"s3://{BUCKET}/out/model.safetensors"],
                            built["weights"]),
            "reshard 4 -> 3": (zs + ["reshard", "-q", "--overwrite", ckpt, "--to", "3", "-o", f"s3://{BUCKET}/w3"],
                               built["total"]),
            "consolidate I/O, reads planned": ([sys.executable, __file__, "--planned-only", ckpt,
                                                f"s3://{BUCKET}/out/planned.safetensors"], built["weights"]),
            "reshard I/O, reads planned": ([sys.executable, __file__, "--planned-reshard-only", ckpt,
                                            f"s3://{BUCKET}/planned-w3"], built["total"]),
            "consolidate, serial": (zs + ["consolidate", "-q", "--overwrite", *serial, ckpt,
                                          f"s3://{BUCKET}/out/model.safetensors"], built["weights"]),
            "reshard 4 -> 3, serial": (zs + ["reshard", "-q", "--overwrite", *serial, ckpt, "--to", "3", "-o",
                                             f"s3://{BUCKET}/w3"], built["total"]),
        }
        if not args.all_variants:
            jobs = {k: v for k, v in jobs.items() if k in ("single-stream copy", "consolidate", "reshard 4 -> 3")}
        detail: dict[str, list[dict]] = {name: [] for name in jobs}

        def side(name):
            def run() -> float:
                detail[name].append(timed(jobs[name][0], pid))
                return detail[name][-1]["wall"]
            return run

        load_before = benchlib.loadavg()
        runs = benchlib.interleave({name: side(name) for name in jobs}, args.repeat, warmup=1)
        rep = benchlib.Report("bench_s3", vars(args), scope=(
            f"CPU, {os.cpu_count()} vCPUs, moto S3 server on loopback ({' '.join(flags)}), "
            f"{built['total'] / 1e6:.0f} MB checkpoint, 4 ranks; each command a process"))
        rep.data["load_before"] = load_before  # the report is made after the runs
        base = "single-stream copy"
        for name, (_, size) in jobs.items():
            rep.runs(key(name), runs[name], f"{name} ({size / 1e6:.0f} MB copied)")
            if name != base:  # throughput ratio: (bytes / s) over the copy's (bytes / s), per round
                ratios = [(size / t) / (jobs[base][1] / tb) for t, tb in zip(runs[name], runs[base])]
                rep.ratio_values(f"{key(name)}_vs_copy", ratios, f"{name} / single-stream copy throughput", ">= 2")
        for name in jobs:
            d = detail[name][1:]  # the warm-up round dropped, as in runs
            rep.value(f"{key(name)}_server_cpu_share", benchlib.quantile([r["server_cpu"] / r["wall"] for r in d], 0.5),
                      "x", f"{name}: moto CPU seconds / wall seconds (median)")
        path = rep.finish(args.json)
        print("\n" + rep.table() + f"\n\nraw JSON: {path}")
    finally:
        if server:
            server.kill()
            server.wait()


if __name__ == "__main__":
    main()
