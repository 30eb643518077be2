//! Stream-ordered NPU ops on 4 simulated devices: after a warm-up call (and
//! the stream check that follows it), a second call of each op makes no host
//! synchronisation, no device or host allocation or free, and no copy between
//! host and device, as the simulator's per-thread counters
//! (`cannsim_counters`) count them; and the workspace pool and the caller's
//! allocator behave as documented. Ignored without an NPU; on real CANN,
//! which has no counters, the counting test says so and checks only results.

mod common;

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};

use ascend_moe::backend::npu::{Allocator, FinalizeImpl, NpuDevice};
use ascend_moe::backend::{DropPadMode, FinalizeArgs, FinalizeDims, OutputRows};
use ascend_moe::moe::prepare_finalize::{finalize, prepare, MoeContext, MoeGroups};
use ascend_moe::moe::shared::{shared_gather_unpad, shared_pad_reduce_scatter, shared_pad_split};
use ascend_moe::moe::{
    finalize_and_reduce, maybe_all_gather_and_maybe_unpad, maybe_pad_and_reduce, ReducePolicy, SharedMode, SpLayout,
};
use ascend_moe::ranks::npu_run_ranks;
use ascend_moe::{Collectives, CommOptions, CommType, DType, Device, ReduceOp, Result, Tensor};

const WORLD: usize = 4;

fn counters() -> Option<acl_sys::CannsimCounters> {
    acl_sys::acl().ok()?.counters()
}

fn reset() {
    if let Ok(api) = acl_sys::acl() {
        api.reset_counters();
    }
}

fn npu(d: &Device) -> &NpuDevice {
    match d {
        Device::Npu(n) => n,
        Device::Cpu => panic!("an NPU device"),
    }
}

/// Runs `f` twice (the first run warms the pool and the staging blocks up,
/// followed by the stream check), counting the second run; returns the
/// problems found, naming the op. Every count must be zero.
fn measure(dev: &NpuDevice, op: &str, f: impl FnMut() -> Result<()>) -> Vec<String> {
    measure_with_staging(dev, op, 0, f)
}

/// [`measure`] for an op that stages `staged` small host-to-device copies of
/// host data through pinned memory (a native kernel's tiling, which it reads
/// from device memory; the padded finalize's slot offsets, one 32-bit word
/// per slot), never tensor data.
fn measure_with_staging(dev: &NpuDevice, op: &str, staged: u64, mut f: impl FnMut() -> Result<()>) -> Vec<String> {
    let mut problems = Vec::new();
    if let Err(e) = f().and_then(|_| dev.check()) {
        return vec![format!("{op}: warm-up failed: {e}")];
    }
    reset();
    let r = f();
    let c = counters();
    if let Err(e) = r.and_then(|_| dev.check()) {
        problems.push(format!("{op}: {e}"));
    }
    if let Some(c) = c {
        let bad = [
            ("host syncs", c.host_syncs),
            ("device mallocs", c.device_mallocs),
            ("device frees", c.device_frees),
            ("host mallocs", c.host_mallocs),
            ("host frees", c.host_frees),
            ("host-to-device copies beyond the staged ones", c.h2d_copies.saturating_sub(staged)),
            ("device-to-host copies", c.d2h_copies),
            ("event queries", c.queries),
        ];
        if c.h2d_copies < staged {
            problems.push(format!("{op}: {} host-to-device copies, {staged} staged ones expected", c.h2d_copies));
        }
        for (what, n) in bad {
            if n != 0 {
                problems.push(format!("{op}: {n} {what}"));
            }
        }
    }
    problems
}

