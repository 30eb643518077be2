//! The Rust mirror of `kernels/finalize_tiling.h` and the tiling plan: tests
//! of the crate's internals, so they live here rather than in `tests/`.

use std::mem::{offset_of, size_of};

use crate::backend::npu::kernel::{self as kernels, FinalizeTiling, TilingParams, TILE_ALIGN, UB_BYTES_910B};
use crate::backend::{FinalizeDims, OutputRows};
use crate::{DType, DropPadMode, Error};

#[test]
fn tiling_struct_matches_the_c_layout() {
    let c = kernels::c_tiling_layout().expect("host kernel is built");
    let rust = [
        offset_of!(FinalizeTiling, magic),
        offset_of!(FinalizeTiling, n),
        offset_of!(FinalizeTiling, k),
        offset_of!(FinalizeTiling, h),
        offset_of!(FinalizeTiling, expanded_rows),
        offset_of!(FinalizeTiling, experts),
        offset_of!(FinalizeTiling, data_dtype),
        offset_of!(FinalizeTiling, scales_dtype),
        offset_of!(FinalizeTiling, mode),
        offset_of!(FinalizeTiling, flags),
        offset_of!(FinalizeTiling, block_dim),
        offset_of!(FinalizeTiling, out_rows),
        offset_of!(FinalizeTiling, slots),
        offset_of!(FinalizeTiling, slot_rows),
        offset_of!(FinalizeTiling, tile_h),
        offset_of!(FinalizeTiling, tiles),
        offset_of!(FinalizeTiling, tail_h),
        offset_of!(FinalizeTiling, rows_per_core),
        offset_of!(FinalizeTiling, rows_rem),
        offset_of!(FinalizeTiling, ub_bytes),
        size_of::<FinalizeTiling>(),
    ];
    let rust: Vec<u32> = rust.iter().map(|&v| v as u32).collect();
    assert_eq!(rust, c, "field offsets + size, Rust vs C");
}

#[test]
fn ub_formula_matches_the_header_and_the_sim_capacity() {
    for d in DType::FLOATS {
        for tile in [16u32, 256, 10_912, 12_272] {
            assert_eq!(
                kernels::ub_bytes(d, tile as usize),
                kernels::c_ub_bytes(d, tile).unwrap() as usize,
                "{d} {tile}"
            );
        }
    }
    assert_eq!(kernels::sim_ub_capacity().unwrap(), UB_BYTES_910B);
}

