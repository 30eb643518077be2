//! The single bindgen configuration shared by the `acl-sys` and `hccl-sys`
//! build scripts (and therefore by `ci/headers.sh`, which regenerates the
//! committed bindings through those same build scripts).
//!
//! A build script calls [`build`]: it looks for CANN headers, and when they
//! and libclang are present it generates the bindings into `OUT_DIR` and sets
//! `cfg(cann_generated)`; in every other case the crate keeps its committed
//! `src/bindings.rs`. Nothing here ever fails the build because CANN or
//! libclang is missing.
//!
//! Environment (each read is declared with `rerun-if-env-changed`):
//! - `ASCEND_MOE_CANN_INCLUDE`: an include root to use instead of the toolkit's
//!   (a toolkit `include/` dir, or a torch-npu wheel's `torch_npu/include`);
//! - `ASCEND_HOME_PATH`, `ASCEND_TOOLKIT_HOME`: CANN roots (then
//!   `/usr/local/Ascend/cann`, `/usr/local/Ascend/ascend-toolkit/latest`);
//! - `ASCEND_MOE_BINDINGS_DUMP`: a directory; when set the generated bindings
//!   are also written there as `<crate>.rs` and any generation failure is fatal
//!   (regeneration mode of `ci/headers.sh`);
//! - `LIBCLANG_PATH`: where clang-sys looks for libclang first;
//! - `DOCS_RS`: skip everything, use the committed bindings.

use std::env;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};

use bindgen::{EnumVariation, Formatter, MacroTypeVariation};

/// The ACL runtime functions acl-sys binds (the NPU symbol contract).
pub const ACL_FUNCTIONS: &[&str] = &[
    "aclInit",
    "aclFinalize",
    "aclrtSetDevice",
    "aclrtResetDevice",
    "aclrtGetDevice",
    "aclrtGetDeviceCount",
    "aclrtCreateStream",
    "aclrtDestroyStream",
    "aclrtSynchronizeStream",
    "aclrtSynchronizeStreamWithTimeout",
    "aclrtStreamWaitEvent",
    "aclrtMalloc",
    "aclrtFree",
    "aclrtMallocHost",
    "aclrtFreeHost",
    "aclrtMemcpy",
    "aclrtMemcpyAsync",
    "aclrtMemset",
    "aclrtMemsetAsync",
    "aclrtGetMemInfo",
    "aclrtCreateEvent",
    "aclrtCreateEventExWithFlag",
    "aclrtRecordEvent",
    "aclrtSynchronizeEvent",
    "aclrtQueryEventStatus",
    "aclrtEventElapsedTime",
    "aclrtDestroyEvent",
    "aclGetRecentErrMsg",
    "aclrtGetSocName",
    "aclrtGetVersion",
    // ACL graph capture (acl_mdl.h in CANN 8.1, acl_rt.h since 8.3).
    "aclmdlRICaptureBegin",
    "aclmdlRICaptureGetInfo",
    "aclmdlRICaptureEnd",
    "aclmdlRICaptureThreadExchangeMode",
    "aclmdlRIExecuteAsync",
    "aclmdlRIDestroy",
];

/// Prototypes of ACL functions in [`ACL_FUNCTIONS`] that older supported
/// headers lack, as CANN 8.5 declares them; the wrapper header adds them
/// after `acl/acl.h` (a compatible redeclaration where the headers have
/// them), so the bindings, and what the crate compiles against, are the
/// same whichever headers generated them. The symbol itself still loads as
/// `Err` from a runtime without it.
pub const ACL_NEWER_PROTOTYPES: &[&str] = &[
    // hicann/runtime v8.5.0 `include/external/acl/acl_rt.h:3953`; not in the
    // torch-npu 2.9.0 wheel's headers.
    "aclError aclmdlRICaptureThreadExchangeMode(aclmdlRICaptureMode *mode);",
];

/// The ACL types acl-sys exports beyond those the functions pull in (the
/// aclnn tensor constructors need the dtype and format enums).
pub const ACL_TYPES: &[&str] = &[
    "aclError",
    "aclDataType",
    "aclFormat",
    "aclrtStream",
    "aclrtEvent",
    "aclrtMemMallocPolicy",
    "aclrtMemcpyKind",
    "aclrtMemAttr",
    "aclrtEventRecordedStatus",
    "aclmdlRI",
    "aclmdlRICaptureMode",
    "aclmdlRICaptureStatus",
];

