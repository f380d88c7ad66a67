"""A save over a committed tag with overwrite=True (zeroshard.deepspeed always passes it, as DeepSpeed
overwrites; the HF Trainer resumed from an earlier checkpoint saves its later ones again): the new
files are staged beside the old checkpoint and swapped in by rank 0 at the commit, so a failure
before the swap leaves the old checkpoint byte for byte, and one inside it leaves the new checkpoint
whole in the stage (checkpointing/save.py, format/output.py)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from distributed import run_ranks

TIER = "default"  # docs/TESTING.md


def _engine() -> Any:
    import zeroshard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return zeroshard.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                {"zero_optimization": {"stage": 3}})


def _train(engine: Any, seed: int) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed + engine.rank))
    engine.backward(engine(x).pow(2).mean())
    engine.step()


def _saves(rank: int, world: int, root: str, steps: int, fail: str | None = None,
           async_save: bool = False) -> dict[str, Any]:
    """Train `steps` steps, then save tag "t" without and with overwrite. `fail`: make the
    overwrite fail, on rank 1's write ("write"), at rank 0's manifest ("manifest") or after the
    swap moved the first file up ("swap")."""
    import zeroshard
    from zeroshard.checkpointing import save as save_module
    from zeroshard.storage.location import Location

    engine = _engine()
    for step in range(steps):
        _train(engine, step)
    out: dict[str, Any] = {"state": {k: v.clone() for k, v in engine.full_state_dict().items()}}
    try:
        engine.save_checkpoint(root, tag="t")
        out["plain"] = "saved"
    except zeroshard.CheckpointSaveError as exc:
        out["plain"] = str(exc)
    real_write, real_build, real_move = save_module.write_rank_file, save_module.build_manifest, Location.move_into
    moved = []

    def write(*args: Any, **kwargs: Any) -> Any:
        if rank == 1:
            raise OSError(28, "No space left on device (injected)")
        return real_write(*args, **kwargs)

    def build(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the manifest could not be built (injected)")

    def move(self: Location, name: str, dest: Location) -> None:
        if moved:
            raise OSError(5, "Input/output error (injected)")
        moved.append(name)
        real_move(self, name, dest)

    if fail == "write":
        save_module.write_rank_file = write
    elif fail == "manifest":
        save_module.build_manifest = build
    elif fail == "swap":
        Location.move_into = move
    try:
        out["overwrite"] = engine.save_checkpoint(root, tag="t", overwrite=True, async_save=async_save)
        engine.wait()  # an async one commits (or raises) here
    except zeroshard.CheckpointSaveError as exc:
        out["overwrite"] = "error: " + str(exc)
    finally:  # the worker process runs other tests after this one
        save_module.write_rank_file, save_module.build_manifest, Location.move_into = real_write, real_build, real_move
    return out


def _files(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _read(root: Path) -> dict[str, torch.Tensor]:
    import zeroshard

    return dict(zeroshard.load_state_dict(str(root)))


def _first_save(root: Path, world_after: int = 2) -> dict[str, torch.Tensor]:
    """A committed checkpoint "t" after one step; resharded to `world_after` ranks in place."""
    from zeroshard.toolkit.reshard import reshard

    first = run_ranks(_saves, 2, timeout=120, root=str(root), steps=1)[0]
    assert first["plain"] == "saved"
    if world_after != 2:
        reshard(str(root / "t"), world_after, str(root.parent / "resharded"))
        shutil.rmtree(root / "t")
        os.rename(root.parent / "resharded", root / "t")
    return first["state"]


@pytest.mark.parametrize("async_save", [False, True])
def test_overwrite_replaces_a_committed_tag_at_another_world_size(tmp_path, async_save):
    from zeroshard.toolkit.verify import verify

    root = tmp_path / "ck"
    _first_save(root, world_after=3)
    result = run_ranks(_saves, 2, timeout=120, root=str(root), steps=3, async_save=async_save)
    assert all("committed checkpoint with this tag exists" in r["plain"] and "overwrite=True" in r["plain"]
               for r in result)  # unasked, still refused
    assert result[0]["overwrite"] == str(root / "t")
    # the 3-rank files went with the old checkpoint; nothing staged is left
    assert sorted(os.listdir(root / "t")) == ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors",
                                              "zeroshard.json"]
    assert verify(str(root)).ok and (root / "latest").read_text().strip() == "t"
    weights = _read(root)
    assert weights.keys() == result[0]["state"].keys()
    assert all(torch.equal(weights[k], v) for k, v in result[0]["state"].items())  # step 3's, not step 1's


@pytest.mark.parametrize("fail", ["write", "manifest"])
def test_a_failed_overwrite_leaves_the_old_checkpoint_byte_for_byte(tmp_path, fail):
    from zeroshard.toolkit.verify import verify

    root = tmp_path / "ck"
    old_state = _first_save(root)
    before = _files(root / "t")
    result = run_ranks(_saves, 2, timeout=120, root=str(root), steps=2, fail=fail)
    for r in result:
        assert r["overwrite"].startswith("error: ") and "nothing committed" in r["overwrite"], r["overwrite"]
        assert ("No space left" if fail == "write" else "could not be built") in r["overwrite"]
        assert fail == "write" or "the checkpoint already there is unchanged" in r["overwrite"]
    assert sorted(os.listdir(root / "t")) == sorted(before)  # no stage, no claim left
    assert _files(root / "t") == before and verify(str(root)).ok
    assert all(torch.equal(_read(root)[k], v) for k, v in old_state.items())
    # the tag is free again: the next overwrite commits
    again = run_ranks(_saves, 2, timeout=120, root=str(root), steps=2)
    assert again[0]["overwrite"] == str(root / "t") and verify(str(root)).ok


def test_an_overwrite_interrupted_inside_the_swap_keeps_the_new_checkpoint_whole(tmp_path):
    """The window of docs/SAFETY.md section 2: the old manifest is gone and a file moved up when
    the swap fails. The stage (with the new manifest) is kept, `clean` does not remove it, and
    moving its files up gives the new checkpoint, verified."""
    from zeroshard.storage.leftovers import KEEP_REASON, find_leftovers
    from zeroshard.storage.location import Location
    from zeroshard.toolkit.verify import verify

    root = tmp_path / "ck"
    _first_save(root)
    result = run_ranks(_saves, 2, timeout=120, root=str(root), steps=2, fail="swap")
    for r in result:
        assert r["overwrite"].startswith("error: ") and "Input/output error" in r["overwrite"]
        assert "nothing is lost" in r["overwrite"] and "move the stage's files up" in r["overwrite"]
    stages = [p for p in (root / "t").iterdir() if p.is_dir()]
    assert len(stages) == 1 and (stages[0] / "zeroshard.json").exists()
    assert not (root / "t" / "zeroshard.json").exists()  # un-committed: never loaded half old, half new
    kept = [x for x in find_leftovers(Location(str(root))) if x.kind == "staging folder"]
    assert len(kept) == 1 and kept[0].keep == KEEP_REASON and not kept[0].stale(0)
    again = run_ranks(_saves, 2, timeout=120, root=str(root), steps=3)  # never written over, asked or not
    for r in again:
        assert "swap into place was interrupted" in r["plain"] and "interrupted" in r["overwrite"], r
    assert [p.name for p in (root / "t").iterdir() if p.is_dir()] == [stages[0].name]
    for p in stages[0].iterdir():
        if not p.name.startswith("."):
            os.replace(p, root / "t" / p.name)  # the recovery SAFETY.md gives
    assert verify(str(root / "t")).ok
    weights = _read(root / "t")
    assert all(torch.equal(weights[k], v) for k, v in result[0]["state"].items())


@pytest.mark.s3
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fail", [None, "write"])
def test_overwrite_on_s3(s3_bucket, s3_endpoint, fail):
    """On S3 the stage is a prefix in the tag's folder and the swap is server-side copies."""
    import s3fs

    from zeroshard.toolkit.verify import verify

    env = {k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                      "AWS_DEFAULT_REGION")}
    root = f"{s3_bucket}/ck"
    first = run_ranks(_saves, 2, root=root, steps=1, env=env, timeout=180)[0]
    fs = s3fs.S3FileSystem()
    folder = f"{root[len('s3://'):]}/t"
    before = {p: fs.info(p)["ETag"] for p in fs.ls(folder)}
    result = run_ranks(_saves, 2, root=root, steps=2, fail=fail, env=env, timeout=180)
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(folder))
    assert names == ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors", "zeroshard.json"]
    assert verify(root).ok
    import zeroshard

    weights = zeroshard.load_state_dict(root)
    expected = (first if fail else result[0])["state"]
    assert all(torch.equal(weights[k], v) for k, v in expected.items())
    if fail:
        assert all(r["overwrite"].startswith("error: ") for r in result)
        assert {p: fs.info(p)["ETag"] for p in fs.ls(folder)} == before
    else:
        assert result[0]["overwrite"] == f"{root}/t"
