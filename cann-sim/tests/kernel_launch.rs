//! The host build of the finalize kernel launched through the simulator's
//! `cannsim_launch_kernel` on device buffers equals the same kernel run
//! directly on host memory, dense and into the padded EP buffer.

mod common;
use common::*;
use std::ffi::c_void;

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
        let tl = kernels::finalize_tiling(&TilingParams::from_args(&args, &dims, out_rows, 5, UB_BYTES_910B)).unwrap();
        let mut want = Tensor::zeros_cpu(&[tl.out_rows as usize, h], ascend_moe::DType::F16);
        kernels::finalize_host(&args, &dims, &mut want, out_rows, 5).unwrap();

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
