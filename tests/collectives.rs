//! Every collective x dtype x world size {1, 2, 3, 4, 8} x counts {0, 1, odd, large}
//! x op, in place and out of place, against a naive reference, on every
//! backend (`backend_test!`; 8 ranks on the CPU only); plus the
//! communicator's failure modes (mismatch, missing rank, dead peer, bad input);
//! and (`every_backend`) the same collectives through `Comm` on the CPU and
//! HCCL communicators alike, with HCCL's own failure modes (NPU cases are
//! ignored without an NPU; `ci/sim.sh` runs them on the simulated runtime).

mod common;

use std::time::{Duration, Instant};

use ascend_moe::backend::cpu::CpuComm;
use ascend_moe::backend::cpu::{segment_path, CpuCommConfig, MAX_WORLD};
use ascend_moe::half::bf16;
use ascend_moe::ranks::{run_ranks, run_ranks_with};
use ascend_moe::testing::within_rounding;
use ascend_moe::{with_reducible_dtype, Collectives, Comm, CommErrorKind, CommOptions, DType, Error, ReduceOp, Tensor};
use common::*;

/// Multi-round staging even for small tests: 4 KiB per slot.
const SMALL: CpuCommConfig = CpuCommConfig { staging_bytes: 4096 };
/// Larger than one 4 KiB staging slot for every dtype and world size.
const LARGE: usize = 2500;
const COUNTS: [usize; 4] = [0, 1, 37, LARGE];

fn opts(secs: f64) -> CommOptions {
    CommOptions::with_timeout(Duration::from_secs_f64(secs))
}

fn t<T: TestElem>(v: &[T]) -> Tensor {
    Tensor::from_slice(v, &[v.len()]).expect("tensor")
}

fn check<T: TestElem>(fails: &mut Vec<String>, what: String, got: &Tensor, want: &[T]) {
    match got.to_vec::<T>() {
        Ok(g) => {
            if let Err(e) = same_bits(&g, want) {
                fails.push(format!("{what}: {e}"));
            }
        }
        Err(e) => fails.push(format!("{what}: {e}")),
    }
}

/// How `all_cases` checks a float sum: bit for bit against the rank-order
/// reference (the CPU communicator; any sum of at most two ranks), or within
/// rounding of the f64 sum (HCCL over more ranks: it promises no order).
#[derive(Clone, Copy)]
enum Sums {
    RankOrder,
    AnyOrder,
}

/// `got` of a reduction `op` of the ranks' data `(seed, rank, len)` taken
/// from element `from`: bit for bit against `want`, except a float sum under
/// `Sums::AnyOrder`, which must lie within rounding of the f64 sum.
fn check_reduction<T: TestElem>(
    fails: &mut Vec<String>,
    what: String,
    got: &Tensor,
    want: &[T],
    (op, sums): (ReduceOp, Sums),
    (seed, world, len): (u64, usize, usize),
    from: usize,
) {
    let float = matches!(T::DTYPE, DType::F32 | DType::F16 | DType::BF16);
    if !(float && op == ReduceOp::Sum && matches!(sums, Sums::AnyOrder)) {
        return check(fails, what, got, want);
    }
    let all: Vec<Vec<f64>> = (0..world).map(|r| data::<T>(seed, r, len).iter().map(|x| x.to_f64()).collect()).collect();
    let range = from..from + want.len();
    let exact: Vec<f64> = range.clone().map(|i| all.iter().map(|d| d[i]).sum()).collect();
    let mag: Vec<f64> = range.map(|i| all.iter().map(|d| d[i].abs()).sum()).collect();
    match got.to_vec::<T>() {
        Ok(g) => {
            let g: Vec<f64> = g.iter().map(|x| x.to_f64()).collect();
            if let Err(e) = within_rounding(&what, T::DTYPE, &g, &exact, &mag) {
                fails.push(e);
            }
        }
        Err(e) => fails.push(format!("{what}: {e}")),
    }
}

fn prefix(c: &[usize]) -> Vec<usize> {
    c.iter()
        .scan(0, |a, &x| {
            let d = *a;
            *a += x;
            Some(d)
        })
        .collect()
}

/// Runs every collective for element type `T` on one rank; returns failures.
fn all_cases<T: TestElem>(comm: &Comm, seed0: u64) -> ascend_moe::Result<Vec<String>> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let dt = T::DTYPE;
    let dev = comm.device();
    let up = |v: &[T]| t(v).to_device(&dev);
    let zeros = |n: usize| Tensor::zeros(&[n], dt, &dev);
    let sums = if matches!(comm, Comm::Cpu(_)) || world <= 2 { Sums::RankOrder } else { Sums::AnyOrder };
    let mut fails = Vec::new();
    for (ci, &n) in COUNTS.iter().enumerate() {
        let seed = seed0 ^ (ci as u64 * 1000);
        for (oi, op) in ReduceOp::ALL.into_iter().enumerate() {
            let s = seed + oi as u64;
            // all_reduce, out of place.
            let src = up(&data::<T>(s, rank, n))?;
            let mut dst = zeros(n)?;
            comm.all_reduce(&src, &mut dst, op)?;
            let want = reduced::<T>(s, world, n, op);
            let red = (op, sums);
            let what = format!("all_reduce {dt} n={n} {} w={world} r={rank}", op.name());
            check_reduction(&mut fails, what, &dst, &want, red, (s, world, n), 0);
            // all_reduce, in place.
            let mut buf = up(&data::<T>(s, rank, n))?;
            comm.all_reduce_in_place(&mut buf, op)?;
            let what = format!("all_reduce_in_place {dt} n={n} {} w={world} r={rank}", op.name());
            check_reduction(&mut fails, what, &buf, &want, red, (s, world, n), 0);
            // reduce_scatter: n elements per rank.
            let src = up(&data::<T>(s + 7, rank, n * world))?;
            let mut dst = zeros(n)?;
            comm.reduce_scatter(&src, &mut dst, op)?;
            let full = reduced::<T>(s + 7, world, n * world, op);
            check_reduction(
                &mut fails,
                format!("reduce_scatter {dt} n={n} {} w={world} r={rank}", op.name()),
                &dst,
                &full[rank * n..(rank + 1) * n],
                red,
                (s + 7, world, n * world),
                rank * n,
            );
            // reduce_scatter_v.
            let counts = v_counts(world, n);
            let total: usize = counts.iter().sum();
            let d = prefix(&counts);
            let src = up(&data::<T>(s + 9, rank, total))?;
            let mut dst = zeros(counts[rank])?;
            // HCCL's ReduceScatterV has no int64 (Atlas A2): the NPU refuses it by name; int64 sums are CPU-only.
            if dt == DType::I64 && matches!(comm, Comm::Npu(_)) {
                let e =
                    comm.reduce_scatter_v(&src, &mut dst, &counts, op).expect_err("HCCL has no int64 ReduceScatterV");
                assert!(e.to_string().contains("HcclReduceScatterV"), "{e}");
                continue;
            }
            comm.reduce_scatter_v(&src, &mut dst, &counts, op)?;
            let full = reduced::<T>(s + 9, world, total, op);
            check_reduction(
                &mut fails,
                format!("reduce_scatter_v {dt} counts={counts:?} {} w={world} r={rank}", op.name()),
                &dst,
                &full[d[rank]..d[rank] + counts[rank]],
                red,
                (s + 9, world, total),
                d[rank],
            );
        }
        // all_gather.
        let src = up(&data::<T>(seed + 11, rank, n))?;
        let mut dst = zeros(world * n)?;
        comm.all_gather(&src, &mut dst)?;
        let want: Vec<T> = (0..world).flat_map(|j| data::<T>(seed + 11, j, n)).collect();
        check(&mut fails, format!("all_gather {dt} n={n} w={world} r={rank}"), &dst, &want);
        // all_gather_v.
        let counts = v_counts(world, n);
        let src = up(&data::<T>(seed + 13, rank, counts[rank]))?;
        let mut dst = zeros(counts.iter().sum())?;
        comm.all_gather_v(&src, &mut dst, &counts)?;
        let want: Vec<T> = (0..world).flat_map(|j| data::<T>(seed + 13, j, counts[j])).collect();
        check(&mut fails, format!("all_gather_v {dt} counts={counts:?} w={world} r={rank}"), &dst, &want);
        // all_to_all_v.
        let m = a2a_matrix(world, n);
        let send = m[rank].clone();
        let recv: Vec<usize> = (0..world).map(|i| m[i][rank]).collect();
        let src = up(&data::<T>(seed + 17, rank, send.iter().sum()))?;
        let mut dst = zeros(recv.iter().sum())?;
        comm.all_to_all_v(&src, &send, &mut dst, &recv)?;
        let want: Vec<T> = (0..world)
            .flat_map(|i| {
                let from = data::<T>(seed + 17, i, m[i].iter().sum());
                let off = prefix(&m[i])[rank];
                from[off..off + m[i][rank]].to_vec()
            })
            .collect();
        check(&mut fails, format!("all_to_all_v {dt} matrix={m:?} w={world} r={rank}"), &dst, &want);
        // broadcast from a rank that depends on the case.
        let root = (n + ci) % world;
        let mut buf = up(&data::<T>(seed + 19, rank, n))?;
        comm.broadcast(&mut buf, root)?;
        check(
            &mut fails,
            format!("broadcast {dt} n={n} root={root} w={world} r={rank}"),
            &buf,
            &data::<T>(seed + 19, root, n),
        );
        comm.barrier()?;
    }
    Ok(fails)
}

