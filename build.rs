//! Builds the native finalize kernel (kernels/).
//!
//! Always: the Ascend C source compiled for the host against kernels/sim (the
//! host implementation of the Ascend C API subset it uses), linked into the
//! crate as `amoe_finalize_kernel_host`; `cfg(amoe_host_kernel)` tells the Rust
//! side it is there.
//!
//! When CANN is installed (`ASCEND_HOME_PATH` or `ASCEND_TOOLKIT_HOME`, with
//! its `bisheng` or `ccec` compiler): additionally the same source compiled for
//! the AI Core into `libamoe_kernels_npu.so` in OUT_DIR, exporting
//! `amoe_finalize_launch_npu`; its path is baked in as `AMOE_NPU_KERNEL_LIB`
//! and `cfg(amoe_npu_kernel)` is set. The library is loaded at run time, so
//! the crate never links CANN.
//!
//! Nothing here fails the build because CANN (or a host C++ compiler) is
//! missing: the kernel is then reported unavailable at run time.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const KERNEL_SOURCES: &[&str] = &[
    "kernels/finalize_kernel.cpp",
    "kernels/finalize_tiling.h",
    "kernels/npu_launch.cpp",
    "kernels/sim/kernel_operator.h",
    "kernels/sim/host_entry.cpp",
];

/// Environment that changes what this script does.
const ENV_VARS: &[&str] = &[
    // CANN install root (set by CANN's set_env.sh).
    "ASCEND_HOME_PATH",
    "ASCEND_TOOLKIT_HOME",
    // AI Core architecture for the NPU build (default dav-2201 = Atlas A2 / 910B).
    "ASCEND_MOE_NPU_ARCH",
    // `1` skips the NPU kernel build even when CANN is present.
    "ASCEND_MOE_NO_NPU_KERNEL",
];

fn main() {
    println!("cargo:rustc-check-cfg=cfg(amoe_host_kernel)");
    println!("cargo:rustc-check-cfg=cfg(amoe_npu_kernel)");
    for f in KERNEL_SOURCES {
        println!("cargo:rerun-if-changed={f}");
    }
    for v in ENV_VARS {
        println!("cargo:rerun-if-env-changed={v}");
    }
    println!("cargo:rerun-if-changed=build.rs");

    build_host_kernel();
    if env::var("ASCEND_MOE_NO_NPU_KERNEL").as_deref() != Ok("1") {
        if let Some(cann) = find_cann() {
            build_npu_kernel(&cann);
        }
    }
}

/// The kernel for the host, against kernels/sim. FP contraction is off so
/// every multiply and add rounds on its own, like the vector unit.
fn build_host_kernel() {
    let mut b = cc::Build::new();
    b.cpp(true)
        .std("c++17")
        .opt_level(2)
        .flag_if_supported("-ffp-contract=off")
        .flag_if_supported("-fno-fast-math")
        .flag_if_supported("-Wno-unused-parameter")
        .include("kernels")
        .include("kernels/sim")
        .file("kernels/finalize_kernel.cpp")
        .file("kernels/sim/host_entry.cpp");
    match b.try_compile("amoe_kernels_host") {
        Ok(()) => println!("cargo:rustc-cfg=amoe_host_kernel"),
        Err(e) => println!("cargo:warning=host build of kernels/ failed, the native kernel is unavailable: {e}"),
    }
}

struct Cann {
    home: PathBuf,
    compiler: PathBuf,
}

/// CANN root and its kernel compiler, if installed.
fn find_cann() -> Option<Cann> {
    let roots = ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"].iter().filter_map(env::var_os).map(PathBuf::from);
    for home in roots {
        let candidates = [
            home.join("compiler/ccec_compiler/bin/bisheng"),
            home.join("compiler/ccec_compiler/bin/ccec"),
            home.join("bin/bisheng"),
            home.join("bin/ccec"),
        ];
        if let Some(compiler) = candidates.into_iter().find(|p| p.is_file()) {
            return Some(Cann { home, compiler });
        }
    }
    None
}

/// One heterogeneous compile (`-xcce`): the device kernel plus the host stub of
/// its `<<<>>>` launch, as a shared library loaded at run time.
fn build_npu_kernel(cann: &Cann) {
    let out = PathBuf::from(env::var_os("OUT_DIR").unwrap_or_default());
    let lib = out.join("libamoe_kernels_npu.so");
    let arch = env::var("ASCEND_MOE_NPU_ARCH").unwrap_or_else(|_| "dav-2201".to_string());
    let tik = cann.home.join("compiler/tikcpp/tikcfw");
    let mut cmd = Command::new(&cann.compiler);
    cmd.arg("-xcce")
        .arg(format!("--npu-arch={arch}"))
        .args(["-O2", "-std=c++17", "-fPIC", "-shared"])
        .arg(inc(&cann.home.join("include")))
        .arg(inc(&tik))
        .arg(inc(&tik.join("impl")))
        .arg(inc(&tik.join("interface")))
        .arg(inc(Path::new("kernels")))
        .arg("kernels/npu_launch.cpp")
        .arg("-o")
        .arg(&lib);
    match cmd.output() {
        Ok(o) if o.status.success() => {
            println!("cargo:rustc-cfg=amoe_npu_kernel");
            println!("cargo:rustc-env=AMOE_NPU_KERNEL_LIB={}", lib.display());
        }
        Ok(o) => {
            let err = String::from_utf8_lossy(&o.stderr);
            let first = err.lines().take(5).collect::<Vec<_>>().join(" | ");
            println!("cargo:warning=NPU build of kernels/ failed with {}: {first}", cann.compiler.display());
        }
        Err(e) => println!("cargo:warning=could not run {}: {e}", cann.compiler.display()),
    }
}

fn inc(p: &Path) -> String {
    format!("-I{}", p.display())
}