/// The HCCL functions hccl-sys binds (the NPU symbol contract).
pub const HCCL_FUNCTIONS: &[&str] = &[
    "HcclGetRootInfo",
    "HcclCommInitRootInfo",
    "HcclCommInitRootInfoConfig",
    "HcclCreateSubCommConfig",
    "HcclCommDestroy",
    "HcclGetRankId",
    "HcclGetRankSize",
    "HcclGetCommName",
    "HcclGetErrorString",
    "HcclGetCommAsyncError",
    "HcclGetCommConfigCapability",
    "HcclAllReduce",
    "HcclReduceScatter",
    "HcclReduceScatterV",
    "HcclAllGather",
    "HcclAllGatherV",
    "HcclAlltoAllV",
    "HcclBroadcast",
    "HcclBarrier",
];

/// The HCCL types hccl-sys exports beyond those the functions pull in.
pub const HCCL_TYPES: &[&str] =
    &["HcclResult", "HcclDataType", "HcclReduceOp", "HcclRootInfo", "HcclComm", "HcclCommConfigCapability"];

/// Which sys crate is being built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Crate {
    /// acl-sys: `acl/acl.h`, parsed as C.
    Acl,
    /// hccl-sys: `hccl/hccl.h`, parsed as C++ (its array bounds are C++ constants).
    Hccl,
}

impl Crate {
    fn name(self) -> &'static str {
        match self {
            Crate::Acl => "acl",
            Crate::Hccl => "hccl",
        }
    }
    fn functions(self) -> &'static [&'static str] {
        match self {
            Crate::Acl => ACL_FUNCTIONS,
            Crate::Hccl => HCCL_FUNCTIONS,
        }
    }
}

/// Where the headers of one CANN installation (or wheel) are.
#[derive(Debug, Clone)]
pub struct Headers {
    /// Include dir holding `acl/acl.h`.
    pub acl_include: PathBuf,
    /// `hccl.h` itself, when present.
    pub hccl_header: Option<PathBuf>,
    /// Include dir from which `hccl.h`'s own includes resolve.
    pub hccl_include: Option<PathBuf>,
}

/// Reads an environment variable and tells cargo to rerun when it changes.
pub fn env_var(name: &str) -> Option<OsString> {
    println!("cargo:rerun-if-env-changed={name}");
    env::var_os(name).filter(|v| !v.is_empty())
}

/// The include roots to try, in order, each with where it came from.
pub fn include_candidates() -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    if let Some(dir) = env_var("ASCEND_MOE_CANN_INCLUDE") {
        out.push((PathBuf::from(dir), "ASCEND_MOE_CANN_INCLUDE".to_string()));
    }
    for var in ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"] {
        if let Some(root) = env_var(var) {
            out.push((Path::new(&root).join("include"), var.to_string()));
        }
    }
    for root in ["/usr/local/Ascend/cann", "/usr/local/Ascend/ascend-toolkit/latest"] {
        out.push((Path::new(root).join("include"), "default location".to_string()));
    }
    out
}

/// Recognises a toolkit include dir (`acl/acl.h`, `hccl/hccl.h`) or a
/// torch-npu wheel's `torch_npu/include` (`third_party/{acl,hccl}/inc/...`).
pub fn headers_in(root: &Path) -> Option<Headers> {
    let toolkit_acl = root.join("acl/acl.h");
    let wheel_acl_inc = root.join("third_party/acl/inc");
    let acl_include = if toolkit_acl.is_file() {
        root.to_path_buf()
    } else if wheel_acl_inc.join("acl/acl.h").is_file() {
        wheel_acl_inc
    } else {
        return None;
    };
    let toolkit_hccl = root.join("hccl/hccl.h");
    let wheel_hccl = root.join("third_party/hccl/inc/hccl/hccl.h");
    let hccl_header = [toolkit_hccl, wheel_hccl].into_iter().find(|p| p.is_file());
    let hccl_include = hccl_header.as_ref().map(|_| root.to_path_buf());
    Some(Headers { acl_include, hccl_header, hccl_include })
}