/// A rank whose operand cannot be lent to the communicator (a tensor on
/// another device: the Tensor layer then calls `Communicator::refuse`) still
/// joins the collective, so the peer fails with that rank's reason rather than
/// waiting for it until the timeout.
#[test]
fn a_refused_collective_fails_the_peers_with_its_reason() {
    use ascend_moe::backend::{Call, Communicator};
    const WHY: &str = "operand on npu:3";
    let counts = [2usize, 2];
    #[rustfmt::skip]
    let calls: [(Call<'_>, usize, usize); 8] = [
        (Call::AllReduce(ReduceOp::Sum), 4, 4),
        (Call::AllReduceInPlace(ReduceOp::Sum), 4, 4),
        (Call::ReduceScatter(ReduceOp::Sum), 8, 4),
        (Call::AllGather, 4, 8),
        (Call::ReduceScatterV(&counts, ReduceOp::Sum), 4, 2),
        (Call::AllGatherV(&counts), 2, 4),
        (Call::AllToAllV(&counts, &counts), 4, 4),
        (Call::Broadcast(1), 4, 4),
    ];
    for (call, src_len, dst_len) in calls {
        let errors = run_ranks(2, &opts(10.0), |rank, comm| {
            let Comm::Cpu(cpu) = &comm else { unreachable!("run_ranks makes CPU communicators") };
            if rank == 0 {
                return Ok(cpu.refuse(call, ascend_moe::DType::F32, Error::invalid("test", "src", WHY)));
            }
            let src = Tensor::from_slice(&vec![1.0f32; src_len], &[src_len])?;
            let mut dst = Tensor::zeros_cpu(&[dst_len], ascend_moe::DType::F32);
            let r = match call {
                Call::AllReduce(op) => comm.all_reduce(&src, &mut dst, op),
                Call::AllReduceInPlace(op) => comm.all_reduce_in_place(&mut dst, op),
                Call::ReduceScatter(op) => comm.reduce_scatter(&src, &mut dst, op),
                Call::AllGather => comm.all_gather(&src, &mut dst),
                Call::ReduceScatterV(c, op) => comm.reduce_scatter_v(&src, &mut dst, c, op),
                Call::AllGatherV(c) => comm.all_gather_v(&src, &mut dst, c),
                Call::AllToAllV(s, r) => comm.all_to_all_v(&src, s, &mut dst, r),
                Call::Broadcast(root) => comm.broadcast(&mut dst, root),
            };
            Ok(r.expect_err("the peer refused the call"))
        })
        .unwrap();
        assert!(errors[0].to_string().contains(WHY), "{call:?} rank 0: {}", errors[0]);
        let peer = &errors[1];
        assert!(
            matches!(peer, Error::Comm { kind: CommErrorKind::Mismatch, .. }) && peer.to_string().contains(WHY),
            "{call:?}: the peer should fail with rank 0's reason, got {peer:?}"
        );
    }
}

/// Every collective of every reducible dtype on `world` ranks of `on`'s
/// backend (the CPU communicator with multi-round staging).
fn matrix(on: On, world: usize) {
    let body = |_rank: usize, comm: Comm| {
        let mut fails = Vec::new();
        for (i, dtype) in REDUCIBLE_DTYPES.into_iter().enumerate() {
            fails.extend(
                with_reducible_dtype!(dtype, T => all_cases::<T>(&comm, 0x5eed + i as u64 * 0x10000)?, else Vec::new()),
            );
        }
        Ok(fails)
    };
    let fails = match on {
        On::Cpu => run_ranks_with(world, &opts(30.0), &SMALL, body),
        On::Npu => on.run(world, &opts(30.0), body),
    }
    .expect("no collective may fail");
    let fails: Vec<String> = fails.into_iter().flatten().collect();
    assert!(fails.is_empty(), "{} wrong results, first: {:#?}", fails.len(), &fails[..fails.len().min(10)]);
}

backend_test!(matrix_world_1, |on: On| matrix(on, 1));
backend_test!(matrix_world_2, |on: On| matrix(on, 2));
backend_test!(matrix_world_3, |on: On| matrix(on, 3));
backend_test!(matrix_world_4, |on: On| matrix(on, 4));

// CPU only: 8 ranks, and the NPU suite runs on 4 devices.
#[test]
fn matrix_world_8() {
    matrix(On::Cpu, 8);
}

/// Multi-round with the default staging (4 MiB slots) and the slice API.
#[test]
fn default_staging_multi_round_and_slice_api() {
    let n = 1_100_001; // > 4 MiB of f32, odd
    let res = run_ranks(3, &opts(30.0), |rank, comm| {
        let Comm::Cpu(c) = &comm else { unreachable!("run_ranks makes CPU comms") };
        let mut got = data::<f32>(3, rank, n);
        c.all_reduce_slice_in_place(&mut got, ReduceOp::Sum)?;
        let mut gathered = vec![0i64; 3 * 1001];
        c.all_gather_slice(&data::<i64>(4, rank, 1001), &mut gathered)?;
        Ok((got, gathered))
    })
    .expect("collectives");
    let want = reduced::<f32>(3, 3, n, ReduceOp::Sum);
    let want_g: Vec<i64> = (0..3).flat_map(|j| data::<i64>(4, j, 1001)).collect();
    for (r, (got, g)) in res.iter().enumerate() {
        same_bits(got, &want).unwrap_or_else(|e| panic!("rank {r} all_reduce: {e}"));
        same_bits(g, &want_g).unwrap_or_else(|e| panic!("rank {r} all_gather: {e}"));
    }
}

/// bf16 all_reduce: identical bits on every rank and across two runs (and equal
/// to the rank-order f32 reference).
#[test]
fn bf16_all_reduce_bitwise_identical() {
    let n = 10_007;
    let run = || {
        run_ranks(4, &opts(30.0), |rank, comm| {
            let mut buf = t(&data::<bf16>(42, rank, n));
            comm.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
            buf.to_vec::<bf16>()
        })
        .expect("all_reduce")
    };
    let (a, b) = (run(), run());
    let want = reduced::<bf16>(42, 4, n, ReduceOp::Sum);
    for r in 0..4 {
        same_bits(&a[r], &a[0]).unwrap_or_else(|e| panic!("rank {r} vs rank 0: {e}"));
        same_bits(&b[r], &a[0]).unwrap_or_else(|e| panic!("run 2 rank {r} vs run 1: {e}"));
    }
    same_bits(&a[0], &want).expect("rank-order f32 accumulation");
}

/// Sub-groups: TP / DP / EP groups of a 2 x 2 world reduce over the right ranks.
#[test]
fn split_groups_reduce_over_members() {
    let res = run_ranks(4, &opts(30.0), |rank, comm| {
        let g = ascend_moe::comm::ParallelGroups::new(&comm, 2, 2)?;
        let mut out = Vec::new();
        for c in [&g.tp, &g.dp, &g.ep] {
            let mut buf = t(&[rank as i64 + 1]);
            c.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
            out.push((c.rank(), c.world_size(), buf.to_vec::<i64>()?[0]));
        }
        Ok(out)
    })
    .expect("groups");
    for (rank, out) in res.iter().enumerate() {
        let (dp, tp) = (rank / 2, rank % 2);
        // TP members: dp*2 + {0,1}; DP members: tp + {0,2}; EP: everyone.
        let tp_sum = (dp * 2 + 1) as i64 + (dp * 2 + 2) as i64;
        let dp_sum = (tp + 1) as i64 + (tp + 3) as i64;
        assert_eq!(out[0], (tp, 2, tp_sum), "rank {rank} tp");
        assert_eq!(out[1], (dp, 2, dp_sum), "rank {rank} dp");
        assert_eq!(out[2], (dp * 2 + tp, 4, 10), "rank {rank} ep");
    }
}

fn comm_kind(e: &Error) -> Option<CommErrorKind> {
    match e {
        Error::Comm { kind, .. } => Some(*kind),
        _ => None,
    }
}

/// Runs `f` on `world` threads with their own rendezvous (so a rank may do
/// something different, including panicking); returns each rank's outcome.
fn threads<F>(name: &str, world: usize, o: &CommOptions, f: F) -> Vec<Result<(), String>>
where
    F: Fn(usize, CpuComm) -> ascend_moe::Result<()> + Sync,
{
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let f = &f;
                s.spawn(move || {
                    let c = CpuComm::rendezvous(name, world, r, o).map_err(|e| e.to_string())?;
                    f(r, c).map_err(|e| format!("{e:?} / {e}"))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("panicked".into()))).collect()
    })
}

