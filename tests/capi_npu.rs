//! The C ABI's NPU half: engine-owned streams, HCCL communicators and device
//! memory passed through the `extern "C"` functions, borrowed and never
//! freed. The NPU tests are ignored without an NPU (`ci/sim.sh` runs them on
//! the simulated runtime).

mod capi_common;

use std::ffi::c_void;
use std::ptr::{null, null_mut};

use ascend_moe::backend::npu::{DeviceBuffer, HcclComm, HcclRootInfo, NpuDevice};
use ascend_moe::capi::*;
use ascend_moe::{Collectives, Comm, CommOptions, ReduceOp, Tensor};
use capi_common::{desc, finalize_args, last_error};

#[test]
fn null_raw_handles_are_null_arguments() {
    let mut s: *mut amoe_stream = null_mut();
    // SAFETY: valid out-pointer; the raw handle is NULL on purpose.
    assert_eq!(unsafe { amoe_stream_wrap(null_mut(), 0, &mut s) }, amoe_status::NullArgument);
    assert!(last_error().contains("raw_acl_stream"), "{}", last_error());
    assert!(s.is_null());
    let mut c: *mut amoe_comm = null_mut();
    // SAFETY: as above.
    assert_eq!(unsafe { amoe_comm_from_hccl(null_mut(), 0, 0, &mut c) }, amoe_status::NullArgument);
    assert!(last_error().contains("raw_hccl_comm"), "{}", last_error());
    assert!(c.is_null());
    // A flag the export does not know is refused before anything is opened.
    let fake = 0x1000 as *mut c_void;
    // SAFETY: refused before the pointer is used.
    assert_eq!(unsafe { amoe_comm_from_hccl(fake, 0, 2, &mut c) }, amoe_status::InvalidArgument);
    assert!(last_error().contains("flags") && last_error().contains("AMOE_HCCL_WORLD"), "{}", last_error());
    assert!(c.is_null());
}

/// `amoe_native_kernel_check`: without CANN no native kernel can launch
/// (UNAVAILABLE, naming the AI Core library); under the simulator with the
/// host build compiled in, they launch (OK).
#[test]
fn the_native_kernel_check_says_whether_the_kernels_can_launch() {
    let st = amoe_native_kernel_check();
    let msg = last_error();
    let host_build = ascend_moe::backend::npu::probe().native_kernel.host_build;
    match acl_sys::acl() {
        Err(_) => {
            assert_eq!(st, amoe_status::Unavailable, "{msg}");
            assert!(msg.contains("amoe_native_kernel_check"), "{msg}");
            assert!(msg.contains("the AI Core kernel library is not loaded"), "{msg}");
        }
        Ok(api) if api.cannsim_launch_kernel.is_some() && host_build => assert_eq!(st, amoe_status::Ok, "{msg}"),
        // Real CANN: as the build's kernel library loads.
        Ok(_) => assert!(matches!(st, amoe_status::Ok | amoe_status::Unavailable), "{st:?}: {msg}"),
    }
}

#[test]
fn npu_descriptors_without_cann_are_unavailable_with_the_loaders_message() {
    let mut data = [1.0f32; 6];
    let idx_data = [0i32, 1];
    let (ps, is) = ([2usize, 3], [2usize]);
    let p = desc(data.as_mut_ptr().cast(), amoe_dtype::F32, &ps, amoe_device_kind::Npu, 0);
    let i = desc(idx_data.as_ptr() as *mut c_void, amoe_dtype::I32, &is, amoe_device_kind::Cpu, 0);
    let mut out = [0.0f32; 6];
    let o = desc(out.as_mut_ptr().cast(), amoe_dtype::F32, &ps, amoe_device_kind::Cpu, 0);
    // SAFETY: every descriptor points to live memory of its size (the NPU one
    // is never dereferenced: the call fails before).
    let st = unsafe { amoe_moe_token_unpermute(&p, &i, null(), &o, null()) };
    let msg = last_error();
    match acl_sys::acl() {
        Err(load) => {
            assert_eq!(st, amoe_status::Unavailable, "{msg}");
            assert!(msg.contains("`permuted` is an NPU tensor"), "{msg}");
            for a in &load.attempts {
                assert!(msg.contains(&*a.candidate.path.to_string_lossy()), "{msg}");
            }
            let fake = 0x1000usize as *mut c_void;
            let mut s: *mut amoe_stream = null_mut();
            // SAFETY: the call fails before the (fake) stream is used.
            assert_eq!(unsafe { amoe_stream_wrap(fake, 0, &mut s) }, amoe_status::Unavailable);
            assert!(s.is_null());
            let mut c: *mut amoe_comm = null_mut();
            // SAFETY: as above.
            assert_eq!(unsafe { amoe_comm_from_hccl(fake, 0, 0, &mut c) }, amoe_status::Unavailable);
            assert!(c.is_null());
        }
        Ok(_) => {
            // CANN (or its simulator) is loaded: an NPU tensor needs a stream.
            assert_eq!(st, amoe_status::Device, "{msg}");
            assert!(msg.contains("no stream was passed"), "{msg}");
        }
    }
}

const WORLD: usize = 2;
const H: usize = 4;

fn val(r: usize, i: usize) -> f32 {
    (((r * 31 + i * 7) % 17) as f32) - 8.0
}

fn ptr<T: ascend_moe::Element>(b: &DeviceBuffer<T>) -> *mut c_void {
    b.as_bytes().as_ptr()
}

