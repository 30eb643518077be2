//! Device-to-device copies at addresses `aclrtMemcpyAsync` refuses (not
//! 64-byte aligned) go through the byte-copy kernel on the stream: an
//! unaligned `copy_rows` (bf16 rows of H = 8, 16 bytes each) makes no host
//! synchronisation and no host copy, is captured into an ACL graph and
//! replays correctly with new source values; overlapping ranges are refused;
//! a fault of the kernel fails the stream like an AI Core exception. Ignored
//! without an NPU (`ci/sim.sh` runs it on the simulated runtime).

mod common;

use common::graph::Graph;
use std::ffi::c_void;

use ascend_moe::backend::npu::kernel::copy::{self, CopyTiling};
use ascend_moe::backend::npu::{NpuBuffer, NpuDevice};
use ascend_moe::half::bf16;
use ascend_moe::ops::DeviceOps;
use ascend_moe::tensor::Storage;
use ascend_moe::Tensor;

const H: usize = 8;
const ROWS: usize = 9;

fn rows(seed: usize) -> Vec<bf16> {
    (0..ROWS * H).map(|i| bf16::from_f32(((seed * 37 + i * 11) % 97) as f32 - 48.0)).collect()
}

fn buf(t: &Tensor) -> &NpuBuffer {
    match t.storage() {
        Storage::Npu(b) => b,
        Storage::Cpu(_) => panic!("an NPU tensor"),
    }
}

fn bits(t: &Tensor) -> Vec<u16> {
    t.to_vec::<bf16>().expect("device to host").iter().map(|v| v.to_bits()).collect()
}

/// `dst` with rows `src[src_row..src_row + n]` written at `dst_row`, on the host.
fn expected(dst: &[bf16], src: &[bf16], src_row: usize, dst_row: usize, n: usize) -> Vec<u16> {
    let mut out = dst.to_vec();
    out[dst_row * H..(dst_row + n) * H].copy_from_slice(&src[src_row * H..(src_row + n) * H]);
    out.iter().map(|v| v.to_bits()).collect()
}