/// Fails with every rank's problems, each prefixed with its rank.
fn assert_no_problems(reports: Vec<Vec<String>>) {
    let problems: Vec<String> = reports
        .into_iter()
        .enumerate()
        .flat_map(|(r, p)| p.into_iter().map(move |s| format!("rank {r}: {s}")))
        .collect();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

fn filled(dev: &Device, shape: &[usize], seed: usize) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| ((i * 7 + seed * 13) % 11) as f32 - 5.0).collect();
    Tensor::from_slice(&v, shape)?.to_device(dev)
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn a_second_call_of_every_op_makes_no_host_sync_allocation_or_host_copy() {
    if counters().is_none() {
        eprintln!("the loaded runtime has no cannsim_counters: counting needs the simulator");
    }
    let reports = npu_run_ranks(WORLD, &CommOptions::from_env(), |rank, comm| -> Result<Vec<String>> {
        let dev = comm.device();
        let nd = npu(&dev).clone();
        let h = 16; // 64-byte rows: every row copy goes to aclrtMemcpyAsync
        let mut p = Vec::new();

        // Collectives.
        let src = filled(&dev, &[WORLD * 4, h], rank)?;
        let mut same = Tensor::zeros(&[WORLD * 4, h], DType::F32, &dev)?;
        let mut part = Tensor::zeros(&[4, h], DType::F32, &dev)?;
        let mut all = Tensor::zeros(&[WORLD * WORLD * 4, h], DType::F32, &dev)?;
        let counts = [3 * h, 0, 5 * h, h];
        let total: usize = counts.iter().sum();
        let vsrc = filled(&dev, &[total / h, h], rank)?;
        let vmine = filled(&dev, &[counts[rank] / h, h], rank)?;
        let mut vdst = Tensor::zeros(&[counts[rank] / h, h], DType::F32, &dev)?;
        let mut vall = Tensor::zeros(&[total / h, h], DType::F32, &dev)?;
        let sc = [h; WORLD];
        let mut a2a = Tensor::zeros(&[WORLD, h], DType::F32, &dev)?;
        let a2a_src = filled(&dev, &[WORLD, h], rank)?;
        p.extend(measure(&nd, "all_reduce", || comm.all_reduce(&src, &mut same, ReduceOp::Sum)));
        p.extend(measure(&nd, "all_reduce_in_place", || comm.all_reduce_in_place(&mut same, ReduceOp::Max)));
        p.extend(measure(&nd, "reduce_scatter", || comm.reduce_scatter(&src, &mut part, ReduceOp::Sum)));
        p.extend(measure(&nd, "all_gather", || comm.all_gather(&src, &mut all)));
        p.extend(measure(&nd, "reduce_scatter_v", || comm.reduce_scatter_v(&vsrc, &mut vdst, &counts, ReduceOp::Sum)));
        p.extend(measure(&nd, "all_gather_v", || comm.all_gather_v(&vmine, &mut vall, &counts)));
        p.extend(measure(&nd, "all_to_all_v", || comm.all_to_all_v(&a2a_src, &sc, &mut a2a, &sc)));
        p.extend(measure(&nd, "broadcast", || comm.broadcast(&mut part, 1)));
        p.extend(measure(&nd, "barrier", || comm.barrier()));

        // Backend ops.
        let b = dev.backend();
        let x = filled(&dev, &[8, h], rank)?;
        let y = filled(&dev, &[8, h], rank + 1)?;
        let mut sum = Tensor::zeros(&[8, h], DType::F32, &dev)?;
        p.extend(measure(&nd, "add", || b.add(&x, &y, &mut sum)));
        p.extend(measure(&nd, "copy_rows", || b.copy_rows(&x, 4, &mut sum, 0, 4)));
        // 16-byte rows (H = 4 f32) start off 64-byte boundaries, which
        // aclrtMemcpyAsync refuses: the byte-copy kernel takes them.
        let narrow = filled(&dev, &[8, 4], rank)?;
        let mut narrow_out = Tensor::zeros(&[8, 4], DType::F32, &dev)?;
        p.extend(measure(&nd, "copy_rows (16-byte rows)", || b.copy_rows(&narrow, 1, &mut narrow_out, 3, 5)));

        // Native finalize, dense and into the padded EP buffer.
        let (n, k) = (6usize, 2usize);
        let ex = filled(&dev, &[n * k, h], rank)?;
        let idx: Vec<i32> = (0..(n * k) as i32).rev().collect();
        let idx = Tensor::from_slice(&idx, &[n * k])?.to_device(&dev)?;
        let scales = filled(&dev, &[n, k], 3)?;
        let args = FinalizeArgs {
            expanded_x: &ex,
            expanded_row_idx: &idx,
            x1: None,
            x2: None,
            bias: None,
            scales: Some(&scales),
            expert_idx: None,
            drop_pad_mode: DropPadMode::DropLessColumn,
        };
        let dims = FinalizeDims { n, k, h, expanded_rows: n * k, experts: 0 };
        let mut dense = Tensor::zeros(&[n, h], DType::F32, &dev)?;
        // One staged copy: the kernel's tiling.
        p.extend(measure_with_staging(&nd, "finalize_routing (native, dense)", 1, || {
            b.finalize_routing(&args, &dims, &mut dense, OutputRows::Dense)
        }));
        // Native token unpermute, with repeated and out-of-range indices
        // (SPEC section 1: they contribute nothing), which aclnn cannot take.
        let wild: Vec<i32> = vec![3, 3, -1, 11, 40, 0, 7, 7, 2, 1, 5, 9];
        let wild = Tensor::from_slice(&wild, &[n * k])?.to_device(&dev)?;
        let mut unpermuted = Tensor::zeros(&[n, h], DType::F32, &dev)?;
        p.extend(measure_with_staging(&nd, "token_unpermute (native)", 1, || {
            b.token_unpermute(&ex, &wild, Some(&scales), k, &mut unpermuted)
        }));
        // The aclnn finalize: its indices are checked on the device first
        // (by the native kernel, whose tiling is staged).
        let aclnn = Device::Npu(nd.clone().with_finalize_impl(FinalizeImpl::Aclnn));
        p.extend(measure_with_staging(&nd, "finalize_routing (aclnn, dense)", 1, || {
            aclnn.backend().finalize_routing(&args, &dims, &mut dense, OutputRows::Dense)
        }));
        let local_sizes = [2usize, 0, 3, 1];
        let mut padded = Tensor::zeros(&[4 * 3, h], DType::F32, &dev)?;
        // The slot offsets and the tiling.
        p.extend(measure_with_staging(&nd, "finalize_routing (native, padded)", 2, || {
            b.finalize_routing(
                &args,
                &dims,
                &mut padded,
                OutputRows::Padded { local_sizes: &local_sizes, slot_rows: 3 },
            )
        }));

        // The SP pad/reduce and gather/unpad pair, and finalize_and_reduce.
        let layout = SpLayout::new(&local_sizes)?;
        let full = filled(&dev, &[n, h], rank)?;
        let shard = filled(&dev, &[local_sizes[rank], h], rank)?;
        p.extend(measure(&nd, "maybe_pad_and_reduce", || maybe_pad_and_reduce(&full, Some(&layout), &comm).map(drop)));
        p.extend(measure(&nd, "maybe_all_gather_and_maybe_unpad", || {
            maybe_all_gather_and_maybe_unpad(&shard, Some(&layout), &comm).map(drop)
        }));
        p.extend(measure_with_staging(&nd, "finalize_and_reduce", 2, || {
            finalize_and_reduce(&args, Some(&layout), &comm).map(drop)
        }));

        // The same pair with 20-byte rows: every row copy is unaligned and
        // goes through the copy kernel.
        let odd = 5;
        let full_odd = filled(&dev, &[n, odd], rank)?;
        let shard_odd = filled(&dev, &[local_sizes[rank], odd], rank)?;
        p.extend(measure(&nd, "maybe_pad_and_reduce (20-byte rows)", || {
            maybe_pad_and_reduce(&full_odd, Some(&layout), &comm).map(drop)
        }));
        p.extend(measure(&nd, "maybe_all_gather_and_maybe_unpad (20-byte rows)", || {
            maybe_all_gather_and_maybe_unpad(&shard_odd, Some(&layout), &comm).map(drop)
        }));

        // Token prepare and finalize of every comm type, DP2 x TP2, SP on
        // and off (uneven DP tokens, fewer than TP on DP rank 1), with 64-
        // and 20-byte rows.
        let groups = MoeGroups::from_world(&comm, 2)?;
        for (sp, width) in [(false, h), (true, h), (false, odd), (true, odd)] {
            let ctx = MoeContext::new(&[5, 1], 2, rank / 2, rank % 2, sp)?;
            let x = filled(&dev, &[ctx.local_tokens(), width], rank)?;
            for ct in CommType::ALL {
                p.extend(measure(&nd, &format!("prepare + finalize {} sp {sp} h {width}", ct.name()), || {
                    let prepared = prepare(&x, ct, &ctx, &groups)?;
                    finalize(prepared.hidden, ct, &ctx, &groups).map(drop)
                }));
            }
        }

        // The shared-expert TP ops (SPEC section 6's split and gather for a
        // sequence-parallel shared expert), over the TP pairs.
        let tp = &groups.tp;
        let tokens = filled(&dev, &[5, h], rank)?;
        let part = shared_pad_split(&tokens, tp)?;
        p.extend(measure(&nd, "shared_pad_split", || shared_pad_split(&tokens, tp).map(drop)));
        p.extend(measure(&nd, "shared_gather_unpad", || shared_gather_unpad(&part, 5, tp).map(drop)));
        p.extend(measure(&nd, "shared_pad_reduce_scatter", || shared_pad_reduce_scatter(&tokens, tp).map(drop)));

        // The three reduction points, each on a policy where it reduces (TP 4).
        let early = ReducePolicy::new(SharedMode::TensorParallel, true, false, WORLD, WORLD)?;
        let late = ReducePolicy::new(SharedMode::TensorParallel, false, false, WORLD, WORLD)?;
        let ag = CommType::AllGather;
        assert!(early.routed_early_reduces(ag) && early.shared_reduces(ag) && late.final_reduces(ag));
        let mut held = Some(filled(&dev, &[8, h], rank)?);
        let mut point = |name: &str, f: &dyn Fn(Tensor) -> Result<Tensor>| {
            measure(&nd, name, || {
                let t = held.take().expect("the tensor goes through every point");
                held = Some(f(t)?);
                Ok(())
            })
        };
        p.extend(point("reduce_routed_early", &|t| early.reduce_routed_early(t, ag, &comm)));
        p.extend(point("reduce_shared", &|t| early.reduce_shared(t, ag, &comm)));
        p.extend(point("reduce_final", &|t| late.reduce_final(t, ag, &comm)));
        Ok(p)
    })
    .unwrap();
    assert_no_problems(reports);
}

