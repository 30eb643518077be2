//! Where the kernel's builds live: the host build linked into the crate
//! (`kernels/host_model/`, over the real Ascend C headers) and the AI Core
//! build loaded at run time.

use std::ffi::c_void;
use std::path::PathBuf;

use super::abi::*;
#[cfg(test)]
use crate::DType;
use crate::{Error, Result};

#[cfg(amoe_host_kernel)]
mod ffi {
    use std::ffi::c_void;
    extern "C" {
        pub fn amoe_finalize_kernel_host(block_idx: u32, block_dim: u32, gm: *const *mut c_void, tiling: *const c_void);
        #[cfg(test)]
        pub fn amoe_finalize_kernel_host_dropped_barrier(
            block_idx: u32,
            block_dim: u32,
            gm: *const *mut c_void,
            tiling: *const c_void,
        );
        #[cfg(test)]
        pub fn amoe_finalize_tiling_layout(out: *mut u32, cap: usize) -> usize;
        #[cfg(test)]
        pub fn amoe_finalize_ub_bytes_host(data_dtype: u32, tile_h: u32) -> u32;
        #[cfg(test)]
        pub fn amoe_sim_ub_capacity() -> u32;
        #[cfg(test)]
        pub fn amoe_sim_selftest(which: u32, msg: *mut std::ffi::c_char, cap: usize) -> i32;
    }
}

/// The host build of the kernel (`amoe_finalize_kernel_host`), `None` when
/// `build.rs` could not compile it. This is the entry a simulated runtime's
/// `cannsim_launch_kernel` runs for every block.
pub(crate) fn host_entry() -> Option<KernelEntry> {
    #[cfg(amoe_host_kernel)]
    {
        Some(ffi::amoe_finalize_kernel_host)
    }
    #[cfg(not(amoe_host_kernel))]
    {
        None
    }
}

/// The same host entry for the kernel built with one `PipeBarrier<PIPE_V>`
/// left out (the one between `Muls` and the accumulating `Add`): the host
/// model must reject every launch of it that scales a slot.
#[cfg(test)]
pub(crate) fn host_entry_dropped_barrier() -> Option<KernelEntry> {
    #[cfg(amoe_host_kernel)]
    {
        Some(ffi::amoe_finalize_kernel_host_dropped_barrier)
    }
    #[cfg(not(amoe_host_kernel))]
    {
        None
    }
}

/// The Ascend C header directory the host build was compiled against, or
/// why there is no host build (for example, the headers were not found).
#[cfg(test)]
pub(crate) fn host_build_info() -> std::result::Result<&'static str, &'static str> {
    match (option_env!("AMOE_HOST_KERNEL_HEADERS"), option_env!("AMOE_HOST_KERNEL_UNAVAILABLE")) {
        (Some(headers), _) if cfg!(amoe_host_kernel) => Ok(headers),
        (_, Some(why)) => Err(why),
        _ => Err("build.rs did not build the host kernel"),
    }
}

#[cfg(test)]
pub(super) fn host_unavailable() -> Error {
    let why = host_build_info().err().unwrap_or("build.rs did not build the host kernel");
    Error::Unavailable(format!("the host build of kernels/finalize_kernel.cpp is not in this crate: {why}"))
}

/// Byte offsets of every `AmoeFinalizeTiling` field as the C compiler laid
/// them out, in declaration order, followed by `sizeof`.
#[cfg(test)]
pub(crate) fn c_tiling_layout() -> Result<Vec<u32>> {
    #[cfg(amoe_host_kernel)]
    {
        let mut v = vec![0u32; 64];
        // SAFETY: the callee writes at most `cap` = v.len() values into v.
        let n = unsafe { ffi::amoe_finalize_tiling_layout(v.as_mut_ptr(), v.len()) };
        v.truncate(n.min(64));
        Ok(v)
    }
    #[cfg(not(amoe_host_kernel))]
    {
        Err(host_unavailable())
    }
}

/// The unified-buffer bytes the C header's formula gives (the kernel's own
/// allocation plan), to check [`ub_bytes`] against.
#[cfg(test)]
pub(crate) fn c_ub_bytes(data: DType, tile_h: u32) -> Result<u32> {
    #[cfg(amoe_host_kernel)]
    {
        // SAFETY: a pure function of two integers.
        Ok(unsafe { ffi::amoe_finalize_ub_bytes_host(data as u32, tile_h) })
    }
    #[cfg(not(amoe_host_kernel))]
    {
        let _ = (data, tile_h);
        Err(host_unavailable())
    }
}

