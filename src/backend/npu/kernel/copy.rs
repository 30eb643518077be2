//! The byte-copy kernel (`kernels/copy_kernel.cpp`): `len` bytes between
//! two arbitrary device addresses, enqueued on a stream.
//!
//! `aclrtMemcpyAsync` copies on-chip device memory only between 64-byte
//! aligned addresses (acl_rt.h). Every other same-device copy goes through
//! this kernel, so it neither synchronises the host nor uses the blocking
//! `aclrtMemcpy`, and can be captured into a graph. The launch takes the
//! [`CopyTiling`] by value (the AI Core build passes its fields as scalar
//! kernel arguments), so it stages nothing and allocates nothing.
//!
//! The kernel has no status record. A launch the runtime refuses is
//! reported by its launcher (`amoe_copy_launch_npu` returns the thread's
//! last error, `aclrtGetLastError`, so the copy fails with that code instead
//! of copying nothing); a broken tiling, which [`CopyTiling::check`] rules
//! out first, traps, which fails the stream like any AI Core exception.
//! Under the simulator, the host build runs through
//! `cannsim_launch_kernel_ex`, which returns a refused launch's code and
//! turns a fault of the host model into the same stream failure.

use std::ffi::{c_char, c_void};

pub(crate) use super::abi::{COPY_GM_COUNT, COPY_GM_DST, COPY_GM_SRC, NPU_COPY_LAUNCH_SYMBOL};
use crate::{Error, Result};

/// `AMOE_COPY_TILING_MAGIC` ('AMC1').
pub(crate) const COPY_TILING_MAGIC: u32 = 0x3143_4D41;
/// `AMOE_COPY_BLOCK`: spans and tiles are multiples of it, and no two cores
/// write into one block of this many destination bytes.
pub(crate) const COPY_BLOCK: usize = 32;
/// `AMOE_COPY_MAX_TILE`: bytes of one DataCopyPad (two such buffers fit the
/// 192 KiB unified buffer with room to spare).
pub(crate) const COPY_MAX_TILE: usize = 64 * 1024;
/// Most cores one copy uses.
pub(crate) const COPY_MAX_CORES: u32 = 8;
/// Bytes below which another core is not worth its launch share.
pub(crate) const COPY_MIN_SPAN: usize = 32 * 1024;
#[cfg(test)]
const KERNEL: &str = "amoe_copy";
const OP: &str = "copy_kernel";

/// `AmoeCopyTiling` (`kernels/copy_tiling.h`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct CopyTiling {
    /// [`COPY_TILING_MAGIC`].
    pub(crate) magic: u32,
    /// Cores of the launch.
    pub(crate) block_dim: u32,
    /// Bytes per DataCopyPad: a multiple of [`COPY_BLOCK`] up to [`COPY_MAX_TILE`].
    pub(crate) tile: u32,
    /// `dst % 32`: where the destination's 32-byte blocks start.
    pub(crate) dst_phase: u32,
    /// Bytes to copy (> 0).
    pub(crate) len: u64,
    /// Bytes of one core's span, a multiple of [`COPY_BLOCK`].
    pub(crate) per_core: u64,
}

impl CopyTiling {
    /// The launch of a copy of `len` bytes into the device address `dst`:
    /// at most [`COPY_MAX_CORES`] cores of at least [`COPY_MIN_SPAN`] bytes
    /// each (one core for a short copy), spans cut at 32-byte blocks of `dst`.
    pub(crate) fn plan(dst: usize, len: usize) -> Result<CopyTiling> {
        if len == 0 {
            return Err(Error::invalid(OP, "len", "0 bytes: an empty copy launches nothing"));
        }
        let phase = dst % COPY_BLOCK;
        // Bytes from the block boundary at or before dst to the end.
        let reach = len
            .checked_add(phase)
            .ok_or_else(|| Error::invalid(OP, "len", format!("{len} bytes overflow the address space")))?;
        let cores = reach.div_ceil(COPY_MIN_SPAN).clamp(1, COPY_MAX_CORES as usize);
        let per_core = reach.div_ceil(cores).div_ceil(COPY_BLOCK) * COPY_BLOCK;
        let t = CopyTiling {
            magic: COPY_TILING_MAGIC,
            block_dim: reach.div_ceil(per_core) as u32,
            tile: per_core.min(COPY_MAX_TILE) as u32,
            dst_phase: phase as u32,
            len: len as u64,
            per_core: per_core as u64,
        };
        t.check()?;
        Ok(t)
    }

