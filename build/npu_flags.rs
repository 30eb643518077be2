//! The AI Core compile line of the finalize kernel, per CANN version: a pure
//! function of the toolkit's paths and version, so `tests/npu_build_flags.rs`
//! can check it where bisheng cannot run. Included by `build.rs` and by that
//! test through `#[path]`.

use std::path::{Path, PathBuf};

/// A CANN release, as its toolkit records it (`8.1.RC1`, `8.3.0`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct CannVersion {
    /// Major release (8).
    pub major: u32,
    /// Minor release (1 in 8.1.RC1).
    pub minor: u32,
}

impl CannVersion {
    /// `--npu-arch` replaced `--cce-aicore-arch` from this release on.
    pub const NPU_ARCH_FLAG: CannVersion = CannVersion { major: 8, minor: 3 };

    /// Parses the leading `major.minor` of a version string.
    pub fn parse(s: &str) -> Option<CannVersion> {
        let mut parts = s.trim().split('.');
        let major = parts.next()?.trim().parse().ok()?;
        let minor_digits: String = parts.next()?.chars().take_while(char::is_ascii_digit).collect();
        Some(CannVersion { major, minor: minor_digits.parse().ok()? })
    }
}

/// The version recorded by a toolkit install's info files, and the file it
/// came from. CANN writes `Version=...` into `compiler/version.info` (read
/// the same way by MindSpore's custom-op build, `gen_version_info.sh`) and
/// `version=...` into `<arch>-linux/ascend_toolkit_install.info`.
pub fn version_files(home: &Path) -> Vec<PathBuf> {
    let mut files = vec![home.join("compiler/version.info")];
    for arch in ["aarch64-linux", "x86_64-linux"] {
        files.push(home.join(arch).join("ascend_toolkit_install.info"));
    }
    files.push(home.join("version.cfg"));
    files
}

/// The version in the text of one of [`version_files`]: the first
/// `version=` / `Version=` line (`version.cfg` writes it as
/// `toolkit_installed_version=[8.1.RC1...]` in some releases).
pub fn parse_version_file(text: &str) -> Option<CannVersion> {
    text.lines().find_map(|line| {
        let (key, value) = line.split_once('=')?;
        let key = key.trim().to_ascii_lowercase();
        if key == "version" || key.ends_with("_version") {
            CannVersion::parse(value.trim().trim_start_matches('[').trim_start_matches('"'))
        } else {
            None
        }
    })
}

/// `-mllvm` options of tikcpp's `bisheng_intf.cmake` (the interface targets
/// every Ascend C kernel of CANN 8.x is compiled with).
pub const MLLVM_OPTIONS: &[&str] = &[
    "-cce-aicore-stack-size=0x8000",
    "-cce-aicore-function-stack-size=0x8000",
    "-cce-aicore-record-overflow=true",
    "-cce-aicore-addr-transform",
    "-cce-aicore-dcci-insert-for-scalar=false",
];

/// What one NPU kernel build needs.
#[derive(Debug, Clone)]
pub struct NpuBuild<'a> {
    /// CANN install root (`ASCEND_HOME_PATH`).
    pub home: &'a Path,
    /// Toolkit version.
    pub version: CannVersion,
    /// `--npu-arch` value for CANN >= 8.3 (`dav-2201`: Atlas A2 / 910B).
    pub npu_arch: &'a str,
    /// The launcher source (`kernels/npu_launch.cpp`).
    pub source: &'a Path,
    /// Directory of `finalize_tiling.h` / `finalize_kernel.cpp`.
    pub kernels_dir: &'a Path,
    /// The shared library to write.
    pub output: &'a Path,
}

fn inc(p: &Path) -> String {
    format!("-I{}", p.display())
}

/// The bisheng arguments (without the compiler itself) of a one-step
/// heterogeneous (`-xcce`) build of the kernel plus the host stub of its
/// `<<<>>>` launch, as a shared library.
///
/// - CANN <= 8.2: the vector-core form of `bisheng_intf.cmake`'s
///   `aiv_intf_pub` (`--cce-aicore-arch=dav-c220-vec`, `--cce-auto-sync`, its
///   `-mllvm` options). Its `--cce-aicore-only` is left out: it drops the host
///   half of the compile, which here is the launch stub.
/// - CANN >= 8.3: `--npu-arch=<arch>` (default `dav-2201`) with the same options.
///
/// Linked against `libascendcl` and `libruntime` of `$ASCEND_HOME_PATH/lib64`
/// with that directory as the run path: the launch stub calls the runtime's
/// kernel-registration and launch entry points, and the library is
/// `dlopen`ed with `RTLD_LOCAL`. The dynamic linker resolves a loaded
/// object's undefined symbols in the global scope and then in the object's
/// own `DT_NEEDED` tree (dlopen(3), "local scope"), so the stub resolves no
/// matter how the process loaded libascendcl.
pub fn bisheng_args(b: &NpuBuild<'_>) -> Vec<String> {
    let tik = b.home.join("compiler/tikcpp/tikcfw");
    let lib64 = b.home.join("lib64");
    let mut a: Vec<String> = vec!["-xcce".into()];
    if b.version >= CannVersion::NPU_ARCH_FLAG {
        a.push(format!("--npu-arch={}", b.npu_arch));
    } else {
        a.push("--cce-aicore-arch=dav-c220-vec".into());
    }
    a.push("--cce-auto-sync".into());
    for o in MLLVM_OPTIONS {
        a.push("-mllvm".into());
        a.push((*o).into());
    }
    a.extend(["-O2", "-std=c++17", "-fPIC", "-shared"].map(String::from));
    a.push(inc(&b.home.join("include")));
    a.push(inc(&tik));
    a.push(inc(&tik.join("impl")));
    a.push(inc(&tik.join("interface")));
    a.push(inc(b.kernels_dir));
    a.push(b.source.display().to_string());
    a.push(format!("-L{}", lib64.display()));
    a.push(format!("-Wl,-rpath,{}", lib64.display()));
    a.push("-lascendcl".into());
    a.push("-lruntime".into());
    a.push("-o".into());
    a.push(b.output.display().to_string());
    a
}
