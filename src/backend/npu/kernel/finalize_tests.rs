//! The host build of the native finalize kernel (kernels/finalize_kernel.cpp
//! against the real Ascend C headers in CPU-debug mode, over the host model of
//! kernels/host_model), bit for bit against a plain f32 reference written
//! here, over the finalize golden matrix; plus the model's enforcement of the
//! hardware rules, including the ordering of the pipes. Tests of the crate's
//! internals, so they live here rather than in `tests/`.

use half::{bf16, f16};

use crate::backend::cpu::CpuBuffer;
use crate::backend::npu::kernel::{self as kernels, FinalizeTiling, TilingParams, UB_BYTES_910B};
use crate::backend::{FinalizeArgs, FinalizeDims, OutputRows, View, ViewMut};
use crate::testing::SplitMix;
use crate::types::TensorMeta;
use crate::{DType, DropPadMode, Error, Tensor};

/// The host tensors of `a` lent to the kernel's host runner.
fn lend<'a>(a: &FinalizeArgs<&'a Tensor>) -> FinalizeArgs<View<'a, CpuBuffer>> {
    a.try_map(|arg, t| t.view("kernel_finalize", arg, "cpu")).unwrap()
}

/// `out` lent to the kernel's host runner.
fn lend_out(out: &mut Tensor) -> ViewMut<'_, CpuBuffer> {
    out.view_mut("kernel_finalize", "out", "cpu").unwrap()
}

/// Shapes and dtypes of `a`, what the tiling is planned from.
fn metas<'a>(a: &FinalizeArgs<&'a Tensor>) -> FinalizeArgs<TensorMeta<'a>> {
    a.try_map(|_, t| Ok(t.meta())).unwrap()
}

/// The crate's one generator, with the draws these cases take.
struct Rng(SplitMix);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(SplitMix::new(seed))
    }
    fn below(&mut self, n: usize) -> usize {
        self.0.below(n as u64) as usize
    }
    /// Uniform in [-2, 2), multiples of 2^-22.
    fn unit(&mut self) -> f32 {
        (self.0.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
    }
}

/// Rounds f32 to `dtype` and back (RNE, the `half` crate).
fn round_to(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::F32 => v,
        DType::F16 => f16::from_f32(v).to_f32(),
        DType::BF16 => bf16::from_f32(v).to_f32(),
        _ => unreachable!(),
    }
}

/// The bits of `v` rounded to `dtype`.
fn bits_of(dtype: DType, v: f32) -> u32 {
    match dtype {
        DType::F32 => v.to_bits(),
        DType::F16 => u32::from(f16::from_f32(v).to_bits()),
        DType::BF16 => u32::from(bf16::from_f32(v).to_bits()),
        _ => unreachable!(),
    }
}

fn tensor(dtype: DType, v: &[f32], shape: &[usize]) -> Tensor {
    match dtype {
        DType::F32 => Tensor::from_slice(v, shape),
        DType::F16 => Tensor::from_slice(&v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>(), shape),
        DType::BF16 => Tensor::from_slice(&v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>(), shape),
        _ => unreachable!(),
    }
    .unwrap()
}

fn out_bits(t: &Tensor) -> Vec<u32> {
    match t.dtype() {
        DType::F32 => t.as_slice::<f32>().unwrap().iter().map(|v| v.to_bits()).collect(),
        DType::F16 => t.as_slice::<f16>().unwrap().iter().map(|v| u32::from(v.to_bits())).collect(),
        DType::BF16 => t.as_slice::<bf16>().unwrap().iter().map(|v| u32::from(v.to_bits())).collect(),
        _ => unreachable!(),
    }
}

/// An output tensor filled with a NaN pattern, so a row the kernel forgets
/// to write can never pass as zeros or as a correct value.
fn garbage_out(dtype: DType, rows: usize, h: usize) -> Tensor {
    let mut t = Tensor::zeros_cpu(&[rows, h], dtype);
    t.cpu_bytes_mut().unwrap().fill(0xFF);
    t
}

#[derive(Clone, Debug)]
struct Case {
    mode: u32,
    data: DType,
    /// `None`: no scales (then K = 1).
    scales: Option<DType>,
    x1: bool,
    x2: bool,
    bias: bool,
    n: usize,
    k: usize,
    h: usize,
    experts: usize,
    capacity: usize,
    block_dim: u32,
    ub: usize,
    /// `(local_sizes, slot_rows)` for the padded output.
    padded: Option<(Vec<usize>, usize)>,
    seed: u64,
}

impl Case {
    fn new(mode: u32, data: DType) -> Self {
        Case {
            mode,
            data,
            scales: Some(data),
            x1: true,
            x2: true,
            bias: true,
            n: 7,
            k: 3,
            h: 40,
            experts: 4,
            capacity: 5,
            block_dim: 4,
            ub: UB_BYTES_910B,
            padded: None,
            seed: 1,
        }
    }
}

/// Inputs of a case, as f32 values already rounded to their dtypes.
struct Inputs {
    dims: FinalizeDims,
    x: Vec<f32>,
    idx: Vec<i32>,
    x1: Option<Vec<f32>>,
    x2: Option<Vec<f32>>,
    bias: Option<Vec<f32>>,
    expert: Option<Vec<i32>>,
    scales: Option<Vec<f32>>,
}

