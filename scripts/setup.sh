#!/usr/bin/env bash
# Installs what replaygrad needs into ./.venv (torch 2.13 from PyPI, maturin, test tools)
# and builds the package into it. Safe to rerun: finished steps are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate

# torch is a multi-GB download: install the pinned set once, keyed by the requirements file.
stamp=.venv/.replaygrad-requirements
if ! cmp -s requirements-dev.txt "$stamp"; then
  python -m pip install --quiet --upgrade pip
  python -m pip install --quiet -r requirements-dev.txt
  cp requirements-dev.txt "$stamp"
fi

# Never let pip build in isolation (it would fetch a second torch): maturin builds in this
# venv, against the torch installed above.
PIP_QUIET=1 maturin develop --release --quiet
