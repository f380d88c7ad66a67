#!/usr/bin/env bash
# The two commands of the README contract, each doing its own set-up:
#   tools/dev.sh demo   - the main job (train with ZeRO on CPU ranks, checkpoint, reshard, consolidate)
#   tools/dev.sh test   - the lint (ruff) and the default tier of the tests (docs/TESTING.md), on both
#                         cores; `test --all` both tiers, with real DeepSpeed, Accelerate and torchtitan
#                         set up first; `test --slow` the slow tier alone; with other arguments, only
#                         pytest with them (no tier filter)
#   tools/dev.sh extras - set up what the slow tier compares with: DeepSpeed, Accelerate, PEFT, torchtitan
#   tools/dev.sh lint   - ruff alone (pass --fix to apply its safe fixes)
#   tools/dev.sh gpu    - on a CUDA machine: GPU tests and benchmarks, one report (tools/gpu_suite.py);
#                         elsewhere, or with --dry-run: print what it would run and exit 0
#   tools/dev.sh floor  - the oldest torch pyproject.toml admits (FLOOR_TORCH), in .venv-torch-floor: the
#                         tests most tied to torch's APIs and the demo; with arguments, pytest with them.
#                         `floor-setup` builds that venv only (CI starts it beside the tests); a failed
#                         install fails the command
# Set-up: a virtual environment in .venv with torch pinned (tools/constraints.txt) and
# zeroshard installed editable with its test extra. Re-runs are quick: a stamp file remembers
# which pyproject/constraints the environment was built from.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv="$root/.venv"
py="$venv/bin/python"

