//! Builds the native finalize kernel (kernels/).
//!
//! Host build (always attempted): `kernels/finalize_kernel.cpp` compiled for
//! the host against the real Ascend C headers in CPU-debug mode, over the
//! host model of `kernels/host_model/` (the intrinsics and runtime hooks the
//! headers lower to), linked into the crate; `cfg(amoe_host_kernel)` tells the
//! Rust side it is there. The headers come from `ASCEND_MOE_ASCENDC_INCLUDE`
//! when it is set (a directory laid out like the toolkit's CPU-debug copy:
//! `include/{basic_api,highlevel_api}` and `tikicpulib/include`), else from
//! the CANN toolkit of `ASCEND_HOME_PATH`, else from
//! `../shared/third_party/ascendc-8.1` beside the repository. Without them
//! the kernel is reported unavailable at run time, with the directories that
//! were looked at (`AMOE_HOST_KERNEL_UNAVAILABLE`).
//!
//! NPU build (when a CANN toolkit is installed: `ASCEND_HOME_PATH`,
//! `ASCEND_TOOLKIT_HOME`, then the default roots the runtime loader searches,
//! `/usr/local/Ascend/cann` and `/usr/local/Ascend/ascend-toolkit/latest`,
//! the first with its `bisheng` or `ccec`): the same source for the AI Core
//! into `libamoe_kernels_npu.so` in OUT_DIR, with the command line of
//! `build/npu_flags.rs`; its path is passed on as `AMOE_NPU_KERNEL_LIB` (the
//! crate compiles its bytes in, so it travels with the library) and
//! `cfg(amoe_npu_kernel)` is set. A failure is a build warning, or a build
//! error with `ASCEND_MOE_NATIVE_KERNEL=required`, which also makes finding
//! no toolkit at all, or `ASCEND_MOE_NO_NPU_KERNEL=1`, a build error.

#[path = "build/npu_flags.rs"]
mod npu_flags;

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const KERNEL_SOURCES: &[&str] = &[
    "build/npu_flags.rs",
    "kernels/copy_kernel.cpp",
    "kernels/copy_tiling.h",
    "kernels/finalize_kernel.cpp",
    "kernels/finalize_tiling.h",
    "kernels/guard_kernel.cpp",
    "kernels/guard_tiling.h",
    "kernels/npu_launch.cpp",
    "kernels/host_model/copy_entry.cpp",
    "kernels/host_model/cpu_debug_hooks.h",
    "kernels/host_model/host_entry.cpp",
    "kernels/host_model/model.cpp",
    "kernels/host_model/model.h",
];

/// Environment that changes what this script does.
const ENV_VARS: &[&str] = &[
    // CANN install root (set by CANN's set_env.sh).
    "ASCEND_HOME_PATH",
    "ASCEND_TOOLKIT_HOME",
    // Ascend C headers for the host build (see the module doc).
    "ASCEND_MOE_ASCENDC_INCLUDE",
    // `1` skips the NPU kernel build even when CANN is present (an error with `required`).
    "ASCEND_MOE_NO_NPU_KERNEL",
    // `required`: no CANN toolkit, or a missing or failing NPU kernel build, is an error.
    "ASCEND_MOE_NATIVE_KERNEL",
];

/// CPU-debug defines for the dav-c220 vector core, from tikicpulib's cmake
/// config (the headers' README lists them).
const CPU_DEBUG_DEFINES: &[(&str, &str)] = &[
    ("__CCE_KT_TEST__", "1"),
    ("ASCENDC_CPU_DEBUG", "1"),
    ("ASCENDC_DEBUG", "1"),
    ("__CCE_AICORE__", "220"),
    ("__DAV_C220__", ""),
    ("_GLIBCXX_USE_CXX11_ABI", "0"),
];