    /// What the kernel requires of its launch (it traps otherwise): the
    /// magic, a positive tile and span that are multiples of 32, a tile of at
    /// most [`COPY_MAX_TILE`], a phase below 32, and `1..=`[`COPY_MAX_CORES`]
    /// cores.
    pub(crate) fn check(&self) -> Result<()> {
        let bad = |what: String| Err(Error::invalid(OP, "tiling", what));
        let block = COPY_BLOCK as u64;
        if self.magic != COPY_TILING_MAGIC {
            return bad(format!("magic {:#x}, expected {COPY_TILING_MAGIC:#x}", self.magic));
        }
        if self.len == 0 {
            return bad("len is 0".into());
        }
        if self.tile == 0 || self.tile as usize % COPY_BLOCK != 0 || self.tile as usize > COPY_MAX_TILE {
            return bad(format!("tile of {} bytes: a multiple of {COPY_BLOCK} up to {COPY_MAX_TILE}", self.tile));
        }
        if self.per_core == 0 || self.per_core % block != 0 {
            return bad(format!("span of {} bytes per core: a positive multiple of {COPY_BLOCK}", self.per_core));
        }
        if self.dst_phase as usize >= COPY_BLOCK {
            return bad(format!("dst_phase {} is not below {COPY_BLOCK}", self.dst_phase));
        }
        if self.block_dim == 0 || self.block_dim > COPY_MAX_CORES {
            return bad(format!("{} cores: 1 to {COPY_MAX_CORES}", self.block_dim));
        }
        Ok(())
    }

    /// The tiling's bytes, as the simulated runtime's launcher takes them.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        bytemuck::bytes_of(self)
    }
}

/// One core of the host build, with the signature of the simulated runtime's
/// `cannsim_kernel_entry_ex`: nonzero (with a message in `msg`) when the core
/// faulted.
pub(crate) type CopyEntry = unsafe extern "C" fn(
    block_idx: u32,
    block_dim: u32,
    gm: *const *mut c_void,
    tiling: *const c_void,
    msg: *mut c_char,
    msg_cap: usize,
) -> i32;

#[cfg(amoe_host_kernel)]
mod ffi {
    use std::ffi::{c_char, c_void};
    extern "C" {
        pub fn amoe_copy_kernel_host(
            block_idx: u32,
            block_dim: u32,
            gm: *const *mut c_void,
            tiling: *const c_void,
            msg: *mut c_char,
            msg_cap: usize,
        ) -> i32;
        #[cfg(test)]
        pub fn amoe_copy_tiling_layout(out: *mut u32, cap: usize) -> usize;
    }
}

/// The host build of the copy kernel; `None` without a host kernel build.
pub(crate) fn copy_host_entry() -> Option<CopyEntry> {
    #[cfg(amoe_host_kernel)]
    {
        Some(ffi::amoe_copy_kernel_host)
    }
    #[cfg(not(amoe_host_kernel))]
    {
        None
    }
}

/// Byte offsets of `AmoeCopyTiling`'s fields as the C compiler laid them
/// out, then its `sizeof`.
#[cfg(test)]
pub(crate) fn c_copy_tiling_layout() -> Result<Vec<u32>> {
    #[cfg(amoe_host_kernel)]
    {
        let mut v = vec![0u32; 8];
        // SAFETY: the callee writes at most `cap` = v.len() values.
        let n = unsafe { ffi::amoe_copy_tiling_layout(v.as_mut_ptr(), v.len()) };
        v.truncate(n.min(8));
        Ok(v)
    }
    #[cfg(not(amoe_host_kernel))]
    {
        Err(super::library::host_unavailable())
    }
}