/// One rank: everything through the C exports with NPU descriptors, against
/// naive references and the host path.
fn rank_body(rank: usize, root: &HcclRootInfo) -> ascend_moe::Result<()> {
    let ord = rank as i32;
    let dev = NpuDevice::open(rank as u32)?;
    let engine_stream = dev.new_stream()?;
    let hccl = HcclComm::from_root_info(&dev, root, WORLD, rank, &CommOptions::from_env())?;
    let mut s: *mut amoe_stream = null_mut();
    let mut c: *mut amoe_comm = null_mut();
    // SAFETY: a live stream and communicator of this device, outliving the handles.
    unsafe {
        assert_eq!(amoe_stream_wrap(engine_stream.raw(), rank as u32, &mut s), amoe_status::Ok, "{}", last_error());
        assert_eq!(amoe_comm_from_hccl(hccl.raw(), rank as u32, 0, &mut c), amoe_status::Ok, "{}", last_error());
    }
    let mut n = 0usize;
    // SAFETY: live handle, writable out.
    assert_eq!(unsafe { amoe_comm_world_size(c, &mut n) }, amoe_status::Ok);
    assert_eq!(n, WORLD);

    // all_reduce (sum) on device memory.
    let len = 12;
    let mine: Vec<f32> = (0..len).map(|i| val(rank, i)).collect();
    let want: Vec<f32> = (0..len).map(|i| (0..WORLD).map(|r| val(r, i)).sum()).collect();
    let src = dev.clone_htod(&mine)?;
    let dst = dev.alloc_zeros::<f32>(len)?;
    // The engine orders its own writes before handing memory over.
    dev.synchronize()?;
    let shape = [len];
    let sd = desc(ptr(&src), amoe_dtype::F32, &shape, amoe_device_kind::Npu, ord);
    let dd = desc(ptr(&dst), amoe_dtype::F32, &shape, amoe_device_kind::Npu, ord);
    // SAFETY: live handles; descriptors over live device memory of this device.
    let st = unsafe { amoe_all_reduce(c, &sd, &dd, 0, s) };
    assert_eq!(st, amoe_status::Ok, "{}", last_error());
    engine_stream.synchronize()?;
    assert_eq!(dst.to_vec()?, want, "all_reduce rank {rank}");

    // A descriptor on another device than the stream is a clear error.
    let other = desc(ptr(&src), amoe_dtype::F32, &shape, amoe_device_kind::Npu, ord + 1);
    // SAFETY: as above (the call fails before touching memory).
    let st = unsafe { amoe_all_reduce(c, &other, &dd, 0, s) };
    assert_eq!(st, amoe_status::Device);
    assert!(last_error().contains(&format!("the stream is on npu:{rank}")), "{}", last_error());

    // all_to_all_v in place (one device buffer as src and dst): HCCL refuses
    // one address for both, so the call is refused before HCCL sees it,
    // naming the overlap; one element to every rank through a separate dst works.
    let ones = [1usize; WORLD];
    let (a2a_shape, sd_a2a) = ([WORLD], desc(ptr(&src), amoe_dtype::F32, &[WORLD], amoe_device_kind::Npu, ord));
    // SAFETY: live handles; the descriptor covers WORLD of src's 12 elements; counts of world length.
    let st = unsafe { amoe_all_to_all_v(c, &sd_a2a, ones.as_ptr(), WORLD, &sd_a2a, ones.as_ptr(), WORLD, s) };
    assert_eq!(st, amoe_status::InvalidArgument, "{}", last_error());
    let msg = last_error();
    assert!(msg.contains("all_to_all_v") && msg.contains("overlap") && msg.contains("in place"), "{msg}");
    let a2a_dst = dev.alloc_zeros::<f32>(WORLD)?;
    dev.synchronize()?;
    let dd_a2a = desc(ptr(&a2a_dst), amoe_dtype::F32, &a2a_shape, amoe_device_kind::Npu, ord);
    // SAFETY: as above.
    let st = unsafe { amoe_all_to_all_v(c, &sd_a2a, ones.as_ptr(), WORLD, &dd_a2a, ones.as_ptr(), WORLD, s) };
    assert_eq!(st, amoe_status::Ok, "{}", last_error());
    engine_stream.synchronize()?;
    // Element i of rank r's dst is element r of rank i's src.
    assert_eq!(a2a_dst.to_vec()?, (0..WORLD).map(|i| val(i, rank)).collect::<Vec<_>>(), "all_to_all_v rank {rank}");

    // maybe_pad_and_reduce: rank r keeps sum over ranks of block r.
    let local = [3usize, 1];
    let rows: usize = local.iter().sum();
    let x: Vec<f32> = (0..rows * H).map(|i| val(rank + 5, i)).collect();
    let off = local[..rank].iter().sum::<usize>() * H;
    let want: Vec<f32> = (off..off + local[rank] * H).map(|i| (0..WORLD).map(|r| val(r + 5, i)).sum()).collect();
    let xb = dev.clone_htod(&x)?;
    let ob = dev.alloc_zeros::<f32>(local[rank] * H)?;
    dev.synchronize()?;
    let (xs, os) = ([rows, H], [local[rank], H]);
    let xd = desc(ptr(&xb), amoe_dtype::F32, &xs, amoe_device_kind::Npu, ord);
    let od = desc(ptr(&ob), amoe_dtype::F32, &os, amoe_device_kind::Npu, ord);
    // SAFETY: as above.
    let st = unsafe { amoe_maybe_pad_and_reduce(&xd, local.as_ptr(), local.len(), c, &od, s) };
    assert_eq!(st, amoe_status::Ok, "{}", last_error());
    engine_stream.synchronize()?;
    assert_eq!(ob.to_vec()?, want, "maybe_pad_and_reduce rank {rank}");
    // The same into the first rows of `x` itself (read from a copy).
    let on_x = desc(ptr(&xb), amoe_dtype::F32, &os, amoe_device_kind::Npu, ord);
    // SAFETY: as above.
    let st = unsafe { amoe_maybe_pad_and_reduce(&xd, local.as_ptr(), local.len(), c, &on_x, s) };
    assert_eq!(st, amoe_status::Ok, "{}", last_error());
    engine_stream.synchronize()?;
    assert_eq!(xb.to_vec()?[..local[rank] * H], want[..], "maybe_pad_and_reduce into its own `x`, rank {rank}");

    // moe_finalize_routing: NPU descriptors equal the host path.
    let (t, k) = (3usize, 2usize);
    let ex: Vec<f32> = (0..t * k * H).map(|i| val(rank + 9, i) * 0.5).collect();
    let rowidx: Vec<i32> = vec![3, 0, 5, 1, 4, 2];
    let scales: Vec<f32> = (0..t * k).map(|i| 0.25 * (i as f32 + 1.0)).collect();
    let mut host_out = vec![0.0f32; t * H];
    let (exs, ris, scs, outs) = ([t * k, H], [t * k], [t, k], [t, H]);
    let mut exh = ex.clone();
    let mut rih = rowidx.clone();
    let mut sch = scales.clone();
    let hx = desc(exh.as_mut_ptr().cast(), amoe_dtype::F32, &exs, amoe_device_kind::Cpu, 0);
    let hr = desc(rih.as_mut_ptr().cast(), amoe_dtype::I32, &ris, amoe_device_kind::Cpu, 0);
    let hs = desc(sch.as_mut_ptr().cast(), amoe_dtype::F32, &scs, amoe_device_kind::Cpu, 0);
    let ho = desc(host_out.as_mut_ptr().cast(), amoe_dtype::F32, &outs, amoe_device_kind::Cpu, 0);
    let args = |x: &amoe_tensor, r: &amoe_tensor, sc: &amoe_tensor| amoe_finalize_args {
        scales: sc,
        ..finalize_args(x, r, 0)
    };
    // SAFETY: host descriptors over live memory; no stream for host tensors.
    let st = unsafe { amoe_moe_finalize_routing(&args(&hx, &hr, &hs), &ho, null()) };
    assert_eq!(st, amoe_status::Ok, "{}", last_error());
    assert!(host_out.iter().any(|&v| v != 0.0));
    let (exb, rib, scb) = (dev.clone_htod(&ex)?, dev.clone_htod(&rowidx)?, dev.clone_htod(&scales)?);
    let nob = dev.alloc_zeros::<f32>(t * H)?;
    dev.synchronize()?;
    let nx = desc(ptr(&exb), amoe_dtype::F32, &exs, amoe_device_kind::Npu, ord);
    let nr = desc(ptr(&rib), amoe_dtype::I32, &ris, amoe_device_kind::Npu, ord);
    let ns = desc(ptr(&scb), amoe_dtype::F32, &scs, amoe_device_kind::Npu, ord);
    let no = desc(ptr(&nob), amoe_dtype::F32, &outs, amoe_device_kind::Npu, ord);
    // SAFETY: descriptors over live device memory of the stream's device.
    let st = unsafe { amoe_moe_finalize_routing(&args(&nx, &nr, &ns), &no, s) };
    assert_eq!(st, amoe_status::Ok, "{}", last_error());
    engine_stream.synchronize()?;
    assert_eq!(nob.to_vec()?, host_out, "finalize rank {rank}");
    // SPEC section 1, mode 0 (column layout): out[i] = sum_k s(i,k) * row(idx[k*T + i]);
    // every value is a multiple of 1/8, so the sums are exact.
    let mut spec = vec![0.0f32; t * H];
    for i in 0..t {
        for kk in 0..k {
            let row = rowidx[kk * t + i] as usize;
            for c in 0..H {
                spec[i * H + c] += scales[i * k + kk] * ex[row * H + c];
            }
        }
    }
    assert_eq!(host_out, spec, "finalize rank {rank}: SPEC's value");

    // An NPU output over an input's memory gets the result a separate output
    // gets, as on the host: the op writes workspace, then one device copy.
    // Unpermute, K = 1 and no probs: a row gather of `permuted` [T*K, H] by
    // the six row indices into itself.
    let pb = dev.clone_htod(&ex)?;
    dev.synchronize()?;
    let np = desc(ptr(&pb), amoe_dtype::F32, &exs, amoe_device_kind::Npu, ord);
    // SAFETY: descriptors over live device memory of the stream's device.
    let st = unsafe { amoe_moe_token_unpermute(&np, &nr, null(), &np, s) };
    assert_eq!(st, amoe_status::Ok, "{}", last_error());
    engine_stream.synchronize()?;
    let gathered: Vec<f32> = rowidx.iter().flat_map(|&r| ex[r as usize * H..(r as usize + 1) * H].to_vec()).collect();
    assert_eq!(pb.to_vec()?, gathered, "unpermute into its own `permuted`, rank {rank}");
    // Finalize into the first T rows of its own `expanded_x`.
    let on_x = desc(ptr(&exb), amoe_dtype::F32, &outs, amoe_device_kind::Npu, ord);
    // SAFETY: as above.
    let st = unsafe { amoe_moe_finalize_routing(&args(&nx, &nr, &ns), &on_x, s) };
    assert_eq!(st, amoe_status::Ok, "{}", last_error());
    engine_stream.synchronize()?;
    assert_eq!(exb.to_vec()?[..t * H], spec[..], "finalize into its own `expanded_x`, rank {rank}");

    // A bad index where the native kernel launches (native or aclnn finalize)
    // is found on the device: the op queues the work and returns OK;
    // amoe_stream_check reports the index, its position and value, once.
    // Elsewhere the op reads the indices first and returns the error itself.
    // The check of NULL (host-only work) is OK.
    let bad = dev.clone_htod(&[3i32, 0, 5, 1, 9, 2])?;
    dev.synchronize()?;
    let nb = desc(ptr(&bad), amoe_dtype::I32, &ris, amoe_device_kind::Npu, ord);
    // SAFETY: as above.
    let st = unsafe { amoe_moe_finalize_routing(&args(&nx, &nb, &ns), &no, s) };
    let st = if dev.checks_indices_on_device() {
        assert_eq!(st, amoe_status::Ok, "{}", last_error());
        // SAFETY: a live stream handle.
        unsafe { amoe_stream_check(s) }
    } else {
        st
    };
    assert_eq!(st, amoe_status::IndexOutOfRange, "{}", last_error());
    let msg = last_error();
    assert!(msg.contains("expanded_row_idx") && msg.contains('4') && msg.contains('9'), "{msg}");
    // SAFETY: as above.
    assert_eq!(unsafe { amoe_stream_check(s) }, amoe_status::Ok, "reported once: {}", last_error());
    // SAFETY: NULL is accepted.
    assert_eq!(unsafe { amoe_stream_check(null()) }, amoe_status::Ok);

    // Reduction point 3 (TP 4, no routed transform, no SP: it reduces) into
    // the caller's `out`, then in place; `x` stays unchanged in the first.
    let pol = amoe_reduce_policy { shared_mode: 0, has_routed_transform: 0, sp: 0, tp_size: WORLD, ep_size: WORLD };
    let xv: Vec<f32> = (0..len).map(|i| val(rank + 2, i)).collect();
    let want: Vec<f32> = (0..len).map(|i| (0..WORLD).map(|r| val(r + 2, i)).sum()).collect();
    let xr = dev.clone_htod(&xv)?;
    let or = dev.alloc_zeros::<f32>(len)?;
    dev.synchronize()?;
    let xdsc = desc(ptr(&xr), amoe_dtype::F32, &shape, amoe_device_kind::Npu, ord);
    let odsc = desc(ptr(&or), amoe_dtype::F32, &shape, amoe_device_kind::Npu, ord);
    // SAFETY: live handles; descriptors over live device memory of this device.
    let st = unsafe { amoe_reduce_final(&pol, &xdsc, 0, c, &odsc, s) };
    assert_eq!(st, amoe_status::Ok, "{}", last_error());
    assert_eq!(xr.to_vec()?, xv, "reduce_final leaves x alone, rank {rank}");
    // SAFETY: as above, in place.
    let st = unsafe { amoe_reduce_final(&pol, &xdsc, 0, c, &xdsc, s) };
    assert_eq!(st, amoe_status::Ok, "{}", last_error());
    // SAFETY: a live stream handle.
    assert_eq!(unsafe { amoe_stream_check(s) }, amoe_status::Ok, "{}", last_error());
    assert_eq!(or.to_vec()?, want, "reduce_final into out, rank {rank}");
    assert_eq!(xr.to_vec()?, want, "reduce_final in place, rank {rank}");

    // A binding's refusal on HCCL sends nothing: OK at once, and the group's
    // next collective (below) still pairs with its peers'.
    let msg = std::ffi::CString::new("binding: refused").expect("no NUL");
    // SAFETY: a live handle; a C string.
    unsafe {
        assert_eq!(amoe_comm_refuse(c, msg.as_ptr()), amoe_status::Ok, "{}", last_error());
        assert_eq!(amoe_reduce_refuse(c, 1, msg.as_ptr()), amoe_status::Ok, "{}", last_error());
    }

    // Freeing the handles leaves the engine's stream, communicator and memory alone.
    // SAFETY: live handles, not used afterwards.
    unsafe {
        amoe_stream_free(s);
        amoe_comm_free(c);
    }
    engine_stream.synchronize()?;
    let comm = Comm::Npu(hccl);
    let a = Tensor::from_slice(&mine, &[len])?.to_device(&comm.device())?;
    let mut b = Tensor::zeros(&[len], ascend_moe::DType::F32, &comm.device())?;
    comm.all_reduce(&a, &mut b, ReduceOp::Sum)?;
    let again: Vec<f32> = (0..len).map(|i| (0..WORLD).map(|r| val(r, i)).sum()).collect();
    assert_eq!(b.to_vec::<f32>()?, again);
    assert_eq!(src.to_vec()?, mine, "the caller's input is intact and still allocated");
    Ok(())
}