fn params(dims: FinalizeDims, data: DType, rows: OutputRows<'_>, block_dim: u32, ub: usize) -> TilingParams<'_> {
    TilingParams {
        dims,
        data,
        scales: Some(DType::F32),
        mode: DropPadMode::DropLessColumn,
        x1: true,
        x2: false,
        bias: false,
        rows,
        block_dim,
        ub_bytes: ub,
    }
}

#[test]
fn tiles_are_the_largest_aligned_ones_that_fit() {
    let dims = FinalizeDims { n: 10, k: 2, h: 100_000, expanded_rows: 20, experts: 0 };
    for d in DType::FLOATS {
        let t = kernels::finalize_tiling(&params(dims, d, OutputRows::Dense, 4, UB_BYTES_910B)).unwrap();
        let tile = t.tile_h as usize;
        assert_eq!(tile % TILE_ALIGN, 0);
        assert!(kernels::ub_bytes(d, tile) <= UB_BYTES_910B, "{d}: tile {tile} overflows");
        assert!(kernels::ub_bytes(d, tile + TILE_ALIGN) > UB_BYTES_910B, "{d}: tile {tile} is not the largest");
        assert_eq!((t.tiles as usize - 1) * tile + t.tail_h as usize, dims.h);
        assert!(t.tail_h >= 1 && t.tail_h <= t.tile_h);
        assert_eq!(t.ub_bytes as usize, kernels::ub_bytes(d, tile));
    }
    // A short row takes one tile rounded up to the alignment.
    let small = FinalizeDims { h: 20, ..dims };
    let t = kernels::finalize_tiling(&params(small, DType::F16, OutputRows::Dense, 4, UB_BYTES_910B)).unwrap();
    assert_eq!((t.tile_h, t.tiles, t.tail_h), (32, 1, 20));
}

#[test]
fn rows_are_split_over_cores_even_when_fewer_than_cores() {
    let dims = FinalizeDims { n: 3, k: 1, h: 8, expanded_rows: 3, experts: 0 };
    let t = kernels::finalize_tiling(&params(dims, DType::F32, OutputRows::Dense, 8, UB_BYTES_910B)).unwrap();
    assert_eq!((t.rows_per_core, t.rows_rem, t.out_rows), (0, 3, 3));
    let dims = FinalizeDims { n: 10, ..dims };
    let t = kernels::finalize_tiling(&params(dims, DType::F32, OutputRows::Dense, 4, UB_BYTES_910B)).unwrap();
    assert_eq!((t.rows_per_core, t.rows_rem), (2, 2));

    let sizes = [3usize, 0, 2, 5];
    let rows = OutputRows::Padded { local_sizes: &sizes, slot_rows: 5 };
    let t = kernels::finalize_tiling(&params(dims, DType::F32, rows, 3, UB_BYTES_910B)).unwrap();
    assert_eq!((t.slots, t.slot_rows, t.out_rows), (4, 5, 20));
    assert_eq!((t.rows_per_core, t.rows_rem), (6, 2));
    assert_eq!(kernels::slot_offsets(rows).unwrap(), vec![0, 3, 3, 5, 10]);
}

#[test]
fn bad_plans_are_clear_errors() {
    let dims = FinalizeDims { n: 10, k: 1, h: 8, expanded_rows: 10, experts: 0 };
    let e = kernels::finalize_tiling(&params(dims, DType::F32, OutputRows::Dense, 0, UB_BYTES_910B)).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { arg: "block_dim", .. }), "{e}");
    let e = kernels::finalize_tiling(&params(dims, DType::F32, OutputRows::Dense, 1, 100)).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { arg: "ub_bytes", .. }), "{e}");
    let sizes = [4usize, 4];
    let rows = OutputRows::Padded { local_sizes: &sizes, slot_rows: 4 };
    let e = kernels::finalize_tiling(&params(dims, DType::F32, rows, 1, UB_BYTES_910B)).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { arg: "local_sizes", .. }), "{e}");
    let sizes = [6usize, 4];
    let rows = OutputRows::Padded { local_sizes: &sizes, slot_rows: 5 };
    let e = kernels::finalize_tiling(&params(dims, DType::F32, rows, 1, UB_BYTES_910B)).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { arg: "local_sizes", .. }), "{e}");
    let mut p = params(dims, DType::F16, OutputRows::Dense, 1, UB_BYTES_910B);
    p.scales = Some(DType::BF16);
    let e = kernels::finalize_tiling(&p).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "scales", .. }), "{e}");
    p.data = DType::I32;
    let e = kernels::finalize_tiling(&p).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "expanded_x", .. }), "{e}");
}

#[test]
fn missing_npu_kernel_library_is_unavailable_not_a_panic() {
    let e = kernels::NpuKernelLib::load_from("/nonexistent/libamoe_kernels_npu.so").unwrap_err();
    match e {
        Error::Unavailable(msg) => assert!(msg.contains("/nonexistent/libamoe_kernels_npu.so"), "{msg}"),
        e => panic!("{e}"),
    }
    // A library without the launcher symbol is rejected by name.
    let e = kernels::NpuKernelLib::load_from("libc.so.6").unwrap_err();
    match e {
        Error::Unavailable(msg) => assert!(msg.contains(kernels::NPU_LAUNCH_SYMBOL), "{msg}"),
        e => panic!("{e}"),
    }
}