fn make_inputs(c: &Case) -> Inputs {
    let mut rng = Rng::new(c.seed.wrapping_mul(0x1000_0001));
    let mode = DropPadMode::from_u32(c.mode).unwrap();
    let k = if c.scales.is_some() { c.k } else { 1 };
    let (n, h) = (c.n, c.h);
    let nk = n * k;
    let expanded_rows = if mode.is_drop_pad() { c.experts * c.capacity } else { nk };
    let mut vals = |len: usize, dtype: DType| (0..len).map(|_| round_to(dtype, rng.unit())).collect::<Vec<_>>();
    let x = vals(expanded_rows * h, c.data);
    let x1 = c.x1.then(|| vals(n * h, c.data));
    let x2 = c.x2.then(|| vals(n * h, c.data));
    let bias = c.bias.then(|| vals(c.experts * h, c.data));
    let scales = c.scales.map(|d| vals(nk, d));
    let idx: Vec<i32> = if mode.is_drop_pad() {
        (0..nk).map(|_| if rng.below(4) == 0 { -1 } else { rng.below(expanded_rows) as i32 }).collect()
    } else {
        // A permutation of 0..N*K (Fisher-Yates).
        let mut p: Vec<i32> = (0..nk as i32).collect();
        for i in (1..p.len()).rev() {
            p.swap(i, rng.below(i + 1));
        }
        p
    };
    let expert = c.bias.then(|| (0..nk).map(|_| rng.below(c.experts) as i32).collect());
    let dims = FinalizeDims { n, k, h, expanded_rows, experts: if c.bias { c.experts } else { 0 } };
    Inputs { dims, x, idx, x1, x2, bias, expert, scales }
}

/// The straightforward f32 finalize of SPEC section 1, in its exact order:
/// acc = x1 (+ x2); for k: acc = acc + s * (row + bias); one rounding.
fn reference(c: &Case, inp: &Inputs) -> Vec<f32> {
    let FinalizeDims { n, k, h, .. } = inp.dims;
    let row_layout = c.mode >= 2;
    let mut out = vec![0f32; n * h];
    for i in 0..n {
        for j in 0..h {
            let mut acc = match (&inp.x1, &inp.x2) {
                (Some(a), Some(b)) => a[i * h + j] + b[i * h + j],
                (Some(a), None) => a[i * h + j],
                (None, Some(b)) => b[i * h + j],
                (None, None) => 0.0,
            };
            for kk in 0..k {
                let r = inp.idx[if row_layout { i * k + kk } else { kk * n + i }];
                let mut term = if r == -1 { 0.0 } else { inp.x[r as usize * h + j] };
                if let (Some(b), Some(e)) = (&inp.bias, &inp.expert) {
                    term += b[e[i * k + kk] as usize * h + j];
                }
                if let Some(s) = &inp.scales {
                    term *= s[i * k + kk];
                }
                acc += term;
            }
            out[i * h + j] = acc;
        }
    }
    out
}

struct Tensors {
    x: Tensor,
    idx: Tensor,
    x1: Option<Tensor>,
    x2: Option<Tensor>,
    bias: Option<Tensor>,
    expert: Option<Tensor>,
    scales: Option<Tensor>,
}

fn tensors(c: &Case, inp: &Inputs) -> Tensors {
    let d = &inp.dims;
    let x_shape = if DropPadMode::from_u32(c.mode).unwrap().is_drop_pad() {
        vec![c.experts, c.capacity, d.h]
    } else {
        vec![d.expanded_rows, d.h]
    };
    Tensors {
        x: tensor(c.data, &inp.x, &x_shape),
        idx: Tensor::from_slice(&inp.idx, &[d.n * d.k]).unwrap(),
        x1: inp.x1.as_ref().map(|v| tensor(c.data, v, &[d.n, d.h])),
        x2: inp.x2.as_ref().map(|v| tensor(c.data, v, &[d.n, d.h])),
        bias: inp.bias.as_ref().map(|v| tensor(c.data, v, &[c.experts, d.h])),
        expert: inp.expert.as_ref().map(|v| Tensor::from_slice(v, &[d.n, d.k]).unwrap()),
        scales: c.scales.map(|s| tensor(s, inp.scales.as_ref().unwrap(), &[d.n, d.k])),
    }
}

fn args<'a>(c: &Case, t: &'a Tensors) -> FinalizeArgs<&'a Tensor> {
    FinalizeArgs::new(&t.x, &t.idx, DropPadMode::from_u32(c.mode).unwrap())
        .with_x1(t.x1.as_ref())
        .with_x2(t.x2.as_ref())
        .with_bias(t.bias.as_ref())
        .with_scales(t.scales.as_ref())
        .with_expert_idx(t.expert.as_ref())
}

fn output_rows(c: &Case) -> OutputRows<'_> {
    match &c.padded {
        None => OutputRows::Dense,
        Some((sizes, slot_rows)) => OutputRows::Padded { local_sizes: sizes, slot_rows: *slot_rows },
    }
}

fn tiling(c: &Case, a: &FinalizeArgs<&Tensor>, dims: &FinalizeDims) -> FinalizeTiling {
    kernels::finalize_tiling(&TilingParams::from_args(&metas(a), dims, output_rows(c), c.block_dim, c.ub)).unwrap()
}

