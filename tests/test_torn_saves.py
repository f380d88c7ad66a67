"""A save torn by a lost peer: rank 0 marks its claim torn, and the rank files the save left are
removed by the next save of that tag (at any world size), by pruning, or by `zeroshard clean`
([Note: torn saves] in zeroshard/checkpointing/save.py).

The loss is simulated where it is seen: the exchange of the ranks' results after every rank
wrote its file raises PeerLostError, as gloo's broken connection does when a node dies then.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from test_clean import dead_owner

import zeroshard
from zeroshard.cli import main
from zeroshard.storage.claim import CLAIM_NAME, is_torn
from zeroshard.storage.owner import owner_tag

from distributed import run_ranks

TIER = "default"  # docs/TESTING.md

RANK_FILES_OF_2 = ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]


def _engine() -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    engine = zeroshard.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  config={"zero_optimization": {"stage": 2}})
    engine.backward(engine(torch.ones(5, 4)).pow(2).mean())
    engine.step()
    return engine


def torn_save(rank: int, world: int, root: str, tag: str) -> str:
    """Every rank writes its file; then the exchange of results breaks, as when a node dies."""
    from zeroshard.checkpointing import save as save_module
    from zeroshard.errors import PeerLostError

    engine = _engine()
    real_agree, real_write, wrote = save_module.agree, save_module.write_rank_file, []

    def write_rank_file(*args, **kwargs):
        result = real_write(*args, **kwargs)
        wrote.append(True)
        return result

    def agree(error, group, **kwargs):
        if wrote:  # the exchange of results, after this rank wrote its file
            raise PeerLostError("the checkpoint save", {1 - rank: "nodeB"}, "Connection closed by peer")
        return real_agree(error, group, **kwargs)

    save_module.agree, save_module.write_rank_file = agree, write_rank_file
    try:
        engine.save_checkpoint(root, tag=tag)
    except Exception as exc:
        return type(exc).__name__
    finally:
        save_module.agree, save_module.write_rank_file = real_agree, real_write
    return "saved"


def save_tags(rank: int, world: int, root: str, tags: list[str], keep_last: int | None = None) -> None:
    engine = _engine()
    for tag in tags:
        engine.save_checkpoint(root, tag=tag, keep_last=keep_last)


def _torn(root: Path, tag: str) -> None:
    """A torn save of `tag` by 2 ranks in processes that are gone afterwards."""
    outcomes = run_ranks(torn_save, 2, root=str(root), tag=tag, fresh=True, timeout=120)
    assert outcomes == ["PeerLostError", "PeerLostError"], outcomes
    assert sorted(p.name for p in (root / tag).iterdir()) == [CLAIM_NAME, *RANK_FILES_OF_2]
    assert is_torn(json.loads((root / tag / CLAIM_NAME).read_text()))


def _cli(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    return result.output


@pytest.mark.timeout(300)
def test_a_torn_save_is_marked_and_its_files_go_when_the_tag_is_saved_again_at_another_world_size(tmp_path):
    root = tmp_path / "ck"
    _torn(root, "step-00000002")
    assert not (root / "latest").exists()
    listed = _cli("clean", str(root))  # a dry run: the files are an interrupted writer's, stale
    for name in [*RANK_FILES_OF_2, CLAIM_NAME]:
        assert f"{root / 'step-00000002' / name}" in listed, listed
    assert "3 stale leftover(s)" in listed, listed
    listed = _cli("ls", str(root))
    assert "step-00000002" in listed and "INCOMPLETE: 2 rank file(s), no zeroshard.json: a torn save" in listed, listed

    # the job goes on with one rank and saves that tag again: not refused, and nothing of the
    # 2-rank save stays beside the new one
    run_ranks(save_tags, 1, root=str(root), tags=["step-00000002"], timeout=120)
    assert sorted(p.name for p in (root / "step-00000002").iterdir()) == [
        "rank-00000-of-00001.safetensors", "zeroshard.json"]
    assert "OK" in _cli("verify", str(root))


@pytest.mark.timeout(300)
def test_clean_removes_a_torn_save_and_its_folder(tmp_path):
    root = tmp_path / "ck"
    _torn(root, "step-00000002")
    removed = _cli("clean", str(root), "--yes")
    assert removed.count("removed ") == 3, removed
    assert list(root.iterdir()) == []


def _claim(folder: Path, owner: str) -> None:
    folder.mkdir(parents=True)
    (folder / CLAIM_NAME).write_text(json.dumps({"owner": owner, "time": time.time(), "nonce": "n"}))
    (folder / RANK_FILES_OF_2[0]).write_bytes(b"x" * 10)


@pytest.mark.timeout(300)
def test_pruning_removes_torn_saves_whose_writers_are_gone_and_nothing_else(tmp_path):
    root = tmp_path / "ck"
    _torn(root, "step-00000001")
    _claim(root / "step-00000002", dead_owner())  # its rank 0 was killed: claim unmarked
    _claim(root / "step-00000003", owner_tag())  # a live writer (this process)
    (root / "mine").mkdir()
    (root / "mine" / RANK_FILES_OF_2[0]).write_bytes(b"x" * 10)  # no claim: nothing says whose it is
    run_ranks(save_tags, 1, root=str(root), tags=["step-00000004", "step-00000005"], keep_last=1,
              init_process_group=False, timeout=120)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "mine", "step-00000003", "step-00000005"]
    assert sorted(p.name for p in (root / "step-00000003").iterdir()) == [CLAIM_NAME, RANK_FILES_OF_2[0]]
    assert os.listdir(root / "mine") == [RANK_FILES_OF_2[0]]


def test_rank_files_no_claim_vouches_for_are_never_removed(tmp_path):
    """Rank files in a folder without a commit file and without an earlier writer's claim (say,
    copied there by hand): nothing says they are a torn save's, so no writer removes them."""
    from checkpoints import training_state, write_checkpoint

    specs, data = training_state()
    write_checkpoint(str(tmp_path / "ck"), specs, data, 2)
    by_hand = tmp_path / "by-hand"
    by_hand.mkdir()
    (by_hand / RANK_FILES_OF_2[0]).write_bytes(b"mine")
    result = CliRunner().invoke(main, ["reshard", str(tmp_path / "ck"), "--to", "3", "-o", str(by_hand)])
    assert result.exit_code != 0 and "exists" in result.output, result.output
    assert os.listdir(by_hand) == [RANK_FILES_OF_2[0]]
    assert (by_hand / RANK_FILES_OF_2[0]).read_bytes() == b"mine"

    root = tmp_path / "root"
    (root / "step-00000002").mkdir(parents=True)
    (root / "step-00000002" / "rank-00003-of-00004.safetensors").write_bytes(b"mine")
    run_ranks(save_tags, 1, root=str(root), tags=["step-00000002"])
    assert (root / "step-00000002" / "rank-00003-of-00004.safetensors").read_bytes() == b"mine"


@pytest.mark.s3
@pytest.mark.timeout(300)
def test_a_torn_save_on_s3_is_marked_and_saved_again_at_another_world_size(s3_bucket, s3_endpoint):
    import s3fs

    env = {k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                      "AWS_DEFAULT_REGION")}
    root, tag = f"{s3_bucket}/ck", "step-00000002"
    outcomes = run_ranks(torn_save, 2, root=root, tag=tag, fresh=True, env=env, timeout=180)
    assert outcomes == ["PeerLostError", "PeerLostError"], outcomes
    fs = s3fs.S3FileSystem()
    folder = f"{root[len('s3://'):]}/{tag}"
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(folder)) == [CLAIM_NAME, *RANK_FILES_OF_2]
    assert is_torn(json.loads(fs.cat_file(f"{folder}/{CLAIM_NAME}")))
    run_ranks(save_tags, 1, root=root, tags=[tag], env=env, timeout=180)
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(folder)) == ["rank-00000-of-00001.safetensors",
                                                                   "zeroshard.json"]