fn main() {
    println!("cargo:rustc-check-cfg=cfg(amoe_host_kernel)");
    println!("cargo:rustc-check-cfg=cfg(amoe_npu_kernel)");
    println!("cargo:rustc-check-cfg=cfg(amoe_avx512)");
    if avx512_intrinsics() {
        println!("cargo:rustc-cfg=amoe_avx512");
    }
    for f in KERNEL_SOURCES {
        println!("cargo:rerun-if-changed={f}");
    }
    for v in ENV_VARS {
        println!("cargo:rerun-if-env-changed={v}");
    }
    println!("cargo:rerun-if-changed=build.rs");

    // The toolkit is looked for first, so that `required` fails before the
    // host build compiles.
    let required = env::var("ASCEND_MOE_NATIVE_KERNEL").as_deref() == Ok("required");
    let cann = npu_toolkit(required);
    build_host_kernel();
    if let Some(cann) = cann {
        build_npu_kernel(&cann, required);
    }
}

/// A crate using the AVX-512 intrinsics and target features the finalize
/// kernels use (`src/backend/cpu/finalize/lanes.rs`), for
/// [`avx512_intrinsics`] to compile.
const AVX512_PROBE: &str = r#"
use core::arch::x86_64::{
    __m128i, _mm512_castsi512_si256, _mm512_cmp_ps_mask, _mm512_cvtph_ps, _mm512_cvtps_ph, _mm512_extracti32x4_epi32,
    _mm512_inserti64x4, _mm512_loadu_si512, _mm512_mask_blend_epi32, _mm512_setzero_ps, _mm512_setzero_si512,
    _mm512_unpacklo_epi16, _CMP_UNORD_Q, _MM_FROUND_TO_NEAREST_INT,
};

#[target_feature(enable = "avx512f,avx512bw")]
pub unsafe fn probe(p: *const u8) -> __m128i {
    let w = _mm512_unpacklo_epi16(_mm512_setzero_si512(), _mm512_loadu_si512(p.cast()));
    let h = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm512_cvtph_ps(_mm512_castsi512_si256(w)));
    let m = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask::<_CMP_UNORD_Q>(_mm512_setzero_ps(), _mm512_setzero_ps()), w, w);
    _mm512_extracti32x4_epi32::<1>(_mm512_inserti64x4::<1>(m, h))
}
"#;

/// Whether the compiler building the crate has the AVX-512 intrinsics the
/// finalize kernels use, stable from Rust 1.89 (an x86_64 target only): a
/// probe crate is checked with `$RUSTC` for the target. A compiler that
/// refuses it (an older release, a nightly from before their stabilisation)
/// builds the AVX2 kernels only, so the declared minimum Rust still builds.
fn avx512_intrinsics() -> bool {
    if env::var("CARGO_CFG_TARGET_ARCH").as_deref() != Ok("x86_64") {
        return false;
    }
    let Some(out_dir) = env::var_os("OUT_DIR").map(PathBuf::from) else { return false };
    let probe = out_dir.join("amoe_avx512_probe.rs");
    if std::fs::write(&probe, AVX512_PROBE).is_err() {
        return false;
    }
    let mut rustc = Command::new(env::var_os("RUSTC").unwrap_or_else(|| "rustc".into()));
    rustc.args(["--edition", "2021", "--crate-type", "lib", "--emit", "metadata", "--crate-name", "amoe_avx512_probe"]);
    rustc.arg("--out-dir").arg(&out_dir).arg(&probe);
    if let Ok(target) = env::var("TARGET") {
        rustc.args(["--target", &target]);
    }
    rustc.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null());
    rustc.status().is_ok_and(|s| s.success())
}