/// The AI Core build carried inside the library loads from its bytes alone:
/// an image of a library exporting the launcher loads, and reports where it
/// came from; bytes that are no library are `Unavailable`, naming the
/// embedded build.
#[test]
fn an_embedded_kernel_image_loads_from_memory() {
    let dir = std::env::temp_dir().join(format!("amoe-embedded-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (src, so) = (dir.join("k.c"), dir.join("k.so"));
    std::fs::write(
        &src,
        format!(
            "int {}(unsigned b, void *s, void **gm, void *t) {{ (void)b; (void)s; (void)gm; (void)t; return 0; }}\n",
            kernels::NPU_LAUNCH_SYMBOL
        ),
    )
    .unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let built = std::process::Command::new(&cc).args(["-shared", "-fPIC", "-o"]).arg(&so).arg(&src).status().unwrap();
    assert!(built.success(), "{cc} could not build the stand-in kernel library");
    let image = std::fs::read(&so).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    // The file is gone: only the bytes remain.
    let lib = kernels::NpuKernelLib::load_image(&image).unwrap();
    assert!(format!("{lib:?}").contains("embedded in this library"), "{lib:?}");
    let e = kernels::NpuKernelLib::load_image(b"not a library").unwrap_err();
    match e {
        Error::Unavailable(msg) => assert!(msg.contains("/proc/self/fd/"), "{msg}"),
        e => panic!("{e}"),
    }
}

/// Every `AMOE_FIN_*` flag, status code and gm slot of `kernels/finalize_tiling.h`
/// equals its Rust mirror (read from the header text, so a new define
/// without a mirror, or a renumbered one, fails).
#[test]
fn header_defines_match_the_rust_constants() {
    let header = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/finalize_tiling.h")).unwrap();
    let mut seen = std::collections::BTreeMap::new();
    for line in header.lines() {
        let mut w = line.split_whitespace();
        if w.next() != Some("#define") {
            continue;
        }
        let (Some(name), Some(value)) = (w.next(), w.next()) else { continue };
        let v = value.trim_end_matches('u');
        let parsed = match v.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16).ok(),
            None => v.parse::<u64>().ok(),
        };
        if let Some(p) = parsed {
            seen.insert(name.to_string(), p);
        }
    }
    let mirrors: [(&str, u64); 19] = [
        ("AMOE_FIN_HAS_X1", kernels::FLAG_X1.into()),
        ("AMOE_FIN_HAS_X2", kernels::FLAG_X2.into()),
        ("AMOE_FIN_HAS_BIAS", kernels::FLAG_BIAS.into()),
        ("AMOE_FIN_HAS_SCALES", kernels::FLAG_SCALES.into()),
        ("AMOE_FIN_PADDED_OUT", kernels::FLAG_PADDED_OUT.into()),
        ("AMOE_FIN_SKIP_INVALID_ROWS", kernels::FLAG_SKIP_INVALID_ROWS.into()),
        ("AMOE_FIN_CHECK_INDICES", kernels::FLAG_CHECK_INDICES.into()),
        ("AMOE_FIN_CHECK_CHUNK", kernels::CHECK_CHUNK as u64),
        ("AMOE_FIN_GM_EXPANDED_X", kernels::GM_EXPANDED_X as u64),
        ("AMOE_FIN_GM_ROW_IDX", kernels::GM_ROW_IDX as u64),
        ("AMOE_FIN_GM_X1", kernels::GM_X1 as u64),
        ("AMOE_FIN_GM_X2", kernels::GM_X2 as u64),
        ("AMOE_FIN_GM_BIAS", kernels::GM_BIAS as u64),
        ("AMOE_FIN_GM_SCALES", kernels::GM_SCALES as u64),
        ("AMOE_FIN_GM_EXPERT_IDX", kernels::GM_EXPERT_IDX as u64),
        ("AMOE_FIN_GM_OUT", kernels::GM_OUT as u64),
        ("AMOE_FIN_GM_SLOT_OFFSETS", kernels::GM_SLOT_OFFSETS as u64),
        ("AMOE_FIN_GM_STATUS", kernels::GM_STATUS as u64),
        ("AMOE_FIN_GM_COUNT", kernels::GM_COUNT as u64),
    ];
    for (name, rust) in mirrors {
        assert_eq!(seen.get(name), Some(&rust), "{name}: header vs Rust");
    }
    let mirrored: Vec<&str> = mirrors.iter().map(|m| m.0).collect();
    let prefixes = ["AMOE_FIN_HAS_", "AMOE_FIN_PADDED_", "AMOE_FIN_SKIP_", "AMOE_FIN_CHECK_", "AMOE_FIN_GM_"];
    for name in seen.keys().filter(|k| prefixes.iter().any(|p| k.starts_with(p))) {
        assert!(mirrored.contains(&name.as_str()), "{name} of the header has no Rust mirror in this test");
    }
}
