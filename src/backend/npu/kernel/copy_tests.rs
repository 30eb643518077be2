//! The byte-copy kernel (`kernels/copy_kernel.cpp`), host build over the real
//! Ascend C headers and the host model: every (source offset, destination
//! offset, length) copies exactly the source bytes and leaves every byte
//! around the destination as it was; the model confines each core to the
//! `len` bytes of each side, so a kernel that over-read or over-wrote would
//! fail here. A broken tiling traps.
//!
//! On the device, device-to-device copies at addresses `aclrtMemcpyAsync`
//! refuses (not 64-byte aligned) go through the kernel on the stream: an
//! unaligned `copy_rows` (bf16 rows of H = 8, 16 bytes each) makes no host
//! synchronisation and no host copy, is captured into an ACL graph and
//! replays correctly with new source values; overlapping ranges are refused;
//! a fault of the kernel fails the stream like an AI Core exception. Those
//! are ignored without an NPU (`ci/sim.sh` runs them on the simulated
//! runtime).
//!
//! Tests of the crate's internals, so they live here rather than in `tests/`.

use std::ffi::c_void;

use half::bf16;

use crate::backend::npu::kernel::copy::*;
use crate::backend::npu::{NpuBuffer, NpuDevice};
use crate::ops::DeviceOps;
use crate::tensor::Storage;
use crate::testing::graph::Graph;
use crate::{Error, Tensor};

/// A 64-byte aligned window of `len` bytes inside a larger vector, so the
/// tests control each address's offset from a 64-byte boundary.
struct Aligned {
    raw: Vec<u8>,
    start: usize,
}

impl Aligned {
    fn new(len: usize, fill: impl Fn(usize) -> u8) -> Aligned {
        let mut raw: Vec<u8> = (0..len + 64).map(&fill).collect();
        let start = (64 - raw.as_ptr() as usize % 64) % 64;
        for (i, b) in raw[start..start + len].iter_mut().enumerate() {
            *b = fill(i);
        }
        Aligned { raw, start }
    }

    fn bytes(&self) -> &[u8] {
        &self.raw[self.start..self.raw.len() - 64 + self.start]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        let end = self.raw.len() - 64 + self.start;
        &mut self.raw[self.start..end]
    }
}

fn src_byte(i: usize) -> u8 {
    (i.wrapping_mul(131) ^ (i >> 8)) as u8
}

fn dst_byte(i: usize) -> u8 {
    0xA0 ^ (i as u8).wrapping_mul(7)
}

/// Copies `len` bytes from offset `so` of a source to offset `dof` of a
/// destination (both 64-byte aligned at offset 0) and checks every byte of
/// the destination: the copied range equals the source, the rest is intact.
fn check_copy(so: usize, dof: usize, len: usize) {
    let span = so.max(dof) + len + 96;
    let src = Aligned::new(span, src_byte);
    let mut dst = Aligned::new(span, dst_byte);
    let mut want: Vec<u8> = dst.bytes().to_vec();
    want[dof..dof + len].copy_from_slice(&src.bytes()[so..so + len]);
    copy_host(&mut dst.bytes_mut()[dof..dof + len], &src.bytes()[so..so + len])
        .unwrap_or_else(|e| panic!("src offset {so}, dst offset {dof}, {len} bytes: {e}"));
    if let Some(i) = dst.bytes().iter().zip(&want).position(|(a, b)| a != b) {
        panic!(
            "src offset {so}, dst offset {dof}, {len} bytes: byte {i} of the destination is {:#04x}, expected {:#04x} \
             ({})",
            dst.bytes()[i],
            want[i],
            if (dof..dof + len).contains(&i) { "inside the copy" } else { "outside the copy" }
        );
    }
}

#[test]
fn tiling_layout_matches_the_c_header() {
    let c = c_copy_tiling_layout().expect("host kernel built");
    let rust = vec![
        std::mem::offset_of!(CopyTiling, magic) as u32,
        std::mem::offset_of!(CopyTiling, block_dim) as u32,
        std::mem::offset_of!(CopyTiling, tile) as u32,
        std::mem::offset_of!(CopyTiling, dst_phase) as u32,
        std::mem::offset_of!(CopyTiling, len) as u32,
        std::mem::offset_of!(CopyTiling, per_core) as u32,
        std::mem::size_of::<CopyTiling>() as u32,
    ];
    assert_eq!(c, rust);
    assert_eq!(rust, vec![0, 4, 8, 12, 16, 24, 32]);
}

#[test]
fn offsets_0_to_63_on_both_sides_copy_short_lengths_exactly() {
    // Every source offset 0..64 with four destination offsets each; as 5 is
    // odd, `so * 5 % 64` runs through every destination offset 0..64 too,
    // and the pairs cover every difference of misalignment.
    for so in 0..64 {
        for k in 0..4 {
            let dof = (so * 5 + k * 13) % 64;
            for len in [0, 1, 31, 32, 33] {
                check_copy(so, dof, len);
            }
        }
    }
}

