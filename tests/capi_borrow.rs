//! The C ABI reads inputs and writes outputs in the caller's host memory, and
//! falls back to a copy exactly where borrowing could change a result: an
//! output overlapping an input (in-place calls), and pointers that are not
//! 8-byte aligned. Each case is checked against the same call on separate,
//! aligned buffers.

mod capi_common;

use std::ffi::CString;
use std::ptr::{null, null_mut};

use ascend_moe::capi::*;
use capi_common::finalize_args;

/// A host f32 descriptor at `data`, which may be misaligned.
fn desc(data: *mut f32, shape: &[usize]) -> amoe_tensor {
    capi_common::desc(data.cast(), amoe_dtype::F32, shape, amoe_device_kind::Cpu, 0)
}

fn idx_desc(data: &mut [i32], shape: &[usize]) -> amoe_tensor {
    amoe_tensor { dtype: amoe_dtype::I32 as u32, ..desc(data.as_mut_ptr().cast(), shape) }
}

/// Drop-less row layout, N tokens, K = 2 (unit f32 scales), H = 8: token `i`
/// gathers rows `2j+1` and `2j` with `j = N-1-i`, so the last tokens read the
/// first rows, which an in-place write-as-you-go would already have clobbered.
const N: usize = 16;
const K: usize = 2;
const H: usize = 8;

fn finalize_into(x: *mut f32, idx: &mut [i32], out: *mut f32) -> amoe_status {
    let (xs, is, os, ss) = ([N * K, H], [N * K], [N, H], [N, K]);
    let mut ones = vec![1f32; N * K];
    let (x, i, o) = (desc(x, &xs), idx_desc(idx, &is), desc(out, &os));
    let s = desc(ones.as_mut_ptr(), &ss);
    let args = amoe_finalize_args { scales: &s, ..finalize_args(&x, &i, amoe_drop_pad_mode::DropLessRow as u32) };
    // SAFETY: every descriptor points at live buffers of the described sizes.
    unsafe { amoe_moe_finalize_routing(&args, &o, null()) }
}

fn inputs() -> (Vec<f32>, Vec<i32>) {
    let x: Vec<f32> = (0..N * K * H).map(|v| (v % 97) as f32 * 0.5 - 7.0).collect();
    let idx: Vec<i32> = (0..N).flat_map(|i| [2 * (N - 1 - i) as i32 + 1, 2 * (N - 1 - i) as i32]).collect();
    (x, idx)
}

fn expected() -> Vec<f32> {
    let (x, idx) = inputs();
    (0..N)
        .flat_map(|i| {
            let (a, b) = (idx[i * K] as usize, idx[i * K + 1] as usize);
            (0..H).map(move |c| (a, b, c)).collect::<Vec<_>>()
        })
        .map(|(a, b, c)| x[a * H + c] + x[b * H + c])
        .collect()
}

#[test]
fn finalize_on_separate_buffers_writes_the_callers_output_and_leaves_inputs_alone() {
    let (mut x, mut idx) = inputs();
    let before = x.clone();
    let mut out = vec![f32::NAN; N * H];
    assert_eq!(finalize_into(x.as_mut_ptr(), &mut idx, out.as_mut_ptr()), amoe_status::Ok);
    assert_eq!(out, expected());
    assert_eq!(x, before, "inputs are read in place, never written");
}

#[test]
fn finalize_in_place_over_its_own_input_gives_the_out_of_place_result() {
    let (mut x, mut idx) = inputs();
    let p = x.as_mut_ptr();
    // `out` is the first N*H elements of `expanded_x` itself.
    assert_eq!(finalize_into(p, &mut idx, p), amoe_status::Ok);
    assert_eq!(&x[..N * H], expected().as_slice());
}