/// Unified-buffer capacity per core that the host model enforces.
#[cfg(test)]
pub(crate) fn sim_ub_capacity() -> Result<usize> {
    #[cfg(amoe_host_kernel)]
    {
        // SAFETY: returns a constant.
        Ok(unsafe { ffi::amoe_sim_ub_capacity() } as usize)
    }
    #[cfg(not(amoe_host_kernel))]
    {
        Err(host_unavailable())
    }
}

/// Runs self-test kernel `which` of the host model (`kernels/host_model/host_entry.cpp`):
/// cases 0 and 12 follow every rule, the others each break one (queue
/// balance, use after free, bounds, alignment, pipe ordering, a wait on an
/// event never set). Returns the violation message that aborted the run,
/// `None` if it ran clean.
#[cfg(test)]
pub(crate) fn sim_selftest(which: u32) -> Result<Option<String>> {
    #[cfg(amoe_host_kernel)]
    {
        let mut buf = vec![0u8; 512];
        // SAFETY: the callee writes at most `cap` bytes, NUL-terminated, into buf.
        let hit = unsafe { ffi::amoe_sim_selftest(which, buf.as_mut_ptr().cast(), buf.len()) };
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        Ok((hit != 0).then(|| String::from_utf8_lossy(&buf[..end]).into_owned()))
    }
    #[cfg(not(amoe_host_kernel))]
    {
        let _ = which;
        Err(host_unavailable())
    }
}

/// The AI Core build `build.rs` compiled when CANN was present, carried
/// inside this library: it travels wherever the library goes (a wheel, a
/// container image), and needs no build directory at run time.
#[cfg(amoe_npu_kernel)]
const EMBEDDED_KERNEL_LIB: Option<&[u8]> = Some(include_bytes!(env!("AMOE_NPU_KERNEL_LIB")));
#[cfg(not(amoe_npu_kernel))]
const EMBEDDED_KERNEL_LIB: Option<&[u8]> = None;

/// Where the AI Core build comes from.
pub(crate) enum KernelSource {
    /// A file: `ASCEND_MOE_KERNEL_LIB`.
    File(PathBuf),
    /// The image compiled into this library ([`EMBEDDED_KERNEL_LIB`]).
    Embedded(&'static [u8]),
}

/// The AI Core build (`libamoe_kernels_npu.so`, exporting
/// [`NPU_LAUNCH_SYMBOL`]): `ASCEND_MOE_KERNEL_LIB` if set, else the image
/// `build.rs` compiled into this library when CANN was present; `None`
/// otherwise.
pub(crate) fn npu_kernel_library() -> Option<KernelSource> {
    if let Some(p) = std::env::var_os("ASCEND_MOE_KERNEL_LIB") {
        return Some(KernelSource::File(PathBuf::from(p)));
    }
    EMBEDDED_KERNEL_LIB.map(KernelSource::Embedded)
}

/// The one attempt per process to load the AI Core build
/// ([`NpuKernelLib::load`]): the library, or why it is not loaded.
fn kernel_lib_load() -> &'static std::result::Result<NpuKernelLib, String> {
    static LIB: std::sync::OnceLock<std::result::Result<NpuKernelLib, String>> = std::sync::OnceLock::new();
    LIB.get_or_init(|| {
        NpuKernelLib::load().map_err(|e| match e {
            Error::Unavailable(msg) => msg,
            other => other.to_string(),
        })
    })
}

/// The AI Core build loaded once per process ([`NpuKernelLib::load`]), shared
/// by every launch (the finalize and the forward-context guard); `None` when
/// there is none ([`kernel_lib_status`] says why).
pub(crate) fn shared_kernel_lib() -> Option<&'static NpuKernelLib> {
    kernel_lib_load().as_ref().ok()
}

/// The AI Core build's load: `Ok(path it was loaded from)` or the load error
/// (no library built or named, or the file named could not be loaded), kept
/// from the one attempt per process.
pub(crate) fn kernel_lib_status() -> std::result::Result<String, String> {
    match kernel_lib_load() {
        Ok(lib) => Ok(lib.path.display().to_string()),
        Err(e) => Err(e.clone()),
    }
}

/// The AI Core build of the kernel (`libamoe_kernels_npu.so`), loaded at run
/// time so the crate never links CANN.
pub(crate) struct NpuKernelLib {
    launch: NpuLaunchFn,
    guard: Option<NpuGuardLaunchFn>,
    copy: Option<NpuCopyLaunchFn>,
    path: PathBuf,
    // Keeps `launch` valid; dropped last.
    _lib: libloading::Library,
}

