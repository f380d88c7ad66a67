"""Every test file is in a tier, and the default tier still reaches every public command.

The rule is docs/TESTING.md's; tests/conftest.py applies it at collection ([Note: test tiers]).
These checks read the test files' source, so they cost no import and no process.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from zeroshard.cli import main

TIER = "default"  # docs/TESTING.md

TESTS = Path(__file__).resolve().parent
TIERS = ("default", "slow", "mixed")


def _tier(tree: ast.Module) -> str | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "TIER" for t in node.targets):
            return node.value.value if isinstance(node.value, ast.Constant) else None
    return None


def _marked_slow(node: ast.AST) -> bool:
    return any(ast.unparse(d).endswith("mark.slow") for d in getattr(node, "decorator_list", []))


def _test_functions(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            yield node, _marked_slow(node)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub.name.startswith("test"):
                    yield sub, _marked_slow(node) or _marked_slow(sub)


@functools.cache
def _files() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), filename=str(path)) for path in sorted(TESTS.glob("test_*.py"))}


def test_every_test_file_declares_a_valid_tier():
    wrong = {path.name: _tier(tree) for path, tree in _files().items() if _tier(tree) not in TIERS}
    assert not wrong, f"test files without TIER in {TIERS} (docs/TESTING.md): {wrong}"


def test_a_files_tier_agrees_with_its_marks():
    # Marks count wherever they stand: on a test, or on one case of it (pytest.param(..., marks=...)).
    for path, tree in _files().items():
        tier = _tier(tree)
        marks_slow = any(isinstance(n, ast.Attribute) and n.attr == "slow" and ast.unparse(n.value).endswith("mark")
                         for n in ast.walk(tree))
        fast = [fn.name for fn, is_slow in _test_functions(tree) if not is_slow]
        if tier == "default":
            assert not marks_slow, f"{path.name} is TIER 'default' but marks tests slow: make it 'mixed'"
        if tier == "mixed":
            assert marks_slow and fast, f"{path.name} is TIER 'mixed' but all its tests are in one tier: say which"


def _strings_the_default_tier_holds() -> set[str]:
    """String constants in default-tier tests: every non-slow test's body, and the module-level
    helpers of files whose tests are all in the default tier."""
    found: set[str] = set()
    for tree in _files().values():
        tier = _tier(tree)
        if tier == "slow":
            continue
        roots = [fn for fn, is_slow in _test_functions(tree) if not is_slow]
        if tier == "default":
            roots = [tree]
        for root in roots:
            found.update(n.value for n in ast.walk(root) if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return found


def _commands(group, prefix: str = "") -> list[str]:
    names = []
    ctx = click.Context(group)  # list_commands/get_command: `import`'s subcommands are made when asked for
    for name in sorted(group.list_commands(ctx)):
        command = group.get_command(ctx, name)
        names.append(prefix + name)
        if hasattr(command, "commands"):
            names.extend(_commands(command, prefix + name + " "))
    return names


def test_the_default_tier_runs_every_public_command():
    # A command counts as run when a default-tier test names it as a CLI word (the argument list
    # of a CliRunner call or a subprocess). Subcommands count by their own word ("import dcp": "dcp").
    held = _strings_the_default_tier_holds()
    words = {word for s in held for word in s.split()}
    missing = [name for name in _commands(main) if name.split()[-1] not in held and name.split()[-1] not in words]
    assert not missing, f"no default-tier test runs: {missing} (docs/TESTING.md)"


def test_the_command_list_is_the_clis():
    # Guards the walk above: a CLI whose commands could not be listed would pass vacuously.
    names = _commands(main)
    assert {"consolidate", "reshard", "verify", "inspect", "import deepspeed"} <= set(names)
    assert CliRunner().invoke(main, ["--help"]).exit_code == 0


@pytest.mark.parametrize("marker", ["slow", "exclusive"])
def test_the_tier_markers_are_registered(marker, pytestconfig):
    # pytest warns, not fails, on an unregistered marker; -m 'not slow' would then select everything.
    assert any(line.startswith(f"{marker}:") for line in pytestconfig.getini("markers"))


# What only `tools/dev.sh test --all` installs: a test that needs one of these skips in the default
# tier, and a test that skips there never runs in CI's slow pass either. So it must be slow.
_NEEDS_AN_EXTRA = ('find_spec("deepspeed")', "HAS_DEEPSPEED", 'importorskip("deepspeed"', 'importorskip("accelerate',
                   'importorskip("peft"', "TORCHTITAN", "needs_torchtitan")


def _needs_an_extra(source: str) -> bool:  # source as ast.unparse writes it: single quotes
    return any(sign.replace('"', "'") in source for sign in _NEEDS_AN_EXTRA)


def _calls(node: ast.AST) -> set[str]:
    return {n.func.id for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


def _helpers_needing_an_extra(tree: ast.Module) -> set[str]:
    """The module's helper functions that need an extra, directly or through another helper."""
    helpers = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)
               and not node.name.startswith("test")}
    needing = {name for name, node in helpers.items() if _needs_an_extra(ast.unparse(node))}
    while True:
        more = {name for name, node in helpers.items() if name not in needing and _calls(node) & needing}
        if not more:
            return needing
        needing |= more


def test_a_test_that_needs_an_extra_only_all_installs_is_slow():
    """DeepSpeed, Accelerate, PEFT or torchtitan: see _NEEDS_AN_EXTRA."""
    offenders = []
    for path, tree in _files().items():
        if _tier(tree) == "slow":
            continue
        helpers = _helpers_needing_an_extra(tree)
        for fn, is_slow in _test_functions(tree):
            source = ast.unparse(fn)
            if not is_slow and (_needs_an_extra(source) or _calls(fn) & helpers):
                offenders.append(f"{path.name}::{fn.name}")
    assert not offenders, f"need an extra only --all installs, yet in the default tier: {offenders}"
