"""Early writeback alone: how long writing a file and fsyncing it takes, with the write-out started
every K MiB as it goes (zeroshard/storage/writeback.py, [Note: early writeback]) and without.

    python tools/bench_writeback.py                    # 512 MB in 4 MiB writes, K = 8, 16, 32, 64, 128; 10 repeats

Each side creates a fresh file (allocated with posix_fallocate, as the toolkit's outputs are),
writes --mb megabytes in --chunk-mib writes, then fsyncs it: the time is from the create to the
end of the fsync. The sides run interleaved (tools/benchlib.py); the figures are medians of the
paired ratios against writing with no early writeback, which is what `cp` + `sync`, or a plain
write + fsync, does. Raw JSON: tools/results/bench_writeback.json (--json PATH elsewhere).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402  (tools/, beside this script)

from zeroshard.storage.writeback import WritebackPacer, start_writeback  # noqa: E402


def write_file(path: str, nbytes: int, data: memoryview, every: int | None) -> float:
    """Seconds to create, fill and fsync `path`; `every`: start the write-out every that many bytes."""
    if os.path.exists(path):
        os.unlink(path)
    start = time.perf_counter()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        pacer = WritebackPacer(every) if every else None
        for offset in range(0, nbytes, len(data)):
            piece = data[:min(len(data), nbytes - offset)]
            os.pwrite(fd, piece, offset)
            if pacer is not None and pacer.due(len(piece)):
                start_writeback(fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512, help="file size in MB (10^6 bytes)")
    parser.add_argument("--chunk-mib", type=int, default=4, help="size of each write")
    parser.add_argument("--every", default="8,16,32,64,128", help="comma-separated K (MiB) to try")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dir", default="/tmp", help="folder on the disk to measure (not tmpfs)")
    parser.add_argument("--json", default=None, help="result file (default tools/results/bench_writeback.json)")
    args = parser.parse_args()

    nbytes, data = args.mb * 10**6, memoryview(os.urandom(args.chunk_mib * 2**20))
    path = os.path.join(args.dir, f"zeroshard-bench-writeback-{os.getpid()}.bin")
    every = [int(k) for k in args.every.split(",")]
    sides = {"none": lambda: write_file(path, nbytes, data, None)}
    sides.update({f"every_{k}": (lambda k=k: write_file(path, nbytes, data, k * 2**20)) for k in every})
    try:
        times = benchlib.interleave(sides, args.repeats)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    report = benchlib.Report("bench_writeback", vars(args),
                             f"CPU, {args.mb} MB file in {args.chunk_mib} MiB pwrites + fsync, folder {args.dir}")
    report.runs("none", times["none"], "write + fsync, no early writeback")
    for k in every:
        report.runs(f"every_{k}", times[f"every_{k}"], f"write + fsync, write-out started every {k} MiB")
        report.ratio(f"every_{k}_vs_none", f"every_{k}", "none")
    print(report.table())
    print(f"raw JSON: {report.finish(args.json)}")


if __name__ == "__main__":
    main()