/// Runs one case through the kernel and compares every output bit.
fn check(c: &Case) {
    let inp = make_inputs(c);
    let t = tensors(c, &inp);
    let a = args(c, &t);
    let rows = output_rows(c);
    let h = inp.dims.h;
    let want = reference(c, &inp);
    // Expected output rows, in output order: Some(token) or None for padding.
    let layout: Vec<Option<usize>> = match &c.padded {
        None => (0..inp.dims.n).map(Some).collect(),
        Some((sizes, slot_rows)) => {
            let mut v = Vec::new();
            let mut first = 0;
            for &s in sizes {
                v.extend((0..*slot_rows).map(|j| (j < s).then_some(first + j)));
                first += s;
            }
            v
        }
    };
    let mut out = garbage_out(c.data, layout.len(), h);
    let tl = tiling(c, &a, &inp.dims);
    kernels::finalize_host_with_tiling(&lend(&a), lend_out(&mut out), rows, &tl)
        .unwrap_or_else(|e| panic!("{c:?}: {e}"));
    let got = out_bits(&out);
    // The CPU backend's kernel, through the op layer's own validation.
    let (shape, dims) = crate::moe::finalize::moe_finalize_routing_output_shape(&a).unwrap();
    assert_eq!(dims, inp.dims, "{c:?}: dims");
    assert_eq!(shape[0], inp.dims.n);
    let mut cpu = garbage_out(c.data, layout.len(), h);
    crate::Device::Cpu.backend().finalize_routing(&a, &dims, &mut cpu, rows).unwrap();
    assert_eq!(out_bits(&cpu), got, "{c:?}: native kernel vs CPU backend");
    for (row, tok) in layout.iter().enumerate() {
        for j in 0..h {
            let expect = match tok {
                Some(i) => bits_of(c.data, want[i * h + j]),
                None => 0,
            };
            assert_eq!(
                got[row * h + j],
                expect,
                "{c:?}\nrow {row} (token {tok:?}) col {j}: kernel {:#x}, reference {expect:#x} (tiling {tl:?})",
                got[row * h + j]
            );
        }
    }
}

#[test]
fn golden_matrix_every_mode_dtype_and_optional_input() {
    let mut runs = 0;
    for mode in 0..4 {
        for data in DType::FLOATS {
            let scale_kinds: Vec<Option<DType>> = if data == DType::F32 {
                vec![None, Some(DType::F32)]
            } else {
                vec![None, Some(data), Some(DType::F32)]
            };
            for scales in scale_kinds {
                for mask in 0..8u32 {
                    let mut c = Case::new(mode, data);
                    c.scales = scales;
                    c.x1 = mask & 1 != 0;
                    c.x2 = mask & 2 != 0;
                    c.bias = mask & 4 != 0;
                    c.seed = u64::from(mode * 100 + mask) + runs;
                    check(&c);
                    runs += 1;
                }
            }
        }
    }
    assert_eq!(runs, 4 * 8 * (2 + 3 + 3));
}

#[test]
fn h_not_a_multiple_of_the_tile_and_larger_than_one_ub_tile() {
    for data in DType::FLOATS {
        // The full 910B budget: the largest tile, two and a bit tiles per row.
        let full = kernels::finalize_tiling(&TilingParams {
            dims: FinalizeDims { n: 1, k: 1, h: 1 << 20, expanded_rows: 1, experts: 0 },
            data,
            scales: None,
            mode: DropPadMode::DropLessColumn,
            x1: false,
            x2: false,
            bias: false,
            rows: OutputRows::Dense,
            block_dim: 1,
            ub_bytes: UB_BYTES_910B,
        })
        .unwrap()
        .tile_h as usize;
        let mut c = Case::new(1, data);
        c.h = 2 * full + 5;
        c.n = 3;
        c.k = 2;
        c.scales = Some(DType::F32);
        c.block_dim = 2;
        check(&c);
        // A small budget: many tiles over a short row, 1000 = 7 * 136 + 48 style tails.
        for (mode, h) in [(0, 1000), (3, 999), (2, 257)] {
            let mut c = Case::new(mode, data);
            c.h = h;
            c.ub = 4096;
            c.seed = h as u64;
            let inp = make_inputs(&c);
            let t = tensors(&c, &inp);
            let tl = tiling(&c, &args(&c, &t), &inp.dims);
            assert!(tl.tiles > 1 && tl.tail_h < tl.tile_h, "{tl:?}");
            check(&c);
        }
    }
}

#[test]
fn fewer_tokens_than_cores_and_more_cores_than_rows() {
    for (n, block_dim) in [(1, 8), (3, 8), (5, 5), (9, 4), (0, 3)] {
        for mode in [0, 3] {
            let mut c = Case::new(mode, DType::BF16);
            c.n = n;
            c.block_dim = block_dim;
            c.seed = (n * 10) as u64 + u64::from(block_dim);
            check(&c);
        }
    }
}

#[test]
fn k_equal_one_with_and_without_scales() {
    for mode in 0..4 {
        for data in DType::FLOATS {
            let mut c = Case::new(mode, data);
            c.k = 1;
            check(&c);
            c.scales = None; // N = expanded_row_idx.len, K = 1
            c.n = 11;
            check(&c);
        }
    }
}