/// `body(rank, root)` on a thread per rank of a `WORLD`-rank HCCL world
/// rooted at npu:0; the ranks' results in rank order (a panic re-raised).
fn on_ranks<R: Send>(body: impl Fn(usize, &HcclRootInfo) -> R + Sync) -> Vec<R> {
    let root = HcclRootInfo::generate(&NpuDevice::open(0).expect("npu:0")).expect("root info");
    std::thread::scope(|sc| {
        let (body, root) = (&body, &root);
        let hs: Vec<_> = (0..WORLD).map(|r| sc.spawn(move || body(r, root))).collect();
        hs.into_iter().enumerate().map(|(r, h)| h.join().unwrap_or_else(|_| panic!("rank {r} panicked"))).collect()
    })
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn c_abi_runs_collectives_and_ops_on_borrowed_npu_memory_streams_and_comms() {
    for (r, res) in on_ranks(rank_body).into_iter().enumerate() {
        res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

/// HCCL reduces only buffers aligned to their elements (HcclAllReduce.md,
/// HcclReduceScatter.md): a caller's pointer two bytes into f32 memory is
/// refused naming the operand and the rule, on the call, before HCCL; one
/// element in, the same memory reduces.
#[test]
#[ignore = "needs an Ascend NPU"]
fn a_reduction_of_npu_memory_not_aligned_to_its_elements_is_refused_naming_it() {
    let dev = NpuDevice::open(0).expect("npu:0");
    let root = HcclRootInfo::generate(&dev).expect("root info");
    let engine_stream = dev.new_stream().expect("stream");
    let hccl = HcclComm::from_root_info(&dev, &root, 1, 0, &CommOptions::from_env()).expect("one-rank world");
    let (mut s, mut c): (*mut amoe_stream, *mut amoe_comm) = (null_mut(), null_mut());
    // SAFETY: a live stream and communicator of this device, outliving the handles.
    unsafe {
        assert_eq!(amoe_stream_wrap(engine_stream.raw(), 0, &mut s), amoe_status::Ok, "{}", last_error());
        assert_eq!(amoe_comm_from_hccl(hccl.raw(), 0, 0, &mut c), amoe_status::Ok, "{}", last_error());
    }
    let src = dev.clone_htod(&[1.0f32, 2.0, 3.0, 4.0, 5.0]).expect("src");
    let dst = dev.alloc_zeros::<f32>(5).expect("dst");
    dev.synchronize().expect("sync");
    let at = |b: &DeviceBuffer<f32>, off: usize| ptr(b).cast::<u8>().wrapping_add(off).cast::<c_void>();
    let shape = [4usize];
    let f32_at = |p| desc(p, amoe_dtype::F32, &shape, amoe_device_kind::Npu, 0);
    for (what, s_off, d_off) in [("src", 2, 0), ("dst", 0, 2)] {
        let (sd, dd) = (f32_at(at(&src, s_off)), f32_at(at(&dst, d_off)));
        // SAFETY: live handles; 16 bytes of each buffer from the offset are live device memory.
        let st = unsafe { amoe_all_reduce(c, &sd, &dd, 0, s) };
        let msg = last_error();
        assert_eq!(st, amoe_status::InvalidArgument, "{msg}");
        assert!(msg.contains(&format!("`{what}`")) && msg.contains("not aligned to its 4-byte f32 elements"), "{msg}");
        // SAFETY: as above.
        let st = unsafe { amoe_reduce_scatter(c, &sd, &dd, 0, s) };
        assert_eq!(st, amoe_status::InvalidArgument, "{}", last_error());
    }
    let (sd, dd) = (f32_at(at(&src, 4)), f32_at(at(&dst, 4)));
    // SAFETY: as above.
    let st = unsafe { amoe_all_reduce(c, &sd, &dd, 0, s) };
    assert_eq!(st, amoe_status::Ok, "{}", last_error());
    engine_stream.synchronize().expect("sync");
    assert_eq!(dst.to_vec().expect("dst"), [0.0, 2.0, 3.0, 4.0, 5.0], "one rank's sum is its own input");
    // SAFETY: handles made above, freed once.
    unsafe {
        amoe_comm_free(c);
        amoe_stream_free(s);
    }
}

/// A barrier on a CPU communicator given an NPU stream is refused on the
/// rank that passed it, and its peer, waiting in the barrier, fails at once
/// quoting that rank's reason (the timeout is far away: one rank keeps its
/// handle until the other returned).
#[test]
#[ignore = "needs an Ascend NPU"]
fn a_cpu_barrier_given_a_stream_fails_its_peers_too() {
    let dev = NpuDevice::open(0).expect("npu:0");
    let engine_stream = dev.new_stream().expect("stream");
    let mut s: *mut amoe_stream = null_mut();
    // SAFETY: a live stream of this device, outliving the handle.
    assert_eq!(unsafe { amoe_stream_wrap(engine_stream.raw(), 0, &mut s) }, amoe_status::Ok, "{}", last_error());
    let stream = s as usize;
    let name = std::ffi::CString::new(format!("capi-npu-barrier-{}", std::process::id())).expect("no NUL");
    let both_returned = std::sync::Barrier::new(2);
    let res: Vec<(amoe_status, String)> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..2usize)
            .map(|r| {
                let (name, both_returned) = (&name, &both_returned);
                sc.spawn(move || {
                    let mut c: *mut amoe_comm = null_mut();
                    // SAFETY: a valid name and out-pointer.
                    let st = unsafe { amoe_comm_cpu_new(name.as_ptr(), 2, r, 60.0, &mut c) };
                    assert_eq!(st, amoe_status::Ok, "{}", last_error());
                    let on = if r == 0 { stream as *const amoe_stream } else { null() };
                    // SAFETY: live handles.
                    let st = unsafe { amoe_barrier(c, on) };
                    let msg = last_error();
                    both_returned.wait();
                    // SAFETY: the handle made above, freed once.
                    unsafe { amoe_comm_free(c) };
                    (st, msg)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    assert_eq!(res[0].0, amoe_status::Device, "{}", res[0].1);
    assert!(res[0].1.contains("npu:0") && res[0].1.contains("cpu"), "{}", res[0].1);
    assert_eq!(res[1].0, amoe_status::CommMismatch, "{}", res[1].1);
    // The peer quotes rank 0's reason (its message after the export's name).
    let reason = res[0].1.strip_prefix("amoe_barrier: ").expect("named by its export");
    assert!(res[1].1.contains("rank 0") && res[1].1.contains(reason), "{}", res[1].1);
    // SAFETY: the handle made above, freed once.
    unsafe { amoe_stream_free(s) };
}

/// An op over NPU inputs writes an NPU output on the stream: a host `out`
/// would need a device-to-host copy and a synchronisation, which the NPU
/// ops never make. It is refused before any work, naming `out`, and left
/// unwritten.
#[test]
#[ignore = "needs an Ascend NPU"]
fn an_op_over_npu_inputs_refuses_a_host_output() {
    let dev = NpuDevice::open(0).expect("npu:0");
    let engine_stream = dev.new_stream().expect("stream");
    let mut s: *mut amoe_stream = null_mut();
    // SAFETY: a live stream of this device, outliving the handle.
    assert_eq!(unsafe { amoe_stream_wrap(engine_stream.raw(), 0, &mut s) }, amoe_status::Ok, "{}", last_error());
    let name = std::ffi::CString::new(format!("capi-npu-host-out-{}", std::process::id())).expect("no NUL");
    let mut c: *mut amoe_comm = null_mut();
    // SAFETY: a valid name and out-pointer.
    assert_eq!(unsafe { amoe_comm_cpu_new(name.as_ptr(), 1, 0, 20.0, &mut c) }, amoe_status::Ok, "{}", last_error());
    let x = dev.clone_htod(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]).expect("x");
    let idx = dev.clone_htod(&[0i32, 1, 2, 3]).expect("idx");
    dev.synchronize().expect("sync");
    let (xs, is) = ([4usize, 2], [4usize]);
    let xd = desc(ptr(&x), amoe_dtype::F32, &xs, amoe_device_kind::Npu, 0);
    let id = desc(ptr(&idx), amoe_dtype::I32, &is, amoe_device_kind::Npu, 0);
    let mut host = [-1.0f32; 8];
    let od = desc(host.as_mut_ptr().cast(), amoe_dtype::F32, &xs, amoe_device_kind::Cpu, 0);

    // SAFETY: live handles; the descriptors point at live memory of their sizes.
    let st = unsafe { amoe_shared_pad_split(&xd, c, &od, s) };
    let msg = last_error();
    assert_eq!(st, amoe_status::Device, "{msg}");
    assert!(msg.contains("amoe_shared_pad_split") && msg.contains("`out`"), "{msg}");
    let args = finalize_args(&xd, &id, amoe_drop_pad_mode::DropLessColumn as u32);
    // SAFETY: as above.
    let st = unsafe { amoe_moe_finalize_routing(&args, &od, s) };
    let msg = last_error();
    assert_eq!(st, amoe_status::Device, "{msg}");
    assert!(msg.contains("amoe_moe_finalize_routing") && msg.contains("`out`"), "{msg}");
    assert_eq!(host, [-1.0f32; 8], "the host output is not written");
    // SAFETY: the handles made above, freed once.
    unsafe {
        amoe_comm_free(c);
        amoe_stream_free(s);
    }
}

/// An engine thread whose current device is npu:0 (torch_npu's) calls the
/// C ABI with a stream of npu:1: each call binds npu:1 for its work and
/// returns with npu:0 current again, so the engine's next call on the
/// thread is not sent to npu:1.
#[test]
#[ignore = "needs an Ascend NPU"]
fn a_call_on_another_devices_stream_leaves_the_callers_device_current() {
    let api = acl_sys::acl().expect("ACL");
    let current = || {
        let mut id = -1i32;
        // SAFETY: a writable out-pointer.
        assert_eq!(unsafe { (api.lib.aclrtGetDevice.as_ref().expect("aclrtGetDevice"))(&mut id) }, 0);
        id
    };
    let dev1 = NpuDevice::open(1).expect("npu:1");
    let engine_stream = dev1.new_stream().expect("stream");
    let dev0 = NpuDevice::open(0).expect("npu:0");
    dev0.set_current().expect("npu:0 current");
    assert_eq!(current(), 0);
    let mut s: *mut amoe_stream = null_mut();
    // SAFETY: a live stream of npu:1, outliving the handle.
    assert_eq!(unsafe { amoe_stream_wrap(engine_stream.raw(), 1, &mut s) }, amoe_status::Ok, "{}", last_error());
    assert_eq!(current(), 0, "amoe_stream_wrap left npu:1 current");
    let src = dev1.clone_htod(&[1.0f32, 2.0, 3.0]).expect("src");
    dev1.synchronize().expect("sync");
    dev0.set_current().expect("npu:0 current");
    let shape = [3usize];
    let d = desc(ptr(&src), amoe_dtype::F32, &shape, amoe_device_kind::Npu, 1);
    let mut c: *mut amoe_comm = null_mut();
    let root = HcclRootInfo::generate(&dev1).expect("root info");
    let hccl = HcclComm::from_root_info(&dev1, &root, 1, 0, &CommOptions::from_env()).expect("one-rank world");
    dev0.set_current().expect("npu:0 current");
    // SAFETY: live handles of npu:1; `src` holds 3 live f32.
    unsafe {
        assert_eq!(amoe_comm_from_hccl(hccl.raw(), 1, 0, &mut c), amoe_status::Ok, "{}", last_error());
        assert_eq!(current(), 0, "amoe_comm_from_hccl left npu:1 current");
        assert_eq!(amoe_all_reduce(c, &d, &d, 0, s), amoe_status::Ok, "{}", last_error());
        assert_eq!(current(), 0, "amoe_all_reduce left npu:1 current");
        assert_eq!(amoe_stream_check(s), amoe_status::Ok, "{}", last_error());
        assert_eq!(current(), 0, "amoe_stream_check left npu:1 current");
        amoe_comm_free(c);
        amoe_stream_free(s);
    }
    assert_eq!(current(), 0, "freeing the handles left npu:1 current");
    assert_eq!(src.to_vec().expect("src"), [1.0, 2.0, 3.0], "one rank's sum is its own input");
}

/// An engine that loaded the runtime itself (as torch_npu does) may make its
/// first call into this library on another device's stream: `amoe_stream_wrap`
/// loads the runtime before it reads the current device, so it still returns
/// with the engine's device current. Runs again in a child process, where no
/// other test loaded the runtime through this library first.
#[test]
#[ignore = "needs an Ascend NPU"]
fn a_first_call_on_another_devices_stream_leaves_the_engines_device_current() {
    const CHILD: &str = "AMOE_TEST_FIRST_NPU_CALL";
    const NAME: &str = "a_first_call_on_another_devices_stream_leaves_the_engines_device_current";
    if std::env::var_os(CHILD).is_none() {
        ascend_moe::testing::runtime::run_ignored_test_in_child(NAME, &[(CHILD, "1")]);
        return;
    }
    assert!(acl_sys::acl_if_loaded().is_none(), "the runtime was loaded through this library before the engine");
    type Init = unsafe extern "C" fn(*const std::ffi::c_char) -> i32;
    type SetDevice = unsafe extern "C" fn(i32) -> i32;
    type GetDevice = unsafe extern "C" fn(*mut i32) -> i32;
    type CreateStream = unsafe extern "C" fn(*mut *mut c_void) -> i32;
    type DestroyStream = unsafe extern "C" fn(*mut c_void) -> i32;
    // The engine's own handle on the runtime: the library this one loads too
    // (`ASCEND_MOE_ACL_LIB`, else the soname), so both use one instance.
    let path = std::env::var("ASCEND_MOE_ACL_LIB").unwrap_or_else(|_| "libascendcl.so".into());
    // SAFETY: the ACL runtime; loading it runs no initialiser with preconditions.
    let lib = unsafe { libloading::Library::new(&path) }.expect("the ACL runtime");
    // SAFETY: the ACL signatures of these symbols (acl_rt.h, acl_base.h).
    let (init, set, get, create, destroy) = unsafe {
        (
            *lib.get::<Init>(b"aclInit\0").expect("aclInit"),
            *lib.get::<SetDevice>(b"aclrtSetDevice\0").expect("aclrtSetDevice"),
            *lib.get::<GetDevice>(b"aclrtGetDevice\0").expect("aclrtGetDevice"),
            *lib.get::<CreateStream>(b"aclrtCreateStream\0").expect("aclrtCreateStream"),
            *lib.get::<DestroyStream>(b"aclrtDestroyStream\0").expect("aclrtDestroyStream"),
        )
    };
    let current = || {
        let mut id = -1;
        // SAFETY: a writable out-pointer.
        assert_eq!(unsafe { get(&mut id) }, 0, "aclrtGetDevice");
        id
    };
    let mut raw = null_mut();
    // SAFETY: plain runtime calls with valid arguments and out-pointers.
    unsafe {
        assert_eq!(init(null()), 0, "aclInit");
        assert_eq!(set(1), 0, "aclrtSetDevice(1)");
        assert_eq!(create(&mut raw), 0, "aclrtCreateStream on npu:1");
        assert_eq!(set(0), 0, "aclrtSetDevice(0)");
    }
    let mut s: *mut amoe_stream = null_mut();
    // SAFETY: a live stream of npu:1, outliving the handle.
    assert_eq!(unsafe { amoe_stream_wrap(raw, 1, &mut s) }, amoe_status::Ok, "{}", last_error());
    assert_eq!(current(), 0, "the first call, amoe_stream_wrap, left npu:1 current");
    // SAFETY: the live handle, not used afterwards.
    unsafe { amoe_stream_free(s) };
    assert_eq!(current(), 0, "amoe_stream_free left npu:1 current");
    // SAFETY: the engine's stream, no longer wrapped.
    unsafe {
        assert_eq!(set(1), 0, "aclrtSetDevice(1)");
        assert_eq!(destroy(raw), 0, "aclrtDestroyStream");
    }
}

/// The opt-in comm-type agreement of a reduction point
/// (`ASCEND_MOE_CHECK_COMM_TYPE=1`) through the C ABI, on an engine's HCCL
/// communicator and stream: the agreement runs on the call's stream, so TP
/// ranks that chose other comm types fail that stream's check naming the
/// choices, on every rank; ranks that agree pass it.
#[test]
#[ignore = "needs an Ascend NPU"]
fn a_reduction_points_comm_type_check_runs_on_the_calls_stream() {
    const VAR: &str = "ASCEND_MOE_CHECK_COMM_TYPE";
    let rank_body = |rank: usize, root: &HcclRootInfo| -> ascend_moe::Result<(amoe_status, String)> {
        let dev = NpuDevice::open(rank as u32)?;
        let engine_stream = dev.new_stream()?;
        let hccl = HcclComm::from_root_info(&dev, root, WORLD, rank, &CommOptions::from_env())?;
        let (mut s, mut c): (*mut amoe_stream, *mut amoe_comm) = (null_mut(), null_mut());
        let shape = [4usize];
        let x = dev.clone_htod(&[rank as f32 + 1.0; 4])?;
        dev.synchronize()?;
        let xd = desc(ptr(&x), amoe_dtype::F32, &shape, amoe_device_kind::Npu, rank as i32);
        let pol = amoe_reduce_policy { shared_mode: 0, has_routed_transform: 0, sp: 0, tp_size: WORLD, ep_size: WORLD };
        // SAFETY: a live stream and communicator of this device, outliving the
        // handles; the descriptors are over live device memory of this device.
        unsafe {
            assert_eq!(amoe_stream_wrap(engine_stream.raw(), rank as u32, &mut s), amoe_status::Ok, "{}", last_error());
            assert_eq!(amoe_comm_from_hccl(hccl.raw(), rank as u32, 0, &mut c), amoe_status::Ok, "{}", last_error());
            // Every rank chose MC2 (1): the check passes.
            assert_eq!(amoe_reduce_final(&pol, &xd, 1, c, &xd, s), amoe_status::Ok, "{}", last_error());
            assert_eq!(amoe_stream_check(s), amoe_status::Ok, "agreeing ranks: {}", last_error());
            // Rank 0 chose ALLTOALL (2), the others MC2.
            let comm_type = if rank == 0 { 2 } else { 1 };
            assert_eq!(amoe_reduce_final(&pol, &xd, comm_type, c, &xd, s), amoe_status::Ok, "{}", last_error());
            let st = amoe_stream_check(s);
            let text = last_error();
            amoe_stream_free(s);
            amoe_comm_free(c);
            Ok((st, text))
        }
    };
    // SAFETY: run alone (--ignored --test-threads=1, as ci/sim.sh does); the
    // variable is set before the rank threads start and removed after they joined.
    std::env::set_var(VAR, "1");
    let results = on_ranks(rank_body);
    std::env::remove_var(VAR);
    for (rank, r) in results.into_iter().enumerate() {
        let (st, text) = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_ne!(st, amoe_status::Ok, "rank {rank}: the comm types differ");
        assert!(text.contains("comm type") && text.contains("ALLTOALL") && text.contains("MC2"), "rank {rank}: {text}");
    }
}

/// Every export with an output refuses one in other memory than its inputs,
/// an NPU output of host inputs as a host output of NPU inputs, with DEVICE
/// and one message naming the output and both memories, before any work (no
/// op copies its result between host and NPU memory; an NPU op never
/// synchronises the host). The memory is checked first, as the Rust ops
/// check it: an output of the wrong dtype too is still DEVICE.
#[test]
#[ignore = "needs an Ascend NPU"]
fn every_export_refuses_an_output_in_other_memory_than_its_inputs() {
    let dev = NpuDevice::open(0).expect("npu:0");
    let engine_stream = dev.new_stream().expect("stream");
    let name = std::ffi::CString::new(format!("capi-npu-mixed-out-{}", std::process::id())).expect("no NUL");
    let (mut s, mut c, mut g): (*mut amoe_stream, *mut amoe_comm, *mut amoe_moe_groups) =
        (null_mut(), null_mut(), null_mut());
    // SAFETY: a live stream of this device, outliving the handle; a valid name and out-pointers.
    unsafe {
        assert_eq!(amoe_stream_wrap(engine_stream.raw(), 0, &mut s), amoe_status::Ok, "{}", last_error());
        assert_eq!(amoe_comm_cpu_new(name.as_ptr(), 1, 0, 20.0, &mut c), amoe_status::Ok, "{}", last_error());
        assert_eq!(amoe_moe_groups_new(c, 1, 1, &mut g), amoe_status::Ok, "{}", last_error());
    }
    let xv = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
    let iv = [0i32, 1, 2, 3];
    let (x_npu, idx_npu, out_npu) =
        (dev.clone_htod(&xv).expect("x"), dev.clone_htod(&iv).expect("idx"), dev.alloc_zeros::<f32>(8).expect("out"));
    dev.synchronize().expect("sync");
    let (mut x_host, mut idx_host, mut out_host) = (xv, iv, [-1.0f32; 8]);
    let (xs, is, dp, ones) = ([4usize, 2], [4usize], [4usize], [4usize]);
    let ctx = amoe_moe_context { dp_tokens: dp.as_ptr(), dp_size: 1, tp_size: 1, ..Default::default() };
    let pol = amoe_reduce_policy { shared_mode: 0, has_routed_transform: 0, sp: 0, tp_size: 1, ep_size: 1 };
    let host_mem = |p: *mut c_void, dtype| desc(p, dtype, &xs, amoe_device_kind::Cpu, 0);
    let npu_mem = |p: *mut c_void, dtype| desc(p, dtype, &xs, amoe_device_kind::Npu, 0);
    for inputs_on_npu in [false, true] {
        let (x, idx) = if inputs_on_npu {
            (npu_mem(ptr(&x_npu), amoe_dtype::F32), desc(ptr(&idx_npu), amoe_dtype::I32, &is, amoe_device_kind::Npu, 0))
        } else {
            let idx = desc(idx_host.as_mut_ptr().cast(), amoe_dtype::I32, &is, amoe_device_kind::Cpu, 0);
            (host_mem(x_host.as_mut_ptr().cast(), amoe_dtype::F32), idx)
        };
        let (inputs, output) = if inputs_on_npu { ("npu:0", "cpu") } else { ("cpu", "npu:0") };
        for out_dtype in [amoe_dtype::F32, amoe_dtype::I32] {
            let out = if inputs_on_npu {
                host_mem(out_host.as_mut_ptr().cast(), out_dtype)
            } else {
                npu_mem(ptr(&out_npu), out_dtype)
            };
            let fin = finalize_args(&x, &idx, amoe_drop_pad_mode::DropLessColumn as u32);
            let (x, out, fin) = (&x, &out, &fin);
            let check = |f: &str, arg: &str, st: amoe_status| {
                let msg = last_error();
                let case = format!("{f}: inputs on {inputs}, `{arg}` ({out_dtype:?}) on {output}");
                assert_eq!(st, amoe_status::Device, "{case}: {msg}");
                let want = format!("{f}: `{arg}` is on {output}, expected {inputs} like the op's input");
                assert!(msg.contains(&want), "{case}: {msg}\nexpected it to contain: {want}");
            };
            // SAFETY (every call): live handles; descriptors over live memory
            // of their sizes; lists of their lengths.
            unsafe {
                check("amoe_moe_finalize_routing", "out", amoe_moe_finalize_routing(fin, out, s));
                check("amoe_moe_token_unpermute", "out", amoe_moe_token_unpermute(x, &idx, null(), out, s));
                check("amoe_maybe_pad_and_reduce", "out", amoe_maybe_pad_and_reduce(x, null(), 0, c, out, s));
                let st = amoe_maybe_all_gather_and_maybe_unpad(x, null(), 0, c, out, s);
                check("amoe_maybe_all_gather_and_maybe_unpad", "out", st);
                check("amoe_finalize_and_reduce", "out", amoe_finalize_and_reduce(fin, null(), 0, c, out, s));
                check("amoe_shared_pad_split", "out", amoe_shared_pad_split(x, c, out, s));
                check("amoe_shared_gather_unpad", "out", amoe_shared_gather_unpad(x, 4, c, out, s));
                check("amoe_shared_pad_reduce_scatter", "out", amoe_shared_pad_reduce_scatter(x, c, out, s));
                check("amoe_token_prepare", "out", amoe_token_prepare(x, 0, &ctx, g, out, null(), s));
                check("amoe_token_finalize", "out", amoe_token_finalize(x, 0, &ctx, g, out, s));
                check("amoe_reduce_routed_early", "out", amoe_reduce_routed_early(&pol, x, 0, c, out, s));
                check("amoe_reduce_shared", "out", amoe_reduce_shared(&pol, x, 0, c, out, s));
                check("amoe_reduce_final", "out", amoe_reduce_final(&pol, x, 0, c, out, s));
                check("amoe_all_reduce", "dst", amoe_all_reduce(c, x, out, 0, s));
                check("amoe_reduce_scatter", "dst", amoe_reduce_scatter(c, x, out, 0, s));
                check("amoe_all_gather", "dst", amoe_all_gather(c, x, out, s));
                check("amoe_reduce_scatter_v", "dst", amoe_reduce_scatter_v(c, x, out, ones.as_ptr(), 1, 0, s));
                check("amoe_all_gather_v", "dst", amoe_all_gather_v(c, x, out, ones.as_ptr(), 1, s));
                let st = amoe_all_to_all_v(c, x, ones.as_ptr(), 1, out, ones.as_ptr(), 1, s);
                check("amoe_all_to_all_v", "dst", st);
            }
        }
    }
    engine_stream.synchronize().expect("sync");
    assert_eq!(out_host, [-1.0f32; 8], "the host output is not written");
    assert_eq!(out_npu.to_vec().expect("out"), [0.0f32; 8], "the NPU output is not written");
    // SAFETY: the handles made above, freed once.
    unsafe {
        amoe_moe_groups_free(g);
        amoe_comm_free(c);
        amoe_stream_free(s);
    }
}
