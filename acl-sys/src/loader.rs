//! Finding and opening the CANN shared libraries at run time.
//!
//! Search order for one library: its override variable alone when set
//! (`ASCEND_MOE_ACL_LIB`, ...); otherwise the plain soname through the dynamic
//! loader's path (`LD_LIBRARY_PATH`, as CANN's `set_env.sh` sets it), then
//! `lib64/` (and any library-specific subdirectory) of every CANN root
//! ([`cann_roots`]). A library that opens but lacks a required symbol counts as
//! a failed attempt and the search goes on. The error lists every attempt.

use std::ffi::{c_void, OsString};
use std::fmt;
use std::path::PathBuf;

use libloading::Library;

/// How to find one CANN library.
#[derive(Debug, Clone, Copy)]
pub struct LibSpec {
    /// The soname, e.g. `libascendcl.so`.
    pub soname: &'static str,
    /// The variable that overrides the path.
    pub env: &'static str,
    /// Directories under a CANN root to look in, in order.
    pub subdirs: &'static [&'static str],
}

/// `libascendcl.so`.
pub const ACL: LibSpec = LibSpec { soname: "libascendcl.so", env: "ASCEND_MOE_ACL_LIB", subdirs: &["lib64"] };
/// `libhccl.so`.
pub const HCCL: LibSpec = LibSpec { soname: "libhccl.so", env: "ASCEND_MOE_HCCL_LIB", subdirs: &["lib64"] };
/// `libnnopbase.so` (aclTensor / aclScalar constructors).
pub const NNOPBASE: LibSpec = LibSpec { soname: "libnnopbase.so", env: "ASCEND_MOE_NNOPBASE_LIB", subdirs: &["lib64"] };
/// `libopapi.so` (the built-in aclnn operators).
pub const OPAPI: LibSpec =
    LibSpec { soname: "libopapi.so", env: "ASCEND_MOE_OPAPI_LIB", subdirs: &["lib64", OPAPI_ARCH_DIR] };

/// Where CANN keeps the real `libopapi.so` (lib64 has a symlink in most releases).
#[cfg(target_arch = "aarch64")]
const OPAPI_ARCH_DIR: &str = "opp/built-in/op_impl/ai_core/tbe/op_api/lib/linux/aarch64";
/// Where CANN keeps the real `libopapi.so` (lib64 has a symlink in most releases).
#[cfg(not(target_arch = "aarch64"))]
const OPAPI_ARCH_DIR: &str = "opp/built-in/op_impl/ai_core/tbe/op_api/lib/linux/x86_64";

/// A CANN root directory and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Root {
    /// The directory.
    pub path: PathBuf,
    /// `ASCEND_HOME_PATH`, `ASCEND_TOOLKIT_HOME` or `default`.
    pub source: &'static str,
}

/// The CANN roots, in the order they are searched: `ASCEND_HOME_PATH`,
/// `ASCEND_TOOLKIT_HOME`, `/usr/local/Ascend/cann`,
/// `/usr/local/Ascend/ascend-toolkit/latest` (duplicates removed).
pub fn cann_roots() -> Vec<Root> {
    let mut roots: Vec<Root> = Vec::new();
    for var in ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"] {
        if let Some(v) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            roots.push(Root { path: PathBuf::from(v), source: var });
        }
    }
    for d in ["/usr/local/Ascend/cann", "/usr/local/Ascend/ascend-toolkit/latest"] {
        roots.push(Root { path: PathBuf::from(d), source: "default" });
    }
    let mut seen = Vec::new();
    roots.retain(|r| {
        let dup = seen.contains(&r.path);
        seen.push(r.path.clone());
        !dup
    });
    roots
}

/// One place a library may be opened from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// What is passed to `dlopen` (a path, or a bare soname).
    pub path: OsString,
    /// Why it is a candidate (`ASCEND_MOE_ACL_LIB`, `loader path`, `ASCEND_HOME_PATH`, ...).
    pub source: String,
}

/// Every candidate for `spec`, in search order (reads its override variable).
pub fn candidates(spec: &LibSpec) -> Vec<Candidate> {
    candidates_with(spec, std::env::var_os(spec.env))
}

/// Every candidate for `spec` given the value of its override variable: the
/// override alone when set and non-empty, else the search list.
pub fn candidates_with(spec: &LibSpec, override_value: Option<OsString>) -> Vec<Candidate> {
    if let Some(v) = override_value.filter(|v| !v.is_empty()) {
        return vec![Candidate { path: v, source: spec.env.to_string() }];
    }
    let mut out = vec![Candidate { path: spec.soname.into(), source: "loader path".into() }];
    for root in cann_roots() {
        for sub in spec.subdirs {
            let p = root.path.join(sub).join(spec.soname);
            out.push(Candidate { path: p.into_os_string(), source: root.source.to_string() });
        }
    }
    out
}

/// One failed attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    /// The candidate.
    pub candidate: Candidate,
    /// Why it failed (the `dlopen` message, or the missing symbols).
    pub reason: String,
}

/// A library could not be loaded from any candidate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadError {
    /// The soname.
    pub library: &'static str,
    /// The override variable of that library.
    pub env: &'static str,
    /// Every attempt, in order.
    pub attempts: Vec<Attempt>,
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "could not load {} (set {} to its path); tried:", self.library, self.env)?;
        for a in &self.attempts {
            write!(f, "\n  {} [{}]: {}", a.candidate.path.to_string_lossy(), a.candidate.source, a.reason)?;
        }
        Ok(())
    }
}

impl std::error::Error for LoadError {}

/// A library that opened and passed its symbol check.
#[derive(Debug)]
pub struct Opened {
    /// The library.
    pub library: Library,
    /// The candidate it came from.
    pub candidate: Candidate,
}

/// Names of `required` symbols that `lib` does not export.
pub fn missing_symbols(lib: &Library, required: &[&str]) -> Vec<String> {
    required
        .iter()
        .filter(|name| {
            // SAFETY: only the address is looked up; it is never called or read here.
            unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_err()
        })
        .map(|s| s.to_string())
        .collect()
}

/// Opens the first candidate of `spec` that exports every `required` symbol.
pub fn open(spec: &LibSpec, required: &[&str]) -> Result<Opened, LoadError> {
    open_candidates(spec, candidates(spec), required)
}

/// Opens the first of `candidates` that exports every `required` symbol.
pub fn open_candidates(spec: &LibSpec, candidates: Vec<Candidate>, required: &[&str]) -> Result<Opened, LoadError> {
    let mut attempts = Vec::new();
    for candidate in candidates {
        // SAFETY: loading a CANN library runs its initialisers; that is the
        // documented way to use CANN and the libraries are trusted like any
        // system library named by the user's environment.
        match unsafe { Library::new(&candidate.path) } {
            Ok(library) => {
                let missing = missing_symbols(&library, required);
                if missing.is_empty() {
                    return Ok(Opened { library, candidate });
                }
                attempts.push(Attempt { candidate, reason: format!("lacks required symbols {}", missing.join(", ")) });
            }
            Err(e) => {
                let reason = dl_reason(&e);
                // dlerror() repeats the path; the attempt already names it.
                let prefix = format!("{}: ", candidate.path.to_string_lossy());
                let reason = reason.strip_prefix(&prefix).map(str::to_string).unwrap_or(reason);
                attempts.push(Attempt { candidate, reason })
            }
        }
    }
    Err(LoadError { library: spec.soname, env: spec.env, attempts })
}

fn dl_reason(e: &libloading::Error) -> String {
    use std::error::Error as _;
    match e.source() {
        Some(inner) => inner.to_string(),
        None => e.to_string(),
    }
}