fn builder_common(name: Crate) -> bindgen::Builder {
    let mut b = bindgen::Builder::default()
        // Vendor prose stays in the vendor's headers.
        .generate_comments(false)
        .formatter(Formatter::Prettyplease)
        // Codes and enums coming back from C may hold values a newer CANN
        // added: newtypes, never Rust enums.
        .default_enum_style(EnumVariation::NewType { is_bitfield: false, is_global: false })
        .default_macro_constant_type(MacroTypeVariation::Signed)
        .dynamic_library_name(match name {
            Crate::Acl => "AclLib",
            Crate::Hccl => "HcclLib",
        })
        // Symbols a given CANN release lacks load as `Err` instead of failing the load.
        .dynamic_link_require_all(false)
        .layout_tests(true)
        .derive_default(true);
    for f in name.functions() {
        b = b.allowlist_function(f);
    }
    b
}

/// The bindgen builder for acl-sys.
pub fn acl_builder(h: &Headers) -> bindgen::Builder {
    let mut b = builder_common(Crate::Acl)
        .header_contents(
            "acl_sys_wrapper.h",
            &format!(
                "#include \"acl/acl.h\"\n#ifdef __cplusplus\nextern \"C\" {{\n#endif\n{}\n#ifdef __cplusplus\n}}\n#endif\n",
                ACL_NEWER_PROTOTYPES.join("\n")
            ),
        )
        .clang_args(["-x", "c", "-std=c11"])
        .clang_arg(format!("-I{}", h.acl_include.display()))
        .must_use_type("aclError")
        .allowlist_var("ACL_SUCCESS|ACL_ERROR_.*|ACL_RT_SUCCESS");
    for t in ACL_TYPES {
        b = b.allowlist_type(t);
    }
    b
}

/// The bindgen builder for hccl-sys (`None` when the headers have no `hccl.h`).
pub fn hccl_builder(h: &Headers) -> Option<bindgen::Builder> {
    let (header, include) = (h.hccl_header.as_ref()?, h.hccl_include.as_ref()?);
    let mut b = builder_common(Crate::Hccl)
        .header(header.display().to_string())
        .clang_args(["-x", "c++", "-std=c++11"])
        .clang_arg(format!("-I{}", include.display()))
        .clang_arg(format!("-I{}", h.acl_include.display()))
        // The ACL types (aclrtStream, ...) come from acl-sys, so the two crates
        // share one definition.
        .blocklist_type("acl.*")
        // Runtime-internal types some HCCL header versions mention; never
        // part of the API we call.
        .blocklist_type("rt.*")
        // The config struct is pinned to layout version 10 in hccl-sys itself
        // (HcclCommConfigInit is header-only and re-implemented there), so an
        // older header cannot silently change the layout we fill in.
        .blocklist_type("HcclCommConfig(Def)?")
        .allowlist_var("HCCL_ROOT_INFO_BYTES|HCCL_COMM_.*|COMM_NAME_MAX_LENGTH|UDI_MAX_LENGTH|BUFFER_NAME_MAX_LENGTH");
    for t in HCCL_TYPES {
        b = b.allowlist_type(t);
    }
    Some(b)
}

/// Generates the bindings of `krate` for `headers` as a string.
pub fn generate(krate: Crate, headers: &Headers) -> Result<String, String> {
    clang_sys::load().map_err(|e| format!("libclang not available: {e}"))?;
    let builder = match krate {
        Crate::Acl => acl_builder(headers),
        Crate::Hccl => hccl_builder(headers).ok_or("no hccl/hccl.h next to acl/acl.h")?,
    };
    let text = match builder.generate() {
        Ok(b) => b.to_string(),
        // Some releases' ACL headers are C++ only (the torch-npu 2.9.0 wheel's
        // acl_rt.h declares a file-scope `constexpr`); their C API sits in
        // `extern "C"`, so parsing them as C++ binds the same functions.
        Err(c_err) if krate == Crate::Acl => acl_builder(headers)
            .clang_args(["-x", "c++", "-std=c++11"])
            .generate()
            .map_err(|e| format!("bindgen failed as C ({c_err}) and as C++ ({e})"))?
            .to_string(),
        Err(e) => return Err(format!("bindgen failed: {e}")),
    };
    let missing: Vec<&str> =
        krate.functions().iter().copied().filter(|f| !text.contains(&format!("pub {f}: Result<"))).collect();
    if !missing.is_empty() {
        return Err(format!("the headers lack {}", missing.join(", ")));
    }
    Ok(text)
}

