"""The house rules of the code's layering, checked: the toolkit never imports the training core,
partition arithmetic imports nothing heavy, the CLI starts without torch, the engine never
imports checkpointing, and nothing outside zeroshard/engine touches the engine's private state."""

import ast
import subprocess
import sys
from pathlib import Path

TIER = "default"  # docs/TESTING.md


def imported_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    return set(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split())


def test_toolkit_never_imports_the_training_core():
    modules = imported_after("import zeroshard.cli, zeroshard.toolkit.consolidate, zeroshard.toolkit.reshard, "
                             "zeroshard.toolkit.shard, zeroshard.toolkit.verify, zeroshard.toolkit.inspect")
    assert not {m for m in modules if m.startswith(("zeroshard.engine", "zeroshard.checkpointing"))}
    assert "torch" not in modules  # start-up stays fast: torch comes only for a dtype cast


def test_partition_is_pure_arithmetic():
    modules = imported_after("import zeroshard.partition")
    assert not {m for m in modules if m.split(".")[0] in ("torch", "fsspec", "numpy", "safetensors")}


ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args:
            if isinstance(node.args[0], ast.Constant):
                found.add(str(node.args[0].value))
    return found


def test_the_engine_never_imports_checkpointing():
    for path in sorted((ROOT / "zeroshard" / "engine").glob("*.py")):
        above = {m for m in _imports(path) if m.startswith(("zeroshard.checkpointing", "zeroshard.training"))}
        assert not above, f"{path.name} imports {sorted(above)}: the engine knows nothing of checkpoints"
    modules = imported_after("import zeroshard.engine")
    assert not {m for m in modules if m.startswith(("zeroshard.checkpointing", "zeroshard.training"))}


def _engine_private_names() -> set[str]:
    """`self._x` attributes and `_x` methods of ZeroEngine (zeroshard/engine/engine.py)."""
    tree = ast.parse((ROOT / "zeroshard" / "engine" / "engine.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ZeroEngine")
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_")
             and not n.name.endswith("__")}
    for node in ast.walk(cls):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                and node.attr.startswith("_") and not node.attr.endswith("__")):
            names.add(node.attr)
    return names


def test_nothing_outside_the_engine_touches_its_private_state():
    private = _engine_private_names()
    assert {"_shard_by_param", "_stage3", "_refresh"} <= private  # the scan sees the engine's internals
    offenders = []
    files = [p for p in ROOT.glob("zeroshard/**/*.py") if "engine" not in p.relative_to(ROOT / "zeroshard").parts[:1]]
    files += [*ROOT.glob("tests/*.py"), *ROOT.glob("tools/*.py"), *ROOT.glob("samples/**/*.py")]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in private:
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id == "self" and path.name != "training.py":
                    continue  # another class's own attribute of the same name
                if isinstance(owner, ast.Name) and owner.id == "self":
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} self.{node.attr}")
                    continue
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert not offenders, "engine internals used outside zeroshard/engine: " + ", ".join(offenders)


def test_every_error_class_is_a_zeroshard_error_exported_from_the_package():
    import zeroshard
    from zeroshard import errors

    classes = {name: obj for name, obj in vars(errors).items()
               if isinstance(obj, type) and issubclass(obj, Exception) and not name.startswith("_")}
    assert len(classes) >= 9
    for name, cls in classes.items():
        assert issubclass(cls, zeroshard.ZeroshardError), name
        assert getattr(zeroshard, name) is cls and name in zeroshard.__all__, name
    # no public error class defined anywhere else in the package (private ones never leave their module)
    elsewhere = []
    for path in ROOT.glob("zeroshard/**/*.py"):
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and any(
                    getattr(b, "id", getattr(b, "attr", "")).endswith(("Error", "Exception")) for b in node.bases):
                elsewhere.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert not elsewhere, elsewhere


def _module_graph() -> dict[str, set[str]]:
    """zeroshard's files as modules, each with the zeroshard modules it imports (anywhere in the
    file, type-checking imports too). `from pkg import mod` is an edge to pkg.mod, not to pkg."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (ROOT / "zeroshard").rglob("*.py")}
    graph = {}
    for name, path in files.items():
        wanted = _imports(path)
        graph[name] = {m for m in wanted if m in files and m != name
                       and not any(other.startswith(m + ".") and other in files for other in wanted)}
    return graph


def test_no_import_circles_between_files():
    """The import graph of zeroshard's files is a DAG, inside packages too (issue 20)."""
    graph = _module_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100  # the graph was really read