#[test]
fn dropped_slots_still_add_the_scaled_bias() {
    for mode in [1, 3] {
        for data in DType::FLOATS {
            let mut c = Case::new(mode, data);
            c.seed = 77;
            let inp = make_inputs(&c);
            assert!(inp.idx.contains(&-1), "the case must contain dropped slots");
            check(&c);
        }
    }
}

#[test]
fn padded_output_places_rank_blocks_and_zeroes_padding() {
    for data in DType::FLOATS {
        for (sizes, slot_rows, block_dim) in
            [(vec![3, 0, 2, 1], 3, 4), (vec![2, 2], 4, 3), (vec![0, 0, 5], 5, 8), (vec![1], 1, 2)]
        {
            let mut c = Case::new(2, data);
            c.n = sizes.iter().sum();
            c.padded = Some((sizes, slot_rows));
            c.block_dim = block_dim;
            check(&c);
            c.ub = 2048; // and several H tiles per row, with a tail
            c.h = 300;
            check(&c);
        }
    }
}

fn run_with_idx(c: &Case, edit: impl FnOnce(&mut Inputs)) -> Result<(), Error> {
    let mut inp = make_inputs(c);
    edit(&mut inp);
    let t = tensors(c, &inp);
    let a = args(c, &t);
    let mut out = garbage_out(c.data, inp.dims.n, inp.dims.h);
    kernels::finalize_host(&lend(&a), &inp.dims, lend_out(&mut out), OutputRows::Dense, c.block_dim)
}

#[test]
fn out_of_range_indices_are_reported_not_read() {
    // The simulation bounds-checks every global read, so an index that was
    // dereferenced would surface as Error::Kernel, not as IndexOutOfRange.
    let c = Case::new(0, DType::F16);
    let nk = c.n * c.k;
    let e = run_with_idx(&c, |i| i.idx[5] = nk as i32).unwrap_err();
    match e {
        Error::IndexOutOfRange { arg: "expanded_row_idx", position: 5, value, ref valid, .. } => {
            assert_eq!(value, nk as i64);
            assert_eq!(valid, &format!("[0, {nk})"));
        }
        e => panic!("{e}"),
    }
    let e = run_with_idx(&c, |i| i.idx[2] = -1).unwrap_err();
    assert!(matches!(e, Error::IndexOutOfRange { position: 2, value: -1, .. }), "{e}");

    // Drop-pad: -1 is legal, -2 and E*C are not.
    let c = Case::new(3, DType::F32);
    let rows = c.experts * c.capacity;
    let e = run_with_idx(&c, |i| i.idx[4] = -2).unwrap_err();
    assert!(matches!(e, Error::IndexOutOfRange { arg: "expanded_row_idx", position: 4, value: -2, .. }), "{e}");
    let e = run_with_idx(&c, |i| i.idx[20] = rows as i32).unwrap_err();
    assert!(matches!(e, Error::IndexOutOfRange { position: 20, .. }), "{e}");
    let e = run_with_idx(&c, |i| i.expert.as_mut().unwrap()[7] = c.experts as i32).unwrap_err();
    match e {
        Error::IndexOutOfRange { arg: "expert_idx", position: 7, value, .. } => assert_eq!(value, c.experts as i64),
        e => panic!("{e}"),
    }
    let e = run_with_idx(&c, |i| i.expert.as_mut().unwrap()[0] = i32::MIN).unwrap_err();
    assert!(matches!(e, Error::IndexOutOfRange { arg: "expert_idx", position: 0, .. }), "{e}");
}

#[test]
fn mismatched_buffers_are_rejected_before_launch() {
    let c = Case::new(0, DType::F32);
    let inp = make_inputs(&c);
    let t = tensors(&c, &inp);
    let a = args(&c, &t);
    let tl = tiling(&c, &a, &inp.dims);
    let mut small = garbage_out(DType::F32, inp.dims.n - 1, inp.dims.h);
    let e = kernels::finalize_host_with_tiling(&lend(&a), lend_out(&mut small), OutputRows::Dense, &tl).unwrap_err();
    assert!(matches!(e, Error::Shape { arg: "out", .. }), "{e}");
    let mut out = garbage_out(DType::F32, inp.dims.n, inp.dims.h);
    let no_bias = FinalizeArgs { bias: None, ..a };
    let e =
        kernels::finalize_host_with_tiling(&lend(&no_bias), lend_out(&mut out), OutputRows::Dense, &tl).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { arg: "bias", .. }), "{e}");
    let mut bad = tl;
    bad.rows_per_core += 1;
    let e = kernels::finalize_host_with_tiling(&lend(&a), lend_out(&mut out), OutputRows::Dense, &bad).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { arg: "tiling", .. }), "{e}");
}

fn kernel_error(e: Error) -> String {
    match e {
        Error::Kernel { detail, .. } => detail,
        e => panic!("expected a kernel error, got {e}"),
    }
}

