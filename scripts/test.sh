#!/usr/bin/env bash
# README command 2: runs every test (the Rust crate's and pytest), after setting up what
# is missing. Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh || exit 1
source scripts/env.sh
# shellcheck disable=SC1091
source .venv/bin/activate

echo "== cargo test"
cargo test --release --quiet || exit 1

echo "== pytest"
python -m pytest tests "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$status"
