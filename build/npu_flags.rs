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
/// `<<<>>>` launch, as a shared library, for every CANN 8.x release.
///
/// The arguments are the vector-core form of the toolkit's own kernel build
/// interface: `--cce-aicore-arch=dav-c220-vec`, `--cce-auto-sync` and the
/// `-mllvm` options of `aiv_intf_pub` in tikcpp's `bisheng_intf.cmake`
/// (CANN 8.1), the same set as `c220_aiv_intf_pub` in the device cmake of
/// hicann/asc-devkit (the Ascend C devkit of CANN 8.5, which still uses
/// `--cce-aicore-arch=dav-c220-vec` for vector kernels). Its
/// `--cce-aicore-only` is left out: it drops the host half of the compile,
/// which here is the launch stub. `-xcce` is the heterogeneous mode of the
/// Bisheng compiler guide (异构编译, `atlas_bisheng_10_0003` for 8.0-8.2;
/// from 8.5 `-x` with the `cce` language, `atlas_bisheng_10_0013`).
///
/// `--npu-arch=dav-2201`, which the 8.5 guide lists for the `-x asc` flow,
/// is not used: it names the architecture and not the core type, and a
/// one-step build expands `KERNEL_TASK_TYPE_DEFAULT` to nothing, so only the
/// `-vec` architecture keeps this vector-only kernel on the vector cores.
///
/// Linked against `libascendcl` and `libruntime` of `$ASCEND_HOME_PATH/lib64`
/// with that directory as the run path: the launch stub calls the runtime's
/// kernel-registration and launch entry points (and `aclrtGetLastError`), and
/// the library is `dlopen`ed with `RTLD_LOCAL`. The dynamic linker resolves a
/// loaded object's undefined symbols in the global scope and then in the
/// object's own `DT_NEEDED` tree (dlopen(3), "local scope"), so the stub
/// resolves no matter how the process loaded libascendcl.
pub fn bisheng_args(b: &NpuBuild<'_>) -> Vec<String> {
    let tik = b.home.join("compiler/tikcpp/tikcfw");
    let lib64 = b.home.join("lib64");
    let mut a: Vec<String> = vec!["-xcce".into(), "--cce-aicore-arch=dav-c220-vec".into(), "--cce-auto-sync".into()];
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