fn unique(tag: &str) -> String {
    format!("test-{tag}-{}-{:?}", std::process::id(), std::thread::current().id())
}

#[test]
fn count_mismatch_fails_every_rank_naming_ranks_and_sizes() {
    let name = unique("mismatch");
    let out = threads(&name, 4, &opts(10.0), |r, c| {
        let n = if r == 2 { 10 } else { 12 };
        let mut buf = Tensor::zeros_cpu(&[n], ascend_moe::DType::F32);
        let e = c.all_reduce_in_place(&mut buf, ReduceOp::Sum).expect_err("must fail");
        assert_eq!(comm_kind(&e), Some(CommErrorKind::Mismatch), "{e}");
        let s = e.to_string();
        for needle in ["all_reduce", name.as_str(), "ranks [2]", "count 10", "count 12", "[0, 1, 3]"] {
            assert!(s.contains(needle), "rank {r}: {s:?} lacks {needle:?}");
        }
        // The group is still usable after a mismatch.
        let mut ok = Tensor::zeros_cpu(&[3], ascend_moe::DType::F32);
        c.all_reduce_in_place(&mut ok, ReduceOp::Sum)
    });
    assert!(out.iter().all(|o| o.is_ok()), "{out:?}");
}

#[test]
fn dtype_and_kind_mismatch_fail_every_rank() {
    let name = unique("dtype");
    let out = threads(&name, 3, &opts(10.0), |r, c| {
        let dt = if r == 1 { ascend_moe::DType::F16 } else { ascend_moe::DType::BF16 };
        let mut buf = Tensor::zeros_cpu(&[8], dt);
        let e = c.all_reduce_in_place(&mut buf, ReduceOp::Max).expect_err("dtype mismatch");
        let s = e.to_string();
        assert_eq!(comm_kind(&e), Some(CommErrorKind::Mismatch), "{s}");
        assert!(s.contains("dtype f16") && s.contains("dtype bf16") && s.contains("ranks [1]"), "{s}");
        // Different collectives: rank 0 gathers, the others barrier.
        let e = if r == 0 {
            let src = Tensor::zeros_cpu(&[2], ascend_moe::DType::I32);
            let mut dst = Tensor::zeros_cpu(&[6], ascend_moe::DType::I32);
            c.all_gather(&src, &mut dst).expect_err("kind mismatch")
        } else {
            c.barrier().expect_err("kind mismatch")
        };
        let s = e.to_string();
        assert!(s.contains("all_gather dtype i32 count 2") && s.contains("barrier"), "{s}");
        Ok(())
    });
    assert!(out.iter().all(|o| o.is_ok()), "{out:?}");
}

#[test]
fn all_to_all_count_disagreement_names_the_pair() {
    let name = unique("a2a");
    let out = threads(&name, 2, &opts(10.0), |r, c| {
        let send = if r == 0 { vec![1, 5] } else { vec![2, 2] };
        // Rank 1 expects 2 elements from rank 0, which sends 5.
        let recv = if r == 0 { vec![1, 2] } else { vec![2, 2] };
        let src = Tensor::zeros_cpu(&[send.iter().sum()], ascend_moe::DType::I64);
        let mut dst = Tensor::zeros_cpu(&[recv.iter().sum()], ascend_moe::DType::I64);
        let e = c.all_to_all_v(&src, &send, &mut dst, &recv).expect_err("mismatch");
        let s = e.to_string();
        assert!(s.contains("rank 0 sends 5 elements to rank 1, which expects 2"), "{s}");
        Ok(())
    });
    assert!(out.iter().all(|o| o.is_ok()), "{out:?}");
}

#[test]
fn buffer_too_small_fails_that_rank_locally_and_the_others_loudly() {
    let name = unique("small");
    let out = threads(&name, 3, &opts(10.0), |r, c| {
        let src = Tensor::zeros_cpu(&[3 * 4], ascend_moe::DType::F32);
        let mut dst = Tensor::zeros_cpu(&[if r == 1 { 11 } else { 12 }], ascend_moe::DType::F32);
        let e = c.all_gather(&Tensor::zeros_cpu(&[4], ascend_moe::DType::F32), &mut dst);
        let e = e.expect_err("too small on rank 1");
        let s = e.to_string();
        if r == 1 {
            assert!(matches!(e, Error::Shape { .. }), "{s}");
            assert!(s.contains("dst") && s.contains("[11]") && s.contains("12 elements"), "{s}");
        } else {
            assert_eq!(comm_kind(&e), Some(CommErrorKind::Mismatch), "{s}");
            assert!(s.contains("ranks [1] passed invalid arguments") && s.contains("12 elements"), "{s}");
        }
        // reduce_scatter with a src of the wrong size on every rank.
        let mut d = Tensor::zeros_cpu(&[5], ascend_moe::DType::F32);
        let e = c.reduce_scatter(&src, &mut d, ReduceOp::Sum).expect_err("src too small");
        assert!(e.to_string().contains("15 elements"), "{e}");
        Ok(())
    });
    assert!(out.iter().all(|o| o.is_ok()), "{out:?}");
}

#[test]
fn missing_rank_times_out_at_join_and_in_a_collective() {
    // Rank 2 never joins.
    let name = unique("nojoin");
    let o = opts(1.0);
    let start = Instant::now();
    let out: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let (name, o) = (&name, &o);
                s.spawn(move || CpuComm::rendezvous(name, 3, r, o).expect_err("rank 2 is missing").to_string())
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("no panic")).collect()
    });
    assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
    for s in &out {
        // The first rank to give up may make the other fail as a peer.
        assert!(s.contains("waiting for ranks [2] to join") || s.contains("aborted"), "{s}");
    }
    assert!(out.iter().any(|s| s.contains("timed out") && s.contains("ranks [2]")), "{out:?}");

    // Everyone joins; rank 1 stays alive but never calls the collective.
    let name = unique("nocall");
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let rx = std::sync::Mutex::new(rx);
    let start = Instant::now();
    let out = threads(&name, 3, &o, |r, c| {
        if r == 1 {
            // Wait (without a timer) until both peers have failed.
            let rx = rx.lock().expect("lock");
            rx.recv().expect("peer");
            rx.recv().expect("peer");
            return Ok(());
        }
        let e = c.barrier().expect_err("rank 1 never arrives");
        let _ = tx.send(());
        let s = e.to_string();
        assert!(matches!(comm_kind(&e), Some(CommErrorKind::Timeout | CommErrorKind::PeerFailed)), "{s}");
        assert!(s.contains("ranks [1]") || s.contains("rank 0 aborted") || s.contains("rank 2 aborted"), "{s}");
        // Broken for good: the same error again, at once.
        let again = c.barrier().expect_err("still broken");
        assert_eq!(again.to_string(), s);
        Ok(())
    });
    assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
    assert!(out.iter().all(|o| o.is_ok()), "{out:?}");
}

#[test]
fn panicking_or_departing_peer_fails_the_others_fast() {
    for panics in [true, false] {
        let name = unique(if panics { "panic" } else { "leave" });
        // A long timeout: failing with PeerFailed (not Timeout) proves the fast path.
        let o = opts(60.0);
        let start = Instant::now();
        let out = threads(&name, 4, &o, |r, c| {
            c.barrier()?;
            if r == 3 {
                if panics {
                    panic!("rank 3 fails on purpose");
                }
                drop(c);
                return Ok(());
            }
            let mut buf = Tensor::zeros_cpu(&[100], ascend_moe::DType::F32);
            let e = c.all_reduce_in_place(&mut buf, ReduceOp::Sum).expect_err("peer is gone");
            assert_eq!(comm_kind(&e), Some(CommErrorKind::PeerFailed), "{e}");
            let s = e.to_string();
            let cause = if panics { "aborted" } else { "left the group" };
            assert!(s.contains(cause), "{s}");
            Ok(())
        });
        assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
        assert_eq!(out[3].is_err(), panics, "{out:?}");
        assert!(out[..3].iter().all(|o| o.is_ok()), "{out:?}");
    }
}