/// Runs the host build of the kernel over host memory with `tiling`, every
/// core in turn: copies `tiling.len` bytes from `src` to `dst`. A core the
/// host model aborted (or that trapped) is [`Error::Kernel`].
///
/// `tiling` is used as given (not [`CopyTiling::check`]ed), so tests can
/// show the kernel refusing a broken one; its `len` must fit both slices.
#[cfg(test)]
pub(crate) fn copy_host_with_tiling(dst: &mut [u8], src: &[u8], tiling: &CopyTiling) -> Result<()> {
    let entry = copy_host_entry().ok_or_else(super::library::host_unavailable)?;
    let len = usize::try_from(tiling.len).unwrap_or(usize::MAX);
    if len > dst.len() || len > src.len() {
        return Err(Error::invalid(OP, "len", format!("{len} bytes, but dst has {} and src {}", dst.len(), src.len())));
    }
    let mut gm = [std::ptr::null_mut::<c_void>(); COPY_GM_COUNT];
    gm[COPY_GM_DST] = dst.as_mut_ptr().cast();
    gm[COPY_GM_SRC] = src.as_ptr() as *mut c_void;
    let cores = tiling.block_dim.max(1);
    for block in 0..cores {
        let mut msg = [0u8; 512];
        // SAFETY: `gm` holds `dst` (exclusively borrowed) and `src` (only
        // read), each at least `tiling.len` bytes; the model confines the
        // core's accesses to exactly those bytes; `msg` has 512 writable bytes.
        let code = unsafe {
            entry(block, cores, gm.as_ptr(), (tiling as *const CopyTiling).cast(), msg.as_mut_ptr().cast(), msg.len())
        };
        if code != 0 {
            let end = msg.iter().position(|&b| b == 0).unwrap_or(msg.len());
            return Err(Error::Kernel {
                kernel: KERNEL,
                block,
                detail: format!("host model: {}", String::from_utf8_lossy(&msg[..end])),
            });
        }
    }
    Ok(())
}

/// Copies `src` into `dst` (equal lengths) with the host build, planning
/// the tiling for `dst`'s address as a launch on the device would.
#[cfg(test)]
pub(crate) fn copy_host(dst: &mut [u8], src: &[u8]) -> Result<()> {
    if dst.len() != src.len() {
        return Err(Error::invalid(OP, "src", format!("{} bytes for a {}-byte dst", src.len(), dst.len())));
    }
    if dst.is_empty() {
        return Ok(());
    }
    let tiling = CopyTiling::plan(dst.as_ptr() as usize, dst.len())?;
    copy_host_with_tiling(dst, src, &tiling)
}

/// Whether [`enqueue_copy`] can launch the kernel in this process: the
/// simulated runtime's `cannsim_launch_kernel_ex` with the host build, or an
/// AI Core build that has the copy kernel.
#[cfg(test)]
pub(crate) fn copy_kernel_available() -> bool {
    let sim = crate::backend::npu::runtime::acl().is_ok_and(|api| api.cannsim_launch_kernel_ex.is_some());
    (sim && copy_host_entry().is_some()) || super::library::shared_kernel_lib().is_some_and(|l| l.has_copy())
}

/// Enqueues the kernel on `stream`: `len` bytes from `src` to `dst`, device
/// memory of the stream's device that does not overlap (the caller checked
/// both ranges). Returns `Ok(false)`, having enqueued nothing, when no
/// launcher exists here (neither the simulated runtime's
/// `cannsim_launch_kernel_ex` with the host build nor an AI Core build that
/// has the copy kernel).
///
/// # Safety
/// `dst` and `src` are valid device memory of `stream`'s device for `len`
/// bytes and stay allocated until the stream has run the copy.
pub(crate) unsafe fn enqueue_copy(
    stream: &crate::backend::npu::runtime::NpuStream,
    dst: *mut c_void,
    src: *const c_void,
    len: usize,
) -> Result<bool> {
    let tiling = CopyTiling::plan(dst as usize, len)?;
    let api = stream.enter()?;
    let mut gm = [std::ptr::null_mut::<c_void>(); COPY_GM_COUNT];
    gm[COPY_GM_DST] = dst;
    gm[COPY_GM_SRC] = src as *mut c_void;
    if let (Some(launch), Some(entry)) = (api.cannsim_launch_kernel_ex, copy_host_entry()) {
        let bytes = tiling.as_bytes();
        // SAFETY: `gm` holds the two device ranges of this function's
        // contract; the simulator copies the tiling bytes at enqueue.
        unsafe {
            crate::backend::npu::result::acl::sim_launch_kernel_ex(
                launch,
                stream.raw(),
                tiling.block_dim,
                Some(entry),
                &gm,
                bytes,
            )
        }?;
        return Ok(true);
    }
    match super::library::shared_kernel_lib() {
        Some(lib) if lib.has_copy() => {
            // SAFETY: this function's contract; the tiling passed `check` in
            // `plan` and is read during the call.
            unsafe { lib.launch_copy(tiling.block_dim, stream.raw(), &gm, (&tiling as *const CopyTiling).cast())? };
            Ok(true)
        }
        _ => Ok(false),
    }
}