#[test]
fn finalize_on_pointers_not_8_byte_aligned_gives_the_aligned_result() {
    let (x, mut idx) = inputs();
    // One f32 of offset: 4-byte aligned (valid for f32), not 8-byte aligned.
    let mut xs = vec![0f32; x.len() + 1];
    let mut outs = vec![f32::NAN; N * H + 1];
    let off = usize::from(xs.as_ptr() as usize % 8 == 0);
    xs[off..off + x.len()].copy_from_slice(&x);
    let out_off = usize::from(outs.as_ptr() as usize % 8 == 0);
    let (xp, op) = (xs[off..].as_mut_ptr(), outs[out_off..].as_mut_ptr());
    assert_ne!(xp as usize % 8, 0);
    assert_ne!(op as usize % 8, 0);
    assert_eq!(finalize_into(xp, &mut idx, op), amoe_status::Ok);
    assert_eq!(&outs[out_off..out_off + N * H], expected().as_slice());
}

/// Runs `f(rank, comm)` on `world` threads of one fresh CPU world.
fn on_ranks(name: &str, world: usize, f: impl Fn(usize, *mut amoe_comm) + Sync) {
    let name = CString::new(format!("{name}-{}", std::process::id())).expect("no NUL");
    std::thread::scope(|s| {
        for r in 0..world {
            let (name, f) = (&name, &f);
            s.spawn(move || {
                let mut c = null_mut();
                // SAFETY: valid name and out-pointer.
                assert_eq!(unsafe { amoe_comm_cpu_new(name.as_ptr(), world, r, 30.0, &mut c) }, amoe_status::Ok);
                f(r, c);
                // SAFETY: a live handle from amoe_comm_cpu_new, freed once.
                unsafe { amoe_comm_free(c) };
            });
        }
    });
}

#[test]
fn all_reduce_in_place_and_out_of_place_on_caller_memory_agree() {
    let len = 1000;
    on_ranks("borrow-ar", 3, |r, c| {
        let mine: Vec<f32> = (0..len).map(|i| (i * (r + 1)) as f32).collect();
        let want: Vec<f32> = (0..len).map(|i| (i * 6) as f32).collect();
        let shape = [len];
        let mut src = mine.clone();
        let mut dst = vec![f32::NAN; len];
        let (s, d) = (desc(src.as_mut_ptr(), &shape), desc(dst.as_mut_ptr(), &shape));
        // SAFETY: live comm; descriptors over live buffers of `len` f32.
        assert_eq!(unsafe { amoe_all_reduce(c, &s, &d, 0, null()) }, amoe_status::Ok);
        assert_eq!(dst, want);
        assert_eq!(src, mine, "src is read in place, never written");

        let mut buf = mine.clone();
        let b = desc(buf.as_mut_ptr(), &shape);
        // SAFETY: as above; src and dst are the same memory (in place).
        assert_eq!(unsafe { amoe_all_reduce(c, &b, &b, 0, null()) }, amoe_status::Ok);
        assert_eq!(buf, want);
    });
}

#[test]
fn a_reduction_point_that_reduces_never_writes_its_input() {
    let len = 64;
    on_ranks("borrow-rp", 2, |r, c| {
        let policy = amoe_reduce_policy { shared_mode: 1, has_routed_transform: 0, sp: 0, tp_size: 2, ep_size: 2 };
        let mine: Vec<f32> = (0..len).map(|i| (i + r) as f32).collect();
        let shape = [len / 8, 8];
        let mut x = mine.clone();
        let mut out = vec![f32::NAN; len];
        let (xd, od) = (desc(x.as_mut_ptr(), &shape), desc(out.as_mut_ptr(), &shape));
        // ALLGATHER without SP: the final reduction is a TP all-reduce.
        let (mut early, mut routed, mut shared, mut fin) = (0u8, 0u8, 0u8, 0u8);
        // SAFETY: valid policy and out-pointers.
        let st = unsafe { amoe_reduce_policy_decisions(&policy, 0, &mut early, &mut routed, &mut shared, &mut fin) };
        assert_eq!(st, amoe_status::Ok);
        assert_eq!(fin, 1, "the case must reduce for this test to mean anything");
        // SAFETY: live comm; descriptors over live buffers.
        assert_eq!(unsafe { amoe_reduce_final(&policy, &xd, 0, c, &od, null()) }, amoe_status::Ok);
        assert_eq!(out, (0..len).map(|i| (2 * i + 1) as f32).collect::<Vec<_>>());
        assert_eq!(x, mine, "the consumed input is the caller's and stays unchanged");
    });
}

