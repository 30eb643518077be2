//! The simulator-only kernel launch hooks, `cannsim_launch_kernel` and
//! `cannsim_launch_kernel_ex`: run a host-compiled device kernel in stream
//! order over the device arena.

#![allow(clippy::missing_safety_doc)]

use std::ffi::{c_char, c_void};

use crate::arena;
use crate::capture;
use crate::ffi::*;
use crate::lease::{self, Lease};
use crate::status::{self, fail, SimError, SimResult};

/// `void (*cannsim_kernel_entry)(uint32_t block_idx, uint32_t block_dim, void *const *gm, const void *tiling)`.
pub type KernelEntry = unsafe extern "C" fn(u32, u32, *const *mut c_void, *const c_void);

/// `int32_t cannsim_launch_kernel(aclrtStream stream, uint32_t block_dim, cannsim_kernel_entry entry, void *const *gm_dev, size_t n_gm, const void *tiling, size_t tiling_len)`.
///
/// Runs `entry(block_idx, block_dim, gm, tiling)` for `block_idx` in
/// `0..block_dim`, in stream order on `stream`'s worker, after translating each
/// of the `n_gm` device pointers in `gm_dev` (NULL stays NULL) into the host
/// address of the same byte inside the simulated device memory. `tiling`
/// (`tiling_len` bytes) in host memory is copied now; in device memory of the
/// stream's device (where a real kernel reads it from GM) it is read each
/// time the task runs, a graph replay included. Either way it is passed
/// 8-byte aligned. Returns
/// `ACL_SUCCESS`, or `ACL_ERROR_RT_PARAM_INVALID` (107000) for a pointer that
/// is not device memory of the stream's device, `ACL_ERROR_INVALID_PARAM`
/// for a bad argument. A pointer whose allocation is freed before the kernel
/// runs (whether or not the address was allocated again since) fails the
/// stream with `ACL_ERROR_RT_DEVICE_MEM_ERROR` and the kernel does not run.
#[no_mangle]
pub unsafe extern "C" fn cannsim_launch_kernel(
    stream: AclrtStream,
    block_dim: u32,
    entry: Option<KernelEntry>,
    gm_dev: *const *mut c_void,
    n_gm: usize,
    tiling: *const c_void,
    tiling_len: usize,
) -> i32 {
    const NAME: &str = "cannsim_launch_kernel";
    status::acl(NAME, || {
        let Some(entry) = entry else {
            return fail(ACL_ERROR_INVALID_PARAM, "entry is NULL");
        };
        let run = move |b, gm, t| {
            // SAFETY: `entry` is the caller's kernel with the documented
            // signature; gm holds translated arena addresses and t the
            // tiling copy, both alive for the call.
            unsafe { entry(b, block_dim, gm, t) };
            Ok(())
        };
        // SAFETY: forwarded from this function's C contract.
        unsafe { launch(NAME, stream, block_dim, gm_dev, n_gm, tiling, tiling_len, run) }
    })
}

/// `int32_t (*cannsim_kernel_entry_ex)(uint32_t block_idx, uint32_t block_dim, void *const *gm, const void *tiling, char *msg, size_t msg_cap)`:
/// one core of a kernel that can fault; nonzero means the core raised an
/// exception, described by the NUL-terminated text it wrote into `msg`.
pub type KernelEntryEx = unsafe extern "C" fn(u32, u32, *const *mut c_void, *const c_void, *mut c_char, usize) -> i32;

/// Bytes of the message buffer a faulting core may fill.
const FAULT_MSG_BYTES: usize = 512;

/// `int32_t cannsim_launch_kernel_ex(aclrtStream stream, uint32_t block_dim, cannsim_kernel_entry_ex entry, void *const *gm_dev, size_t n_gm, const void *tiling, size_t tiling_len)`.
///
/// [`cannsim_launch_kernel`] for a kernel without a status record of its
/// own: when a core returns nonzero, the rest of the launch is skipped and
/// the stream fails with `ACL_ERROR_RT_AICORE_EXCEPTION` (507015) and the
/// core's message, which the next synchronisation of the stream reports, as
/// a trap or an address fault of a kernel on the AI Core fails its stream.
#[no_mangle]
pub unsafe extern "C" fn cannsim_launch_kernel_ex(
    stream: AclrtStream,
    block_dim: u32,
    entry: Option<KernelEntryEx>,
    gm_dev: *const *mut c_void,
    n_gm: usize,
    tiling: *const c_void,
    tiling_len: usize,
) -> i32 {
    const NAME: &str = "cannsim_launch_kernel_ex";
    status::acl(NAME, || {
        let Some(entry) = entry else {
            return fail(ACL_ERROR_INVALID_PARAM, "entry is NULL");
        };
        let run = move |b, gm, t| {
            let mut msg = [0u8; FAULT_MSG_BYTES];
            // SAFETY: as for `cannsim_launch_kernel`; `msg` has
            // FAULT_MSG_BYTES writable bytes.
            let code = unsafe { entry(b, block_dim, gm, t, msg.as_mut_ptr().cast(), msg.len()) };
            if code == 0 {
                return Ok(());
            }
            let end = msg.iter().position(|&c| c == 0).unwrap_or(msg.len());
            Err(SimError::new(
                ACL_ERROR_RT_AICORE_EXCEPTION,
                format!("AI Core exception in block {b} (code {code}): {}", String::from_utf8_lossy(&msg[..end])),
            ))
        };
        // SAFETY: forwarded from this function's C contract.
        unsafe { launch(NAME, stream, block_dim, gm_dev, n_gm, tiling, tiling_len, run) }
    })
}

