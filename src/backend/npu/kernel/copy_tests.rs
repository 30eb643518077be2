//! The byte-copy kernel (`kernels/copy_kernel.cpp`), host build over the real
//! Ascend C headers and the host model: every (source offset, destination
//! offset, length) copies exactly the source bytes and leaves every byte
//! around the destination as it was; the model confines each core to the
//! `len` bytes of each side, so a kernel that over-read or over-wrote would
//! fail here. A broken tiling traps. Tests of the crate's internals, so they
//! live here rather than in `tests/`.

use crate::backend::npu::kernel::copy::*;
use crate::Error;

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
