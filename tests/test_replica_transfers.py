"""Files moved between ranks (checkpointing/replicas.run_transfers): chunked, checked before they
land, and every byte off the wire whatever fails, so the next transfer of a plan still lines up."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from distributed import run_ranks

TIER = "default"  # docs/TESTING.md

CHUNK = 1000  # bytes: files of a few chunks, a ragged last one, exercise both receive buffers


def _transfer(rank: int, world_size: int, root: str) -> dict:
    from zeroshard.checkpointing import replicas
    from zeroshard.storage.hashing import hash_bytes

    src_dir, dst_dir = Path(root, "src"), Path(root, "dst")
    same = random.Random(7)  # the same bytes on both ranks
    files = {"multi": same.randbytes(5 * CHUNK + 123), "one": same.randbytes(CHUNK), "empty": b"",
             "broken-writer": same.randbytes(4 * CHUNK + 1), "refused": same.randbytes(3 * CHUNK),
             "unreadable": b"", "after": same.randbytes(2 * CHUNK + 7)}
    if rank == 0:
        src_dir.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            if name != "unreadable":
                (src_dir / name).write_bytes(data)
    torch.distributed.barrier()
    checked: list[tuple[str, int]] = []

    def read(name: str) -> torch.Tensor:
        return replicas.map_file(str(src_dir / name))  # "unreadable" is missing: an error at the source

    def check(name: str, size: int, digest: str, file_rank: int) -> None:
        checked.append((name, file_rank))
        assert (size, digest) == (len(files[name]), hash_bytes(files[name])), name  # what was sent
        if name == "refused":
            raise ValueError("refused by the check")

    class Landing(replicas.Landing):
        def writer(self, name: str):
            writer = super().writer(name)
            if name == "broken-writer":  # the disk fills on its third chunk, in the background write
                calls, write = [0], writer.write

                def filling(view):
                    calls[0] += 1
                    if calls[0] == 3:
                        writer._file = FullDisk()
                    write(view)
                writer.write = filling
            return writer

    class FullDisk:
        closed = False

        def write(self, view):
            raise OSError(28, "No space left on device")

        def close(self):
            self.closed = True

    old = replicas.CHUNK_BYTES
    replicas.CHUNK_BYTES = CHUNK  # the pool's processes are reused: restored below
    try:
        plan = [(name, k, 0, 1) for k, name in enumerate(files)]
        error = replicas.run_transfers(plan, rank, read, check, None, Landing(str(dst_dir)))
    finally:
        replicas.CHUNK_BYTES = old
    if rank == 0:
        return {"error": repr(error)}
    landed = {p.name: p.read_bytes() for p in dst_dir.iterdir()} if dst_dir.exists() else {}
    return {"error": repr(error), "checked": checked,
            "landed": {name: data == files.get(name) for name, data in landed.items()}}


def test_files_land_whole_and_checked_and_a_failed_one_leaves_nothing_but_its_error(tmp_path):
    sender, receiver = run_ranks(_transfer, 2, timeout=60, root=str(tmp_path))
    assert "FileNotFoundError" in sender["error"]  # the source could not read "unreadable"
    # the receiver's first error, the failed write, names the file; the plan went on after it
    assert "StorageError" in receiver["error"] and "no space left on device" in receiver["error"], receiver
    assert "dst/broken-writer:" in receiver["error"], receiver
    # each file was checked once with its sender's size and hash; not the ones that failed first
    assert receiver["checked"] == [("multi", 0), ("one", 1), ("empty", 2), ("refused", 4), ("after", 6)]
    # landed: byte for byte the files accepted, and nothing else (no temp files, nothing refused)
    assert receiver["landed"] == {"multi": True, "one": True, "empty": True, "after": True}


def _refused(rank: int, world_size: int, root: str) -> dict:
    from zeroshard.checkpointing import replicas

    src_dir = Path(root, "src")
    if rank == 0:
        src_dir.mkdir(parents=True, exist_ok=True)
        (src_dir / "a").write_bytes(b"x" * 2500)
        (src_dir / "b").write_bytes(b"")
    torch.distributed.barrier()
    old = replicas.CHUNK_BYTES
    replicas.CHUNK_BYTES = CHUNK
    try:
        landing = replicas.Landing(str(Path(root, "dst")), refused=PermissionError("not this job's folder"))
        error = replicas.run_transfers([("a", 0, 0, 1), ("b", 1, 0, 1)], rank,
                                       lambda name: replicas.map_file(str(src_dir / name)),
                                       lambda *args: None, None, landing)
    finally:
        replicas.CHUNK_BYTES = old
    return {"error": repr(error), "dst": Path(root, "dst").exists()}


def test_a_landing_that_may_not_write_still_takes_every_byte_so_the_sender_finishes(tmp_path):
    sender, receiver = run_ranks(_refused, 2, timeout=60, root=str(tmp_path))
    assert sender == {"error": "None", "dst": False}
    assert receiver == {"error": "PermissionError(\"not this job's folder\")", "dst": False}