def _bare_builtin_raises(root: Path) -> list[str]:
    """`raise X(...)` / `raise X` in root's .py files where X is a built-in exception and the line
    lacks the `# internal:` marker (a guard that only a zeroshard bug can trip)."""
    import builtins

    builtin = {n for n, o in vars(builtins).items() if isinstance(o, type) and issubclass(o, BaseException)}
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id in builtin and "# internal:" not in lines[node.lineno - 1]:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {exc.id}")
    found.sort(key=lambda s: (s.split(":")[0], int(s.split(":")[1].split()[0])))
    return found


def test_no_bare_builtin_raises(tmp_path):
    """Every error zeroshard raises is a ZeroshardError (issue 19); built-in ones only as marked internal guards."""
    offenders = _bare_builtin_raises(ROOT / "zeroshard")
    assert not offenders, "bare built-in raises (use a class from zeroshard/errors.py): " + ", ".join(offenders)
    # the scan itself sees both forms and honours the marker only on the raise line
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("def f(x):\n    if x:\n        raise ValueError('bad')\n    raise KeyError\n"
                              "def g():\n    raise RuntimeError('bug')  # internal: cannot happen\n")
    assert sorted(_bare_builtin_raises(pkg)) == ["pkg/m.py:3 ValueError", "pkg/m.py:4 KeyError"]
    internal = sum(line.count("# internal:") for p in (ROOT / "zeroshard").rglob("*.py") for line in [p.read_text()])
    assert 0 < internal <= 12  # a handful of guards, not a way around the rule


# ---- storage is the only door to bytes (issue 20) ----------------------------------------------------------
DOOR_CALLS = {f"os.{n}" for n in ("open", "fdopen", "fsync", "fdatasync", "write", "pwrite", "pwritev", "pread",
                                  "preadv")} | {"open()", "io.open"}

# Calls outside zeroshard/storage/ that stay, each named: the list can only shrink (a stale entry fails too).
DOOR_ALLOWED = {
    # not checkpoint data: small files the user names, read once
    ("zeroshard/cli.py", "open()"): "/proc/<ppid>/cmdline, to tell how the CLI was launched",
    ("zeroshard/deepspeed/config.py", "open()"): "the user's DeepSpeed JSON config",
    ("zeroshard/engine/config.py", "open()"): "engine: the user's JSON config",
    # not checkpoint data: the engine's NVMe parameter tier, a scratch file with O_DIRECT (no store has it)
    ("zeroshard/engine/param_offload.py", "os.open"): "engine: offload_param nvme scratch file (O_DIRECT)",
    ("zeroshard/format/signature.py", "open()"): "the user's signing key file",
    ("zeroshard/toolkit/consolidate.py", "open()"): "the user's --config JSON file",
    # DeepSpeed's own folder layout, read by the compatibility engine
    ("zeroshard/deepspeed/engine.py", "open()"): "DeepSpeed's `latest` tag file in a DeepSpeed folder",
}


def _door_offenders(root: Path, package: str = "zeroshard") -> dict[tuple[str, str], int]:
    """(file, call) -> count for byte-level file calls and imports of `_` names from the storage
    package, in every module of `package` under `root` outside its storage/ folder."""
    found: dict[tuple[str, str], int] = {}
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(f"{package}/storage/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            call = None
            if isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Name) and func.id == "open":
                    call = "open()"
                elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                    call = f"{func.value.id}.{func.attr}"
            elif isinstance(node, ast.ImportFrom) and node.module in ("os", "io"):
                names = {f"{node.module}.{a.name}" for a in node.names}
                call = next((f"from {n}" for n in sorted(names) if n in DOOR_CALLS), None)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"{package}.storage"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                call = f"import {node.module}.{private[0]}" if private else None
            if call is not None and (call in DOOR_CALLS or call.startswith(("from ", "import "))):
                found[rel, call] = found.get((rel, call), 0) + 1
    return found