#[test]
fn bad_setup_arguments_say_which() {
    let o = opts(2.0);
    let e = CpuComm::rendezvous("x", 0, 0, &o).expect_err("world 0").to_string();
    assert!(e.contains("world size 0"), "{e}");
    let e = CpuComm::rendezvous("x", 4, 4, &o).expect_err("rank 4 of 4").to_string();
    assert!(e.contains("rank 4 is out of range for world size 4"), "{e}");
    let e = run_ranks(0, &o, |_, _| Ok(())).expect_err("world 0").to_string();
    assert!(e.contains("world size 0"), "{e}");
    // Over the limit: refused by run_ranks itself before any rank starts (a
    // very large world used to fail starting its threads before any rank's
    // rendezvous could refuse it).
    let started = std::sync::atomic::AtomicUsize::new(0);
    let e = run_ranks(MAX_WORLD + 1, &o, |_, _| {
        started.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    })
    .expect_err("one rank over the limit")
    .to_string();
    let want = format!(
        "run_ranks: invalid argument `world`: world size {} exceeds the CPU communicator's limit of {MAX_WORLD} ranks",
        MAX_WORLD + 1
    );
    assert_eq!(e, want);
    assert_eq!(started.load(std::sync::atomic::Ordering::Relaxed), 0);

    // Split: duplicates, out of range, caller not a member.
    let res = run_ranks(3, &o, |rank, comm| {
        let dup = comm.split(&[0, 2, 2]).expect_err("duplicate").to_string();
        let oor = comm.split(&[0, 5]).expect_err("out of range").to_string();
        let not = if rank == 1 { comm.split(&[0, 2]).expect_err("not member").to_string() } else { String::new() };
        Ok((dup, oor, not))
    })
    .expect("run");
    for (r, (dup, oor, not)) in res.iter().enumerate() {
        assert!(dup.contains("rank 2 appears more than once in [0, 2, 2]"), "{dup}");
        assert!(oor.contains("rank 5 in [0, 5] is out of range for world size 3"), "{oor}");
        assert!(r != 1 || not.contains("rank 1 is not in [0, 2]"), "{not}");
    }
}

#[test]
fn name_of_a_live_world_of_another_size_is_refused_and_duplicate_rank_too() {
    let name = unique("live");
    let o = opts(5.0);
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let rx = std::sync::Mutex::new(rx);
    let out = threads(&name, 2, &o, |r, c| {
        if r == 0 {
            let e = CpuComm::rendezvous(&name, 3, 0, &o).expect_err("size 3 under a live size-2 name").to_string();
            assert!(e.contains("live world of size 2") && e.contains("asked for size 3"), "{e}");
            let e = CpuComm::rendezvous(&name, 2, 1, &o).expect_err("rank 1 taken").to_string();
            assert!(e.contains("rank 1 is already joined by this process") && e.contains("duplicate rank"), "{e}");
            assert!(e.contains("close or drop it before joining again"), "{e}");
            tx.send(()).expect("send");
        } else {
            rx.lock().expect("lock").recv().expect("recv");
        }
        c.barrier()
    });
    assert!(out.iter().all(|o| o.is_ok()), "{out:?}");
}

#[test]
fn segments_are_removed_on_teardown() {
    let name = unique("teardown");
    let path = segment_path(&name);
    let out = threads(&name, 3, &opts(10.0), |_, c| {
        // Unlinked as soon as every rank attached: the memory goes with the
        // last mapping, whatever happens to the ranks.
        assert!(!std::path::Path::new(c.segment_path()).exists(), "{} still linked", c.segment_path());
        let mut b = Tensor::zeros_cpu(&[4], ascend_moe::DType::I32);
        c.all_reduce_in_place(&mut b, ReduceOp::Sum)?;
        // A sub-group's segment goes too.
        let sub = c.split(&[0, 1, 2])?;
        sub.barrier()
    });
    assert!(out.iter().all(|o| o.is_ok()), "{out:?}");
    assert!(!std::path::Path::new(&path).exists(), "{path} left behind");
    let leftovers: Vec<_> = std::fs::read_dir(ascend_moe::backend::cpu::shm_dir())
        .expect("shm dir")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|f| f.contains(&name.replace(|c: char| !c.is_ascii_alphanumeric() && c != '-', "")[..20]))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn overflowing_v_counts_are_invalid_arguments_on_that_rank_and_a_mismatch_elsewhere() {
    let name = unique("vsum");
    let out = threads(&name, 2, &opts(10.0), |r, c| {
        let mut rng = common_rng(11);
        for i in 0..12 {
            let bad_rank = (rng() % 2) as usize;
            // Two counts whose sum passes usize::MAX, in random order.
            let huge = usize::MAX - (rng() % 1000) as usize;
            let mut bad = vec![huge, 1000 + (rng() % 1000) as usize];
            if rng() % 2 == 1 {
                bad.reverse();
            }
            let good = vec![1usize, 1];
            let counts = if r == bad_rank { bad.clone() } else { good.clone() };
            let src = Tensor::zeros_cpu(&[2], ascend_moe::DType::F32);
            let mut dst = Tensor::zeros_cpu(&[1], ascend_moe::DType::F32);
            let (e, arg) = match i % 3 {
                0 => (c.reduce_scatter_v(&src, &mut dst, &counts, ReduceOp::Sum), "counts"),
                1 => (
                    c.all_gather_v(
                        &Tensor::zeros_cpu(&[1], ascend_moe::DType::F32),
                        &mut Tensor::zeros_cpu(&[2], ascend_moe::DType::F32),
                        &counts,
                    ),
                    "counts",
                ),
                _ => {
                    let (send, recv) = if i % 2 == 0 { (&counts, &good) } else { (&good, &counts) };
                    let mut dst = Tensor::zeros_cpu(&[2], ascend_moe::DType::F32);
                    let arg = if i % 2 == 0 { "send_counts" } else { "recv_counts" };
                    (c.all_to_all_v(&src, send, &mut dst, recv), arg)
                }
            };
            let e = e.expect_err("overflowing counts");
            let s = e.to_string();
            if r == bad_rank {
                assert!(matches!(e, Error::InvalidArgument { .. }), "case {i}: {s}");
                assert!(s.contains(arg) && s.contains(&huge.to_string()), "case {i}: {s}");
            } else {
                assert_eq!(comm_kind(&e), Some(CommErrorKind::Mismatch), "case {i}: {s}");
                assert!(s.contains(&format!("ranks [{bad_rank}] passed invalid arguments")), "case {i}: {s}");
            }
        }
        // The group is still usable.
        let mut ok = Tensor::zeros_cpu(&[3], ascend_moe::DType::F32);
        c.all_reduce_in_place(&mut ok, ReduceOp::Sum)
    });
    assert!(out.iter().all(|o| o.is_ok()), "{out:?}");
}

/// Seeded values from the shared test mixer.
fn common_rng(seed: u64) -> impl FnMut() -> u64 {
    let mut k = seed << 32;
    move || {
        k += 1;
        mix(k)
    }
}

#[test]
fn split_with_different_rank_lists_is_a_mismatch_naming_both_lists() {
    // Different members, and the same members in another order. Rank 2
    // keeps its communicator until both others returned: a member that left
    // fails a split it is listed in as gone (PeerFailed) when that split
    // looks before the other lists were posted.
    for lists in [[vec![0, 1], vec![0, 1, 2], vec![]], [vec![1, 0], vec![0, 1], vec![]]] {
        let name = unique("splitmismatch");
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let done_rx = std::sync::Mutex::new(done_rx);
        let out = threads(&name, 3, &opts(10.0), |r, c| {
            if lists[r].is_empty() {
                let rx = done_rx.lock().expect("lock");
                for _ in 0..2 {
                    rx.recv_timeout(Duration::from_secs(30)).expect("ranks 0 and 1 return from their splits");
                }
                return Ok(());
            }
            let res = c.split(&lists[r]);
            done_tx.send(()).expect("rank 2 waits");
            let e = res.expect_err("lists differ");
            let s = e.to_string();
            assert_eq!(comm_kind(&e), Some(CommErrorKind::Mismatch), "rank {r}: {s}");
            for l in &lists[..2] {
                assert!(s.contains(&format!("{l:?}")), "rank {r}: {s} lacks {l:?}");
            }
            Ok(())
        });
        assert!(out.iter().all(|o| o.is_ok()), "{lists:?}: {out:?}");
    }
    // A member that never calls split but keeps its communicator is still a
    // timeout; one that dropped it never splits, and fails the split at once.
    let (failed_tx, failed_rx) = std::sync::mpsc::channel::<()>();
    let failed_rx = std::sync::Mutex::new(failed_rx);
    let name = unique("splitmissing");
    let out = threads(&name, 2, &opts(2.0), |r, c| {
        if r == 1 {
            failed_rx.lock().expect("lock").recv().expect("rank 0");
            return Ok(());
        }
        let e = c.split(&[0, 1]).expect_err("rank 1 never splits");
        failed_tx.send(()).expect("rank 1");
        assert_eq!(comm_kind(&e), Some(CommErrorKind::Timeout), "{e}");
        Ok(())
    });
    assert!(out.iter().all(|o| o.is_ok()), "{out:?}");
    let name = unique("splitleft");
    let out = threads(&name, 2, &opts(30.0), |r, c| {
        if r == 1 {
            return Ok(());
        }
        let e = c.split(&[0, 1]).expect_err("rank 1 left");
        assert_eq!(comm_kind(&e), Some(CommErrorKind::PeerFailed), "{e}");
        assert!(e.to_string().contains("rank 1 left the group"), "{e}");
        Ok(())
    });
    assert!(out.iter().all(|o| o.is_ok()), "{out:?}");
}

