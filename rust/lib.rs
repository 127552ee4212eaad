//! replaygrad's core: plans PyTorch's backward pass the way the autograd engine runs it.
//!
//! - [`ffi`]: the C++ shim and safe wrappers over it (the only `unsafe` calls into torch).
//! - [`graph`]: a snapshot of the reachable graph as plain data.
//! - [`order`]: the engine's execution order and gradient routing.
//! - [`layout`]: saved-value slots, hooks, step modes and the structural key.
//! - [`plan`]: the above together, and what a replay does to the live graph.
//! - `python`: the `replaygrad._core` module.

pub mod errors;
pub mod ffi;
pub mod graph;
pub mod layout;
pub mod order;
pub mod plan;
mod python;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    python::register(m)
}
