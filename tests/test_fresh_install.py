"""The package installed as a user installs it: a fresh venv, torch first (pinned, as .ci/run and
systemd/install.sh's users do), then o3edge with its runtime dependencies and no extras. The tools a
user runs first must work there: a dependency used at run time but not declared (rich, once) fails
here and nowhere else, since the test environment has every extra.

Marked `slow` (it still runs in CI, where only `gpu` and `reliability_long` are left out): ~1 minute on
a 2-core machine (100 s before pip stopped byte-compiling what it installs). pip's cache (and
/opt/wheels, where present) keeps downloads out of it after the first run.
"""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH = "torch==2.13.0"  # first and pinned: any looser request could pull a multi-GB CUDA build


def run(cmd, cwd, env) -> str:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
def test_install_without_extras_runs_build_help_and_inspects_the_shipped_engine(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}  # nothing of this tree
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], tmp_path, env)
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    # --no-compile: byte-compiling torch and sympy was half of this test's time, and is not what it checks
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]
    run(pip + [TORCH], tmp_path, env)
    run(pip + [REPO], tmp_path, env)

    assert "usage: o3edge build" in run([bin_dir / "o3edge", "build", "--help"], tmp_path, env)
    installed = run([python, "-c", "import o3edge, os; print(os.path.dirname(o3edge.__file__))"], tmp_path, env)
    assert installed.strip().startswith(str(venv))  # the installed copy, not this checkout
    shown = run([bin_dir / "o3edge", "inspect", os.path.join(installed.strip(), "models", "o3edge-ref-int4")],
                tmp_path, env)
    assert "INT4 group 32" in shown and "relative error" in shown
    extras = run([python, "-c", "import importlib.util as u; print([m for m in ('transformers', 'onnx', "
                                "'onnxruntime', 'pytest', 'matplotlib') if u.find_spec(m)])"], tmp_path, env)
    assert extras.strip() == "[]"  # no extra came along: what ran above needs only the declared dependencies