#[test]
fn ranks_that_disagree_on_the_context_tag_all_fail_naming_who_chose_what() {
    let name = unique("ctxtag");
    let out = threads(&name, 4, &opts(10.0), |r, c| {
        c.set_context_tag(Some((r / 2) as u64));
        let mut b = Tensor::zeros_cpu(&[4], ascend_moe::DType::BF16);
        let e = c.all_reduce_in_place(&mut b, ReduceOp::Sum).expect_err("the tags differ");
        let s = e.to_string();
        assert_eq!(comm_kind(&e), Some(CommErrorKind::Mismatch), "rank {r}: {s}");
        assert!(s.contains("ranks [0, 1] chose 0, ranks [2, 3] chose 1"), "rank {r}: {s}");
        // Agreeing again, the group works.
        c.set_context_tag(Some(3));
        assert_eq!(c.context_tag(), Some(3));
        c.barrier()
    });
    assert!(out.iter().all(|o| o.is_ok()), "{out:?}");
}

/// The collectives of SPEC section 8 through the `Comm` API, one body per
/// test for both communicators (`backend_test!`: a `cpu` case over the
/// shared-memory communicator, an `npu` case over HCCL on 4 NPUs), then what
/// only HCCL has: root info, the stream check, HCCL's split rules.
mod every_backend {
    use crate::backend_test;
    use ascend_moe::backend::npu::{HcclRootInfo, NpuDevice};
    use ascend_moe::half::{bf16, f16};
    use ascend_moe::ranks::npu_run_ranks;
    use ascend_moe::testing::runtime::in_child_that_may_leak;
    use ascend_moe::{Collectives, Comm, CommOptions, DType, Device, Element, ReduceOp, Result, Tensor};

    const WORLD: usize = 4;

    /// Rank `r`'s value at position `i` (small integers: exact in every dtype).
    fn val(r: usize, i: usize) -> f64 {
        (((r * 31 + i * 7) % 17) as f64) - 8.0
    }

    fn tensor<T: Element>(dev: &Device, data: &[f64]) -> Result<Tensor> {
        let v: Vec<T> = data.iter().map(|&x| T::from_f32(x as f32)).collect();
        Tensor::from_slice(&v, &[v.len()])?.to_device(dev)
    }

    fn read(t: &Tensor) -> Result<Vec<f64>> {
        let host = t.to_cpu()?;
        Ok(match t.dtype() {
            DType::F32 => host.as_slice::<f32>()?.iter().map(|x| *x as f64).collect(),
            DType::F16 => host.as_slice::<f16>()?.iter().map(|x| x.to_f64()).collect(),
            DType::BF16 => host.as_slice::<bf16>()?.iter().map(|x| x.to_f64()).collect(),
            DType::I32 => host.as_slice::<i32>()?.iter().map(|x| *x as f64).collect(),
            DType::I64 => host.as_slice::<i64>()?.iter().map(|x| *x as f64).collect(),
            other => ascend_moe::with_dtype!(other, T => host.as_slice::<T>()?.iter().map(|x| x.to_f64()).collect()),
        })
    }

    fn reduce(op: ReduceOp, xs: impl Iterator<Item = f64>) -> f64 {
        let v: Vec<f64> = xs.collect();
        match op {
            ReduceOp::Sum => v.iter().sum(),
            ReduceOp::Max => v.iter().cloned().fold(f64::MIN, f64::max),
            ReduceOp::Min => v.iter().cloned().fold(f64::MAX, f64::min),
        }
    }

    fn opts() -> CommOptions {
        CommOptions::from_env()
    }

    fn reductions_for<T: Element>(rank: usize, comm: &Comm) -> Result<()> {
        let dev = comm.device();
        let (w, n) = (comm.world_size(), 10);
        for op in ReduceOp::ALL {
            let mine: Vec<f64> = (0..n * w).map(|i| val(rank, i)).collect();
            let want: Vec<f64> = (0..n * w).map(|i| reduce(op, (0..w).map(|r| val(r, i)))).collect();
            let src = tensor::<T>(&dev, &mine)?;
            let mut dst = Tensor::zeros(&[n * w], T::DTYPE, &dev)?;
            comm.all_reduce(&src, &mut dst, op)?;
            assert_eq!(read(&dst)?, want, "all_reduce {op:?} {}", T::DTYPE);
            let mut inplace = tensor::<T>(&dev, &mine)?;
            comm.all_reduce_in_place(&mut inplace, op)?;
            assert_eq!(read(&inplace)?, want, "all_reduce_in_place {op:?}");
            let mut rs = Tensor::zeros(&[n], T::DTYPE, &dev)?;
            comm.reduce_scatter(&src, &mut rs, op)?;
            assert_eq!(read(&rs)?, want[rank * n..(rank + 1) * n].to_vec(), "reduce_scatter {op:?}");
        }
        Ok(())
    }

    backend_test!(reductions_in_every_dtype_and_op, ranks = WORLD, |rank, comm| {
        reductions_for::<f32>(rank, &comm)?;
        reductions_for::<f16>(rank, &comm)?;
        reductions_for::<bf16>(rank, &comm)?;
        reductions_for::<i32>(rank, &comm)?;
        reductions_for::<i64>(rank, &comm)
    });

    backend_test!(gathers_broadcast_barrier, ranks = WORLD, |rank, comm| {
        let dev = comm.device();
        let n = 6;
        let src = tensor::<bf16>(&dev, &(0..n).map(|i| val(rank, i)).collect::<Vec<_>>())?;
        let mut all = Tensor::zeros(&[n * WORLD], DType::BF16, &dev)?;
        comm.all_gather(&src, &mut all)?;
        let want: Vec<f64> = (0..WORLD).flat_map(|r| (0..n).map(move |i| val(r, i))).collect();
        assert_eq!(read(&all)?, want, "all_gather");
        for root in 0..WORLD {
            let mut buf = tensor::<f32>(&dev, &(0..n).map(|i| val(rank, i)).collect::<Vec<_>>())?;
            comm.broadcast(&mut buf, root)?;
            assert_eq!(read(&buf)?, (0..n).map(|i| val(root, i)).collect::<Vec<_>>(), "broadcast from {root}");
        }
        comm.barrier()
    });

    backend_test!(v_variants_with_uneven_and_zero_counts, ranks = WORLD, |rank, comm| {
        let counts = [3usize, 0, 5, 1];
        let total: usize = counts.iter().sum();
        let dev = comm.device();
        // all_gather_v
        let mine: Vec<f64> = (0..counts[rank]).map(|i| val(rank, i)).collect();
        let mut out = Tensor::zeros(&[total], DType::F32, &dev)?;
        comm.all_gather_v(&tensor::<f32>(&dev, &mine)?, &mut out, &counts)?;
        let want: Vec<f64> = (0..WORLD).flat_map(|r| (0..counts[r]).map(move |i| val(r, i))).collect();
        assert_eq!(read(&out)?, want, "all_gather_v");
        // reduce_scatter_v
        let src: Vec<f64> = (0..total).map(|i| val(rank, i)).collect();
        let mut dst = Tensor::zeros(&[counts[rank]], DType::F32, &dev)?;
        comm.reduce_scatter_v(&tensor::<f32>(&dev, &src)?, &mut dst, &counts, ReduceOp::Sum)?;
        let off: usize = counts[..rank].iter().sum();
        let want: Vec<f64> = (off..off + counts[rank]).map(|i| (0..WORLD).map(|r| val(r, i)).sum()).collect();
        assert_eq!(read(&dst)?, want, "reduce_scatter_v");
        // all_to_all_v: rank r sends (r + j) % 3 elements to rank j.
        let sc: Vec<usize> = (0..WORLD).map(|j| (rank + j) % 3).collect();
        let rc: Vec<usize> = (0..WORLD).map(|i| (i + rank) % 3).collect();
        let send: Vec<f64> =
            (0..WORLD).flat_map(|j| (0..sc[j]).map(move |e| (rank * 100 + j * 10 + e) as f64)).collect();
        let mut recv = Tensor::zeros(&[rc.iter().sum::<usize>()], DType::I32, &dev)?;
        comm.all_to_all_v(&tensor::<i32>(&dev, &send)?, &sc, &mut recv, &rc)?;
        let want: Vec<f64> =
            (0..WORLD).flat_map(|i| (0..rc[i]).map(move |e| (i * 100 + rank * 10 + e) as f64)).collect();
        assert_eq!(read(&recv)?, want, "all_to_all_v");
        Ok(())
    });

