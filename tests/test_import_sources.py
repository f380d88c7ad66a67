"""One source registry (issue 54): every import source is one module with a SOURCE, listed in
zeroshard/interop/sources.py; `zeroshard import`'s subcommands, the hints a foreign folder gets
and resolve_checkpoint's errors all ask it, and format/ knows no foreign file name."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from zeroshard.cli import main
from zeroshard.errors import CheckpointError
from zeroshard.interop.sources import SOURCES, all_sources, foreign_checkpoint_kind, source, what_it_is
from zeroshard.storage.location import Location

TIER = "default"  # docs/TESTING.md

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"
# Every fixture checkpoint under tests/data, by glob, and the source that imports it (a later
# glob overrides an earlier one). A Trainer run folder (checkpoint-N inside) is told by its newest.
FIXTURES = {
    "deepspeed/*": "deepspeed",
    "deepspeed/hf_trainer_ddp": "dcp",  # the Trainer without DeepSpeed: `import dcp`
    "deepspeed_releases/*/*": "deepspeed",
    "dcp/*/*": "dcp",
    "accelerate_plain/*/checkpoint": "dcp",
    "torchtitan/interval/checkpoint/step-3": "dcp",
    "megatron/tp2": "megatron",
}


def _fixtures() -> dict[Path, str]:
    found: dict[Path, str] = {}
    for pattern, name in FIXTURES.items():
        matched = [p for p in DATA.glob(pattern) if p.is_dir()]
        assert matched, f"{pattern}: no fixture folder"
        found.update((p, name) for p in matched)
    return found


def test_the_registry_lists_every_source():
    """SOURCES names each module holding a SOURCE, under that source's name, and nothing else."""
    holders = {path.stem for path in (ROOT / "zeroshard" / "interop").glob("*.py")
               if any(isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "SOURCE" for t in node.targets)
                      for node in ast.parse(path.read_text()).body)}
    assert holders == set(SOURCES.values()) and "deepspeed_ckpt" in holders, (holders, SOURCES)  # the scan sees them
    assert [s.name for s in all_sources()] == list(SOURCES)
    for src in all_sources():
        assert src.label and src.help.strip() and callable(src.recognise) and callable(src.read), src.name
        assert all(o.kind in ("value", "int", "flag", "lines") and o.flags[0].startswith("--") for o in src.options)
    with pytest.raises(Exception, match="no import source 'nope'"):
        source("nope")


def test_each_fixture_is_recognised_as_exactly_its_own_source():
    """Each fixture folder is claimed by its own source alone (a Megatron folder is a DCP folder
    too: megatron comes first in SOURCES), and the hint names that source and the folder."""
    fixtures = _fixtures()
    assert len(fixtures) > 60 and set(fixtures.values()) == set(SOURCES)
    wrong = []
    for folder, name in sorted(fixtures.items()):
        kind = foreign_checkpoint_kind(Location(str(folder)))
        if kind is None or kind.source != name or kind.path != str(folder) and "Trainer run folder" not in kind.what:
            wrong.append(f"{folder.relative_to(DATA)}: {kind} (expected {name})")
            continue
        checkpoint = Location(kind.path)  # a run folder's newest checkpoint-N
        claims = [s.name for s in all_sources() if what_it_is(s, checkpoint, checkpoint.list())]
        if claims != [name] and not (name == "megatron" and claims == ["megatron", "dcp"]):
            wrong.append(f"{folder.relative_to(DATA)}: claimed by {claims} (expected {name})")
    assert not wrong, "\n".join(wrong)