/// The toolkit the NPU build uses: `None` when the build is skipped
/// (`ASCEND_MOE_NO_NPU_KERNEL=1`, no toolkit, or an unusable one, which
/// warns). Under `required` each of those is a build error.
fn npu_toolkit(required: bool) -> Option<Cann> {
    if env::var("ASCEND_MOE_NO_NPU_KERNEL").as_deref() == Ok("1") {
        if required {
            panic!(
                "ASCEND_MOE_NATIVE_KERNEL=required asks for the AI Core build of kernels/, but \
                 ASCEND_MOE_NO_NPU_KERNEL=1 (perhaps inherited from the environment) skips it: unset one of them"
            );
        }
        return None;
    }
    match find_cann() {
        Ok(Some(cann)) => Some(cann),
        Ok(None) if required => {
            let looked: Vec<String> = cann_roots().iter().map(|(r, why)| format!("{} ({why})", r.display())).collect();
            panic!(
                "ASCEND_MOE_NATIVE_KERNEL=required: no CANN toolkit to build the AI Core kernels/ with: \
                 ASCEND_HOME_PATH and ASCEND_TOOLKIT_HOME are unset and none of {} exists (source CANN's \
                 set_env.sh, or set ASCEND_HOME_PATH)",
                looked.join(", ")
            );
        }
        Ok(None) => None,
        Err(e) => {
            fail_npu(required, &e);
            None
        }
    }
}

fn manifest_dir() -> PathBuf {
    PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default())
}

/// The two header roots of a CPU-debug build.
struct AscendcHeaders {
    /// Holds `basic_api/` and `highlevel_api/`.
    api: PathBuf,
    /// tikicpulib's `include/` (stub_fun.h, kern_fwk.h, ...).
    cpu: PathBuf,
}

impl AscendcHeaders {
    fn complete(&self) -> bool {
        self.api.join("basic_api/kernel_operator.h").is_file() && self.cpu.join("stub_fun.h").is_file()
    }

    fn dirs(&self) -> Vec<PathBuf> {
        let b = self.api.join("basic_api");
        let h = self.api.join("highlevel_api");
        vec![
            b.clone(),
            b.join("impl"),
            b.join("interface"),
            b.join("inner_interface"),
            h.clone(),
            h.join("lib"),
            h.join("impl"),
            self.cpu.clone(),
        ]
    }
}

/// Candidate header locations, in order of preference.
fn header_candidates() -> Vec<AscendcHeaders> {
    let mut c = Vec::new();
    if let Some(root) = env::var_os("ASCEND_MOE_ASCENDC_INCLUDE").map(PathBuf::from) {
        // An explicit choice: no silent fall-back to other headers.
        c.push(AscendcHeaders { api: root.join("include"), cpu: root.join("tikicpulib/include") });
        return c;
    }
    for var in ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"] {
        if let Some(home) = env::var_os(var).map(PathBuf::from) {
            let cpu = home.join("tools/tikicpulib/lib/include");
            for api in ["compiler/ascendc/include", "aarch64-linux/ascendc/include", "x86_64-linux/ascendc/include"] {
                c.push(AscendcHeaders { api: home.join(api), cpu: cpu.clone() });
            }
        }
    }
    let shared = manifest_dir().join("../shared/third_party/ascendc-8.1");
    c.push(AscendcHeaders { api: shared.join("include"), cpu: shared.join("tikicpulib/include") });
    c
}