fn open() -> NpuDevice {
    let dev = NpuDevice::open(0).expect("NPU 0");
    assert!(copy::copy_kernel_available(), "no copy kernel can launch on this runtime");
    dev
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn an_unaligned_copy_rows_makes_no_host_sync() {
    let dev = open();
    let (s0, d0) = (rows(1), rows(2));
    let src = dev.copy_from(&Tensor::from_slice(&s0, &[ROWS, H]).unwrap()).unwrap();
    let mut dst = dev.copy_from(&Tensor::from_slice(&d0, &[ROWS, H]).unwrap()).unwrap();
    dev.check().unwrap();
    // Rows 1.. and 3.. start 16 and 48 bytes into 64-byte aligned buffers.
    let (src_row, dst_row, n) = (1, 3, 5);
    let addr = |t: &Tensor, row: usize| buf(t).as_ptr() as usize + row * H * 2;
    assert!(addr(&src, src_row) % 64 != 0 && addr(&dst, dst_row) % 64 != 0, "the test needs unaligned rows");
    let api = acl_sys::acl().expect("ACL loaded");
    api.reset_counters();
    dev.copy_rows(&src, src_row, &mut dst, dst_row, n).unwrap();
    let c = api.counters();
    dev.check().unwrap();
    assert_eq!(bits(&dst), expected(&d0, &s0, src_row, dst_row, n));
    if let Some(c) = c {
        assert_eq!(c.host_syncs, 0, "host synchronisations of an unaligned copy_rows");
        assert_eq!((c.h2d_copies, c.d2h_copies), (0, 0), "host copies of an unaligned copy_rows");
        assert_eq!((c.device_mallocs, c.device_frees), (0, 0), "allocations of an unaligned copy_rows");
    }
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn odd_offsets_and_lengths_copy_exactly_on_the_device() {
    let dev = open();
    let total = 3000usize;
    let s0: Vec<u8> = (0..total).map(|i| (i * 13 + 5) as u8).collect();
    let d0: Vec<u8> = (0..total).map(|i| (i * 7) as u8 ^ 0x5A).collect();
    for (so, dof, len) in [(1, 0, 1), (0, 3, 31), (17, 45, 33), (63, 1, 1000), (5, 64, 2048), (64, 7, 129)] {
        let src = NpuBuffer::alloc(&dev, total).unwrap();
        let dst = NpuBuffer::alloc(&dev, total).unwrap();
        src.copy_from_host_at(0, &s0).unwrap();
        dst.copy_from_host_at(0, &d0).unwrap();
        dst.copy_from_device(dof, &src, so, len).unwrap();
        let mut got = vec![0u8; total];
        dst.copy_to_host_at(0, &mut got).unwrap();
        let mut want = d0.clone();
        want[dof..dof + len].copy_from_slice(&s0[so..so + len]);
        assert!(got == want, "src offset {so}, dst offset {dof}, {len} bytes");
    }
    dev.check().unwrap();
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn an_unaligned_copy_rows_is_captured_and_replays_with_new_sources() {
    let dev = open();
    let d0 = rows(7);
    let src = dev.copy_from(&Tensor::from_slice(&rows(0), &[ROWS, H]).unwrap()).unwrap();
    let mut dst = dev.copy_from(&Tensor::from_slice(&d0, &[ROWS, H]).unwrap()).unwrap();
    dev.check().unwrap();
    let raw = dev.stream().raw();
    let (src_row, dst_row, n) = (2, 1, 6);
    let graph = Graph::capture(raw, || dev.copy_rows(&src, src_row, &mut dst, dst_row, n).unwrap());
    // Captured, not run.
    dev.check().unwrap();
    assert_eq!(bits(&dst), d0.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "the capture ran the copy");
    for replay in 1..=3 {
        let s = rows(100 + replay);
        buf(&src).copy_from_host_at(0, bytemuck::cast_slice(&s)).unwrap();
        graph.replay(raw);
        dev.check().unwrap();
        assert_eq!(bits(&dst), expected(&d0, &s, src_row, dst_row, n), "replay {replay}");
    }
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn overlapping_ranges_are_refused() {
    let dev = open();
    let b = NpuBuffer::zeros(&dev, 256).unwrap();
    let e = b.copy_from_device(16, &b, 0, 32).unwrap_err();
    assert!(e.to_string().contains("overlap"), "{e}");
    let e = b.copy_from_device(0, &b, 64, 128).unwrap_err();
    assert!(e.to_string().contains("overlap"), "{e}");
    b.copy_from_device(0, &b, 0, 256).unwrap();
    b.copy_from_device(0, &b, 32, 32).unwrap();
    dev.check().unwrap();
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn a_faulting_copy_kernel_fails_the_stream_like_an_ai_core_exception() {
    let dev = open();
    let api = acl_sys::acl().expect("ACL loaded");
    let Some(launch) = api.cannsim_launch_kernel_ex else {
        eprintln!("not the simulated runtime: an AI Core fault is not provoked on real hardware");
        return;
    };
    let entry = copy::copy_host_entry().expect("host kernel build");
    let src = NpuBuffer::zeros(&dev, 64).unwrap();
    let dst = NpuBuffer::zeros(&dev, 64).unwrap();
    dev.check().unwrap();
    let broken = CopyTiling { magic: 0, ..CopyTiling::plan(dst.as_ptr() as usize, 64).unwrap() };
    let gm: [*mut c_void; copy::COPY_GM_COUNT] = [dst.as_ptr(), src.as_ptr()];
    let bytes = broken.as_bytes();
    // SAFETY: both pointers are 64-byte device buffers of the stream's
    // device, alive until the check below drained the stream.
    let code = unsafe {
        launch(dev.stream().raw(), 1, Some(entry), gm.as_ptr(), gm.len(), bytes.as_ptr().cast(), bytes.len())
    };
    assert_eq!(code, 0, "the launch itself is accepted");
    let e = dev.check().unwrap_err().to_string();
    assert!(e.contains("507015") && e.contains("trap"), "{e}");
}