/// Checks that bindgen can really generate bindings on this host: loads
/// libclang the way the build scripts do and parses a header that includes
/// `<stddef.h>` as C (the ACL mode) and as C++ (the HCCL mode). A libclang
/// without its resource headers fails here with "'stddef.h' file not found",
/// as it would in the real generation. Returns the libclang that was used.
pub fn probe() -> Result<PathBuf, String> {
    clang_sys::load().map_err(|e| format!("libclang not available: {e}"))?;
    let lib =
        clang_sys::get_library().map(|l| l.path().to_path_buf()).ok_or("libclang loaded but its path is unknown")?;
    for (lang, std) in [("c", "-std=c11"), ("c++", "-std=c++11")] {
        let text = bindgen::Builder::default()
            .header_contents("cann_bindgen_probe.h", "#include <stddef.h>\ntypedef size_t cann_bindgen_probe_t;\n")
            .clang_args(["-x", lang, std])
            .allowlist_type("cann_bindgen_probe_t")
            .generate()
            .map_err(|e| {
                format!("bindgen cannot parse a header including <stddef.h> as {lang} with {}: {e}", lib.display())
            })?
            .to_string();
        if !text.contains("cann_bindgen_probe_t") {
            return Err(format!("bindgen ({lang}, {}) produced no binding for a size_t typedef", lib.display()));
        }
    }
    Ok(lib)
}

/// The whole build-script logic of one sys crate.
pub fn build(krate: Crate) {
    println!("cargo:rustc-check-cfg=cfg(cann_generated)");
    println!("cargo:rerun-if-changed=src/bindings.rs");
    let origin = if env::var_os("DOCS_RS").is_some() { None } else { try_generate(krate) };
    match origin {
        Some(root) => {
            println!("cargo:rustc-cfg=cann_generated");
            println!("cargo:rustc-env=CANN_BINDINGS_ORIGIN=generated from {}", root.display());
        }
        None => println!("cargo:rustc-env=CANN_BINDINGS_ORIGIN=committed"),
    }
}

/// Generates into `OUT_DIR`; the header root on success, `None` to use the
/// committed bindings.
fn try_generate(krate: Crate) -> Option<PathBuf> {
    env_var("LIBCLANG_PATH");
    let dump = env_var("ASCEND_MOE_BINDINGS_DUMP").map(PathBuf::from);
    let fail = |msg: String| -> Option<PathBuf> {
        if dump.is_some() {
            panic!("{}-sys: regeneration requested but failed: {msg}", krate.name());
        }
        println!("cargo:warning={}-sys: using the committed bindings ({msg})", krate.name());
        None
    };
    let candidates = include_candidates();
    let Some((root, headers)) = candidates.iter().find_map(|(dir, _)| headers_in(dir).map(|h| (dir.clone(), h))) else {
        if dump.is_some() {
            let tried: Vec<String> = candidates.iter().map(|(d, why)| format!("{} ({why})", d.display())).collect();
            return fail(format!("no CANN headers in {}", tried.join(", ")));
        }
        // No SDK: the normal case on CI and laptops, not worth a warning.
        return None;
    };
    println!("cargo:rerun-if-changed={}", root.display());
    let text = match generate(krate, &headers) {
        Ok(t) => t,
        Err(e) => return fail(format!("{e}; headers at {}", root.display())),
    };
    let Some(out_dir) = env::var_os("OUT_DIR").map(PathBuf::from) else {
        return fail("OUT_DIR is not set".into());
    };
    if let Err(e) = fs::write(out_dir.join("bindings.rs"), &text) {
        return fail(format!("cannot write {}: {e}", out_dir.display()));
    }
    if let Some(dir) = &dump {
        let path = dir.join(format!("{}.rs", krate.name()));
        if let Err(e) = fs::create_dir_all(dir).and_then(|_| fs::write(&path, &text)) {
            panic!("cannot write {}: {e}", path.display());
        }
    }
    Some(root)
}
