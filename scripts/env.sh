# Build environment shared by the scripts (sourced, not run).
# tch links the libtorch of the torch that Python imports; torch 2.13.x with x > 0 only
# differs from the 2.13.0 tch expects by a patch release.
export LIBTORCH_USE_PYTORCH=1
export LIBTORCH_BYPASS_VERSION_CHECK=1
# Rust build output lives outside the clone and survives between runs (torch-sys's C++
# takes minutes on a small machine).
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/replaygrad/target}"