setup() {
    local want have=""
    want=$(cat pyproject.toml tools/constraints.txt | sha256sum | cut -c1-16)
    [ -f "$venv/.zeroshard-stamp" ] && have=$(cat "$venv/.zeroshard-stamp")
    if [ -x "$py" ] && [ "$want" = "$have" ]; then return; fi
    echo "== set-up: creating $venv (torch pinned by tools/constraints.txt)"
    [ -x "$py" ] || python3 -m venv "$venv"
    # (pip's notes about this machine's local index folders are noise: filtered out)
    pip_install() { "$py" -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
    pip_install --upgrade pip >/dev/null || true
    pip_install -c tools/constraints.txt torch==2.13.0
    pip_install -c tools/constraints.txt -e ".[test]"
    echo "$want" > "$venv/.zeroshard-stamp"
}

# The slow tier compares with real DeepSpeed (docs/DEEPSPEED.md), Accelerate, PEFT and torchtitan;
# the default tier needs none of them. Each is installed at the version the tests and docs name
# (an installed other version is replaced: a test of "Accelerate 1.15.0" must run 1.15.0).
# DeepSpeed's build imports torch, so it needs --no-build-isolation. Best effort: a package that
# cannot be installed makes its tests skip, with the reason printed.
EXTRAS_PINS=(accelerate==1.15.0 peft==0.21.2)  # PEFT depends on Accelerate: it comes after it
has_pin() {  # has_pin NAME==VERSION: that version is installed in .venv
    "$py" -c "import importlib.metadata as m, sys; n, v = sys.argv[1].split('=='); sys.exit(m.version(n) != v)" "$1" \
        >/dev/null 2>&1
}
test_extras() {
    local quiet_pip="is ignored: it is neither a file nor a directory" pin
    if ! has_pin deepspeed==0.19.8 && [ ! -f "$venv/.deepspeed-failed" ]; then
        echo "== set-up: DeepSpeed 0.19.8 (CPU, no ops) for the comparison tests"
        if ! DS_BUILD_OPS=0 DS_ACCELERATOR=cpu timeout 900 "$py" -m pip install -q -c tools/constraints.txt \
                --no-build-isolation deepspeed==0.19.8 2> >(grep -v "$quiet_pip" >&2); then
            echo "== DeepSpeed could not be installed: the tests that need it will skip" >&2
            touch "$venv/.deepspeed-failed"
        fi
    fi
    # Accelerate and torchtitan write the DCP layouts tests/test_dcp_layouts.py imports; PEFT's
    # own adapters are what consolidate --peft is compared with (tests/test_peft_export.py).
    for pin in "${EXTRAS_PINS[@]}"; do
        if ! has_pin "$pin" && [ ! -f "$venv/.${pin%%==*}-failed" ]; then
            echo "== set-up: $pin for the slow tier"
            if ! timeout 600 "$py" -m pip install -q -c tools/constraints.txt "$pin" 2> >(grep -v "$quiet_pip" >&2); then
                echo "== $pin could not be installed: the tests that need it will skip" >&2
                touch "$venv/.${pin%%==*}-failed"
            fi
        fi
    done
    # torchtitan declares heavy dependencies (datasets, wandb, ...): only its package and what its
    # checkpoint and optimizer code import, in a folder of their own the test puts on sys.path.
    local titan="$venv/torchtitan-0.3.0"
    if [ ! -d "$titan/torchtitan" ] && [ ! -f "$venv/.torchtitan-failed" ]; then
        echo "== set-up: torchtitan 0.3.0 (no dependencies) in $titan for the DCP layout tests"
        if ! timeout 600 "$py" -m pip install -q --no-deps --target "$titan" -c tools/constraints.txt \
                torchtitan==0.3.0 tyro==1.0.17 docstring-parser==0.18.0 spmd_types==0.2.3 \
                2> >(grep -v "$quiet_pip" >&2); then
            echo "== torchtitan could not be installed: its DCP layout test will skip" >&2
            rm -rf "$titan"
            touch "$venv/.torchtitan-failed"
        fi
    fi
}

# The GPU check runs on the machine's own CUDA torch (a CPU venv from here cannot drive a GPU):
# .venv-gpu sees the system's packages, plus any wheels carried in .whl/ (no internet there).
gpu() {
    local sys_py=${ZEROSHARD_GPU_PYTHON:-python3} gvenv="$root/.venv-gpu"
    if [[ " $* " == *" --dry-run "* ]] || \
            ! "$sys_py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        exec "$sys_py" tools/gpu_suite.py --python "$sys_py" "$@"  # prints the plan, runs nothing
    fi
    if [ ! -x "$gvenv/bin/python" ]; then
        echo "== set-up: $gvenv over $sys_py's packages (its CUDA torch)"
        "$sys_py" -m venv --system-site-packages "$gvenv"
        # A venv made from a venv sees the base interpreter's packages, not its parent venv's
        # (where a CUDA image keeps torch): a .pth file adds the parent's site-packages after ours.
        local purelib
        purelib=$("$gvenv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        "$sys_py" -c 'import site; print("\n".join(site.getsitepackages()))' > "$purelib/zz-parent-env.pth"
    fi
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$gvenv/bin/python" -m pip install -q --no-index --no-deps .whl/*.whl
    fi
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    exec "$gvenv/bin/python" tools/gpu_suite.py --python "$gvenv/bin/python" "$@"
}

# The torch floor pyproject.toml declares (torch>=FLOOR_TORCH), tested rather than assumed. PyPI's
# build of it is a CUDA build (about 5.5 GB with its NVIDIA packages) that runs on the CPU; pinned, so
# pip resolves nothing else. Best effort like test_extras: without it the check says so and passes.
FLOOR_TORCH=2.8.0
FLOOR_TESTS=(tests/test_engine_parity.py tests/test_engine_stage3.py tests/test_engine_overlap.py tests/test_engine_meta.py
             tests/test_engine_accumulation.py tests/test_engine_lifetime.py tests/test_buffers.py
             tests/test_checkpoint_engine.py tests/test_checkpointer.py tests/test_interop_dcp.py
             tests/test_dcp_older_torch.py tests/test_import_deepspeed.py)
fvenv="$root/.venv-torch-floor"
fpy="$fvenv/bin/python"
floor_setup() {
    local pins want
    want="$FLOOR_TORCH $(cat pyproject.toml tools/constraints.txt | sha256sum | cut -c1-16)"  # rebuilt when any changes
    if [ "$(cat "$fvenv/.zeroshard-floor" 2>/dev/null)" = "$want" ]; then return 0; fi
    echo "== set-up: $fvenv with torch $FLOOR_TORCH (PyPI's CUDA build, run on the CPU: about 5.5 GB)"
    rm -rf "$fvenv" && python3 -m venv "$fvenv"
    pins=$(mktemp) && grep -v '^torch==' tools/constraints.txt > "$pins"
    # A floor that cannot be installed is a failed check, not a printed line (the machine reaches PyPI).
    if ! timeout 1200 "$fpy" -m pip install -q "torch==$FLOOR_TORCH" 2> >(grep -v "is ignored: it is neither" >&2) ||
       ! timeout 600 "$fpy" -m pip install -q -c "$pins" -e ".[test]" 2> >(grep -v "is ignored: it is neither" >&2); then
        echo "== torch $FLOOR_TORCH could not be installed: the floor check cannot run" >&2
        rm -rf "$fvenv" "$pins"; return 1
    fi
    rm -f "$pins"
    echo "$want" > "$fvenv/.zeroshard-floor"
}
floor() {
    floor_setup
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    "$fpy" -c "import torch, zeroshard; assert torch.__version__.startswith('$FLOOR_TORCH'), torch.__version__"
    if [ $# -gt 0 ]; then exec "$fpy" -m pytest -q "$@"; fi
    # Their default tier: the same torch APIs as their slow cases, which add ranks and matrices
    echo "== floor: torch $FLOOR_TORCH, the default tier of ${#FLOOR_TESTS[@]} test files (both cores) and the demo"
    "$fpy" -m pytest -q -p no:cacheprovider -n 2 -m "not slow" "${FLOOR_TESTS[@]}"
    "$fpy" tools/demo.py
}

# One tier (a pytest -m expression) on N pytest-xdist workers, then its `exclusive` tests one at a
# time: those measure the machine's time or memory and must have it to themselves (docs/TESTING.md).
# The slow tier takes 3 workers on 2 cores: its tests spend much of their time waiting (torchrun
# rendezvous, process start-up, nodes killed and timed out), which a third worker fills.
run_tier() {
    local tier=$1 workers=$2 rc=0
    shift 2
    echo "== tests: -m '$tier' on $workers workers, then its exclusive tests alone"
    "$py" -m pytest -q -rs -p no:cacheprovider -n "$workers" -m "($tier) and not exclusive" "$@" || rc=$?
    "$py" -m pytest -q -rs -p no:cacheprovider -m "($tier) and exclusive" "$@" || { local r=$?; [ $r -eq 5 ] || rc=$r; }
    return $rc
}

cmd=${1:-}
shift || true
case "$cmd" in
    setup) setup ;;
    demo) setup; export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}; exec "$py" tools/demo.py "$@" ;;
    # The README's command: the lint (ruff, pinned in the test extra), then the default tier. --all
    # adds the slow tier and what it compares with; --slow runs the slow tier alone (CI's second step).
    test) setup; export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
          case "${1:-}" in
              "") echo "== lint: ruff check"; "$venv/bin/ruff" check .; run_tier "not slow" 2 ;;
              --all) shift; test_extras; echo "== lint: ruff check"; "$venv/bin/ruff" check .
                     run_tier "not slow or slow" 3 "$@" ;;
              --slow) shift; test_extras; run_tier "slow" 3 "$@" ;;
              *) exec "$py" -m pytest -q "$@" ;;
          esac ;;
    extras) setup; test_extras ;;
    lint) setup; exec "$venv/bin/ruff" check "$@" . ;;
    gpu) gpu "$@" ;;
    floor) floor "$@" ;;
    floor-setup) floor_setup ;;
    *) echo "usage: tools/dev.sh {demo|test [--all|--slow]|lint|setup|extras|gpu|floor|floor-setup} [args...]" >&2
       exit 2 ;;
esac