#[test]
fn sim_rejects_a_plan_that_overflows_the_unified_buffer() {
    for data in DType::FLOATS {
        let mut c = Case::new(0, data);
        c.h = 100_000;
        c.n = 2;
        c.k = 1;
        // The plan believes in a 1 MiB unified buffer; the 910B has 192 KiB.
        c.ub = 1 << 20;
        let inp = make_inputs(&c);
        let t = tensors(&c, &inp);
        let a = args(&c, &t);
        let tl = tiling(&c, &a, &inp.dims);
        assert!(tl.ub_bytes as usize > UB_BYTES_910B);
        let mut out = garbage_out(data, inp.dims.n, inp.dims.h);
        let msg = kernel_error(
            kernels::finalize_host_with_tiling(&lend(&a), lend_out(&mut out), OutputRows::Dense, &tl).unwrap_err(),
        );
        // The CPU-debug headers' own InitBuffer check (one buffer larger than
        // the 196,608-byte UB, or all of them) or the model's (buffers past its end).
        assert!(msg.contains("unified buffer overflow") || msg.contains("196608"), "{msg}");
        // One aligned step smaller than the real budget's limit fits.
        c.ub = UB_BYTES_910B;
        check(&c);
    }
}

#[test]
fn sim_rejects_a_misaligned_data_copy() {
    let c = Case::new(0, DType::F32);
    let inp = make_inputs(&c);
    let t = tensors(&c, &inp);
    let a = args(&c, &t);
    let mut tl = tiling(&c, &a, &inp.dims);
    // 10 f32 = 40 bytes per full tile: DataCopy needs multiples of 32 bytes.
    tl.tile_h = 10;
    tl.tiles = (inp.dims.h as u32).div_ceil(10);
    tl.tail_h = inp.dims.h as u32 - (tl.tiles - 1) * 10;
    let mut out = garbage_out(DType::F32, inp.dims.n, inp.dims.h);
    let msg = kernel_error(
        kernels::finalize_host_with_tiling(&lend(&a), lend_out(&mut out), OutputRows::Dense, &tl).unwrap_err(),
    );
    assert!(msg.contains("DataCopy") && msg.contains("32B align"), "{msg}");
}

/// The host build is compiled against the real Ascend C headers (in CI
/// always: `CI=true` fails the suite if the host build did not happen).
#[test]
fn the_host_kernel_is_built_against_the_real_headers() {
    let ci = std::env::var("CI").as_deref() == Ok("true");
    match kernels::host_build_info() {
        Ok(dir) => {
            assert!(std::path::Path::new(dir).join("basic_api/kernel_operator.h").is_file(), "{dir}");
            assert!(kernels::host_entry().is_some());
        }
        Err(why) => {
            assert!(!ci, "CI=true, but the host kernel was not built against the Ascend C headers: {why}");
            assert!(kernels::host_entry().is_none());
            // Without the headers the reason names where they were looked for.
            assert!(why.contains("ascendc") || why.contains("failed"), "{why}");
        }
    }
}

#[test]
fn host_entry_has_the_simulator_signature() {
    // The simulated runtime's cannsim_launch_kernel takes exactly this type.
    let entry: Option<unsafe extern "C" fn(u32, u32, *const *mut std::ffi::c_void, *const std::ffi::c_void)> =
        kernels::host_entry();
    assert!(entry.is_some());
}

#[test]
fn narrowing_rounds_to_nearest_even_like_the_half_crate() {
    // out[i] = s_i * 1.0 exactly in f32, so the kernel's only rounding is the
    // final f32 -> f16 / bf16 cast: ties, overflow, subnormals, signed zero.
    let specials: Vec<f32> = vec![
        1.0 + f32::powi(2.0, -11), // f16 tie, rounds down to even
        1.0 + 3.0 * f32::powi(2.0, -11),
        1.0 + f32::powi(2.0, -8), // bf16 tie
        1.0 + 3.0 * f32::powi(2.0, -8),
        -(1.0 + 3.0 * f32::powi(2.0, -8)),
        65504.0,
        65520.0, // f16 tie between max and inf -> inf
        1.0e9,
        -1.0e9,
        f32::powi(2.0, -24),       // smallest f16 subnormal
        f32::powi(2.0, -25),       // tie to zero
        3.0 * f32::powi(2.0, -26), // rounds up to 2^-24
        1.0e-30,
        -0.0,
        3.4e38,
        f32::from_bits(0x3F80_8000), // exactly halfway in bf16
        f32::from_bits(0x3F81_8000),
    ];
    let n = specials.len();
    let h = 16;
    for data in [DType::F16, DType::BF16] {
        let x = tensor(data, &vec![1.0; n * h], &[n, h]);
        let idx = Tensor::from_slice(&(0..n as i32).collect::<Vec<_>>(), &[n]).unwrap();
        let scales = Tensor::from_slice(&specials, &[n, 1]).unwrap();
        let a = FinalizeArgs::new(&x, &idx, DropPadMode::DropLessRow).with_scales(&scales);
        let dims = FinalizeDims { n, k: 1, h, expanded_rows: n, experts: 0 };
        let mut out = garbage_out(data, n, h);
        kernels::finalize_host(&lend(&a), &dims, lend_out(&mut out), OutputRows::Dense, 3).unwrap();
        let got = out_bits(&out);
        for (i, &s) in specials.iter().enumerate() {
            // acc = 0 + s * 1.0 (no skip inputs: acc starts at +0).
            let want = bits_of(data, 0.0 + s);
            assert_eq!(got[i * h], want, "{data}: scale {s:e} ({:#010x})", s.to_bits());
            assert!(got[i * h..(i + 1) * h].iter().all(|&b| b == want));
        }
    }
}

