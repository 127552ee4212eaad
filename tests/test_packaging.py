"""Packaging: the wheel works in a fresh environment; a mismatched torch is refused clearly."""

from __future__ import annotations

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