/// Rank `r`'s `[rows, 4]` input of seed `s`.
fn rank_rows(s: usize, r: usize, rows: usize) -> Vec<f32> {
    (0..rows * 4).map(|i| ((i * 7 + r * 31 + s * 13) % 23) as f32 * 0.25 - 2.0).collect()
}

/// What the Rust ops give on a CPU world of 3 ranks for rank `r`: pad-reduce,
/// gather-unpad (layout [3, 0, 2]), shared pad-split, gather-unpad and
/// pad-reduce-scatter (5 tokens).
fn layout_and_shared_results() -> Vec<[Vec<f32>; 5]> {
    use ascend_moe::moe::{pad_reduce, shared};
    use ascend_moe::{CommOptions, SpLayout, Tensor};
    let l = SpLayout::new(&[3, 0, 2]).expect("a layout");
    ascend_moe::ranks::run_ranks(3, &CommOptions::with_timeout(std::time::Duration::from_secs(30)), |r, comm| {
        let full = Tensor::from_slice(&rank_rows(1, r, 5), &[5, 4])?;
        let mine = l.local_size(r);
        let shard = Tensor::from_slice(&rank_rows(2, r, mine), &[mine, 4])?;
        let part = Tensor::from_slice(&rank_rows(3, r, 2), &[2, 4])?;
        Ok([
            pad_reduce::maybe_pad_and_reduce(&full, Some(&l), &comm)?.to_vec()?,
            pad_reduce::maybe_all_gather_and_maybe_unpad(&shard, Some(&l), &comm)?.to_vec()?,
            shared::shared_pad_split(&full, &comm)?.to_vec()?,
            shared::shared_gather_unpad(&part, 5, &comm)?.to_vec()?,
            shared::shared_pad_reduce_scatter(&full, &comm)?.to_vec()?,
        ])
    })
    .expect("the Rust ops run")
}

/// Element-wise sum of `f(q)` over `world` ranks.
fn rank_sum(world: usize, f: impl Fn(usize) -> Vec<f32>) -> Vec<f32> {
    (1..world).fold(f(0), |acc, q| acc.iter().zip(f(q)).map(|(a, b)| a + b).collect())
}

/// The same five results from SPEC sections 3 and 4 and the shared helpers'
/// documented rows (TP = the world of 3: 5 tokens pad to 6, 2 rows per
/// rank), computed on the host. Every value is a multiple of 0.25, so the
/// sums are exact.
fn layout_and_shared_spec(r: usize) -> [Vec<f32>; 5] {
    let local = [3usize, 0, 2];
    let first: usize = local[..r].iter().sum();
    let rows = |v: &[f32], from: usize, n: usize| v[from * 4..(from + n) * 4].to_vec();
    let padded = |q: usize| [rank_rows(1, q, 5), vec![0.0; 4]].concat();
    [
        rows(&rank_sum(3, |q| rank_rows(1, q, 5)), first, local[r]),
        (0..3).flat_map(|q| rank_rows(2, q, local[q])).collect(),
        rows(&padded(r), 2 * r, 2),
        (0..3).flat_map(|q| rank_rows(3, q, 2)).take(5 * 4).collect(),
        rows(&rank_sum(3, padded), 2 * r, 2),
    ]
}