    backend_test!(dp2_tp2_and_ep4_sub_communicators, ranks = WORLD, |rank, world| {
        const TP: usize = 2;
        let (dp, tp) = (rank / TP, rank % TP);
        let tp_ranks: Vec<usize> = (0..TP).map(|t| dp * TP + t).collect();
        let dp_ranks: Vec<usize> = (0..WORLD / TP).map(|d| d * TP + tp).collect();
        let tp_group = world.split(&tp_ranks)?;
        let dp_group = world.split(&dp_ranks)?;
        let ep_group = world.split(&(0..WORLD).collect::<Vec<_>>())?;
        assert_eq!((tp_group.rank(), tp_group.world_size()), (tp, TP));
        assert_eq!((dp_group.rank(), dp_group.world_size()), (dp, WORLD / TP));
        assert_eq!((ep_group.rank(), ep_group.world_size()), (rank, WORLD));
        let dev = world.device();
        for (group, members) in [(&tp_group, &tp_ranks), (&dp_group, &dp_ranks), (&ep_group, &(0..WORLD).collect())] {
            let mut buf = tensor::<f32>(&dev, &(0..5).map(|i| val(rank, i)).collect::<Vec<_>>())?;
            group.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
            let want: Vec<f64> = (0..5).map(|i| members.iter().map(|&r| val(r, i)).sum()).collect();
            assert_eq!(read(&buf)?, want, "{} members {members:?}", group.name());
        }
        Ok(())
    });

    // A size or root every rank got wrong on its own is that rank's argument
    // error, the same on both communicators (never a disagreement: there is
    // none).
    backend_test!(
        a_ranks_own_bad_size_or_root_is_an_argument_error_on_both_communicators,
        ranks = WORLD,
        |_rank, world| {
            use ascend_moe::Error;
            let dev = world.device();
            let t = |n: usize| Tensor::zeros(&[n], DType::F32, &dev);
            let arg_of = |e: &Error| match e {
                Error::Shape { op, arg, .. } => format!("shape {op} {arg}"),
                Error::InvalidArgument { op, arg, .. } => format!("invalid {op} {arg}"),
                other => format!("other {other:?}"),
            };
            let cases: Vec<(&str, Error)> = vec![
                ("shape all_reduce dst", world.all_reduce(&t(4)?, &mut t(3)?, ReduceOp::Sum).unwrap_err()),
                ("shape reduce_scatter src", world.reduce_scatter(&t(8)?, &mut t(3)?, ReduceOp::Sum).unwrap_err()),
                ("shape all_gather dst", world.all_gather(&t(2)?, &mut t(7)?).unwrap_err()),
                ("invalid all_gather_v dst", world.all_gather_v(&t(1)?, &mut t(3)?, &[1; WORLD]).unwrap_err()),
                ("invalid reduce_scatter_v dst", {
                    world.reduce_scatter_v(&t(WORLD)?, &mut t(2)?, &[1; WORLD], ReduceOp::Sum).unwrap_err()
                }),
                (
                    "shape all_to_all_v src",
                    world.all_to_all_v(&t(3)?, &[1; WORLD], &mut t(WORLD)?, &[1; WORLD]).unwrap_err(),
                ),
                ("invalid broadcast root", world.broadcast(&mut t(2)?, WORLD).unwrap_err()),
            ];
            for (want, e) in &cases {
                assert_eq!(&arg_of(e), want, "{e}");
            }
            // Nothing was queued: the group still works.
            let mut buf = t(2)?;
            world.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
            Ok(())
        }
    );

    #[test]
    #[ignore = "needs an Ascend NPU"]
    fn root_info_travels_as_hex_between_ranks() {
        let dev0 = NpuDevice::open(0).unwrap();
        let hex = HcclRootInfo::generate(&dev0).unwrap().to_hex();
        let sums: Vec<f64> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    let hex = hex.clone();
                    s.spawn(move || -> Result<f64> {
                        let dev = NpuDevice::open(rank as u32)?;
                        let root = HcclRootInfo::from_hex(&hex)?;
                        let comm = ascend_moe::backend::npu::HcclComm::from_root_info(&dev, &root, 2, rank, &opts())?;
                        let d = Device::Npu(dev);
                        let mut t = tensor::<f32>(&d, &[rank as f64 + 1.0])?;
                        comm.all_reduce_in_place(&mut t, ReduceOp::Sum)?;
                        Ok(read(&t)?[0])
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
        });
        assert_eq!(sums, [3.0, 3.0]);
    }

    /// Two ranks of one world asking for one NPU: HCCL refuses that (every
    /// rank's HcclCommInitRootInfo fails, HCCL_E_PARA), and this process
    /// refuses the second before it calls HCCL, naming both ranks and the
    /// NPU. The refused rank then joins on another NPU and the world forms.
    #[test]
    #[ignore = "needs an Ascend NPU"]
    fn two_ranks_on_one_npu_are_refused_before_hccl() {
        let dev0 = NpuDevice::open(0).unwrap();
        let root = HcclRootInfo::generate(&dev0).unwrap();
        let outs: Vec<(Option<String>, f64)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    let root = &root;
                    s.spawn(move || -> Result<(Option<String>, f64)> {
                        let join = |npu: u32| {
                            let dev = NpuDevice::open(npu)?;
                            ascend_moe::backend::npu::HcclComm::from_root_info(&dev, root, 2, rank, &opts())
                        };
                        // Both ask for NPU 0: whichever comes second is refused.
                        let (refusal, comm) = match join(0) {
                            Ok(c) => (None, c),
                            Err(e) => (Some(e.to_string()), join(1)?),
                        };
                        let mut t = tensor::<f32>(&comm.device(), &[rank as f64 + 1.0])?;
                        comm.all_reduce_in_place(&mut t, ReduceOp::Sum)?;
                        Ok((refusal, read(&t)?[0]))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
        });
        let refusals: Vec<&String> = outs.iter().filter_map(|(r, _)| r.as_ref()).collect();
        assert_eq!(refusals.len(), 1, "{outs:?}");
        let msg = refusals[0];
        assert!(msg.contains("rank 0") && msg.contains("rank 1") && msg.contains("npu:0"), "{msg}");
        assert!(msg.contains("HCCL_E_PARA"), "{msg}");
        assert_eq!(outs.iter().map(|(_, v)| *v).collect::<Vec<_>>(), [3.0, 3.0]);
    }

    /// HCCL names a root-info communicator after its root info and refuses
    /// a second one of a live name on one device (HCCL_E_PARA, saying
    /// nothing of why): joining a root info again on an NPU that holds its
    /// communicator is refused here first, naming the NPU and the rank that
    /// holds it. Once that communicator is dropped, the root info joins again.
    #[test]
    #[ignore = "needs an Ascend NPU"]
    fn a_root_info_joined_again_on_one_npu_is_refused_while_its_communicator_lives() {
        use ascend_moe::backend::npu::HcclComm;
        let dev = NpuDevice::open(0).unwrap();
        let root = HcclRootInfo::generate(&dev).unwrap();
        let first = HcclComm::from_root_info(&dev, &root, 1, 0, &opts()).unwrap();
        let msg = HcclComm::from_root_info(&dev, &root, 1, 0, &opts()).expect_err("a live name").to_string();
        assert!(msg.contains("npu:0 already holds a communicator of this root info (rank 0 of 1)"), "{msg}");
        assert!(msg.contains("HCCL_E_PARA"), "{msg}");
        // Another root info is another name.
        let other = HcclComm::from_root_info(&dev, &HcclRootInfo::generate(&dev).unwrap(), 1, 0, &opts()).unwrap();
        drop((first, other));
        let again = HcclComm::from_root_info(&dev, &root, 1, 0, &opts()).unwrap();
        let d = Device::Npu(dev);
        let mut t = tensor::<f32>(&d, &[2.0]).unwrap();
        again.all_reduce_in_place(&mut t, ReduceOp::Sum).unwrap();
        assert_eq!(read(&t).unwrap(), [2.0]);
    }

    #[test]
    #[ignore = "needs an Ascend NPU"]
    fn mismatched_sizes_fail_with_a_clear_error() {
        npu_run_ranks(WORLD, &opts(), |_rank, comm| {
            let dev = comm.device();
            let src = Tensor::zeros(&[8], DType::F32, &dev)?;
            let mut dst = Tensor::zeros(&[3], DType::F32, &dev)?;
            let err = comm.reduce_scatter(&src, &mut dst, ReduceOp::Sum).expect_err("8 != 4 x 3");
            assert!(err.to_string().contains("reduce_scatter"), "{err}");
            let host = Tensor::zeros_cpu(&[12], DType::F32);
            let err = comm.all_reduce(&host, &mut dst, ReduceOp::Sum).expect_err("host tensor");
            assert!(matches!(err, ascend_moe::Error::Device { .. } | ascend_moe::Error::Comm { .. }), "{err:?}");
            let err =
                comm.all_gather_v(&dst, &mut Tensor::zeros(&[3], DType::F32, &dev)?, &[1, 2]).expect_err("2 counts");
            assert!(err.to_string().contains("counts"), "{err}");
            Ok(())
        })
        .unwrap();
    }