#[test]
fn block_and_tile_edges_copy_exactly() {
    for len in [32, 63, 64, 65, 100, 255, 256, 1000, 4096, 4097] {
        for (so, dof) in [(0, 0), (1, 0), (0, 1), (3, 61), (17, 17), (31, 32), (32, 31), (63, 1), (40, 8)] {
            check_copy(so, dof, len);
        }
    }
}

#[test]
fn large_copies_over_several_cores_and_tiles_copy_exactly() {
    for len in [COPY_MAX_TILE - 1, COPY_MAX_TILE, COPY_MAX_TILE + 1, 3 * COPY_MIN_SPAN + 5, 1_000_003] {
        for (so, dof) in [(0, 0), (5, 0), (0, 27), (13, 50)] {
            check_copy(so, dof, len);
        }
    }
}

#[test]
fn a_large_copy_is_split_over_cores_at_destination_blocks() {
    let t = CopyTiling::plan(64 + 27, 1_000_003).unwrap();
    assert_eq!(t.block_dim, COPY_MAX_CORES);
    assert_eq!(t.dst_phase, 27);
    assert_eq!(t.per_core % COPY_BLOCK as u64, 0);
    assert!(t.per_core * u64::from(t.block_dim) >= 1_000_003 + 27);
    assert_eq!(t.tile as usize, COPY_MAX_TILE);
    let short = CopyTiling::plan(5, 16).unwrap();
    assert_eq!((short.block_dim, short.tile, short.per_core), (1, 32, 32));
    assert!(CopyTiling::plan(0, 0).is_err());
}

#[test]
fn a_launch_on_fewer_cores_than_planned_still_copies_every_byte() {
    let len = 5 * COPY_MIN_SPAN + 9;
    let src = Aligned::new(len, src_byte);
    let mut dst = Aligned::new(len, dst_byte);
    let mut t = CopyTiling::plan(dst.bytes().as_ptr() as usize, len).unwrap();
    assert!(t.block_dim > 2);
    t.block_dim = 2;
    copy_host_with_tiling(dst.bytes_mut(), src.bytes(), &t).unwrap();
    assert!(dst.bytes() == src.bytes(), "the last core copies to the end");
}

#[test]
fn a_broken_tiling_traps_instead_of_copying_part() {
    let src = Aligned::new(256, src_byte);
    let good = CopyTiling::plan(0, 256).unwrap();
    let broken = [
        CopyTiling { magic: 0x1234, ..good },
        CopyTiling { tile: 48, ..good },
        CopyTiling { tile: 0, ..good },
        CopyTiling { tile: (COPY_MAX_TILE + 32) as u32, ..good },
        CopyTiling { per_core: 100, ..good },
        CopyTiling { dst_phase: 32, ..good },
    ];
    for t in broken {
        assert!(t.check().is_err(), "{t:?} passes the host check");
        let mut dst = Aligned::new(256, dst_byte);
        let before = dst.bytes().to_vec();
        match copy_host_with_tiling(dst.bytes_mut(), src.bytes(), &t) {
            Err(Error::Kernel { detail, .. }) => assert!(detail.contains("trap"), "{t:?}: {detail}"),
            other => panic!("{t:?}: {other:?}"),
        }
        assert_eq!(dst.bytes(), &before[..], "{t:?} wrote bytes before trapping");
    }
}

#[test]
fn a_tiling_longer_than_the_buffers_is_refused_before_the_launch() {
    let src = Aligned::new(4096, src_byte);
    let mut dst = Aligned::new(4096, dst_byte);
    let longer = CopyTiling { len: 4096, ..CopyTiling::plan(0, 64).unwrap() };
    let e = copy_host_with_tiling(&mut dst.bytes_mut()[..64], &src.bytes()[..64], &longer).unwrap_err();
    assert!(e.to_string().contains("4096 bytes"), "{e}");
}

// On the device.

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
    assert!(copy_kernel_available(), "no copy kernel can launch on this runtime");
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
    let c = crate::testing::runtime::sim_counters();
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

/// Only the simulated runtime can provoke an AI Core fault
/// (`cannsim_launch_kernel_ex`): `ci/npu-4card.sh` skips the `sim_only_`
/// tests on real hardware.
#[test]
#[ignore = "needs the simulated CANN runtime"]
fn sim_only_a_faulting_copy_kernel_fails_the_stream_like_an_ai_core_exception() {
    let dev = open();
    let api = acl_sys::acl().expect("ACL loaded");
    let launch =
        api.cannsim_launch_kernel_ex.expect("cannsim_launch_kernel_ex: a sim_only_ test needs the simulated runtime");
    let entry = copy_host_entry().expect("host kernel build");
    let src = NpuBuffer::zeros(&dev, 64).unwrap();
    let dst = NpuBuffer::zeros(&dev, 64).unwrap();
    dev.check().unwrap();
    let broken = CopyTiling { magic: 0, ..CopyTiling::plan(dst.as_ptr() as usize, 64).unwrap() };
    let gm: [*mut c_void; COPY_GM_COUNT] = [dst.as_ptr(), src.as_ptr()];
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