def test_storage_is_the_only_door_to_bytes(tmp_path):
    """No module outside zeroshard/storage/ opens, reads, writes or fsyncs files by hand, or
    reaches for storage's private names; the few named exceptions are listed above."""
    found = _door_offenders(ROOT)
    new = sorted(f"{f} {c}" for f, c in found if (f, c) not in DOOR_ALLOWED)
    assert not new, ("byte-level file calls outside zeroshard/storage/ (use Location: read_bytes, open_reader, "
                     "atomic_writer, create_exclusive, temp_name, fsync): " + ", ".join(new))
    stale = sorted(f"{f} {c}" for f, c in DOOR_ALLOWED if (f, c) not in found)
    assert not stale, "allowed but gone (remove from DOOR_ALLOWED: the list only shrinks): " + ", ".join(stale)
    # the scan sees every form, and skips storage/ itself
    pkg = tmp_path / "pkg"
    (pkg / "storage").mkdir(parents=True)
    (pkg / "storage" / "door.py").write_text("import os\nos.open('x', 0)\n")
    (pkg / "m.py").write_text("import os\nfrom os import fsync\nfrom pkg.storage.location import _protocols, A\n"
                              "def f(p):\n    with open(p) as f:\n        os.write(1, b'')\n"
                              "    os.pread(3, 1, 0); os.pread(3, 1, 1); os.path.join(p)\n")
    assert _door_offenders(tmp_path, "pkg") == {
        ("pkg/m.py", "from os.fsync"): 1, ("pkg/m.py", "import pkg.storage.location._protocols"): 1,
        ("pkg/m.py", "open()"): 1, ("pkg/m.py", "os.write"): 1, ("pkg/m.py", "os.pread"): 2}


def _view_members() -> set[str]:
    """The names the EngineView protocol declares (fields, properties, methods)."""
    tree = ast.parse((ROOT / "zeroshard" / "engine" / "engine_view.py").read_text())
    view = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineView")
    return {n.target.id for n in view.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)} | {
        n.name for n in view.body if isinstance(n, ast.FunctionDef)}


def test_engine_helpers_read_only_what_the_engine_view_declares():
    """engine/memory.py and engine/state.py are handed the engine as an EngineView: every
    attribute they read of it is declared there (public), none of the class's private state."""
    members = _view_members()
    assert {"shards", "optimizer", "shard_of", "param_refresh"} <= members
    used = set()
    for name in ("memory.py", "state.py"):
        tree = ast.parse((ROOT / "zeroshard" / "engine" / name).read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef):
                continue
            viewed = {a.arg for a in fn.args.args
                      if a.annotation is not None and "EngineView" in ast.unparse(a.annotation)}
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in viewed:
                    used.add((name, node.attr))
    assert len(used) > 15  # the scan sees their reads
    outside = sorted(f"{f}: engine.{a}" for f, a in used if a not in members)
    assert not outside, "read of the engine beyond EngineView (declare it there, public): " + ", ".join(outside)


LOCAL_RUN = """
import sys
from zeroshard.cli import main
main(sys.argv[1:], standalone_mode=False)
assert "fsspec" not in sys.modules, "fsspec was imported"
"""


def test_local_commands_never_import_fsspec(tmp_path):
    """A plain local folder is served by os calls: fsspec (and asyncio under it) would add about
    50 ms to every command's start-up. Each whole command runs, its output's clean-up included."""
    from checkpoints import training_state, write_checkpoint

    specs, data = training_state()
    ck = str(tmp_path / "ck")
    write_checkpoint(ck, specs, data, 2)
    for args in (["reshard", ck, "--to", "3", "-o", str(tmp_path / "r3")],
                 ["consolidate", ck, str(tmp_path / "model.safetensors")],
                 ["shard", str(tmp_path / "model.safetensors"), str(tmp_path / "s2"), "--world", "2"],
                 ["verify", ck], ["inspect", ck], ["clean", str(tmp_path)]):
        result = subprocess.run([sys.executable, "-c", LOCAL_RUN, *args], capture_output=True, text=True)
        assert result.returncode == 0, (args, result.stderr[-2000:])