#[test]
fn sim_enforces_queue_discipline_bounds_alignment_and_pipe_order() {
    assert_eq!(kernels::sim_selftest(0).unwrap(), None, "a kernel that follows the rules runs clean");
    assert_eq!(kernels::sim_selftest(12).unwrap(), None, "MTE3 -> V flags order a reuse of UB");
    let expect = [
        (1, "exceed limits 1"),
        (2, "DeQue"),
        (3, "still allocated"),
        (4, "after FreeTensor"),
        (5, "outside the 64-element dst tensor"),
        (6, "outside the 256-byte buffer"),
        (7, "32B aligned"),
        (8, "still enqueued"),
        (9, "written by MTE2"),
        (10, "written by V"),
        (11, "that MTE3 #1 still reads"),
        (13, "never set"),
    ];
    for (case, needle) in expect {
        let msg = kernels::sim_selftest(case).unwrap().unwrap_or_else(|| panic!("case {case} ran clean"));
        assert!(msg.contains(needle), "case {case}: {msg}");
    }
}

#[test]
fn dropping_one_vector_barrier_is_a_pipe_hazard() {
    // The kernel built with AMOE_FINALIZE_DROP_BARRIER lacks the
    // PipeBarrier<PIPE_V> between Muls and the accumulating Add; every
    // dtype's run scales a slot, so every one must be rejected, while the
    // kernel with the barrier passes the same case bit for bit.
    let dropped = kernels::host_entry_dropped_barrier().expect("host kernel is built");
    for data in DType::FLOATS {
        let c = Case::new(0, data);
        check(&c);
        let (status, tl) = raw_launch_with(dropped, &c, c.block_dim, &(0..c.block_dim).collect::<Vec<_>>(), |_| {});
        let msg = kernel_error(kernels::check_status(&status, &tl).unwrap_err());
        assert!(msg.contains("pipe hazard"), "{data}: {msg}");
        assert!(msg.contains("Add (vadd)") && msg.contains("Muls (vmuls)"), "{data}: {msg}");
    }
}

/// Launches the host entry by hand for `blocks` (the runner would refuse these
/// launches), returning the status array.
fn raw_launch(
    c: &Case,
    launch_dim: u32,
    blocks: &[u32],
    edit: impl FnOnce(&mut FinalizeTiling),
) -> (Vec<u32>, FinalizeTiling) {
    raw_launch_with(kernels::host_entry().unwrap(), c, launch_dim, blocks, edit)
}

/// [`raw_launch`] through a given host entry.
fn raw_launch_with(
    entry: kernels::KernelEntry,
    c: &Case,
    launch_dim: u32,
    blocks: &[u32],
    edit: impl FnOnce(&mut FinalizeTiling),
) -> (Vec<u32>, FinalizeTiling) {
    use std::ffi::c_void;
    let inp = make_inputs(c);
    let t = tensors(c, &inp);
    let a = args(c, &t);
    let mut tl = tiling(c, &a, &inp.dims);
    edit(&mut tl);
    let mut out = garbage_out(c.data, inp.dims.n, inp.dims.h);
    let mut status = vec![kernels::STATUS_NOT_RUN; launch_dim as usize * kernels::STATUS_WORDS];
    let ptr = |t: Option<&Tensor>| t.map_or(std::ptr::null_mut(), |t| t.cpu_bytes().unwrap().as_ptr() as *mut c_void);
    let mut gm = [std::ptr::null_mut::<c_void>(); kernels::GM_COUNT];
    gm[kernels::GM_EXPANDED_X] = ptr(Some(&t.x));
    gm[kernels::GM_ROW_IDX] = ptr(Some(&t.idx));
    gm[kernels::GM_X1] = ptr(t.x1.as_ref());
    gm[kernels::GM_X2] = ptr(t.x2.as_ref());
    gm[kernels::GM_BIAS] = ptr(t.bias.as_ref());
    gm[kernels::GM_SCALES] = ptr(t.scales.as_ref());
    gm[kernels::GM_EXPERT_IDX] = ptr(t.expert.as_ref());
    gm[kernels::GM_OUT] = out.cpu_bytes_mut().unwrap().as_mut_ptr() as *mut c_void;
    gm[kernels::GM_STATUS] = status.as_mut_ptr() as *mut c_void;
    for &b in blocks {
        // SAFETY: the buffers match the unedited tiling's sizes; the edits
        // below only make the kernel refuse to run or leave cores unrun.
        unsafe { entry(b, launch_dim, gm.as_ptr(), (&tl as *const FinalizeTiling).cast()) };
    }
    (status, tl)
}

#[test]
fn kernel_rejects_a_tiling_for_another_launch_and_unrun_cores_are_detected() {
    let c = Case::new(2, DType::F16);
    // Tiling planned for 4 cores, launched on 3: every core refuses.
    let (status, mut tl) = raw_launch(&c, 3, &[0, 1, 2], |_| {});
    tl.block_dim = 3;
    let e = kernels::check_status(&status, &tl).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { arg: "tiling", .. }), "{e}");
    // A wrong magic is refused by the kernel too.
    let (status, tl) = raw_launch(&c, 4, &[0, 1, 2, 3], |t| t.magic ^= 1);
    let e = kernels::check_status(&status, &tl).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { arg: "tiling", .. }), "{e}");
    // Core 2 never runs: its sentinel survives.
    let (status, tl) = raw_launch(&c, 4, &[0, 1, 3], |_| {});
    match kernels::check_status(&status, &tl).unwrap_err() {
        Error::Kernel { block: 2, detail, .. } => assert!(detail.contains("did not run"), "{detail}"),
        e => panic!("{e}"),
    }
    // All four run: clean.
    let (status, tl) = raw_launch(&c, 4, &[0, 1, 2, 3], |_| {});
    kernels::check_status(&status, &tl).unwrap();
}

