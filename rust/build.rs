//! Compiles the C++ shim against the torch that Python imports, and tells the linker where
//! that torch (and, for test binaries, libpython) lives.

use std::env;
use std::path::PathBuf;
use std::process::Command;

/// What build.rs needs to know about the Python + torch install it builds against.
struct TorchInstall {
    version: String,
    include_dirs: Vec<PathBuf>,
    lib_dir: PathBuf,
    cxx11_abi: String,
    python_include: PathBuf,
    python_libdir: PathBuf,
}

const PROBE: &str = r#"
import sysconfig, torch, torch.utils.cpp_extension as ext
print("version", torch.__version__.split("+")[0])
for p in ext.include_paths():
    print("include", p)
for p in ext.library_paths():
    print("lib", p)
print("abi", int(torch._C._GLIBCXX_USE_CXX11_ABI))
print("pyinclude", sysconfig.get_path("include"))
print("pylibdir", sysconfig.get_config_var("LIBDIR"))
"#;

/// The interpreter maturin (PYO3_PYTHON) or an activated venv points at; torch-sys makes
/// the same choice from VIRTUAL_ENV, so both see the same torch.
fn python() -> PathBuf {
    if let Ok(p) = env::var("PYO3_PYTHON") {
        return PathBuf::from(p);
    }
    if let Ok(venv) = env::var("VIRTUAL_ENV") {
        return PathBuf::from(venv).join("bin").join("python");
    }
    PathBuf::from("python3")
}

fn probe_torch() -> TorchInstall {
    let python = python();
    let out = Command::new(&python)
        .arg("-c")
        .arg(PROBE)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    assert!(
        out.status.success(),
        "{} could not import torch (activate the venv that has torch==2.13.*):\n{}",
        python.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let mut install = TorchInstall {
        version: String::new(),
        include_dirs: Vec::new(),
        lib_dir: PathBuf::new(),
        cxx11_abi: "1".into(),
        python_include: PathBuf::new(),
        python_libdir: PathBuf::new(),
    };
    for line in text.lines() {
        let Some((tag, value)) = line.split_once(' ') else {
            continue;
        };
        match tag {
            "version" => install.version = value.into(),
            "include" => install.include_dirs.push(value.into()),
            "lib" => install.lib_dir = value.into(),
            "abi" => install.cxx11_abi = value.into(),
            "pyinclude" => install.python_include = value.into(),
            "pylibdir" => install.python_libdir = value.into(),
            _ => {}
        }
    }
    install
}

fn main() {
    println!("cargo:rerun-if-changed=cpp_shim");
    println!("cargo:rerun-if-changed=rust/build.rs");
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
    println!("cargo:rerun-if-env-changed=VIRTUAL_ENV");

    let torch = probe_torch();
    assert!(
        torch.version.starts_with("2.13."),
        "replaygrad builds against torch 2.13 (the version tch 0.26 supports), found {}",
        torch.version
    );
    println!("cargo:rustc-env=REPLAYGRAD_TORCH_VERSION={}", torch.version);

    cc::Build::new()
        .cpp(true)
        .pic(true)
        .std("c++17")
        .opt_level(2)
        .warnings(false)
        .flag("-w")
        .includes(&torch.include_dirs)
        .include(&torch.python_include)
        .define("_GLIBCXX_USE_CXX11_ABI", torch.cxx11_abi.as_str())
        .file("cpp_shim/shim.cpp")
        .compile("replaygrad_shim");

    let lib = torch.lib_dir.display();
    println!("cargo:rustc-link-search=native={lib}");
    for name in ["torch_python", "torch_cpu", "c10"] {
        println!("cargo:rustc-link-lib=dylib={name}");
    }
    // torch-sys passes its rpath only to the C++ compiler, so every binary we link (the
    // extension, cargo test binaries) gets it here. The wheel also finds torch next to it.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/../torch/lib");
    // Test binaries link libpython (pyo3 without an extension module); pyenv-style installs
    // keep it off the loader path.
    println!(
        "cargo:rustc-link-arg=-Wl,-rpath,{}",
        torch.python_libdir.display()
    );
}
