"""tools/sim_405b.py (issue 55): its sparse checkpoint is what the writer writes, less the data.

At a tiny scale (2 layers of a narrow Llama, 8 ranks) the simulated rank files must carry the
exact headers and sizes write_rank_file gives a real checkpoint of the same tensors, the dry runs
on it must name the files and bytes a real reshard to 6 ranks and a real consolidate write, and
the tool's end-to-end run must record every figure SCALE.md binds.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

TIER = "default"  # docs/TESTING.md

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import sim_405b  # noqa: E402

from zeroshard.format import build_manifest, commit_checkpoint, write_rank_file  # noqa: E402
from zeroshard.format.manifest import rank_contents  # noqa: E402
from zeroshard.partition import holders, shard_range  # noqa: E402
from zeroshard.storage.location import Location  # noqa: E402
from zeroshard.toolkit import consolidate, reshard  # noqa: E402

TINY = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 96, "vocab": 80}
WORLD, TO = 8, 6


def _specs(world: int = WORLD) -> tuple[list, dict]:
    params = sim_405b.llama_params(**TINY)
    return sim_405b.engine_tensors(params, world, 40), sim_405b.manifest_fields(params, world, 7, TINY)


def _real(folder: Path, specs: list, fields: dict, checkpoint_id: str) -> None:
    """The same checkpoint written by the format's writer, data zeros."""
    location = Location(str(folder))
    location.makedirs()

    def fill(spec, start, end, write):
        write(memoryview(bytes((end - start) * spec.itemsize)))

    results = [write_rank_file(location, checkpoint_id, r, WORLD, rank_contents(specs, WORLD, r), fill)
               for r in range(WORLD)]
    commit_checkpoint(location, build_manifest(specs, WORLD, results, checkpoint_id, **fields))


def test_llama_405b_has_its_real_parameter_count_and_names():
    params = sim_405b.llama_params(**sim_405b.SHAPE_405B)
    assert sum(math.prod(shape) for _, shape in params) == 405_853_388_800
    names = dict(params)
    assert names["model.layers.125.self_attn.k_proj.weight"] == (1024, 16384)
    assert names["model.layers.0.mlp.down_proj.weight"] == (16384, 53248)
    assert names["lm_head.weight"] == names["model.embed_tokens.weight"] == (128256, 16384)
    assert len(params) == 126 * 9 + 3


def test_sparse_files_carry_the_writers_headers_and_sizes(tmp_path):
    specs, fields = _specs()
    sim = sim_405b.write_sparse(tmp_path / "sim", specs, WORLD, fields, checkpoint_id="ab" * 16)
    _real(tmp_path / "real", specs, fields, "ab" * 16)
    for r in range(WORLD):
        name = f"rank-{r:05d}-of-{WORLD:05d}.safetensors"
        real, fake = (tmp_path / "real" / name).read_bytes(), (tmp_path / "sim" / name).read_bytes()
        assert len(fake) == len(real) == sim.files[r].size
        head = 8 + int.from_bytes(real[:8], "little")
        assert fake[:head] == real[:head]
        assert fake[head:] == bytes(len(fake) - head)  # the data: a hole, read as zeros
    # the manifests differ only in the file hashes the simulation cannot know
    real_doc = json.loads((tmp_path / "real" / "zeroshard.json").read_bytes())
    sim_doc = json.loads((tmp_path / "sim" / "zeroshard.json").read_bytes())
    for doc in (real_doc, sim_doc):
        for f in doc["files"]:
            f.pop("hash")
    assert sim_doc == real_doc


def test_dry_runs_name_the_files_and_bytes_the_real_commands_write(tmp_path):
    specs, fields = _specs()
    sim_405b.write_sparse(tmp_path / "sim", specs, WORLD, fields, checkpoint_id="cd" * 16)
    _real(tmp_path / "real", specs, fields, "cd" * 16)
    plan = reshard.dry_run(str(tmp_path / "sim"), TO, str(tmp_path / "out"))
    done = reshard.reshard(str(tmp_path / "real"), TO, str(tmp_path / "out"))
    sizes = {f.name: f.size for f in done.manifest.files}
    carried = sum(t.nbytes for t in specs if t.layout != "local")
    assert f"read {carried:,} bytes from {WORLD} of {WORLD} input files" in plan
    assert f"write {sum(sizes.values()):,} bytes ({carried:,} of tensor data) into {TO} files" in plan
    for name, size in sizes.items():
        assert f"  {name}: {size:,} bytes, " in plan
    export = tmp_path / "export"
    plan = consolidate.dry_run(str(tmp_path / "sim"), str(export), dtype="bf16", max_shard_size="200KB")
    written = consolidate.consolidate(str(tmp_path / "real"), str(export), dtype="bf16", max_shard_size="200KB")
    shards = [Path(u) for u in written if u.endswith(".safetensors")]
    weights = sum(t.numel for t in specs if t.role == "param") * 2
    assert f"{len(shards)} file(s), {weights:,} bytes of weights" in plan
    for shard in shards:
        assert f"  {shard.name}: {shard.stat().st_size:,} bytes, " in plan


def test_the_tool_records_every_figure_at_a_tiny_scale(tmp_path):
    out = tmp_path / "sim.json"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "sim_405b.py"), *flags, "--world", str(WORLD),
                           "--to", str(TO), "--repeat", "1", "--dir", str(tmp_path / "work"), "--json", str(out)],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    for key in ("reshard_dry_run", "consolidate_dry_run", "inspect", "ls", "load_plan"):
        assert data["values"][f"{key}_s"]["met"] and data["values"][f"{key}_rss_MiB"]["met"], key
    params = sim_405b.llama_params(**TINY)
    assert data["values"]["parameters"]["value"] == sum(math.prod(s) for _, s in params)
    # rank 1 of 6 loads its range of every parameter: the old ranks holding it, by the rule itself
    needed = sorted({r for _, s in params for r, _ in holders(math.prod(s), WORLD,
                                                              *shard_range(math.prod(s), TO, 1))})
    assert f"from files {', '.join(map(str, needed))};" in proc.stdout
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("doc", ["docs/SCALE.md"])
def test_scale_md_binds_the_simulation_figures(doc):
    import test_docs_figures

    text = (ROOT / doc).read_text()
    start = text.index("## Simulated: Llama 3.1 405B over 16,384 ranks")
    section = text[start:text.find("\n## ", start + 1)]
    assert "tools/results/sim_405b.json" in section
    assert test_docs_figures.problems(section) == []
