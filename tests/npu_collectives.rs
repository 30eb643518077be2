//! HCCL collectives on 4 NPUs (threads, one device each), checked against
//! naive references: every collective, reduce op and dtype, the V variants,
//! and the DP2 x TP2 / EP4 sub-communicators. Ignored without an NPU.

mod common;

use ascend_moe::backend::npu::{npu_run_ranks, HcclRootInfo, NpuDevice};
use ascend_moe::half::{bf16, f16};
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

#[test]
#[ignore = "needs an Ascend NPU"]
fn reductions_in_every_dtype_and_op() {
    npu_run_ranks(WORLD, &opts(), |rank, comm| {
        reductions_for::<f32>(rank, &comm)?;
        reductions_for::<f16>(rank, &comm)?;
        reductions_for::<bf16>(rank, &comm)?;
        reductions_for::<i32>(rank, &comm)?;
        reductions_for::<i64>(rank, &comm)
    })
    .unwrap();
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn gathers_broadcast_barrier() {
    npu_run_ranks(WORLD, &opts(), |rank, comm| {
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
    })
    .unwrap();
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn v_variants_with_uneven_and_zero_counts() {
    let counts = [3usize, 0, 5, 1];
    let total: usize = counts.iter().sum();
    npu_run_ranks(WORLD, &opts(), |rank, comm| {
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
    })
    .unwrap();
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn dp2_tp2_and_ep4_sub_communicators() {
    const TP: usize = 2;
    npu_run_ranks(WORLD, &opts(), |rank, world| {
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
    })
    .unwrap();
}

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
        let err = comm.all_gather_v(&dst, &mut Tensor::zeros(&[3], DType::F32, &dev)?, &[1, 2]).expect_err("2 counts");
        assert!(err.to_string().contains("counts"), "{err}");
        Ok(())
    })
    .unwrap();
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn a_mismatch_between_ranks_is_reported_by_the_check_of_the_operands_stream() {
    npu_run_ranks(WORLD, &opts(), |rank, comm| {
        let Comm::Npu(hccl) = &comm else { panic!("an HCCL world") };
        // The operands live on a second stream of the rank's device: the
        // collective is queued there, not on the communicator's own stream.
        let other = NpuDevice::open(rank as u32)?;
        let dev = Device::Npu(other.clone());
        let n = if rank == 0 { 8 } else { 4 };
        let src = Tensor::zeros(&[n], DType::F32, &dev)?;
        let mut dst = Tensor::zeros(&[n], DType::F32, &dev)?;
        comm.all_reduce(&src, &mut dst, ReduceOp::Sum).expect("queued: only the device sees the mismatch");
        hccl.npu_device().check().expect("nothing was queued on the communicator's stream");
        let err = other.check().expect_err("rank 0 reduces 8 elements, the others 4");
        match &err {
            ascend_moe::Error::Comm { collective, group, rank: r, .. } => {
                assert_eq!((collective.as_str(), group.as_str(), *r), ("all_reduce", comm.name(), rank), "{err}");
            }
            other => panic!("expected a Comm error, got {other:?}"),
        }
        // Reported once: the next check has nothing new to say about the
        // collective (the stream itself may keep CANN's sticky error).
        if let Err(again) = other.check() {
            assert!(!matches!(again, ascend_moe::Error::Comm { .. }), "reported twice: {again}");
        }
        Ok(())
    })
    .unwrap();
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn a_rank_that_never_joins_is_reported_by_the_check_never_a_hang() {
    let opts = CommOptions::with_timeout(std::time::Duration::from_secs(2));
    npu_run_ranks(WORLD, &opts, |rank, comm| {
        let Comm::Npu(hccl) = &comm else { panic!("an HCCL world") };
        if rank == WORLD - 1 {
            // This rank never calls the collective.
            return Ok(());
        }
        let dev = comm.device();
        let src = Tensor::zeros(&[4], DType::F32, &dev)?;
        let mut dst = Tensor::zeros(&[4], DType::F32, &dev)?;
        comm.all_reduce(&src, &mut dst, ReduceOp::Sum).expect("queued: the host does not wait");
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

#[test]
#[ignore = "needs an Ascend NPU"]
fn a_sub_communicator_is_split_through_the_global_one() {
    npu_run_ranks(WORLD, &opts(), |rank, world| {
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
    })
    .unwrap();
}
