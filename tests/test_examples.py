"""The examples and the ways to turn replaygrad on without changing a script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import sys, torch
w = torch.randn(3, requires_grad=True)
for _ in range(3):
    (w.exp() * w).sum().backward()
rg = sys.modules.get("replaygrad")
info = rg.cache_info() if rg else None
print("replayed", None if info is None else info.hits + info.misses)
"""


def run(args, env=None, cwd=None):
    result = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_train_mlp_example():
    out = run([str(ROOT / "examples" / "train_mlp.py"), "--compiler", "aot_eager", "--steps", "4"])
    assert "largest difference from eager training: 0.00e+00" in out
    assert "compiled replays: 1, reused: 3" in out


def test_custom_cpp_op_example():
    out = run([str(ROOT / "examples" / "custom_cpp_op.py")])
    assert "graph breaks: ['torch::autograd::CppNode<ClipGrad>']" in out
    assert "gradients equal eager: True" in out


def test_environment_variable_enables_an_unmodified_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    assert run([str(script)], env={"REPLAYGRAD": "none"}).strip() == "replayed 3"
    assert run([str(script)], env={"REPLAYGRAD": "0"}).strip() == "replayed None"


def test_environment_variable_naming_no_compiler_says_so(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env={**os.environ, "REPLAYGRAD": "indutor"},
        timeout=600,
    )
    # Imported (to read the name), not enabled: no backward went through it.
    assert result.returncode == 0 and result.stdout.strip() == "replayed 0"
    assert "Traceback" not in result.stderr and result.stderr.count("REPLAYGRAD=") == 1
    assert result.stderr.startswith("replaygrad: REPLAYGRAD='indutor' ignored, replaygrad is off:")
    assert "unknown compiler 'indutor'" in result.stderr


def test_module_runner(tmp_path):
    # The script imports a module next to it, as `python train.py` allows.
    (tmp_path / "helper.py").write_text("VALUE = 3\n")
    script = tmp_path / "train.py"
    script.write_text(f"import helper\nassert helper.VALUE == 3\n{SCRIPT}")
    out = run(["-m", "replaygrad", "--compiler", "none", str(script)], cwd=ROOT)
    assert out.strip() == "replayed 3"
