//! What CANN pieces this process can use, and every place it looked: the
//! report behind `ascend-moe info`.

use std::fmt;

use acl_sys::loader::{self, LibSpec};

use super::result::acl as rt;

/// The outcome for one library.
#[derive(Debug, Clone)]
pub struct LibraryProbe {
    /// The soname.
    pub library: &'static str,
    /// Its override variable.
    pub env: &'static str,
    /// Every candidate in search order, as `(path, why)`.
    pub candidates: Vec<(String, String)>,
    /// `Ok(path it was opened from)` or the load error (listing each attempt).
    pub result: Result<String, String>,
}

/// Versions and devices, when the ACL runtime loaded.
#[derive(Debug, Clone)]
pub struct RuntimeInfo {
    /// `aclrtGetVersion` as `major.minor.patch`.
    pub version: Option<String>,
    /// `aclrtGetSocName`.
    pub soc: Option<String>,
    /// Visible devices, or why they could not be counted.
    pub devices: Result<u32, String>,
    /// Whether the runtime is the simulator: it exports any `cannsim_*`
    /// entry point (a kernel launcher or the call counters), which real CANN
    /// never does.
    pub simulator: bool,
}

/// Everything [`probe`] found.
#[derive(Debug, Clone)]
pub struct ProbeReport {
    /// The CANN roots searched, as `(dir, source, exists)`.
    pub roots: Vec<(String, &'static str, bool)>,
    /// Origin of the compiled-in bindings of acl-sys and hccl-sys.
    pub bindings: [(&'static str, &'static str); 2],
    /// libascendcl, libhccl, libnnopbase, libopapi.
    pub libraries: Vec<LibraryProbe>,
    /// Runtime details, when libascendcl loaded.
    pub runtime: Option<RuntimeInfo>,
    /// The aclnn operators the backend uses, each with the library file it
    /// was resolved from (`None`: not found).
    pub aclnn_ops: Vec<(&'static str, Option<String>)>,
    /// The native kernels (finalize, guard, copy).
    pub native_kernel: NativeKernelProbe,
}

/// Where the native kernels (`kernels/`) can launch.
#[derive(Debug, Clone)]
pub struct NativeKernelProbe {
    /// Whether the host build was compiled in (a simulated runtime launches it).
    pub host_build: bool,
    /// The AI Core library (`libamoe_kernels_npu.so`, `ASCEND_MOE_KERNEL_LIB`):
    /// `Ok(path it was loaded from)` or why it is not loaded. Without it (and
    /// off the simulator) finalize calls fall back to aclnn.
    pub library: Result<String, String>,
}

fn probe_library<T>(spec: &LibSpec, load: Result<T, loader::LoadError>, origin: impl Fn(&T) -> String) -> LibraryProbe {
    LibraryProbe {
        library: spec.soname,
        env: spec.env,
        candidates: loader::candidates(spec)
            .into_iter()
            .map(|c| (c.path.to_string_lossy().into_owned(), c.source))
            .collect(),
        result: load.as_ref().map(origin).map_err(|e| e.to_string()),
    }
}

fn describe(c: &loader::Candidate) -> String {
    format!("{} [{}]", c.path.to_string_lossy(), c.source)
}

/// Whether `api` exports any of the simulator-only entry points.
fn is_simulator(api: &acl_sys::Acl) -> bool {
    api.cannsim_launch_kernel.is_some()
        || api.cannsim_launch_kernel_ex.is_some()
        || api.cannsim_counters.is_some()
        || api.cannsim_counters_reset.is_some()
}

/// Looks for every CANN piece (loading what it finds).
pub fn probe() -> ProbeReport {
    let acl = acl_sys::acl();
    let hccl = hccl_sys::hccl();
    let nn = acl_sys::aclnn::nnopbase();
    let opapi = acl_sys::aclnn::opapi();
    let runtime = acl.as_ref().ok().map(|api| {
        let version = rt::get_version().map(|(a, b, c)| format!("{a}.{b}.{c}"));
        let devices = super::runtime::device_count().map_err(|e| e.to_string());
        let soc = rt::get_soc_name();
        RuntimeInfo { version, soc, devices, simulator: is_simulator(api) }
    });
    let aclnn_ops = match &opapi {
        Ok(o) => ["aclnnMoeFinalizeRoutingV2", "aclnnMoeTokenUnpermute", "aclnnAdd"]
            .into_iter()
            .map(|name| (name, o.source_of(name).map(str::to_string)))
            .collect(),
        Err(_) => Vec::new(),
    };
    ProbeReport {
        roots: loader::cann_roots()
            .into_iter()
            .map(|r| (r.path.to_string_lossy().into_owned(), r.source, r.path.is_dir()))
            .collect(),
        bindings: [("acl-sys", acl_sys::BINDINGS_ORIGIN), ("hccl-sys", hccl_sys::BINDINGS_ORIGIN)],
        libraries: vec![
            probe_library(&loader::ACL, acl, |a| describe(&a.origin)),
            probe_library(&loader::HCCL, hccl, |h| describe(&h.origin)),
            probe_library(&loader::NNOPBASE, nn, |n| describe(&n.origin)),
            probe_library(&loader::OPAPI, opapi, |o| describe(&o.origin)),
        ],
        runtime,
        aclnn_ops,
        native_kernel: NativeKernelProbe {
            host_build: super::kernel::host_entry().is_some(),
            library: super::kernel::kernel_lib_status(),
        },
    }
}

/// [`probe`] as text.
pub fn probe_report() -> String {
    probe().to_string()
}

impl ProbeReport {
    /// True when every library loaded.
    pub fn all_found(&self) -> bool {
        self.libraries.iter().all(|l| l.result.is_ok())
    }
}

impl fmt::Display for ProbeReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "CANN roots searched:")?;
        for (dir, source, exists) in &self.roots {
            writeln!(f, "  {dir} [{source}]{}", if *exists { "" } else { " (absent)" })?;
        }
        writeln!(f, "bindings:")?;
        for (krate, origin) in &self.bindings {
            writeln!(f, "  {krate}: {origin}")?;
        }
        writeln!(f, "libraries:")?;
        for lib in &self.libraries {
            match &lib.result {
                Ok(from) => {
                    writeln!(f, "  {}: found at {from}", lib.library)?;
                    let looked: Vec<&str> = lib.candidates.iter().map(|(p, _)| p.as_str()).collect();
                    writeln!(f, "    search order: {} (override: {})", looked.join(", "), lib.env)?;
                }
                Err(e) => writeln!(f, "  {}: NOT FOUND\n    {}", lib.library, e.replace('\n', "\n    "))?,
            }
        }
        match &self.runtime {
            Some(rt) => {
                writeln!(f, "runtime:")?;
                writeln!(f, "  ACL version: {}", rt.version.as_deref().unwrap_or("unknown"))?;
                writeln!(f, "  SoC: {}", rt.soc.as_deref().unwrap_or("unknown"))?;
                match &rt.devices {
                    Ok(n) => writeln!(f, "  devices: {n}")?,
                    Err(e) => writeln!(f, "  devices: unavailable ({e})")?,
                }
                if rt.simulator {
                    writeln!(f, "  simulated runtime (it exports cannsim_* entry points)")?;
                }
            }
            None => writeln!(f, "runtime: not loaded")?,
        }
        writeln!(f, "native kernels:")?;
        let host = if self.native_kernel.host_build { "compiled in" } else { "not built" };
        writeln!(f, "  host build (launched by a simulated runtime): {host}")?;
        match &self.native_kernel.library {
            Ok(path) => writeln!(f, "  AI Core library: loaded from {path}")?,
            Err(e) => writeln!(
                f,
                "  AI Core library: NOT LOADED (override: ASCEND_MOE_KERNEL_LIB)\n    {}",
                e.replace('\n', "\n    ")
            )?,
        }
        if !self.aclnn_ops.is_empty() {
            writeln!(f, "aclnn operators:")?;
            for (name, from) in &self.aclnn_ops {
                match from {
                    Some(path) => writeln!(f, "  {name}: available, from {path}")?,
                    None => writeln!(f, "  {name}: missing")?,
                }
            }
        }
        Ok(())
    }
}
