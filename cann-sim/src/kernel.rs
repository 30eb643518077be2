//! The simulator-only kernel launch hook, `cannsim_launch_kernel`: runs a
//! host-compiled device kernel in stream order over the device arena.

#![allow(clippy::missing_safety_doc)]

use std::ffi::c_void;

use crate::arena;
use crate::context;
use crate::ffi::*;
use crate::status::{self, fail, SimError};

/// `void (*cannsim_kernel_entry)(uint32_t block_idx, uint32_t block_dim, void *const *gm, const void *tiling)`.
pub type KernelEntry = unsafe extern "C" fn(u32, u32, *const *mut c_void, *const c_void);

/// `int32_t cannsim_launch_kernel(aclrtStream stream, uint32_t block_dim, cannsim_kernel_entry entry, void *const *gm_dev, size_t n_gm, const void *tiling, size_t tiling_len)`.
///
/// Runs `entry(block_idx, block_dim, gm, tiling)` for `block_idx` in
/// `0..block_dim`, in stream order on `stream`'s worker, after translating each
/// of the `n_gm` device pointers in `gm_dev` (NULL stays NULL) into the host
/// address of the same byte inside the simulated device memory. `tiling`
/// (`tiling_len` bytes) is copied now and passed 8-byte aligned. Returns
/// `ACL_SUCCESS`, or `ACL_ERROR_RT_PARAM_INVALID` (107000) for a pointer that
/// is not device memory of the stream's device, `ACL_ERROR_INVALID_PARAM`
/// for a bad argument. A pointer freed before the kernel runs fails the
/// stream with `ACL_ERROR_RT_DEVICE_MEM_ERROR`.
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
    status::acl("cannsim_launch_kernel", || {
        let Some(entry) = entry else {
            return fail(ACL_ERROR_INVALID_PARAM, "entry is NULL");
        };
        if block_dim == 0 {
            return fail(ACL_ERROR_INVALID_PARAM, "block_dim is 0");
        }
        if (n_gm > 0 && gm_dev.is_null()) || (tiling_len > 0 && tiling.is_null()) {
            return fail(ACL_ERROR_INVALID_PARAM, "gm_dev or tiling is NULL but its length is not 0");
        }
        let s = context::stream_here(stream as usize)?;
        let ptrs: Vec<usize> = if n_gm == 0 {
            Vec::new()
        } else {
            // SAFETY: gm_dev holds n_gm pointers (C contract).
            unsafe { std::slice::from_raw_parts(gm_dev, n_gm) }.iter().map(|p| *p as usize).collect()
        };
        for (i, &p) in ptrs.iter().enumerate() {
            if p == 0 {
                continue;
            }
            let sp = arena::resolve_ext(p, 0, &format!("gm_dev[{i}]"), true)?;
            if sp.device != s.device {
                return fail(
                    ACL_ERROR_RT_PARAM_INVALID,
                    format!("gm_dev[{i}] is on device {}, the stream on device {}", sp.device, s.device),
                );
            }
        }
        let mut tiling_buf = vec![0u64; tiling_len.div_ceil(8)];
        if tiling_len > 0 {
            // SAFETY: tiling holds tiling_len readable bytes (C contract); the
            // destination has at least that many.
            unsafe {
                std::ptr::copy_nonoverlapping(tiling as *const u8, tiling_buf.as_mut_ptr() as *mut u8, tiling_len)
            };
        }
        s.enqueue(
            "cannsim_launch_kernel",
            Box::new(move || {
                let mut gm = Vec::with_capacity(ptrs.len());
                for (i, &p) in ptrs.iter().enumerate() {
                    if p == 0 {
                        gm.push(std::ptr::null_mut());
                        continue;
                    }
                    let sp = arena::resolve_ext(p, 0, &format!("gm_dev[{i}]"), true).map_err(|e| {
                        SimError::new(
                            ACL_ERROR_RT_DEVICE_MEM_ERROR,
                            format!("{} (freed before the kernel ran?)", e.msg),
                        )
                    })?;
                    gm.push(sp.host as *mut c_void);
                }
                let t = if tiling_len > 0 { tiling_buf.as_ptr() as *const c_void } else { std::ptr::null() };
                for b in 0..block_dim {
                    // SAFETY: `entry` is the caller's kernel with the documented
                    // signature; gm holds translated arena addresses and t the
                    // tiling copy, both alive for the call.
                    unsafe { entry(b, block_dim, gm.as_ptr(), t) };
                }
                Ok(())
            }),
        );
        Ok(())
    })
}
