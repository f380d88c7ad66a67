"""A Llama-3.1-405B training checkpoint at 16,384 ranks, simulated: the metadata tools timed on it.

    python tools/sim_405b.py                      # 405B over 16,384 ranks, reshard to 12,288 (~9 GB of headers)
    python tools/sim_405b.py --layers 2 --world 64 --to 48 --json /tmp/sim.json   # a quick look

Writes the checkpoint zeroshard's engine saves for Llama 3.1 405B under ZeRO-3 (HF names, 126
layers, hidden 16384, 128 heads, 8 KV heads, head_dim 128, FFN 53248, vocab 128256, untied
embeddings): per parameter the fp32 master and AdamW's exp_avg and exp_avg_sq (F32, layout flat),
Adam's step in the manifest, compute dtype BF16 recorded in `dtypes` (the engine stores no bf16
copy: the bf16 weights are a cast of the masters, which `consolidate --dtype bf16` writes), and
each rank's rank-state blob (its RNG streams, `--rank-state-bytes`). The manifest and every rank
file's header are the bytes the project's writer puts there (zeroshard.format.layouts composes
them; tests/test_sim_405b.py checks them against write_rank_file); each file is then extended to
its real size with ftruncate, so its data (the fragments and the fragment-hash table) is a hole:
nothing reads as the checkpoint's values, and the manifest's file hashes are placeholders (a
`verify` fails, by design). Only the headers take disk space: `--world` x one header.

Then each command runs as a fresh process, as a user runs it (wall time, and CPU time and peak
RSS from GNU time, /usr/bin/time), `--repeat` times, interleaved:

- `zeroshard reshard CKPT --to TO --dry-run`
- `zeroshard consolidate CKPT OUT --dtype bf16 --max-shard-size 5GB --dry-run` (HF's layout)
- `zeroshard inspect CKPT` and `zeroshard ls ROOT`
- the load plan of rank `--rank` of TO ranks, in a fresh process doing only that (timed after its
  imports): what load_checkpoint does before reading a byte (zeroshard/checkpointing/load.py,
  open_checkpoint + open_needed_files): read and check the manifest, find the fragments of this
  rank's range of every parameter at the new world size (format.reader.fragments_of), open the
  files holding them and check their headers against the manifest. Without torch, which the
  engine's module imports (290 MB of RSS on its own): the figure is the plan's.

Raw JSON: tools/results/sim_405b.json (--json PATH elsewhere). Targets (issue 55): each dry run,
inspect and ls <= 30 s and <= 1 GiB; the load plan <= 1 s and <= 256 MiB.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import benchlib  # noqa: E402  (puts the repository on sys.path)
from bench_env import use_compiled_bytecode  # noqa: E402

from zeroshard.format import FileEntry, Manifest, TensorEntry, commit_checkpoint, rank_file_name  # noqa: E402
from zeroshard.format.layouts import RankLayouts  # noqa: E402
from zeroshard.format.manifest import FORMAT_VERSION  # noqa: E402
from zeroshard.format.training_state import optimizer_key, rank_state_key  # noqa: E402
from zeroshard.storage.location import Location  # noqa: E402

# Llama 3.1 405B (meta-llama/Llama-3.1-405B config.json)
SHAPE_405B = {"layers": 126, "hidden": 16384, "heads": 128, "kv_heads": 8, "ffn": 53248, "vocab": 128256}
# encode_rank_state({"rng": RNGState().state_dict()}) on a CPU-only machine: 15,601 bytes
# (zeroshard.checkpointing.stateful; a CUDA rank adds its generator's few bytes)
RANK_STATE_BYTES = 15601
PLACEHOLDER_HASH = "0" * 16  # no data was written, so no file hash exists
ADAMW = {"lr": 8e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False, "foreach": None,
         "maximize": False, "capturable": False, "differentiable": False, "fused": None}


def llama_params(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int) -> list[tuple[str, tuple]]:
    """(name, shape) of LlamaForCausalLM's parameters, in named_parameters() order (untied head)."""
    head_dim = hidden // heads
    out: list[tuple[str, tuple]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (heads * head_dim, hidden)),
                (p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
                (p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
                (p + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
                (p + "mlp.gate_proj.weight", (ffn, hidden)),
                (p + "mlp.up_proj.weight", (ffn, hidden)),
                (p + "mlp.down_proj.weight", (hidden, ffn)),
                (p + "input_layernorm.weight", (hidden,)),
                (p + "post_attention_layernorm.weight", (hidden,))]
    return out + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def engine_tensors(params: list[tuple[str, tuple]], world: int, rank_state_bytes: int) -> list[TensorEntry]:
    """The specs zeroshard's engine saves (checkpointing/contents.py): each parameter's fp32 master
    followed by its AdamW moments, then every rank's rank-state blob."""
    specs = []
    for name, shape in params:
        specs.append(TensorEntry(name, "param", "F32", shape, "flat"))
        specs += [TensorEntry(optimizer_key(s, name), "optimizer", "F32", shape, "flat", param=name, state=s)
                  for s in ("exp_avg", "exp_avg_sq")]
    if rank_state_bytes:
        specs += [TensorEntry(rank_state_key(r), "extra", "U8", (rank_state_bytes,), "local", owner=r)
                  for r in range(world)]
    return specs


def manifest_fields(params: list[tuple[str, tuple]], world: int, step: int, shape: dict) -> dict:
    """The manifest fields a ZeRO-3 AdamW run's save records (checkpointing/contents.py)."""
    names = [n for n, _ in params]
    engine = {"zero_stage": 3, "world_size": world, "shard_world_size": world, "global_steps": step,
              "micro_steps": step, "skipped_steps": 0, "loss_scaler": {}, "optimizer_class": "AdamW"}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape["hidden"],
              "intermediate_size": shape["ffn"], "num_attention_heads": shape["heads"],
              "num_hidden_layers": shape["layers"], "num_key_value_heads": shape["kv_heads"],
              "vocab_size": shape["vocab"], "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    return {"zero_stage": 3, "step": step, "dtypes": {"compute": "BF16", "master": "F32"},
            "optimizer": {"class": "torch.optim.adamw.AdamW", "param_groups": [{**ADAMW, "params": names}],
                          "scalar_state": {n: {"step": {"dtype": "F32", "value": float(step)}} for n in names}},
            "extra": {"engine": engine, "model_config": config}}


def write_sparse(folder: Path, specs: list[TensorEntry], world: int, fields: dict,
                 checkpoint_id: str | None = None) -> Manifest:
    """Every rank file as its header followed by a hole of the data's size, then the manifest
    (last: the commit). Returns the manifest."""
    checkpoint_id = checkpoint_id or uuid.uuid4().hex
    layouts = RankLayouts(specs, world, checkpoint_id, FORMAT_VERSION)
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for rank in range(world):
        header = layouts.header(rank)
        size = layouts.file_size(rank, header)
        name = rank_file_name(rank, world)
        fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(header)
            while view:
                view = view[os.write(fd, view):]
            os.ftruncate(fd, size)  # the data: a hole
        finally:
            os.close(fd)
        files.append(FileEntry(name, rank, size, PLACEHOLDER_HASH))
    manifest = Manifest(world_size=world, tensors={t.name: t for t in specs}, files=files, id=checkpoint_id, **fields)
    commit_checkpoint(Location(str(folder)), manifest)
    return manifest


def build(root: Path, args: argparse.Namespace) -> tuple[Path, Manifest]:
    """root/step-NNNNNN (the checkpoint) and root/latest naming it."""
    shape = {k: getattr(args, k) for k in SHAPE_405B}
    params = llama_params(**shape)
    ckpt = root / f"step-{args.step:06d}"
    manifest = write_sparse(ckpt, engine_tensors(params, args.world, args.rank_state_bytes), args.world,
                            manifest_fields(params, args.world, args.step, shape))
    (root / "latest").write_text(ckpt.name + "\n")
    return ckpt, manifest


# What load_checkpoint does for one rank before it reads a byte (checkpointing/load.py: open_checkpoint,
# then open_needed_files: this rank's range of each parameter at the new world size, the files
# holding it, each opened and its header checked against the manifest). Timed after the imports.
LOAD_PLAN = """
import sys, time
from zeroshard.format import CheckpointReader, open_checkpoint
from zeroshard.format.reader import fragments_of
from zeroshard.partition import shard_range
def vm(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
path, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
before = vm("VmRSS")
start, cpu = time.perf_counter(), time.process_time()
location, manifest = open_checkpoint(path)
ranks, pieces = set(), 0
for t in manifest.tensors.values():
    if t.role == "param":  # its optimizer state lies in the same files (same layout)
        s, e = shard_range(t.numel, world, rank) if t.layout == "flat" else (0, t.numel)
        for holder, _, _ in fragments_of(t, manifest.world_size, s, e):
            ranks.add(holder)
            pieces += 1
    elif t.role == "buffer":
        ranks.update(h for h, _, _ in fragments_of(t, manifest.world_size))
with CheckpointReader(location, manifest, complete_fragments=True) as reader:
    for holder in sorted(ranks):
        reader.open_file(holder)
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
print(f"{seconds:.6f} {cpu:.6f} {vm('VmHWM')} {before} {pieces} {' '.join(map(str, sorted(ranks)))}")
"""


def zeroshard(*args: str) -> list[str]:
    return [sys.executable, "-m", "zeroshard.cli", *args, "-q"]


TIME = "/usr/bin/time"  # GNU time: the child's peak RSS, measured from a process of its own


def run(cmd: list[str]) -> tuple[float, float, int, str]:
    """Wall seconds, CPU seconds (user + system), peak RSS (bytes) and stdout of one child process.

    Through GNU time, not wait4 from here: Linux carries a forked child's RSS before its exec into
    its ru_maxrss, so a child of this process (which holds the big manifest) would report at least
    this process's size."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as stats:
        start = time.perf_counter()
        proc = subprocess.run([TIME, "-f", "%M %U %S", "-o", stats.name, *cmd], capture_output=True)
        wall = time.perf_counter() - start
        if proc.returncode:
            raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr.decode()[-2000:]}")
        peak_kb, user, system = stats.read().split()[-3:]
    return wall, float(user) + float(system), int(peak_kb) * 1024, proc.stdout.decode()


def commands(root: Path, ckpt: Path, args: argparse.Namespace) -> dict[str, tuple[str, list[str], float, int]]:
    """key -> (label, command, seconds target, RSS target in MiB)."""
    export = root.parent / f"{root.name}-export"
    return {
        "reshard_dry_run": (f"zeroshard reshard --to {args.to} --dry-run",
                            zeroshard("reshard", str(ckpt), "--to", str(args.to), "--dry-run"), 30, 1024),
        "consolidate_dry_run": ("zeroshard consolidate --dtype bf16 --max-shard-size 5GB --dry-run",
                                zeroshard("consolidate", str(ckpt), str(export), "--dtype", "bf16",
                                          "--max-shard-size", "5GB", "--dry-run"), 30, 1024),
        "inspect": ("zeroshard inspect", zeroshard("inspect", str(ckpt)), 30, 1024),
        "ls": ("zeroshard ls (the run's root)", zeroshard("ls", str(root)), 30, 1024),
    }


def measure(root: Path, ckpt: Path, args: argparse.Namespace, rep: benchlib.Report) -> dict[str, str]:
    """Time every command `args.repeat` times, interleaved; record medians of wall time, CPU time
    (what the command costs when it has a core to itself: the cores here are shared) and peak
    RSS. Returns each command's last output."""
    cases = commands(root, ckpt, args)
    keys = [*cases, "load_plan"]
    seconds: dict[str, list[float]] = {k: [] for k in keys}
    cpu: dict[str, list[float]] = {k: [] for k in keys}
    rss: dict[str, list[int]] = {k: [] for k in keys}
    outputs: dict[str, str] = {}
    plan_cmd = [sys.executable, "-c", LOAD_PLAN, str(ckpt), str(args.rank), str(args.to)]
    for repeat in range(args.repeat):
        for key in benchlib.rotated(keys, repeat):
            if key == "load_plan":
                _, _, _, out = run(plan_cmd)
                took, used, peak, before, pieces, *files = out.split()
                took, used, peak = float(took), float(used), int(peak)
                outputs[key] = (f"rank {args.rank} of {args.to}: {pieces} pieces from files {', '.join(files)}; "
                                f"RSS {int(before) / 2**20:.1f} MiB after imports")
            else:
                took, used, peak, outputs[key] = run(cases[key][1])
            seconds[key].append(took)
            cpu[key].append(used)
            rss[key].append(peak)
    labels = {k: (label, bar_s, bar_mib) for k, (label, _, bar_s, bar_mib) in cases.items()}
    labels["load_plan"] = (f"load plan of rank {args.rank} of {args.to} (after imports)", 1, 256)
    for key, (label, bar_s, bar_mib) in labels.items():
        rep.runs(key, seconds[key], f"{label}: wall")
        rep.runs(f"{key}_cpu", cpu[key], f"{label}: CPU (user + system)")
        rep.value(f"{key}_s", benchlib.summary(seconds[key])["median"], "s", f"{label}: median wall time",
                  f"<= {bar_s}")
        rep.value(f"{key}_cpu_s", benchlib.summary(cpu[key])["median"], "s", f"{label}: median CPU time",
                  f"<= {bar_s}")
        rep.value(f"{key}_rss_MiB", benchlib.summary(rss[key])["median"] / 2**20, "MiB", f"{label}: peak RSS",
                  f"<= {bar_mib}")
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=16384, help="ranks of the simulated checkpoint")
    parser.add_argument("--to", type=int, default=12288, help="world size of the reshard and of the load plan")
    parser.add_argument("--rank", type=int, default=1, help="the rank whose load plan is timed (of --to)")
    for key, value in SHAPE_405B.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=value, help=f"(405B: {value})")
    parser.add_argument("--rank-state-bytes", type=int, default=RANK_STATE_BYTES,
                        help="each rank's rank-state blob (0: none)")
    parser.add_argument("--step", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each command (interleaved)")
    parser.add_argument("--dir", default="/tmp/zs-sim405b", help="scratch folder (holds world x one header)")
    parser.add_argument("--json", default=None, help="result file (default tools/results/sim_405b.json)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint (then --reuse it)")
    parser.add_argument("--reuse", action="store_true", help="time the checkpoint a --keep run left in --dir")
    args = parser.parse_args()
    if not 0 <= args.rank < args.to:
        raise SystemExit(f"--rank {args.rank} is not a rank of --to {args.to}")
    use_compiled_bytecode()  # the commands import from bytecode, as an installed zeroshard does
    work = Path(args.dir)
    root = work / "run"
    rep = benchlib.Report("sim_405b", vars(args), scope=(
        f"CPU, {benchlib.machine()['cores']} vCPUs, local disk, warm page cache; a simulated checkpoint (headers "
        f"and manifest real, data a hole); each command a fresh process (start-up included)"))
    if args.reuse:
        ckpt = root / (root / "latest").read_text().strip()
        from zeroshard.format import open_checkpoint

        manifest = open_checkpoint(str(ckpt))[1]
        print(f"reusing {ckpt}")
    else:
        shutil.rmtree(work, ignore_errors=True)
        start = time.perf_counter()
        ckpt, manifest = build(root, args)
        built = time.perf_counter() - start
        rep.value("build_s", built, "s", "writing the sparse checkpoint (headers, holes, manifest)")
        print(f"built {ckpt} in {built:.1f} s")
    files = sorted(ckpt.glob("rank-*.safetensors"))
    header = len(RankLayouts(list(manifest.tensors.values()), manifest.world_size, manifest.id,
                             manifest.version).header(0))
    on_disk = sum(f.stat().st_blocks * 512 for f in files)
    params = sum(t.numel for t in manifest.tensors.values() if t.role == "param")
    rep.value("parameters", params, "", "parameters")
    rep.value("tensors", len(manifest.tensors), "", "tensors in the manifest (rank-state blobs included)")
    rep.value("checkpoint_TB", sum(f.size for f in manifest.files) / 1e12, "TB", "the checkpoint's size (files)")
    rep.value("manifest_MB", (ckpt / "zeroshard.json").stat().st_size / 1e6, "MB", "manifest")
    rep.value("header_kB", header / 1e3, "kB", "rank 0's header")
    rep.value("headers_GB", on_disk / 1e9, "GB", f"disk used by the {len(files)} sparse rank files (headers)")
    outputs = measure(root, ckpt, args, rep)
    for key in ("reshard_dry_run", "consolidate_dry_run", "load_plan"):
        print(f"{key}: " + "\n  ".join(outputs[key].splitlines()[:3]))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    path = rep.finish(args.json)
    print("\n" + rep.table() + f"\n\nraw JSON: {path}")


if __name__ == "__main__":
    main()
