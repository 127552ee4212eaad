//! The one home for errors: what can fail in the core, and which Python exception each
//! becomes (the same types torch raises for the same failures).

use std::fmt;

/// The Python exception type an error maps to, mirroring how torch maps C++ exceptions
/// (`c10::ValueError` → `ValueError`, other `c10::Error` → `RuntimeError`, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    Runtime,
    Index,
    Value,
    Type,
    NotImplemented,
    Memory,
    /// `c10::LinAlgError`: `torch.linalg.LinAlgError` (a RuntimeError).
    LinAlg,
}

impl ErrorKind {
    /// The shim's `rg_error_kind` codes.
    pub fn from_code(code: i32) -> Self {
        match code {
            1 => ErrorKind::Index,
            2 => ErrorKind::Value,
            3 => ErrorKind::Type,
            4 => ErrorKind::NotImplemented,
            5 => ErrorKind::Memory,
            6 => ErrorKind::LinAlg,
            _ => ErrorKind::Runtime,
        }
    }
}

/// An error from the core or from torch code the shim ran.
#[derive(Debug, PartialEq, Eq)]
pub enum ShimError {
    /// A C++ exception (or a failed check of ours) with torch's message.
    Torch { kind: ErrorKind, message: String },
    /// Python code run by torch (a hook, a custom Function) raised; the Python exception is
    /// set and is handed to the caller unchanged.
    Python,
}

impl ShimError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ShimError::Torch {
            kind,
            message: message.into(),
        }
    }
}

impl fmt::Display for ShimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShimError::Torch { message, .. } => f.write_str(message),
            ShimError::Python => f.write_str("a Python exception was raised"),
        }
    }
}

impl std::error::Error for ShimError {}

impl From<tch::TchError> for ShimError {
    fn from(e: tch::TchError) -> Self {
        ShimError::new(ErrorKind::Runtime, e.to_string())
    }
}

impl From<ShimError> for pyo3::PyErr {
    fn from(e: ShimError) -> Self {
        use pyo3::exceptions as exc;
        match e {
            ShimError::Python => pyo3::Python::attach(|py| {
                pyo3::PyErr::take(py).unwrap_or_else(|| {
                    exc::PyRuntimeError::new_err("replaygrad: torch reported a Python error but none was set")
                })
            }),
            ShimError::Torch { kind, message } => match kind {
                ErrorKind::Runtime => exc::PyRuntimeError::new_err(message),
                ErrorKind::Index => exc::PyIndexError::new_err(message),
                ErrorKind::Value => exc::PyValueError::new_err(message),
                ErrorKind::Type => exc::PyTypeError::new_err(message),
                ErrorKind::NotImplemented => exc::PyNotImplementedError::new_err(message),
                ErrorKind::Memory => exc::PyMemoryError::new_err(message),
                ErrorKind::LinAlg => pyo3::Python::attach(|py| {
                    use pyo3::types::PyAnyMethods;
                    let linalg_error = py
                        .import("torch.linalg")
                        .and_then(|m| m.getattr("LinAlgError"))
                        .and_then(|t| t.cast_into::<pyo3::types::PyType>().map_err(Into::into));
                    match linalg_error {
                        Ok(t) => pyo3::PyErr::from_type(t, message),
                        Err(_) => exc::PyRuntimeError::new_err(message),
                    }
                }),
            },
        }
    }
}
