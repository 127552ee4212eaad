#!/usr/bin/env bash
# Builds the release wheel and installs it into a fresh virtual environment that already
# has the pinned torch (borrowed from ./.venv, so nothing is downloaded), then checks that it
# imports, replays a backward, and honours REPLAYGRAD, outside the source tree.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
source .venv/bin/activate

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
maturin build --release --quiet --auditwheel skip -o "$out/dist"
wheel=$(ls "$out"/dist/replaygrad-*.whl)

python -m venv "$out/venv"
fresh="$out/venv/bin/python"
site=$("$fresh" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# torch and its dependencies from ./.venv; a path line in a .pth does not run that
# directory's .pth files, so ./.venv's editable replaygrad stays out of sight.
python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$site/borrowed-torch.pth"
"$fresh" -m pip install --quiet --no-deps --ignore-installed "$wheel"

cd "$out"
"$fresh" - <<'PY'
import torch, replaygrad
assert replaygrad.__file__.startswith(__import__("sys").prefix), replaygrad.__file__
w = torch.randn(4, requires_grad=True)
replaygrad.backward((w.exp() * w).sum(), compiler="aot_eager")
torch.testing.assert_close(w.grad, w.exp() * w + w.exp())
print("wheel ok:", replaygrad.__file__, "torch", torch.__version__)
PY
REPLAYGRAD=none "$fresh" -c "
import torch, sys
w = torch.randn(3, requires_grad=True)
(w * w).sum().backward()
assert sys.modules['replaygrad'].cache_info().misses == 1
print('REPLAYGRAD autoload ok')"