#[test]
fn layout_and_shared_expert_ops_write_the_callers_output_as_the_rust_ops_compute_it() {
    let want = layout_and_shared_results();
    let spec: Vec<[Vec<f32>; 5]> = (0..3).map(layout_and_shared_spec).collect();
    let local = [3usize, 0, 2];
    on_ranks("borrow-layout", 3, |r, c| {
        let mut full = rank_rows(1, r, 5);
        let mut shard = rank_rows(2, r, local[r]);
        let mut part = rank_rows(3, r, 2);
        let (full_in, shard_in, part_in) = (full.clone(), shard.clone(), part.clone());
        let (fs, ss, ps) = ([5, 4], [local[r], 4], [2, 4]);
        let (fd, sd, pd) = (desc(full.as_mut_ptr(), &fs), desc(shard.as_mut_ptr(), &ss), desc(part.as_mut_ptr(), &ps));
        let shapes = [[local[r], 4], [5, 4], [2, 4], [5, 4], [2, 4]];
        for (i, shape) in shapes.iter().enumerate() {
            let mut out = vec![f32::NAN; shape[0] * 4];
            let od = desc(out.as_mut_ptr(), shape);
            // SAFETY: live comm; descriptors over live buffers of their shapes.
            let st = unsafe {
                match i {
                    0 => amoe_maybe_pad_and_reduce(&fd, local.as_ptr(), 3, c, &od, null()),
                    1 => amoe_maybe_all_gather_and_maybe_unpad(&sd, local.as_ptr(), 3, c, &od, null()),
                    2 => amoe_shared_pad_split(&fd, c, &od, null()),
                    3 => amoe_shared_gather_unpad(&pd, 5, c, &od, null()),
                    _ => amoe_shared_pad_reduce_scatter(&fd, c, &od, null()),
                }
            };
            assert_eq!(st, amoe_status::Ok, "op {i} rank {r}");
            let same =
                out.len() == want[r][i].len() && out.iter().zip(&want[r][i]).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "op {i} rank {r}: {out:?} vs {:?}", want[r][i]);
            assert_eq!(out, spec[r][i], "op {i} rank {r}: SPEC's value");
        }
        assert_eq!((full, shard, part), (full_in, shard_in, part_in), "inputs are read in place, never written");
    });
}

#[test]
fn every_reduction_point_writes_the_callers_output_as_the_rust_point_computes_it() {
    use ascend_moe::moe::{ReducePolicy, SharedMode};
    use ascend_moe::{CommType, Tensor};
    let len = 48;
    // TP-sharded shared expert, no SP, a routed transform: every point reduces under ALLGATHER.
    let policy = amoe_reduce_policy { shared_mode: 1, has_routed_transform: 1, sp: 0, tp_size: 2, ep_size: 2 };
    let p = ReducePolicy::new(SharedMode::TensorParallel, true, false, 2, 2).expect("a policy");
    let want: Vec<Vec<f32>> = ascend_moe::ranks::run_ranks(2, &ascend_moe::CommOptions::from_env(), |r, comm| {
        let x = Tensor::from_slice(&rank_rows(4, r, len / 4), &[len / 4, 4])?;
        p.reduce_shared(x, CommType::AllGather, &comm)?.to_vec()
    })
    .expect("the Rust point runs");
    // Both reducing points are a TP all-reduce (sum) over the 2 ranks.
    let spec = rank_sum(2, |q| rank_rows(4, q, len / 4));
    on_ranks("borrow-points", 2, |r, c| {
        let mine = rank_rows(4, r, len / 4);
        let shape = [len / 4, 4];
        for point in 0..3 {
            let mut x = mine.clone();
            let mut out = vec![f32::NAN; len];
            let (xd, od) = (desc(x.as_mut_ptr(), &shape), desc(out.as_mut_ptr(), &shape));
            // SAFETY: valid policy; live comm; descriptors over live buffers.
            let st = unsafe {
                match point {
                    0 => amoe_reduce_routed_early(&policy, &xd, 0, c, &od, null()),
                    1 => amoe_reduce_shared(&policy, &xd, 0, c, &od, null()),
                    _ => amoe_reduce_final(&policy, &xd, 0, c, &od, null()),
                }
            };
            assert_eq!(st, amoe_status::Ok, "point {point} rank {r}");
            if point < 2 {
                assert!(out.iter().zip(&want[r]).all(|(a, b)| a.to_bits() == b.to_bits()), "point {point} rank {r}");
                assert_eq!(out, spec, "point {point} rank {r}: SPEC's value");
            } else {
                // The late point does not reduce under this early policy: a copy of `x`.
                assert_eq!(out, mine, "point {point} rank {r}");
            }
            assert_eq!(x, mine, "point {point} rank {r}: x is never written");
        }
    });
}