    #[test]
    #[ignore = "needs an Ascend NPU"]
    fn a_count_mismatch_in_the_first_call_is_refused_by_the_call_on_every_rank() {
        npu_run_ranks(WORLD, &opts(), |rank, comm| {
            let Comm::Npu(hccl) = &comm else { panic!("an HCCL world") };
            // The operands live on a second stream of the rank's device.
            let other = NpuDevice::open(rank as u32)?;
            let dev = Device::Npu(other.clone());
            let n = if rank == 0 { 8 } else { 4 };
            let src = Tensor::zeros(&[n], DType::F32, &dev)?;
            let mut dst = Tensor::zeros(&[n], DType::F32, &dev)?;
            // HCCL sets up the links of a communicator's first all-reduce
            // inside the call and checks there that every rank passed the same
            // arguments (EI0005): the call itself fails, on every rank.
            let err =
                comm.all_reduce(&src, &mut dst, ReduceOp::Sum).expect_err("rank 0 reduces 8 elements, the others 4");
            match &err {
                ascend_moe::Error::Comm { collective, group, rank: r, kind, .. } => {
                    assert_eq!((collective.as_str(), group.as_str(), *r), ("all_reduce", comm.name(), rank), "{err}");
                    assert_eq!(*kind, ascend_moe::CommErrorKind::Mismatch, "{err}");
                }
                other => panic!("expected a Comm error, got {other:?}"),
            }
            // Nothing was queued, and HCCL records no async error for it.
            other.check().expect("nothing was queued on the operands' stream");
            hccl.npu_device().check().expect("nothing was queued on the communicator's stream");
            // The communicator still works: matching calls set the links up.
            let mut buf = tensor::<f32>(&dev, &[val(rank, 0), val(rank, 1)])?;
            comm.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
            assert_eq!(read(&buf)?, [0, 1].map(|i| (0..WORLD).map(|r| val(r, i)).sum::<f64>()));
            Ok(())
        })
        .unwrap();
    }

    /// With HCCL's inconsistent-op check on (`HCCL_DFS_CONFIG`, read once per
    /// process, so in a child), a later all-reduce whose count differs
    /// between ranks is HCCL's async error HCCL_E_PARA, reported by the
    /// check as a mismatch on every rank, not as a failed peer.
    #[test]
    #[ignore = "needs an Ascend NPU"]
    fn a_later_disagreeing_call_found_by_hccls_inconsistent_op_check_is_a_mismatch() {
        const NAME: &str = "every_backend::a_later_disagreeing_call_found_by_hccls_inconsistent_op_check_is_a_mismatch";
        if std::env::var_os("HCCL_DFS_CONFIG").is_none() {
            // The communicators whose streams failed are left, not
            // destroyed: the simulator only prints its leak report.
            let env = [("HCCL_DFS_CONFIG", "inconsistent_check:on"), ("CANNSIM_LEAK_REPORT", "1")];
            ascend_moe::testing::runtime::run_ignored_test_in_child(NAME, &env);
            return;
        }
        npu_run_ranks(WORLD, &CommOptions::with_timeout(std::time::Duration::from_secs(20)), |rank, comm| {
            let dev = comm.device();
            set_up_links(&comm)?;
            let Comm::Npu(hccl) = &comm else { panic!("an HCCL world") };
            let n = if rank == 0 { 8 } else { 4 };
            let src = Tensor::zeros(&[n], DType::F32, &dev)?;
            let mut dst = Tensor::zeros(&[n], DType::F32, &dev)?;
            comm.all_reduce(&src, &mut dst, ReduceOp::Sum).expect("queued: HCCL checks only a first call on the host");
            let err = hccl.npu_device().check().expect_err("rank 0 reduces 8 elements, the others 4");
            match &err {
                ascend_moe::Error::Comm { collective, rank: r, kind, .. } => {
                    assert_eq!((collective.as_str(), *r), ("all_reduce", rank), "{err}");
                    assert_eq!(*kind, ascend_moe::CommErrorKind::Mismatch, "{err}");
                    assert!(err.to_string().contains("inconsistent-op check"), "{err}");
                }
                other => panic!("expected a Comm error, got {other:?}"),
            }
            Ok(())
        })
        .unwrap();
    }

    /// A collective runs on the stream of its first operand; a destination
    /// on another stream of the device is read through that stream, which
    /// is ordered after the collective.
    #[test]
    #[ignore = "needs an Ascend NPU"]
    fn a_destination_on_another_stream_holds_the_result_when_read_through_it() {
        npu_run_ranks(WORLD, &opts(), |rank, comm| {
            let other = Device::Npu(NpuDevice::open(rank as u32)?);
            let src = tensor::<f32>(&comm.device(), &[val(rank, 0), val(rank, 1)])?;
            let mut sum = Tensor::zeros(&[2], DType::F32, &other)?;
            comm.all_reduce(&src, &mut sum, ReduceOp::Sum)?;
            assert_eq!(read(&sum)?, [0, 1].map(|i| (0..WORLD).map(|r| val(r, i)).sum::<f64>()), "all_reduce");
            let mut all = Tensor::zeros(&[2 * WORLD], DType::F32, &other)?;
            comm.all_gather(&src, &mut all)?;
            let want: Vec<f64> = (0..WORLD).flat_map(|r| [val(r, 0), val(r, 1)]).collect();
            assert_eq!(read(&all)?, want, "all_gather");
            Ok(())
        })
        .unwrap();
    }

    /// One all-reduce of every rank, checked: HCCL sets up its links at a
    /// communicator's first call of a collective and checks only that one on
    /// the host, so a later call is queued without waiting for the others.
    fn set_up_links(comm: &Comm) -> Result<()> {
        let mut warm = tensor::<f32>(&comm.device(), &[1.0])?;
        comm.all_reduce_in_place(&mut warm, ReduceOp::Sum)?;
        assert_eq!(read(&warm)?, [WORLD as f64]);
        let Comm::Npu(hccl) = comm else { panic!("an HCCL world") };
        hccl.npu_device().check()
    }

    /// Ranks `0..WORLD - 1` queue an all-reduce rank `WORLD - 1` never makes,
    /// after one all-reduce of every rank (so the links are set up and the
    /// call itself does not wait for the missing rank); then `after(rank,
    /// comm)` on the ranks that queued it.
    fn a_rank_skips_the_second_all_reduce(opts: &CommOptions, after: impl Fn(usize, &Comm) -> Result<()> + Sync) {
        npu_run_ranks(WORLD, opts, |rank, comm| {
            let dev = comm.device();
            set_up_links(&comm)?;
            if rank == WORLD - 1 {
                return Ok(());
            }
            let src = Tensor::zeros(&[4], DType::F32, &dev)?;
            let mut dst = Tensor::zeros(&[4], DType::F32, &dev)?;
            comm.all_reduce(&src, &mut dst, ReduceOp::Sum).expect("queued: the host does not wait");
            after(rank, &comm)
        })
        .unwrap();
    }

    #[test]
    #[ignore = "needs an Ascend NPU"]
    fn a_rank_that_never_joins_is_reported_by_the_check_never_a_hang() {
        // The communicators whose collective never completes are left, not
        // destroyed under it.
        if !in_child_that_may_leak("every_backend::a_rank_that_never_joins_is_reported_by_the_check_never_a_hang") {
            return;
        }
        let opts = CommOptions::with_timeout(std::time::Duration::from_secs(2));
        a_rank_skips_the_second_all_reduce(&opts, |rank, comm| {
            let Comm::Npu(hccl) = comm else { panic!("an HCCL world") };
            let err = hccl.npu_device().check().expect_err("rank 3 never joins");
            match &err {
                ascend_moe::Error::Comm { collective, group, rank: r, kind, .. } => {
                    assert_eq!((collective.as_str(), group.as_str(), *r), ("all_reduce", comm.name(), rank), "{err}");
                    assert!(
                        matches!(kind, ascend_moe::CommErrorKind::Timeout | ascend_moe::CommErrorKind::PeerFailed),
                        "{err}"
                    );
                }
                other => panic!("expected a Comm error, got {other:?}"),
            }
            Ok(())
        });
    }

    #[test]
    #[ignore = "needs an Ascend NPU"]
    fn teardown_after_a_rank_never_joined_ends_with_a_recorded_timeout() {
        // The communicators whose collective never completes are left, not
        // destroyed under it.
        if !in_child_that_may_leak("every_backend::teardown_after_a_rank_never_joined_ends_with_a_recorded_timeout") {
            return;
        }
        let _ = ascend_moe::backend::npu::take_drop_errors();
        let opts = CommOptions::with_timeout(std::time::Duration::from_secs(2));
        // No check: the tensors, the communicator and the device stream are
        // dropped with the collective still queued. Each drop's wait is
        // bounded by the communicator's timeout; the first that times out
        // records it, the later ones release nothing and do not wait again.
        a_rank_skips_the_second_all_reduce(&opts, |_, _| Ok(()));
        let errors = ascend_moe::backend::npu::take_drop_errors();
        let timeouts = errors
            .iter()
            .filter(|e| {
                matches!(e, ascend_moe::Error::Acl { code, .. }
                    if *code == acl_sys::ACL_ERROR_RT_STREAM_SYNC_TIMEOUT as acl_sys::aclError)
            })
            .count();
        // At least one per rank that queued the collective (3 of 4).
        assert!(timeouts >= WORLD - 1, "{timeouts} timeouts recorded by the drops: {errors:?}");
    }