/// The kernels and the host model for the host. The translation units
/// (each kernel, the finalize with one barrier dropped, the host entries,
/// the model) compile in parallel.
fn build_host_kernel() {
    let candidates = header_candidates();
    let Some(headers) = candidates.iter().find(|h| h.complete()) else {
        let looked: Vec<String> = candidates.iter().map(|h| h.api.display().to_string()).collect();
        let msg = format!(
            "the Ascend C headers were not found (looked for basic_api/kernel_operator.h under {}; set \
             ASCEND_MOE_ASCENDC_INCLUDE or check out shared/ beside the repository)",
            looked.join(", ")
        );
        println!("cargo:warning=host build of kernels/ skipped, the native kernel is unavailable: {msg}");
        println!("cargo:rustc-env=AMOE_HOST_KERNEL_UNAVAILABLE={msg}");
        return;
    };
    for d in headers.dirs() {
        println!("cargo:rerun-if-changed={}", d.display());
    }
    let out = PathBuf::from(env::var_os("OUT_DIR").unwrap_or_default());
    let mut base = cc::Build::new();
    base.cpp(true)
        .std("c++17")
        .opt_level(1)
        .debug(false)
        // Every multiply and add rounds on its own, like the vector unit.
        .flag_if_supported("-ffp-contract=off")
        .flag_if_supported("-fno-fast-math")
        .include("kernels")
        .include("kernels/host_model")
        .warnings(true)
        .extra_warnings(true)
        // The headers call `Fp16T(int32_t)` / `Bf16T(float)` constructors
        // whose member initialiser passes `this` to a conversion defined in
        // model.cpp; GCC cannot see that it never reads the member.
        .flag_if_supported("-Wno-maybe-uninitialized");
    for (k, v) in CPU_DEBUG_DEFINES {
        base.define(k, if v.is_empty() { None } else { Some(*v) });
    }
    for d in headers.dirs() {
        // Vendor headers: their own warnings are theirs (reviewed in kernels/README.md).
        base.flag(format!("-isystem{}", d.display()));
    }
    let hooks = manifest_dir().join("kernels/host_model/cpu_debug_hooks.h");
    let units = [
        Unit { name: "kernel", file: "kernels/finalize_kernel.cpp", defines: &[], api: true },
        Unit {
            name: "kernel_dropped_barrier",
            file: "kernels/finalize_kernel.cpp",
            defines: &[
                ("AMOE_FINALIZE_DROP_BARRIER", "1"),
                ("AMOE_FINALIZE_KERNEL_NAME", "amoe_finalize_kernel_dropped_barrier"),
            ],
            api: true,
        },
        Unit { name: "guard", file: "kernels/guard_kernel.cpp", defines: &[], api: true },
        Unit { name: "copy", file: "kernels/copy_kernel.cpp", defines: &[], api: true },
        Unit { name: "copy_entry", file: "kernels/host_model/copy_entry.cpp", defines: &[], api: true },
        Unit { name: "host_entry", file: "kernels/host_model/host_entry.cpp", defines: &[], api: true },
        Unit { name: "model", file: "kernels/host_model/model.cpp", defines: &[], api: false },
    ];
    let results: Vec<Result<Vec<PathBuf>, cc::Error>> = std::thread::scope(|s| {
        let handles: Vec<_> = units
            .iter()
            .map(|u| {
                let mut b = base.clone();
                b.out_dir(out.join("host_model").join(u.name)).file(u.file);
                if u.api {
                    b.flag("-include").flag(hooks.display().to_string());
                } else {
                    // The model itself only includes tikicpulib's stub headers.
                    b.opt_level(2);
                }
                for (k, v) in u.defines {
                    b.define(k, Some(*v));
                }
                s.spawn(move || b.try_compile_intermediates())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| panic!("a host kernel compile panicked"))).collect()
    });
    let mut objects = Vec::new();
    for r in results {
        match r {
            Ok(o) => objects.extend(o),
            Err(e) => {
                let msg = format!("host build of kernels/ against {} failed: {e}", headers.api.display());
                println!("cargo:warning={msg}, the native kernel is unavailable");
                println!("cargo:rustc-env=AMOE_HOST_KERNEL_UNAVAILABLE={msg}");
                return;
            }
        }
    }
    let mut lib = cc::Build::new();
    lib.cpp(true).objects(&objects);
    match lib.try_compile("amoe_kernels_host") {
        Ok(()) => {
            println!("cargo:rustc-cfg=amoe_host_kernel");
            println!("cargo:rustc-env=AMOE_HOST_KERNEL_HEADERS={}", headers.api.display());
        }
        Err(e) => {
            let msg = format!("archiving the host build of kernels/ failed: {e}");
            println!("cargo:warning={msg}");
            println!("cargo:rustc-env=AMOE_HOST_KERNEL_UNAVAILABLE={msg}");
        }
    }
}

/// One translation unit of the host build.
struct Unit {
    name: &'static str,
    file: &'static str,
    defines: &'static [(&'static str, &'static str)],
    /// Includes the Ascend C API headers (gets the CPU-debug hooks).
    api: bool,
}

struct Cann {
    home: PathBuf,
    compiler: PathBuf,
    version: npu_flags::CannVersion,
}