#[test]
fn random_shapes_layouts_and_budgets_match_the_reference() {
    let mut rng = Rng::new(0xC0FF_EE00_1234_5678);
    for seed in 0..120u64 {
        let data = DType::FLOATS[rng.below(3)];
        let mut c = Case::new(rng.below(4) as u32, data);
        c.seed = seed;
        c.n = rng.below(12);
        c.k = 1 + rng.below(4);
        c.h = 1 + rng.below(200);
        c.experts = 1 + rng.below(5);
        c.capacity = 1 + rng.below(6);
        c.block_dim = 1 + rng.below(9) as u32;
        c.ub = [UB_BYTES_910B, 1024, 2048, 5000][rng.below(4)];
        c.x1 = rng.below(2) == 0;
        c.x2 = rng.below(2) == 0;
        c.bias = rng.below(2) == 0;
        c.scales = match rng.below(3) {
            0 => None,
            1 => Some(data),
            _ => Some(DType::F32),
        };
        if rng.below(3) == 0 {
            // Spread the tokens over 1..=4 EP slots, some possibly empty.
            let slots = 1 + rng.below(4);
            let mut sizes = vec![0usize; slots];
            for _ in 0..c.n {
                sizes[rng.below(slots)] += 1;
            }
            let slot_rows = sizes.iter().copied().max().unwrap_or(0) + rng.below(2);
            c.padded = Some((sizes, slot_rows));
        }
        check(&c);
    }
}

/// The index check of the aclnn path (`FLAG_CHECK_INDICES`) on the host
/// build: over many slot counts (one value, around the per-core chunk, several
/// chunks per core), with and without bias, in a drop-less and a drop-pad
/// mode, the output holds the indices with every bad one replaced (-1 in the
/// drop-pad modes, else 0; experts 0) and the error names the first bad
/// position of the first core that has one (a core checks its row indices
/// before its expert indices).
#[test]
fn the_index_check_copies_indices_and_replaces_bad_ones() {
    let block_dim = 8usize;
    let h = 4usize;
    for nk in [1usize, 7, 2047, 2049, 8 * 2048 + 5, 40_000] {
        for mode in [DropPadMode::DropLessRow, DropPadMode::DropPadRow] {
            for bias in [false, true] {
                let (rows, experts) = (nk, 3usize);
                let lo = if mode.is_drop_pad() { -1 } else { 0 };
                let mut idx: Vec<i32> = (0..nk).map(|i| ((i * 7919) % rows) as i32).collect();
                let mut exp: Vec<i32> = (0..nk).map(|i| (i % experts) as i32).collect();
                // Bad values: a few, at chunk and core edges.
                for &p in &[nk / 2, nk - 1, (nk * 7) / 8 + 1] {
                    if p < nk {
                        idx[p] = if p % 2 == 0 { rows as i32 } else { -5 };
                    }
                }
                if bias && nk > 3 {
                    exp[nk / 3] = experts as i32;
                    exp[3] = -1;
                }
                let x = Tensor::from_slice(&vec![0f32; rows * h], &[rows, h]).unwrap();
                let it = Tensor::from_slice(&idx, &[nk]).unwrap();
                let et = Tensor::from_slice(&exp, &[nk, 1]).unwrap();
                let bt = Tensor::from_slice(&vec![0f32; experts * h], &[experts, h]).unwrap();
                let args = FinalizeArgs::new(&x, &it, mode)
                    .with_bias(bias.then_some(&bt))
                    .with_expert_idx(bias.then_some(&et));
                let dims =
                    FinalizeDims { n: nk, k: 1, h, expanded_rows: rows, experts: if bias { experts } else { 0 } };
                let mut t = kernels::finalize_tiling(&TilingParams::from_args(
                    &metas(&args),
                    &dims,
                    OutputRows::Dense,
                    block_dim as u32,
                    UB_BYTES_910B,
                ))
                .unwrap();
                t.flags |= kernels::FLAG_CHECK_INDICES;
                let len = kernels::checked_indices_len(nk, bias);
                let mut out = Tensor::from_slice(&vec![i32::MIN; len], &[len]).unwrap();
                let got = kernels::finalize_host_with_tiling(&lend(&args), lend_out(&mut out), OutputRows::Dense, &t);

                // Expected: sanitized copies, and the first error in core order.
                let bad_row = |v: i32| v < lo || v as i64 >= rows as i64;
                let bad_exp = |v: i32| v < 0 || v as usize >= experts;
                let mut want = vec![i32::MIN; len];
                for p in 0..nk {
                    want[p] = if bad_row(idx[p]) { lo } else { idx[p] };
                    if bias {
                        let q = kernels::checked_expert_offset(nk) + p;
                        want[q] = if bad_exp(exp[p]) { 0 } else { exp[p] };
                    }
                }
                let (per, rem) = (nk / block_dim, nk % block_dim);
                let mut first: Option<(&str, usize, i64)> = None;
                for b in 0..block_dim {
                    let start = b * per + b.min(rem);
                    let range = start..start + per + usize::from(b < rem);
                    if let Some(p) = range.clone().find(|&p| bad_row(idx[p])) {
                        first = Some(("expanded_row_idx", p, idx[p] as i64));
                    } else if let Some(p) = range.clone().find(|&p| bias && bad_exp(exp[p])) {
                        first = Some(("expert_idx", p, exp[p] as i64));
                    }
                    if first.is_some() {
                        break;
                    }
                }
                let what = format!("nk {nk} {mode:?} bias {bias}");
                match (got, first) {
                    (Err(Error::IndexOutOfRange { arg, position, value, .. }), Some(f)) => {
                        assert_eq!((arg, position, value), f, "{what}")
                    }
                    (Ok(()), None) => {}
                    (got, want) => panic!("{what}: got {got:?}, expected {want:?}"),
                }
                // Elements between the two copies are never written.
                assert!(out.as_slice::<i32>().unwrap() == want.as_slice(), "{what}: checked copies");
            }
        }
    }
}

