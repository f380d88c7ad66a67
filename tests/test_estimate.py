"""`zeroshard estimate`: the ZeRO paper's Table 1, the formulas, and the click command."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from zeroshard.estimate import estimate_command, fmt_gb, model_state_bytes, parse_count

TIER = "default"  # docs/TESTING.md


def test_reproduces_zero_paper_table_1() -> None:
    # 7.5B parameters, 64 GPUs, mixed-precision Adam (K = 12): 120 / 31.4 / 16.6 / 1.88 GB.
    got = [fmt_gb(model_state_bytes(7.5e9, 64, s).total) for s in (0, 1, 2, 3)]
    assert got == ["120", "31.4", "16.6", "1.88"]


def test_formulas() -> None:
    psi, n = 1e9, 8
    assert model_state_bytes(psi, n, 0).total == 16 * psi
    assert model_state_bytes(psi, n, 1).total == 4 * psi + 12 * psi / n
    assert model_state_bytes(psi, n, 2).total == 2 * psi + 14 * psi / n
    assert model_state_bytes(psi, n, 3).total == 16 * psi / n
    assert model_state_bytes(psi, n, 2, "fp16") == model_state_bytes(psi, n, 2, "bf16")
    # fp32: params 4, grads 4, Adam moments 8 (the params are their own master copy).
    assert model_state_bytes(psi, n, 0, "fp32").total == 16 * psi
    fp32_s2 = model_state_bytes(psi, n, 2, "fp32")
    assert (fp32_s2.params, fp32_s2.grads, fp32_s2.optimizer) == (4 * psi, 4 * psi / n, 8 * psi / n)


@pytest.mark.parametrize("text, value", [("7.5B", 7.5e9), ("350M", 3.5e8), ("1.3e9", 1.3e9), ("125k", 1.25e5),
                                         ("2T", 2e12), ("1000", 1000.0), (" 7G ", 7e9)])
def test_parse_count(text: str, value: float) -> None:
    assert parse_count(text) == value


@pytest.mark.parametrize("bad", ["", "7.5X", "-3B", "0", "B"])
def test_parse_count_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_count(bad)


def test_fmt_gb_never_uses_exponents() -> None:
    assert [fmt_gb(x) for x in (1234e9, 120e9, 31.40625e9, 1.875e9, 0.0234e9, 0)] == \
        ["1234", "120", "31.4", "1.88", "0.0234", "0"]


def test_command_prints_the_table() -> None:
    result = CliRunner().invoke(estimate_command, ["--params", "7.5B", "--gpus", "64"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    totals = [line.split()[-1] for line in lines[2:]]
    assert totals == ["120", "31.4", "16.6", "1.88"]
    assert "GB = 1e9 bytes" in lines[0]


def test_command_one_stage_fp32_and_errors() -> None:
    result = CliRunner().invoke(estimate_command, ["--params", "7.5B", "--gpus", "64", "--stage", "3",
                                                   "--dtype", "fp32"])
    assert result.exit_code == 0 and len(result.output.splitlines()) == 3
    assert result.output.splitlines()[-1].split()[-1] == "1.88"  # 16 bytes/param either way
    bad = CliRunner().invoke(estimate_command, ["--params", "lots", "--gpus", "64"])
    assert bad.exit_code == 2 and "--params" in bad.output
    assert CliRunner().invoke(estimate_command, ["--params", "1B", "--gpus", "0"]).exit_code == 2


def test_estimate_imports_neither_torch_nor_the_engine() -> None:
    code = "import sys, zeroshard.estimate; print('torch' in sys.modules, 'zeroshard.engine' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