/// The CANN roots, as the runtime loader searches them
/// (`acl_sys::loader::cann_roots`): `ASCEND_HOME_PATH`, `ASCEND_TOOLKIT_HOME`
/// (when set and non-empty), then the default install locations, each with
/// where it came from.
fn cann_roots() -> Vec<(PathBuf, &'static str)> {
    let mut roots: Vec<(PathBuf, &'static str)> = Vec::new();
    for var in ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"] {
        if let Some(v) = env::var_os(var).filter(|v| !v.is_empty()) {
            roots.push((PathBuf::from(v), var));
        }
    }
    for d in ["/usr/local/Ascend/cann", "/usr/local/Ascend/ascend-toolkit/latest"] {
        roots.push((PathBuf::from(d), "default"));
    }
    roots
}

/// CANN root, its kernel compiler and its version, if a toolkit is
/// installed; an error when one is announced (a variable, or a default root
/// that exists) but unusable.
fn find_cann() -> Result<Option<Cann>, String> {
    let roots: Vec<PathBuf> =
        cann_roots().into_iter().filter(|(r, why)| *why != "default" || r.is_dir()).map(|(r, _)| r).collect();
    if roots.is_empty() {
        return Ok(None);
    }
    for home in &roots {
        let candidates = [
            home.join("compiler/ccec_compiler/bin/bisheng"),
            home.join("compiler/ccec_compiler/bin/ccec"),
            home.join("bin/bisheng"),
            home.join("bin/ccec"),
        ];
        let Some(compiler) = candidates.into_iter().find(|p| p.is_file()) else {
            continue;
        };
        let files = npu_flags::version_files(home);
        let version =
            files.iter().find_map(|f| std::fs::read_to_string(f).ok().and_then(|t| npu_flags::parse_version_file(&t)));
        for f in &files {
            println!("cargo:rerun-if-changed={}", f.display());
        }
        let Some(version) = version else {
            let looked: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
            return Err(format!("CANN at {}: no version found in {}", home.display(), looked.join(", ")));
        };
        return Ok(Some(Cann { home: home.clone(), compiler, version }));
    }
    let looked: Vec<String> = roots.iter().map(|r| r.display().to_string()).collect();
    Err(format!("no bisheng or ccec compiler under the CANN install {}", looked.join(", ")))
}

fn fail_npu(required: bool, msg: &str) {
    if required {
        panic!("ASCEND_MOE_NATIVE_KERNEL=required: the NPU build of kernels/ failed: {msg}");
    }
    println!("cargo:warning=NPU build of kernels/ failed, the NPU path uses aclnn: {msg}");
}

/// One heterogeneous compile (`-xcce`): the device kernel plus the host stub of
/// its `<<<>>>` launch, as a shared library loaded at run time.
fn build_npu_kernel(cann: &Cann, required: bool) {
    let out = PathBuf::from(env::var_os("OUT_DIR").unwrap_or_default());
    let lib = out.join("libamoe_kernels_npu.so");
    let b = npu_flags::NpuBuild {
        home: &cann.home,
        source: Path::new("kernels/npu_launch.cpp"),
        kernels_dir: Path::new("kernels"),
        output: &lib,
    };
    let mut cmd = Command::new(&cann.compiler);
    cmd.args(npu_flags::bisheng_args(&b));
    match cmd.output() {
        Ok(o) if o.status.success() => {
            println!("cargo:rustc-cfg=amoe_npu_kernel");
            println!("cargo:rustc-env=AMOE_NPU_KERNEL_LIB={}", lib.display());
        }
        Ok(o) => {
            let err = String::from_utf8_lossy(&o.stderr);
            let first = err.lines().take(8).collect::<Vec<_>>().join(" | ");
            let v = cann.version;
            let what = format!("{} (CANN {}.{}) exited with {}", cann.compiler.display(), v.major, v.minor, o.status);
            fail_npu(required, &format!("{what}: {first}"));
        }
        Err(e) => fail_npu(required, &format!("could not run {}: {e}", cann.compiler.display())),
    }
}
