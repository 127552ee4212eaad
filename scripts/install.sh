#!/usr/bin/env bash
# README command 1: installs everything and runs the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/python examples/demo.py
