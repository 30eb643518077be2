//! The host build of the finalize kernel launched through the simulator's
//! `cannsim_launch_kernel` on device buffers equals the same kernel run
//! directly on host memory, dense and into the padded EP buffer; a core of a
//! `cannsim_launch_kernel_ex` launch that faults fails the stream with an AI
//! Core exception and the cores after it do not run.

mod common;
use common::*;
use std::ffi::{c_char, c_void};

use ascend_moe::backend::npu::kernel::{self as kernels, TilingParams, UB_BYTES_910B};
use ascend_moe::backend::{FinalizeArgs, FinalizeDims, OutputRows};
use ascend_moe::half::f16;
use ascend_moe::{DropPadMode, Tensor};

#[test]
fn finalize_kernel_runs_under_cannsim_launch_kernel() {
    let s = use_device(0);
    let (n, k, h, e, c) = (6usize, 2usize, 300usize, 3usize, 4usize);
    let rows = e * c;
    let xv: Vec<f16> = (0..rows * h).map(|i| f16::from_f32(((i * 7919) % 1000) as f32 / 250.0 - 2.0)).collect();
    let idx: Vec<i32> = (0..n * k).map(|i| if i % 5 == 0 { -1 } else { ((i * 7) % rows) as i32 }).collect();
    let x1v: Vec<f16> = (0..n * h).map(|i| f16::from_f32(((i * 31) % 97) as f32 / 50.0)).collect();
    let bv: Vec<f16> = (0..e * h).map(|i| f16::from_f32(((i * 13) % 41) as f32 / 20.0 - 1.0)).collect();
    let sv: Vec<f32> = (0..n * k).map(|i| 0.25 + i as f32 * 0.1).collect();
    let ev: Vec<i32> = (0..n * k).map(|i| (i % e) as i32).collect();
    let x = Tensor::from_slice(&xv, &[e, c, h]).unwrap();
    let it = Tensor::from_slice(&idx, &[n * k]).unwrap();
    let x1 = Tensor::from_slice(&x1v, &[n, h]).unwrap();
    let b = Tensor::from_slice(&bv, &[e, h]).unwrap();
    let sc = Tensor::from_slice(&sv, &[n, k]).unwrap();
    let ei = Tensor::from_slice(&ev, &[n, k]).unwrap();
    let args = FinalizeArgs {
        expanded_x: &x,
        expanded_row_idx: &it,
        x1: Some(&x1),
        x2: None,
        bias: Some(&b),
        scales: Some(&sc),
        expert_idx: Some(&ei),
        drop_pad_mode: DropPadMode::DropPadRow,
    };
    let dims = FinalizeDims { n, k, h, expanded_rows: rows, experts: e };
    let sizes = [2usize, 0, 4];
    for out_rows in [OutputRows::Dense, OutputRows::Padded { local_sizes: &sizes, slot_rows: 4 }] {
        let tl = kernels::finalize_tiling(&TilingParams::from_args(
            &args.try_map(|_, t| Ok(t.meta())).unwrap(),
            &dims,
            out_rows,
            5,
            UB_BYTES_910B,
        ))
        .unwrap();
        let mut want = Tensor::zeros_cpu(&[tl.out_rows as usize, h], ascend_moe::DType::F16);
        let host = args.try_map(|arg, t| t.view("kernel_launch", arg, "cpu")).unwrap();
        kernels::finalize_host(&host, &dims, want.view_mut("kernel_launch", "out", "cpu").unwrap(), out_rows, 5)
            .unwrap();

        let st = stream();
        let offs = kernels::slot_offsets(out_rows).unwrap();
        let mut gm = [std::ptr::null_mut::<c_void>(); kernels::GM_COUNT];
        gm[kernels::GM_EXPANDED_X] = upload(&xv);
        gm[kernels::GM_ROW_IDX] = upload(&idx);
        gm[kernels::GM_X1] = upload(&x1v);
        gm[kernels::GM_BIAS] = upload(&bv);
        gm[kernels::GM_SCALES] = upload(&sv);
        gm[kernels::GM_EXPERT_IDX] = upload(&ev);
        let out_bytes = tl.out_rows as usize * h * 2;
        gm[kernels::GM_OUT] = malloc(out_bytes);
        if !offs.is_empty() {
            gm[kernels::GM_SLOT_OFFSETS] = upload(&offs);
        }
        let status0 = vec![kernels::STATUS_NOT_RUN; tl.status_words()];
        gm[kernels::GM_STATUS] = upload(&status0);
        let entry = kernels::host_entry().unwrap();
        let r = unsafe {
            (s.cannsim_launch_kernel)(
                st,
                tl.block_dim,
                Some(entry),
                gm.as_ptr(),
                gm.len(),
                tl.as_bytes().as_ptr() as *const c_void,
                tl.as_bytes().len(),
            )
        };
        assert_eq!(r, 0, "{}", err_msg());
        sync(st);
        let mut got = vec![0u8; out_bytes];
        let mut status = vec![0u32; tl.status_words()];
        unsafe {
            assert_eq!((s.aclrtMemcpy)(got.as_mut_ptr() as Ptr, out_bytes, gm[kernels::GM_OUT], out_bytes, D2H), 0);
            assert_eq!(
                (s.aclrtMemcpy)(
                    status.as_mut_ptr() as Ptr,
                    status.len() * 4,
                    gm[kernels::GM_STATUS],
                    status.len() * 4,
                    D2H
                ),
                0
            );
        }
        kernels::check_status(&status, &tl).unwrap();
        assert_eq!(got, want.cpu_bytes().unwrap(), "device result differs from the host runner");
        for p in gm {
            if !p.is_null() {
                free(p);
            }
        }
        destroy_stream(st);
    }
}

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