/// The host build launched through the simulated runtime's
/// `cannsim_launch_kernel` on device buffers equals the same kernel run
/// directly on host memory, dense and into the padded EP buffer. Only the
/// simulated runtime has `cannsim_launch_kernel`: `ci/sim.sh` runs this, and
/// `ci/npu-4card.sh` skips the `sim_only_` tests on real hardware.
#[test]
#[ignore = "needs the simulated CANN runtime"]
fn sim_only_finalize_kernel_runs_under_cannsim_launch_kernel() {
    use crate::backend::npu::{NpuBuffer, NpuDevice};

    let dev = NpuDevice::open(0).expect("NPU 0");
    let api = crate::backend::npu::runtime::acl().expect("ACL loaded");
    let launch =
        api.cannsim_launch_kernel.expect("cannsim_launch_kernel: a sim_only_ test needs the simulated runtime");
    let entry = kernels::host_entry().expect("host kernel build");
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
    let upload = |bytes: &[u8]| {
        let buf = NpuBuffer::alloc(&dev, bytes.len()).unwrap();
        buf.copy_from_host_at(0, bytes).unwrap();
        buf
    };
    for out_rows in [OutputRows::Dense, OutputRows::Padded { local_sizes: &sizes, slot_rows: 4 }] {
        let tl = kernels::finalize_tiling(&TilingParams::from_args(&metas(&args), &dims, out_rows, 5, UB_BYTES_910B))
            .unwrap();
        let mut want = Tensor::zeros_cpu(&[tl.out_rows as usize, h], DType::F16);
        kernels::finalize_host(&lend(&args), &dims, lend_out(&mut want), out_rows, 5).unwrap();

        let offs = kernels::slot_offsets(out_rows).unwrap();
        let out_bytes = tl.out_rows as usize * h * 2;
        let inputs = [
            (kernels::GM_EXPANDED_X, upload(bytemuck::cast_slice(&xv))),
            (kernels::GM_ROW_IDX, upload(bytemuck::cast_slice(&idx))),
            (kernels::GM_X1, upload(bytemuck::cast_slice(&x1v))),
            (kernels::GM_BIAS, upload(bytemuck::cast_slice(&bv))),
            (kernels::GM_SCALES, upload(bytemuck::cast_slice(&sv))),
            (kernels::GM_EXPERT_IDX, upload(bytemuck::cast_slice(&ev))),
        ];
        let out = NpuBuffer::alloc(&dev, out_bytes).unwrap();
        let offsets = (!offs.is_empty()).then(|| upload(bytemuck::cast_slice(&offs)));
        let status_buf = upload(bytemuck::cast_slice(&vec![kernels::STATUS_NOT_RUN; tl.status_words()]));
        let mut gm = [std::ptr::null_mut::<std::ffi::c_void>(); kernels::GM_COUNT];
        for (at, buf) in &inputs {
            gm[*at] = buf.as_ptr();
        }
        gm[kernels::GM_OUT] = out.as_ptr();
        if let Some(offsets) = &offsets {
            gm[kernels::GM_SLOT_OFFSETS] = offsets.as_ptr();
        }
        gm[kernels::GM_STATUS] = status_buf.as_ptr();
        // SAFETY: every non-NULL pointer of `gm` is a buffer of device 0
        // sized for the tiling, alive until the check below drained the stream.
        unsafe {
            crate::backend::npu::result::acl::sim_launch_kernel(
                launch,
                dev.stream().raw(),
                tl.block_dim,
                Some(entry),
                &gm,
                tl.as_bytes(),
            )
        }
        .unwrap();
        dev.check().unwrap();
        let mut got = vec![0u8; out_bytes];
        out.copy_to_host_at(0, &mut got).unwrap();
        let mut status = vec![0u32; tl.status_words()];
        status_buf.copy_to_host_at(0, bytemuck::cast_slice_mut(&mut status)).unwrap();
        kernels::check_status(&status, &tl).unwrap();
        assert_eq!(got, want.cpu_bytes().unwrap(), "device result differs from the host runner");
    }
}
