"""Packaging: the wheel works in a fresh environment; a mismatched torch is refused clearly."""

from __future__ import annotations

import ast
import inspect
import subprocess
from pathlib import Path

import pytest
import torch

import replaygrad

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_installs_into_a_fresh_environment():
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "check_wheel.sh")],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "wheel ok" in result.stdout and "REPLAYGRAD autoload ok" in result.stdout


def test_import_refuses_another_torch_series(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.14.0+cpu")
    with pytest.raises(ImportError, match=r"built against torch 2\.13\.x but torch 2\.14\.0"):
        replaygrad._check_torch()


def test_metadata_pins_the_torch_series():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dependencies = ["torch==2.13.*"]' in pyproject
    assert replaygrad._core.TORCH_VERSION.startswith("2.13.")


def _stub_parameters(fn: ast.FunctionDef) -> list[str]:
    args = fn.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return names


def test_the_native_module_stub_names_every_parameter_as_the_module_does():
    from replaygrad import _core

    tree = ast.parse((ROOT / "python" / "replaygrad" / "_core.pyi").read_text())
    compared, mismatched = 0, []
    for node in tree.body:
        owner, defs = _core, [node]
        if isinstance(node, ast.ClassDef):
            owner = getattr(_core, node.name)
            defs = [f for f in node.body if isinstance(f, ast.FunctionDef) and not f.decorator_list]
        for fn in defs:
            if not isinstance(fn, ast.FunctionDef):
                continue
            try:
                signature = inspect.signature(getattr(owner, fn.name))
            except ValueError:  # a METH_FASTCALL function made by the shim (buffer_sum)
                continue
            compared += 1
            if list(signature.parameters) != _stub_parameters(fn):
                mismatched.append((fn.name, list(signature.parameters), _stub_parameters(fn)))
    assert compared > 30
    assert not mismatched