/// The checks and the stream-ordered run shared by both launchers: `run`
/// gets each block's index, the translated `gm` array and the tiling copy.
///
/// # Safety
/// `gm_dev` holds `n_gm` pointers and `tiling` `tiling_len` readable bytes
/// (the launchers' C contract).
#[allow(clippy::too_many_arguments)]
unsafe fn launch(
    name: &'static str,
    stream: AclrtStream,
    block_dim: u32,
    gm_dev: *const *mut c_void,
    n_gm: usize,
    tiling: *const c_void,
    tiling_len: usize,
    run: impl Fn(u32, *const *mut c_void, *const c_void) -> SimResult<()> + Send + Sync + 'static,
) -> SimResult<()> {
    if block_dim == 0 {
        return fail(ACL_ERROR_INVALID_PARAM, "block_dim is 0");
    }
    if (n_gm > 0 && gm_dev.is_null()) || (tiling_len > 0 && tiling.is_null()) {
        return fail(ACL_ERROR_INVALID_PARAM, "gm_dev or tiling is NULL but its length is not 0");
    }
    let s = capture::stream_here(stream as usize)?;
    let ptrs: Vec<usize> = if n_gm == 0 {
        Vec::new()
    } else {
        // SAFETY: gm_dev holds n_gm pointers (C contract).
        unsafe { std::slice::from_raw_parts(gm_dev, n_gm) }.iter().map(|p| *p as usize).collect()
    };
    // The allocation of each operand and of a device tiling, checked again
    // when the launch runs (see [`crate::lease`]).
    let mut leases = Vec::new();
    for (i, &p) in ptrs.iter().enumerate() {
        if p == 0 {
            continue;
        }
        let what = format!("gm_dev[{i}]");
        let sp = arena::resolve_ext(p, 0, &what, true)?;
        leases.push(Lease::device(&sp, what));
        if sp.device != s.device {
            return fail(
                ACL_ERROR_RT_PARAM_INVALID,
                format!("gm_dev[{i}] is on device {}, the stream on device {}", sp.device, s.device),
            );
        }
    }
    let mut tiling_buf = vec![0u64; tiling_len.div_ceil(8)];
    // A tiling in device memory (as a real kernel takes it: a GM address) is
    // read when the task runs, not now: a captured launch reads its arguments
    // at every execution, so bytes that change in between (memory handed to
    // other work) show in the kernel's result. A host tiling is copied now.
    // Source: hicann/runtime v9.1.0 docs/02_dev_guide/04-01_单流捕获.md:5
    // (captured tasks run only when aclmdlRIExecuteAsync executes the model)
    // and :20 (restriction 7: the resources the tasks use must stay valid
    // until the model is destroyed).
    let device_tiling = tiling_len > 0 && arena::owner(tiling as usize).is_some();
    if device_tiling {
        let sp = arena::resolve_ext(tiling as usize, tiling_len, "tiling", true)?;
        leases.push(Lease::device(&sp, "tiling"));
        if sp.device != s.device {
            return fail(
                ACL_ERROR_RT_PARAM_INVALID,
                format!("tiling is on device {}, the stream on device {}", sp.device, s.device),
            );
        }
    } else if tiling_len > 0 {
        // SAFETY: tiling holds tiling_len readable bytes (C contract); the
        // destination has at least that many.
        unsafe { std::ptr::copy_nonoverlapping(tiling as *const u8, tiling_buf.as_mut_ptr() as *mut u8, tiling_len) };
    }
    let tiling_addr = tiling as usize;
    s.enqueue(
        name,
        Box::new(move || {
            lease::check_all(&leases)?;
            let mut gm = Vec::with_capacity(ptrs.len());
            for (i, &p) in ptrs.iter().enumerate() {
                if p == 0 {
                    gm.push(std::ptr::null_mut());
                    continue;
                }
                let sp = arena::resolve_ext(p, 0, &format!("gm_dev[{i}]"), true).map_err(|e| {
                    SimError::new(ACL_ERROR_RT_DEVICE_MEM_ERROR, format!("{} (freed before the kernel ran?)", e.msg))
                })?;
                gm.push(sp.host as *mut c_void);
            }
            let mut tiling_buf = tiling_buf.clone();
            if device_tiling {
                let sp = arena::resolve_ext(tiling_addr, tiling_len, "tiling", true).map_err(|e| {
                    SimError::new(ACL_ERROR_RT_DEVICE_MEM_ERROR, format!("{} (freed before the kernel ran?)", e.msg))
                })?;
                // SAFETY: `sp` is `tiling_len` bytes inside a live allocation
                // of the arena; the destination has at least that many.
                unsafe { std::ptr::copy_nonoverlapping(sp.host, tiling_buf.as_mut_ptr() as *mut u8, tiling_len) };
            }
            let t = if tiling_len > 0 { tiling_buf.as_ptr() as *const c_void } else { std::ptr::null() };
            for b in 0..block_dim {
                run(b, gm.as_ptr(), t)?;
            }
            Ok(())
        }),
    );
    Ok(())
}
