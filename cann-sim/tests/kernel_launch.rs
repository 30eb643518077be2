//! A core of a `cannsim_launch_kernel_ex` launch that faults fails the
//! stream with an AI Core exception and the cores after it do not run. (The
//! crate's finalize kernel launched through `cannsim_launch_kernel` is
//! checked against its host runner in the crate itself,
//! `sim_only_finalize_kernel_runs_under_cannsim_launch_kernel`, which `ci/sim.sh`
//! runs: the kernel's launch code is not public.)

mod common;
use common::*;
use std::ffi::{c_char, c_void};

/// Marks its block in `gm[0]` (one u32 per block) and faults in block 1,
/// or in the block the tiling's first byte names.
unsafe extern "C" fn faulting(
    b: u32,
    _n: u32,
    gm: *const Ptr,
    tiling: *const c_void,
    msg: *mut c_char,
    cap: usize,
) -> i32 {
    // SAFETY: gm[0] is the translated host address of a buffer of one u32
    // per block; the tiling holds one byte; msg has cap bytes.
    unsafe {
        *(*gm as *mut u32).add(b as usize) = 1;
        if b != u32::from(*(tiling as *const u8)) {
            return 0;
        }
        let text = b"address fault\0";
        std::ptr::copy_nonoverlapping(text.as_ptr(), msg as *mut u8, text.len().min(cap));
    }
    7
}

#[test]
fn a_faulting_core_fails_the_stream_with_an_ai_core_exception() {
    let s = use_device(0);
    for (fault_in, ran) in [(1u8, [1u32, 1, 0, 0]), (9, [1, 1, 1, 1])] {
        let st = stream();
        let marks = upload(&[0u32; 4]);
        let gm = [marks];
        let r = unsafe {
            (s.cannsim_launch_kernel_ex)(st, 4, Some(faulting), gm.as_ptr(), 1, (&fault_in as *const u8).cast(), 1)
        };
        assert_eq!(r, 0, "{}", err_msg());
        let r = unsafe { (s.aclrtSynchronizeStream)(st) };
        let mut got = [0u32; 4];
        unsafe { assert_eq!((s.aclrtMemcpy)(got.as_mut_ptr() as Ptr, 16, marks, 16, D2H), 0) };
        assert_eq!(got, ran, "blocks that ran (fault in block {fault_in})");
        if fault_in < 4 {
            assert_eq!(r, 507015, "ACL_ERROR_RT_AICORE_EXCEPTION");
            let m = err_msg();
            assert!(m.contains("block 1") && m.contains("address fault"), "{m}");
        } else {
            assert_eq!(r, 0, "{}", err_msg());
        }
        free(marks);
        let _ = unsafe { (s.aclrtDestroyStream)(st) };
    }
}
