//! The safe ACL layer itself: typed and pinned buffers, streams (owned and
//! borrowed), events, and errors from the runtime. Ignored without an NPU.

use ascend_moe::backend::npu::{self, DeviceBuffer, NpuDevice, NpuEvent, PinnedHostBuffer};
use ascend_moe::{Error, Tensor};

fn dev() -> NpuDevice {
    NpuDevice::open(0).unwrap_or_else(|e| panic!("npu:0: {e}\n{}", npu::probe_report()))
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn typed_buffers_copy_every_way() {
    let d = dev();
    let data: Vec<i64> = (0..1000).map(|i| i * i - 7).collect();
    let a = d.clone_htod(&data).unwrap();
    assert_eq!(a.len(), 1000);
    let mut b = d.alloc_zeros::<i64>(1000).unwrap();
    assert_eq!(b.to_vec().unwrap(), vec![0i64; 1000]);
    b.copy_from_device(&a).unwrap();
    assert_eq!(d.clone_dtoh(&b).unwrap(), data);

    // Pinned host memory, queued copies, read after a sync.
    let mut pinned = PinnedHostBuffer::zeros(&d, 8 * 1000).unwrap();
    pinned.as_bytes_mut().copy_from_slice(bytemuck::cast_slice(&data));
    let mut c = DeviceBuffer::<i64>::alloc(&d, 1000).unwrap();
    c.copy_from_pinned_async(&pinned).unwrap();
    let mut back = PinnedHostBuffer::zeros(&d, 8 * 1000).unwrap();
    c.copy_to_pinned_async(&mut back).unwrap();
    d.synchronize().unwrap();
    assert_eq!(back.as_bytes(), pinned.as_bytes());

    // Length mismatches are errors, not partial copies.
    let mut short = vec![0i64; 999];
    assert!(matches!(a.copy_to_host(&mut short), Err(Error::InvalidArgument { .. })));
    assert!(d.clone_htod::<f32>(&[]).unwrap().is_empty());
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn borrowed_stream_is_used_but_never_destroyed() {
    let owner = dev();
    let raw = owner.stream().raw();
    let data = vec![1.5f32; 64];
    {
        // SAFETY: `owner` keeps the stream alive for this whole block.
        let borrowed = unsafe { NpuDevice::with_borrowed_stream(0, raw) }.unwrap();
        assert!(!borrowed.stream().is_owned());
        let buf = borrowed.clone_htod(&data).unwrap();
        assert_eq!(buf.to_vec().unwrap(), data);
    }
    // The owner's stream still works after the borrower is gone.
    let t = Tensor::from_slice(&data, &[8, 8]).unwrap().to_device(&ascend_moe::Device::Npu(owner.clone())).unwrap();
    assert_eq!(t.to_vec::<f32>().unwrap(), data);
    owner.synchronize().unwrap();

    // The default (NULL) stream of the device, borrowed.
    // SAFETY: the default stream lives as long as the device context.
    let default = unsafe { NpuDevice::with_borrowed_stream(0, std::ptr::null_mut()) }.unwrap();
    assert_eq!(default.clone_htod(&data).unwrap().to_vec().unwrap(), data);
    assert!(npu::take_drop_errors().is_empty());
}

/// A borrowed stream of another device is refused when it is wrapped,
/// naming the stream and the device it was claimed for; the same stream
/// wrapped for its own device works, through the Rust API and the C ABI.
#[test]
#[ignore = "needs an Ascend NPU"]
fn a_stream_borrowed_for_another_device_is_refused_naming_it() {
    use ascend_moe::capi::{amoe_status, amoe_stream, amoe_stream_free, amoe_stream_wrap};
    let other = NpuDevice::open(1).unwrap_or_else(|e| panic!("npu:1: {e}\n{}", npu::probe_report()));
    let raw = other.stream().raw();
    // SAFETY: `other` keeps the stream alive; device 0 is the case under test.
    let err = unsafe { NpuDevice::with_borrowed_stream(0, raw) }.expect_err("a stream of npu:1 taken for npu:0");
    let msg = err.to_string();
    assert!(matches!(err, Error::InvalidArgument { arg: "raw_stream", .. }), "{msg}");
    assert!(msg.contains(&format!("{raw:p} is not a stream of NPU 0")), "{msg}");
    let mut s: *mut amoe_stream = std::ptr::null_mut();
    // SAFETY: as above; `s` is writable.
    assert_eq!(unsafe { amoe_stream_wrap(raw, 0, &mut s) }, amoe_status::InvalidArgument);
    assert!(s.is_null(), "no handle on failure");
    // SAFETY: `other` keeps the stream alive, now claimed for its own device.
    let own = unsafe { NpuDevice::with_borrowed_stream(1, raw) }.expect("npu:1's own stream");
    let data = [2.5f32; 16];
    assert_eq!(own.clone_htod(&data).unwrap().to_vec().unwrap(), data);
    // SAFETY: as above; the handle is released once.
    unsafe {
        assert_eq!(amoe_stream_wrap(raw, 1, &mut s), amoe_status::Ok);
        amoe_stream_free(s);
    }
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn events_order_streams_and_time_work() {
    let d = dev();
    let s2 = d.new_stream().unwrap();
    let start = NpuEvent::create(d.stream()).unwrap();
    let end = NpuEvent::create(d.stream()).unwrap();
    start.record(d.stream()).unwrap();
    let buf = d.alloc_zeros::<f32>(1 << 16).unwrap();
    end.record(d.stream()).unwrap();
    s2.wait_event(&end).unwrap();
    s2.synchronize().unwrap();
    end.synchronize().unwrap();
    assert!(end.is_complete().unwrap());
    let ms = end.elapsed_ms_since(&start).unwrap();
    assert!(ms >= 0.0 && ms.is_finite(), "{ms}");
    assert_eq!(buf.to_vec().unwrap().iter().filter(|v| **v != 0.0).count(), 0);
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn runtime_failures_are_acl_errors_with_the_call_name() {
    let d = dev();
    let (free, total) = d.mem_info().unwrap();
    assert!(free <= total && total > 0);
    let err =
        DeviceBuffer::<i32>::alloc(&d, total.saturating_mul(4).max(1 << 40) / 4).expect_err("more than the device has");
    match err {
        Error::Acl { call, code, .. } => {
            assert_eq!(call, "aclrtMalloc");
            assert_ne!(code, 0);
        }
        other => panic!("expected Error::Acl from aclrtMalloc, got {other:?}"),
    }
    let err = NpuDevice::open(npu::device_count().unwrap()).expect_err("one past the last device");
    assert!(matches!(err, Error::InvalidArgument { arg: "ordinal", .. }), "{err:?}");
    // The device is still fine afterwards.
    assert_eq!(d.clone_htod(&[3i32; 5]).unwrap().to_vec().unwrap(), vec![3i32; 5]);
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn a_device_opened_on_the_default_stream_runs_ops_and_their_checks() {
    // SAFETY: the default (NULL) stream lives as long as the device context.
    let d = unsafe { NpuDevice::with_borrowed_stream(0, std::ptr::null_mut()) }.unwrap();
    // aclmdlRICaptureGetInfo refuses a NULL stream (CANN returns 100000): the
    // default stream never captures, so it is not asked about it.
    assert!(!d.stream().is_capturing().unwrap());
    let dev = ascend_moe::Device::Npu(d.clone());
    let a: Vec<f32> = (0..96).map(|i| i as f32 * 0.5 - 7.0).collect();
    let b: Vec<f32> = (0..96).map(|i| 3.25 - i as f32).collect();
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    let ta = Tensor::from_slice(&a, &[8, 12]).unwrap().to_device(&dev).unwrap();
    let tb = Tensor::from_slice(&b, &[8, 12]).unwrap().to_device(&dev).unwrap();
    let mut out = Tensor::zeros(&[8, 12], ascend_moe::DType::F32, &dev).unwrap();
    dev.backend().add(&ta, &tb, &mut out).unwrap();
    // The device-side equality check queues a kernel and reads its status at the check.
    let idx = Tensor::from_slice(&[5i32; 16], &[16]).unwrap().to_device(&dev).unwrap();
    let mismatch: ascend_moe::backend::Mismatch =
        Box::new(|_, at, v| Error::invalid("default_stream_test", "idx", format!("{v} at {at}")));
    dev.backend().expect_all_equal(&idx, 5, mismatch).unwrap();
    d.check().unwrap();
    assert_eq!(out.to_vec::<f32>().unwrap(), want);
    assert!(npu::take_drop_errors().is_empty());
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn a_capture_spans_two_streams_through_their_events_and_replays() {
    let d = dev();
    let side_stream = d.new_stream().unwrap();
    // SAFETY: `side_stream` outlives every use of `side`.
    let side = unsafe { NpuDevice::with_borrowed_stream(0, side_stream.raw()) }.unwrap();
    const N: usize = 256;
    let first: Vec<f32> = (0..N).map(|i| i as f32 * 0.25).collect();
    let mut a = d.clone_htod(&first).unwrap();
    let mut b = side.alloc_zeros::<f32>(N).unwrap();
    let mut c = d.alloc_zeros::<f32>(N).unwrap();
    d.synchronize().unwrap();
    side.synchronize().unwrap();
    // Each copy orders its stream after the source's (NpuStream::wait_for):
    // the side stream joins the capture through the main stream's event and
    // is joined back through its own, so the capture ends cleanly. The
    // runtime refuses aclrtCreateEvent events on a capturing stream, so
    // this needs aclrtCreateEventExWithFlag(ACL_EVENT_SYNC) events.
    let graph = ascend_moe::testing::graph::Graph::capture(d.stream().raw(), || {
        b.copy_from_device(&a).expect("captured copy onto the side stream");
        c.copy_from_device(&b).expect("captured copy back onto the main stream");
    });
    assert!(!side.stream().is_capturing().unwrap(), "the capture ended on both streams");
    for round in 0..3 {
        let v: Vec<f32> = (0..N).map(|i| (round * 1000 + i) as f32 - 0.5).collect();
        a.copy_from_host(&v).unwrap();
        d.synchronize().unwrap();
        graph.replay(d.stream().raw());
        d.synchronize().unwrap();
        assert_eq!(c.to_vec().unwrap(), v, "replay {round}");
    }
    drop(graph);
    assert!(npu::take_drop_errors().is_empty());
}

/// Ops on one stream of a device whose other operands live on a second
/// stream of it (another handle): each operand's own stream is ordered after
/// the op, so an output read through its stream holds the op's result, and an
/// input freed through its stream is not freed under the op.
#[test]
#[ignore = "needs an Ascend NPU"]
fn an_op_orders_the_streams_of_its_operands_after_it() {
    use ascend_moe::backend::{DropPadMode, FinalizeArgs};
    use ascend_moe::moe::finalize::{moe_finalize_routing_into, moe_token_unpermute_into};
    use ascend_moe::{DType, Device};
    let (a, b) = (Device::Npu(dev()), Device::Npu(dev()));
    let on = |t: Tensor, d: &Device| t.to_device(d).unwrap();

    // Finalize, mode 0, K = 1: out[i] = x[idx[i]].
    let x = on(Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap(), &a);
    let idx = on(Tensor::from_slice(&[1i32, 0], &[2]).unwrap(), &b);
    let mut out = Tensor::zeros(&[2, 3], DType::F32, &b).unwrap();
    moe_finalize_routing_into(&FinalizeArgs::new(&x, &idx, DropPadMode::DropLessColumn), &mut out).unwrap();
    drop(idx);
    assert_eq!(out.to_vec::<f32>().unwrap(), [4.0, 5.0, 6.0, 1.0, 2.0, 3.0]);

    // Token unpermute, K = 2: out[t] = sum_k probs[t, k] * permuted[s[2t + k]].
    let permuted = on(Tensor::from_slice(&[1.0f32, 10.0, 100.0, 1000.0], &[4, 1]).unwrap(), &a);
    let sorted = on(Tensor::from_slice(&[3i32, 0, 1, 2], &[4]).unwrap(), &b);
    let probs = on(Tensor::from_slice(&[0.5f32, 2.0, 1.0, 0.25], &[2, 2]).unwrap(), &b);
    let mut unpermuted = Tensor::zeros(&[2, 1], DType::F32, &b).unwrap();
    moe_token_unpermute_into(&permuted, &sorted, Some(&probs), &mut unpermuted).unwrap();
    drop((sorted, probs));
    // 0.5 * 1000 + 2 * 1, 1 * 10 + 0.25 * 100.
    assert_eq!(unpermuted.to_vec::<f32>().unwrap(), [502.0, 35.0]);

    // A copy onto the other stream, its source freed through its own.
    let src = on(Tensor::from_slice(&[7i32, 8, 9], &[3]).unwrap(), &a);
    let copy = src.to_device(&b).unwrap();
    drop(src);
    assert_eq!(copy.to_vec::<i32>().unwrap(), [7, 8, 9]);

    for d in [&a, &b] {
        let Device::Npu(n) = d else { unreachable!() };
        n.check().unwrap();
    }
    assert!(npu::take_drop_errors().is_empty());
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn a_captured_equality_check_reports_a_bad_replay_followed_by_a_good_one() {
    let d = dev();
    let dev = ascend_moe::Device::Npu(d.clone());
    let good = [5i32; 16];
    let idx = Tensor::from_slice(&good, &[16]).unwrap().to_device(&dev).unwrap();
    let write = |v: &[i32]| match idx.storage() {
        ascend_moe::tensor::Storage::Npu(b) => b.copy_from_host_at(0, bytemuck::cast_slice(v)).unwrap(),
        _ => unreachable!("an NPU tensor"),
    };
    let mismatch = || -> ascend_moe::backend::Mismatch {
        Box::new(|_, at, v| Error::invalid("captured_equality", "idx", format!("{v} at {at}")))
    };
    // Warm-up outside capture: the stream's records and workspace exist.
    dev.backend().expect_all_equal(&idx, 5, mismatch()).unwrap();
    d.check().unwrap();
    let graph = ascend_moe::testing::graph::Graph::capture(d.stream().raw(), || {
        dev.backend().expect_all_equal(&idx, 5, mismatch()).expect("captured check")
    });
    // Replay 1 sees 7 at position 3; replay 2 sees only 5s; one check after both.
    let mut bad = good;
    bad[3] = 7;
    write(&bad);
    graph.replay(d.stream().raw());
    write(&good);
    graph.replay(d.stream().raw());
    let err = d.check().expect_err("the first replay found 7 at 3");
    assert!(err.to_string().contains("7 at 3"), "{err}");
    d.check().expect("reported once");
    graph.replay(d.stream().raw());
    d.check().expect("a good replay");
}

/// Buffers dropped while their stream is captured into a graph cannot wait
/// for the work queued on them (the runtime refuses to synchronise a
/// capturing stream, and that work still runs): they are left allocated,
/// each with a recorded drop error naming the capture, without the
/// synchronisation, rather than freed under it, where a queued copy would
/// write into a later allocation or read freed host memory.
#[test]
#[ignore = "needs an Ascend NPU"]
fn buffers_dropped_while_their_stream_captures_are_not_freed_under_queued_work() {
    use ascend_moe::backend::npu::NpuBuffer;
    use ascend_moe::testing::graph::Graph;
    // The two buffers are left allocated: the test runs in a child process.
    if !ascend_moe::testing::runtime::in_child_that_may_leak(
        "buffers_dropped_while_their_stream_captures_are_not_freed_under_queued_work",
    ) {
        return;
    }
    let d = dev();
    let api = acl_sys::acl().unwrap();
    let src = NpuBuffer::alloc(&d, 4096).unwrap();
    src.memset_async(3, 0, 4096).unwrap();
    let victim = NpuBuffer::alloc(&d, 4096).unwrap();
    let mut pinned = PinnedHostBuffer::zeros(&d, 4096).unwrap();
    pinned.as_bytes_mut().fill(5);
    let dst = NpuBuffer::zeros_now(&d, 4096).unwrap();
    let marker = NpuBuffer::alloc(&d, 64).unwrap();
    d.synchronize().unwrap();
    let _ = npu::take_drop_errors();
    // Eager work queued on both buffers, then a capture begins.
    victim.copy_from_device(0, &src, 0, 4096).unwrap();
    dst.copy_from_pinned_async(0, &pinned).unwrap();
    api.reset_counters();
    let graph =
        Graph::capture_in(d.stream().raw(), acl_sys::aclmdlRICaptureMode::ACL_MODEL_RI_CAPTURE_MODE_RELAXED, || {
            marker.memset_async(1, 0, 64).unwrap();
            drop(victim);
            drop(pinned);
        });
    let counters = ascend_moe::testing::runtime::sim_counters();
    let errors = npu::take_drop_errors();
    assert_eq!(errors.len(), 2, "one recorded error per buffer left allocated: {errors:?}");
    for e in &errors {
        assert!(e.to_string().contains("captured into a graph"), "each names the capture: {e}");
    }
    if let Some(c) = counters {
        assert_eq!((c.device_frees, c.host_frees), (0, 0), "nothing is freed while its stream captures");
    }
    let fresh = NpuBuffer::zeros_now(&d, 4096).unwrap();
    d.synchronize().unwrap();
    let mut back = vec![9u8; 4096];
    fresh.copy_to_host(&mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0), "the copy queued before the drop wrote into a later allocation");
    dst.copy_to_host(&mut back).unwrap();
    assert!(back.iter().all(|&b| b == 5), "the copy out of the pinned buffer read freed memory");
    drop(graph);
}