def test_the_import_subcommands_are_the_registrys():
    """`zeroshard import`'s subcommands are exactly the sources, each with the source's help and
    options beside the common ones, and its help names every source's tool."""
    group = main.commands["import"]
    ctx = main.make_context("zeroshard", ["import", "--help"], resilient_parsing=True)
    assert group.list_commands(ctx) == sorted(SOURCES)
    assert group.get_command(ctx, "auto") is None
    common = {"src", "out", "world_size", "overwrite", "storage_option", "quiet", "debug"}
    for src in all_sources():
        command = group.get_command(ctx, src.name)
        assert command.help == src.help
        names = [p.name for p in command.params]
        assert set(names) == common | {o.flags[-1].lstrip("-").replace("-", "_") for o in src.options}, names
    result = CliRunner().invoke(main, ["import", "--help"])
    assert result.exit_code == 0, result.output
    for src in all_sources():
        assert src.label in result.output and f"\n  {src.name} " in result.output, result.output


def test_a_megatron_folder_is_told_to_import_megatron(tmp_path):
    """Its `.metadata` made it a DCP folder to the hints before the registry: now the CLI's hint,
    `ls` and the Python API's error all name `import megatron`."""
    src = DATA / "megatron" / "tp2"
    result = CliRunner().invoke(main, ["inspect", str(src)])
    assert result.exit_code == 1 and f"`zeroshard import megatron {src} OUT`" in result.output, result.output
    listed = CliRunner().invoke(main, ["ls", str(src.parent)])
    assert f"FOREIGN: a Megatron-Core dist checkpoint (torch_dist): `zeroshard import megatron {src} OUT`" \
        in listed.output, listed.output
    from zeroshard import open_tensors

    with pytest.raises(CheckpointError, match=f"convert it first with `zeroshard import megatron {src} OUT`"):
        open_tensors(str(src))


FOREIGN_NAMES = ("_model_states.pt", "_optim_states.pt", "mp_rank_", "latest_universal", ".distcp", "sharded_backend",
                 "optimizer.pt", "optimizer.bin", "pytorch_model_fsdp", "checkpoint-", "metadata.json")


def test_format_knows_no_foreign_file_name():
    """format/ names no import source's files and imports no interop module: what a foreign folder
    is comes from interop/sources.py, installed by the toolkit and interop packages."""
    mentions = [f"{path.name}: {name}" for path in sorted((ROOT / "zeroshard" / "format").glob("*.py"))
                for name in FOREIGN_NAMES if name in path.read_text()]
    assert not mentions, mentions
    code = ("import sys; from zeroshard.format import resolve_checkpoint; from zeroshard.storage.location import "
            "Location\ntry:\n    resolve_checkpoint(Location(sys.argv[1]))\nexcept Exception as exc:\n    print(exc)\n"
            "print(sorted(m for m in sys.modules if m.startswith('zeroshard.interop')))")
    out = subprocess.run([sys.executable, "-c", code, str(DATA / "deepspeed" / "stage1")], capture_output=True,
                         text=True, check=True).stdout
    assert "not a zeroshard checkpoint: neither zeroshard.json nor latest" not in out  # `latest` is there
    assert "zeroshard import" not in out and out.strip().endswith("[]"), out


def test_a_command_imports_only_the_source_it_names(tmp_path):
    """`verify` of a zeroshard checkpoint loads no source's module (the CLI's start-up stays as it
    was), `zeroshard import deepspeed` only its own; one process, in that order."""
    from checkpoints import training_state, write_checkpoint

    specs, data = training_state()
    write_checkpoint(str(tmp_path / "ck"), specs, data, 2)
    code = ("import sys\nfrom zeroshard.cli import main\n"
            "def run(*args):\n    main(list(args), standalone_mode=False)\n"
            "    print(sorted(m.rsplit('.', 1)[1] for m in sys.modules if m.startswith('zeroshard.interop.')))\n"
            "run('verify', sys.argv[1]); run('import', 'deepspeed', '--help')")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ck")], capture_output=True, text=True,
                         check=True).stdout
    after_verify, after_import = (set(ast.literal_eval(line)) & set(SOURCES.values())
                                  for line in out.strip().splitlines() if line.startswith("["))
    assert (after_verify, after_import) == (set(), {"deepspeed_ckpt"}), out