impl std::fmt::Debug for NpuKernelLib {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NpuKernelLib").field("path", &self.path).finish_non_exhaustive()
    }
}

impl NpuKernelLib {
    /// Loads [`npu_kernel_library`]; [`Error::Unavailable`] when there is none
    /// (no CANN at build time and no `ASCEND_MOE_KERNEL_LIB`).
    pub(crate) fn load() -> Result<Self> {
        let source = npu_kernel_library().ok_or_else(|| {
            Error::Unavailable(
                "no AI Core build of the finalize kernel: CANN was not found when this library was built \
                 and ASCEND_MOE_KERNEL_LIB is not set"
                    .into(),
            )
        })?;
        match source {
            KernelSource::File(path) => Self::load_from(path),
            KernelSource::Embedded(image) => Self::load_image(image),
        }
    }

    /// Loads a kernel library from its bytes: written into an anonymous
    /// in-memory file that only this process holds (`memfd_create`), loaded
    /// through `/proc/self/fd`, and closed once loaded (the loader's mapping
    /// keeps it). No file on disk is written or read, so no other user can
    /// plant or swap one.
    ///
    /// The loader knows a library by the name it was opened with, and an fd
    /// number is reused once closed: a library loaded earlier as
    /// `/proc/self/fd/N` would be returned in place of this one. The file is
    /// moved to a number no loaded library is named after first.
    pub(crate) fn load_image(image: &[u8]) -> Result<Self> {
        use std::io::Write;
        use std::os::fd::{AsRawFd, FromRawFd};
        let unavailable = |what: &str, e: std::io::Error| {
            Error::Unavailable(format!(
                "the AI Core build embedded in this library ({} bytes): {what}: {e}",
                image.len()
            ))
        };
        // SAFETY: a NUL-terminated name and valid flags; the fd returned, if
        // any, is new and owned by the `File` below alone.
        let fd = unsafe { libc::memfd_create(c"amoe_kernels_npu".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(unavailable("memfd_create", std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is open and owned by nothing else.
        let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
        file.write_all(image).map_err(|e| unavailable("writing the in-memory file", e))?;
        let path = loop {
            let path = format!("/proc/self/fd/{}", file.as_raw_fd());
            // SAFETY: RTLD_NOLOAD loads nothing: it only finds a library already
            // loaded under this name (and the handle is closed again at once).
            let taken =
                unsafe { libloading::os::unix::Library::open(Some(&path), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
            if taken.is_err() {
                break path;
            }
            // SAFETY: duplicates an open fd of ours onto a free number above it.
            let moved = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_DUPFD_CLOEXEC, file.as_raw_fd() + 1) };
            if moved < 0 {
                return Err(unavailable("moving the in-memory file", std::io::Error::last_os_error()));
            }
            // SAFETY: `moved` is a new fd owned by nothing else; the old one closes as `file` is replaced.
            file = unsafe { std::fs::File::from_raw_fd(moved) };
        };
        let mut lib = Self::load_from(path)?;
        lib.path = PathBuf::from(format!("embedded in this library ({} bytes)", image.len()));
        Ok(lib)
    }

    /// Loads the kernel library at `path`.
    pub(crate) fn load_from(path: impl Into<PathBuf>) -> Result<Self> {
        let path = path.into();
        // SAFETY: loading runs the library's initialisers; the AI Core build
        // has none beyond the CANN runtime's kernel registration.
        let lib = unsafe { libloading::Library::new(&path) }
            .map_err(|e| Error::Unavailable(format!("loading {}: {e}", path.display())))?;
        let sym = format!("{NPU_LAUNCH_SYMBOL}\0");
        // SAFETY: the symbol has the C signature NpuLaunchFn (kernels/npu_launch.cpp).
        let launch = unsafe { lib.get::<NpuLaunchFn>(sym.as_bytes()) }
            .map(|s| *s)
            .map_err(|e| Error::Unavailable(format!("{}: no {NPU_LAUNCH_SYMBOL}: {e}", path.display())))?;
        let guard_sym = format!("{NPU_GUARD_LAUNCH_SYMBOL}\0");
        // SAFETY: the symbol has the C signature NpuGuardLaunchFn (kernels/npu_launch.cpp).
        let guard = unsafe { lib.get::<NpuGuardLaunchFn>(guard_sym.as_bytes()) }.ok().map(|s| *s);
        let copy_sym = format!("{NPU_COPY_LAUNCH_SYMBOL}\0");
        // SAFETY: the symbol has the C signature NpuCopyLaunchFn (kernels/npu_launch.cpp).
        let copy = unsafe { lib.get::<NpuCopyLaunchFn>(copy_sym.as_bytes()) }.ok().map(|s| *s);
        Ok(NpuKernelLib { launch, guard, copy, path, _lib: lib })
    }

    /// Enqueues the kernel on `stream` over `block_dim` cores.
    ///
    /// # Safety
    /// `stream` is a live `aclrtStream`; every non-NULL pointer of `gm` is
    /// device memory of that stream's device sized as [`check_launch`]
    /// requires (call it first), NULL exactly where the tiling marks an input
    /// absent; `tiling_dev` is device memory holding the tiling's bytes; the
    /// status buffer holds `block_dim * STATUS_WORDS` words; `block_dim`
    /// equals the tiling's. All of it stays alive until the stream has run it.
    pub(crate) unsafe fn launch(
        &self,
        block_dim: u32,
        stream: *mut c_void,
        gm: &[*mut c_void; GM_COUNT],
        tiling_dev: *mut c_void,
    ) -> Result<()> {
        // SAFETY: forwarded from this function's contract.
        let code = unsafe { (self.launch)(block_dim, stream, gm.as_ptr(), tiling_dev) };
        if code == 0 {
            Ok(())
        } else {
            Err(Error::Acl { call: NPU_LAUNCH_SYMBOL, code, msg: String::new() })
        }
    }

    /// Enqueues the forward-context guard (`amoe_guard_kernel`, one core) on `stream`.
    ///
    /// # Safety
    /// `stream` is a live `aclrtStream`; `gm[GUARD_GM_LIVE]` is a live context
    /// of `CTX_WORDS` words and `gm[GUARD_GM_STATUS]` one status record of
    /// `STATUS_WORDS` words, both device memory of the stream's device;
    /// `tiling_dev` is device memory holding an `AmoeGuardTiling`. All of it
    /// stays alive until the stream has run it.
    pub(crate) unsafe fn launch_guard(
        &self,
        stream: *mut c_void,
        gm: &[*mut c_void; GUARD_GM_COUNT],
        tiling_dev: *mut c_void,
    ) -> Result<()> {
        let f = self.guard.ok_or_else(|| {
            Error::Unavailable(format!("{}: no {NPU_GUARD_LAUNCH_SYMBOL} (an older kernel build)", self.path.display()))
        })?;
        // SAFETY: forwarded from this function's contract.
        let code = unsafe { f(stream, gm.as_ptr(), tiling_dev) };
        if code == 0 {
            Ok(())
        } else {
            Err(Error::Acl { call: NPU_GUARD_LAUNCH_SYMBOL, code, msg: String::new() })
        }
    }

    /// Whether the library has the byte-copy kernel (an older build has not).
    pub(crate) fn has_copy(&self) -> bool {
        self.copy.is_some()
    }

    /// Enqueues the byte-copy kernel (`amoe_copy_kernel`) on `stream` over
    /// `block_dim` cores, with `tiling` pointing at an `AmoeCopyTiling` in
    /// host memory (`backend::npu::kernel::copy::CopyTiling`), read during
    /// the call.
    ///
    /// # Safety
    /// `stream` is a live `aclrtStream`; `gm[COPY_GM_DST]` and
    /// `gm[COPY_GM_SRC]` are device memory of its device valid for the
    /// tiling's `len` bytes, not overlapping, alive until the stream has run
    /// the copy; the tiling passed `CopyTiling::check`.
    pub(crate) unsafe fn launch_copy(
        &self,
        block_dim: u32,
        stream: *mut c_void,
        gm: &[*mut c_void; COPY_GM_COUNT],
        tiling: *const c_void,
    ) -> Result<()> {
        let f = self.copy.ok_or_else(|| {
            Error::Unavailable(format!("{}: no {NPU_COPY_LAUNCH_SYMBOL} (an older kernel build)", self.path.display()))
        })?;
        // SAFETY: forwarded from this function's contract.
        let code = unsafe { f(block_dim, stream, gm.as_ptr(), tiling) };
        if code == 0 {
            Ok(())
        } else {
            Err(Error::Acl { call: NPU_COPY_LAUNCH_SYMBOL, code, msg: String::new() })
        }
    }
}