    #[test]
    #[ignore = "needs an Ascend NPU"]
    fn reduce_scatter_v_of_int64_is_refused_naming_the_collective_and_the_dtype() {
        npu_run_ranks(WORLD, &opts(), |rank, comm| {
            let dev = comm.device();
            let counts = [1usize; WORLD];
            let src = tensor::<i64>(&dev, &[1.0; WORLD])?;
            let mut dst = Tensor::zeros(&[1], DType::I64, &dev)?;
            // HcclReduceScatterV takes no int64 on Atlas A2 (HCCL API reference).
            let err = comm.reduce_scatter_v(&src, &mut dst, &counts, ReduceOp::Sum).expect_err("int64");
            let msg = err.to_string();
            assert!(msg.contains("reduce_scatter_v") && msg.contains("HcclReduceScatterV"), "{msg}");
            assert!(matches!(err, ascend_moe::Error::DType { actual: DType::I64, .. }), "{err:?}");
            // The reductions whose A2 table has int64 take it.
            let mut all = tensor::<i64>(&dev, &[rank as f64])?;
            comm.all_reduce_in_place(&mut all, ReduceOp::Sum)?;
            assert_eq!(read(&all)?, [(0..WORLD).sum::<usize>() as f64]);
            Ok(())
        })
        .unwrap();
    }

    #[test]
    #[ignore = "needs an Ascend NPU"]
    fn a_barrier_is_refused_under_graph_capture_and_runs_outside_it() {
        npu_run_ranks(WORLD, &opts(), |_, comm| {
            let Comm::Npu(hccl) = &comm else { panic!("an HCCL world") };
            let stream = hccl.npu_device().stream().clone();
            let mut under_capture = None;
            let graph = ascend_moe::testing::graph::Graph::capture(stream.raw(), || {
                under_capture = Some(hccl.barrier_on(&stream))
            });
            drop(graph);
            let err = under_capture.expect("the body ran").expect_err("HcclBarrier is not supported under capture");
            let msg = err.to_string();
            assert!(msg.contains("HcclBarrier") && msg.contains("captured"), "{msg}");
            comm.barrier()?;
            hccl.npu_device().check()
        })
        .unwrap();
    }

    /// A rank with nothing to send passes a small live buffer in place of
    /// its empty one (HCCL refuses NULL). It is allocated with the
    /// communicator, not by the first such call, which may come under a graph
    /// capture, where nothing is allocated: a V collective with a zero count,
    /// the world's first collective, is captured and replays.
    #[test]
    #[ignore = "needs an Ascend NPU"]
    fn a_zero_count_v_collective_first_called_under_capture_replays() {
        npu_run_ranks(WORLD, &opts(), |rank, comm| {
            let Comm::Npu(hccl) = &comm else { panic!("an HCCL world") };
            let dev = comm.device();
            let counts = [3usize, 0, 5, 1];
            let src = tensor::<f32>(&dev, &(0..counts[rank]).map(|i| val(rank, i)).collect::<Vec<_>>())?;
            let mut out = Tensor::zeros(&[counts.iter().sum()], DType::F32, &dev)?;
            let stream = hccl.npu_device().stream().clone();
            let mut captured = None;
            let graph = ascend_moe::testing::graph::Graph::capture(stream.raw(), || {
                captured = Some(comm.all_gather_v(&src, &mut out, &counts))
            });
            captured.expect("the body ran")?;
            graph.replay(stream.raw());
            hccl.npu_device().check()?;
            let want: Vec<f64> = (0..WORLD).flat_map(|r| (0..counts[r]).map(move |i| val(r, i))).collect();
            assert_eq!(read(&out)?, want, "all_gather_v replayed");
            Ok(())
        })
        .unwrap();
    }

    #[test]
    #[ignore = "needs an Ascend NPU"]
    fn a_borrowed_communicator_is_not_split_since_it_may_be_a_sub_communicator() {
        npu_run_ranks(WORLD, &opts(), |_, comm| {
            let Comm::Npu(hccl) = &comm else { panic!("an HCCL world") };
            // SAFETY: the world communicator outlives the borrowed handle.
            let borrowed =
                unsafe { ascend_moe::backend::npu::HcclComm::borrow_raw(hccl.npu_device(), hccl.raw(), &opts()) }?;
            let err = borrowed.split_hccl(&[0, 1, 2, 3]).map(|_| ()).expect_err("a borrowed communicator");
            let msg = err.to_string();
            assert!(msg.contains("borrowed") && msg.contains("HcclCreateSubCommConfig"), "{msg}");
            // The communicator HcclComm::from_root_info made splits.
            let pair = comm.split(&[0, 1, 2, 3])?;
            assert_eq!(pair.world_size(), WORLD);
            Ok(())
        })
        .unwrap();
    }

    #[test]
    #[ignore = "needs an Ascend NPU"]
    fn split_with_unsorted_ranks_fails_naming_the_order_and_the_rule() {
        npu_run_ranks(WORLD, &opts(), |rank, world| {
            // Pairs {0, 1} and {2, 3}, each listed in descending order.
            let pair: Vec<usize> = if rank < 2 { vec![1, 0] } else { vec![3, 2] };
            let err = world.split(&pair).map(|_| ()).expect_err("a descending rank list");
            let msg = err.to_string();
            assert!(msg.contains(&format!("{pair:?}")) && msg.contains("not ascending"), "{msg}");
            assert!(msg.contains("HcclCreateSubCommConfig"), "the message names HCCL's rule: {msg}");
            // Nothing was created, and the world communicator still works.
            let mut buf = tensor::<f32>(&world.device(), &[1.0])?;
            world.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
            assert_eq!(read(&buf)?, [WORLD as f64]);
            Ok(())
        })
        .unwrap();
    }

    backend_test!(a_sub_communicator_is_split_through_the_global_one, ranks = WORLD, |rank, world| {
        // HCCL splits only the global communicator; a split of {0,1,2,3}'s
        // sub-communicator {rank pairs} is made from the world one.
        let pair_ranks: Vec<usize> = if rank < 2 { vec![0, 1] } else { vec![2, 3] };
        let pair = world.split(&pair_ranks)?;
        let nested = pair.split(&[0, 1])?;
        assert_eq!((nested.rank(), nested.world_size()), (rank % 2, 2));
        let mut buf = tensor::<f32>(&world.device(), &[val(rank, 0)])?;
        nested.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
        assert_eq!(read(&buf)?, [pair_ranks.iter().map(|&r| val(r, 0)).sum::<f64>()]);
        Ok(())
    });

    /// Each backend's own communicator (not only `Comm`) refuses a reduction
    /// of a one-byte dtype on every rank, with an error naming the collective
    /// and the dtype, and the group stays usable.
    fn refuses_byte_reductions<C: Collectives>(comm: &C) -> Result<()> {
        let dev = comm.device();
        let w = comm.world_size();
        for dt in [DType::Bool, DType::F8E4M3, DType::F8E5M2, DType::U8] {
            let x = Tensor::zeros(&[2 * w], dt, &dev)?;
            let mut y = Tensor::zeros(&[2 * w], dt, &dev)?;
            let mut part = Tensor::zeros(&[2], dt, &dev)?;
            let mut buf = Tensor::zeros(&[2 * w], dt, &dev)?;
            let counts = vec![2; w];
            let errs = [
                ("all_reduce", comm.all_reduce(&x, &mut y, ReduceOp::Sum).err()),
                ("all_reduce", comm.all_reduce_in_place(&mut buf, ReduceOp::Max).err()),
                ("reduce_scatter", comm.reduce_scatter(&x, &mut part, ReduceOp::Sum).err()),
                ("reduce_scatter_v", comm.reduce_scatter_v(&x, &mut part, &counts, ReduceOp::Min).err()),
            ];
            for (op, e) in errs {
                let e = e.unwrap_or_else(|| panic!("{op} of {dt} on {} succeeded", comm.name())).to_string();
                assert!(e.contains(op) && e.contains(dt.name()) && e.contains("never reduced"), "{op} {dt}: {e}");
            }
        }
        // Data movement of the same dtype still works after the refusals.
        let x = Tensor::zeros(&[3], DType::Bool, &dev)?;
        let mut y = Tensor::zeros(&[3 * w], DType::Bool, &dev)?;
        comm.all_gather(&x, &mut y)
    }

    backend_test!(backend_communicators_refuse_byte_reductions, ranks = WORLD, |_rank, comm| {
        match &comm {
            Comm::Cpu(c) => refuses_byte_reductions(c),
            Comm::Npu(c) => refuses_byte_reductions(c),
        }
    });
}