static ALLOCS: AtomicUsize = AtomicUsize::new(0);
static FREES: AtomicUsize = AtomicUsize::new(0);

/// A test allocator over aclrtMalloc/aclrtFree (what an engine's caching
/// allocator would do once and then cache), counting its calls.
unsafe extern "C" fn test_alloc(ctx: *mut c_void, bytes: usize, _stream: *mut c_void) -> *mut c_void {
    assert_eq!(ctx as usize, 0xC0FFEE, "ctx is passed through unchanged");
    ALLOCS.fetch_add(1, Ordering::SeqCst);
    let api = acl_sys::acl().unwrap();
    let mut p = std::ptr::null_mut();
    // SAFETY: valid out-pointer, nonzero size, the op's device is bound.
    let rc = unsafe {
        (api.lib.aclrtMalloc.as_ref().unwrap())(&mut p, bytes, acl_sys::aclrtMemMallocPolicy::ACL_MEM_MALLOC_HUGE_FIRST)
    };
    if rc == 0 {
        p
    } else {
        std::ptr::null_mut()
    }
}

unsafe extern "C" fn test_free(_ctx: *mut c_void, ptr: *mut c_void, _bytes: usize, stream: *mut c_void) {
    FREES.fetch_add(1, Ordering::SeqCst);
    let api = acl_sys::acl().unwrap();
    // SAFETY: a live stream of the bound device; the test allocator frees
    // only after the stream drained (a caching allocator would keep the block).
    unsafe {
        (api.lib.aclrtSynchronizeStream.as_ref().unwrap())(stream);
        (api.lib.aclrtFree.as_ref().unwrap())(ptr);
    }
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn the_callers_allocator_serves_the_workspace_and_gets_every_block_back() {
    let dev = NpuDevice::open(0).unwrap();
    let d = Device::Npu(dev.clone());
    let (a0, f0) = (ALLOCS.load(Ordering::SeqCst), FREES.load(Ordering::SeqCst));
    dev.stream().set_allocator(Some(Allocator { alloc: test_alloc, free: test_free, ctx: 0xC0FFEE as *mut c_void }));
    let before = dev.stream().workspace_stats();
    let x = filled(&d, &[6, 16], 1).unwrap();
    let y = filled(&d, &[6, 16], 2).unwrap();
    let mut out = Tensor::zeros(&[6, 16], DType::F32, &d).unwrap();
    // The padded layout of a non-native finalize needs a scratch buffer; add
    // needs its aclnn workspace when it has one: count what was asked.
    d.backend().add(&x, &y, &mut out).unwrap();
    let scratch = d.backend().scratch(&[64, 16], DType::F32).unwrap();
    assert!(ALLOCS.load(Ordering::SeqCst) > a0, "the allocator was not called");
    drop(scratch);
    dev.check().unwrap();
    dev.stream().set_allocator(None);
    let after = dev.stream().workspace_stats();
    assert_eq!(after.segments, before.segments, "the pool did not grow while the allocator served");
    assert_eq!(
        ALLOCS.load(Ordering::SeqCst) - a0,
        FREES.load(Ordering::SeqCst) - f0,
        "every block went back to the allocator"
    );
    let want: Vec<f32> =
        x.to_vec::<f32>().unwrap().iter().zip(y.to_vec::<f32>().unwrap()).map(|(a, b)| a + b).collect();
    assert_eq!(out.to_vec::<f32>().unwrap(), want);
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn the_pool_reserves_ahead_reuses_blocks_and_never_grows_under_capture() {
    let dev = NpuDevice::open(1).unwrap();
    let d = Device::Npu(dev.clone());
    dev.stream().reserve_workspace(1 << 20).unwrap();
    let s0 = dev.stream().workspace_stats();
    assert_eq!(s0.segments, 1);
    assert!(s0.reserved_bytes >= 1 << 20);
    // Reserved: taking and returning blocks adds no segment.
    for _ in 0..3 {
        let a = d.backend().scratch(&[256, 256], DType::F32).unwrap(); // 256 KiB
        let b = d.backend().scratch(&[256, 256], DType::F32).unwrap();
        drop((a, b));
    }
    assert_eq!(dev.stream().workspace_stats().segments, 1, "the reserved segment served every block");

    // Under capture a request no free block holds fails clearly, without malloc.
    let api = acl_sys::acl().unwrap();
    let Ok(begin) = acl_sys::acl_symbol!(api, aclmdlRICaptureBegin) else {
        eprintln!("no graph capture API in this runtime");
        return;
    };
    let end = acl_sys::acl_symbol!(api, aclmdlRICaptureEnd).unwrap();
    let destroy = acl_sys::acl_symbol!(api, aclmdlRIDestroy).unwrap();
    dev.set_current().unwrap();
    // SAFETY: a live non-default stream of the bound device.
    assert_eq!(
        unsafe { begin(dev.stream().raw(), acl_sys::aclmdlRICaptureMode::ACL_MODEL_RI_CAPTURE_MODE_RELAXED) },
        0
    );
    assert!(dev.stream().is_capturing().unwrap());
    let fits = d.backend().scratch(&[256, 256], DType::F32);
    assert!(fits.is_ok(), "a reserved block is served under capture: {:?}", fits.err());
    let err = d.backend().scratch(&[1024, 1024], DType::F32).expect_err("4 MiB do not fit the 1 MiB reserve");
    let msg = err.to_string();
    assert!(msg.contains("captured") && msg.contains("reserve"), "{msg}");
    assert!(dev.stream().reserve_workspace(8 << 20).is_err(), "no reserve under capture");
    let err = dev.check().expect_err("a check would synchronise the capturing stream");
    assert!(err.to_string().contains("captured"), "{err}");
    drop(fits);
    let mut model: acl_sys::aclmdlRI = std::ptr::null_mut();
    // SAFETY: the stream began the capture; valid out-pointer.
    assert_eq!(unsafe { end(dev.stream().raw(), &mut model) }, 0);
    assert!(!dev.stream().is_capturing().unwrap());
    // SAFETY: the model just ended, never replayed.
    assert_eq!(unsafe { destroy(model) }, 0);
    assert_eq!(dev.stream().workspace_stats().segments, 1, "the pool did not grow under capture");
    // Outside capture it grows on demand.
    drop(d.backend().scratch(&[1024, 1024], DType::F32).unwrap());
    assert_eq!(dev.stream().workspace_stats().segments, 2);
}

/// The comm-type agreement check of `prepare` on the NPU compares the
/// gathered choices on the device: the call only enqueues (no sync, no host
/// read), ranks that agree pass their stream check, and when two DP groups
/// disagree every rank's stream check fails naming a rank of the other
/// choice. It can be captured and replayed.
#[test]
#[ignore = "needs an Ascend NPU"]
fn the_comm_type_agreement_check_runs_on_the_device() {
    use ascend_moe::moe::prepare_finalize::check_comm_type_agreement;
    let reports = npu_run_ranks(WORLD, &CommOptions::from_env(), |rank, comm| -> Result<Vec<String>> {
        let nd = npu(&comm.device()).clone();
        // Two staged copies: this rank's choice, from pinned memory, and the
        // device check's tiling.
        let mut p = measure_with_staging(&nd, "agreeing ranks", 2, || check_comm_type_agreement(CommType::Mc2, &comm));
        let mine = if rank < 2 { CommType::AllGather } else { CommType::Mc2 };
        check_comm_type_agreement(mine, &comm)?;
        match nd.check() {
            Err(e) => {
                let msg = e.to_string();
                let other = if rank < 2 { "MC2" } else { "ALLGATHER" };
                if !(msg.contains("disagree") && msg.contains(other) && msg.contains(&format!("rank {rank}"))) {
                    p.push(format!("disagreement reported as {msg}"));
                }
            }
            Ok(()) => p.push("a disagreement passed the stream check".into()),
        }
        nd.check().map_err(|e| ascend_moe::Error::invalid("test", "check", format!("reported twice: {e}")))?;
        // Captured with a disagreement, every replay reports it, once each.
        nd.set_current()?;
        let graph = common::graph::Graph::capture(nd.stream().raw(), || {
            check_comm_type_agreement(mine, &comm).expect("captured check");
        });
        for round in 0..2 {
            graph.replay(nd.stream().raw());
            match nd.check() {
                Err(e) if e.to_string().contains("disagree") => {}
                other => p.push(format!("replay {round}: {other:?}")),
            }
        }
        drop(graph);
        Ok(p)
    })
    .unwrap();
    assert_no_problems(reports);
}
