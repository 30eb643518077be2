//! A whole MoE layer forward captured in an ACL graph on 4 simulated devices
//! (DP2 x TP2), through the C ABI and CANN's own capture calls, for every comm
//! type: token prepare, an experts stand-in (the fused finalize), the routed
//! reduction point, token finalize, the shared-expert and final reduction
//! points. Each graph is replayed 3 times with new values written into the
//! same input buffers; every replay's outputs equal, bit for bit, the
//! layer's SPEC formulas computed here on plain vectors, as do the same C ABI
//! calls run eagerly on host memory and the CPU communicator. Ignored without
//! an NPU (`ci/sim.sh` runs it on the simulated runtime).

mod capi_common;
mod common;

use ascend_moe::testing::graph::Graph;
use std::ffi::c_void;
use std::ptr::{null, null_mut};

use ascend_moe::backend::npu::{DeviceBuffer, HcclComm, HcclRootInfo, NpuDevice};
use ascend_moe::capi::*;
use ascend_moe::CommOptions;
use capi_common::{finalize_args, last_error};

const WORLD: usize = 4;
const TP: usize = 2;
const H: usize = 16;
const DP_TOKENS: [usize; 2] = [5, 3];
const REPLAYS: usize = 3;

#[derive(Clone, Copy, Debug)]
struct Case {
    comm: amoe_comm_type,
    sp: bool,
}

const CASES: [Case; 5] = [
    Case { comm: amoe_comm_type::Allgather, sp: false },
    Case { comm: amoe_comm_type::Allgather, sp: true },
    Case { comm: amoe_comm_type::Mc2, sp: false },
    Case { comm: amoe_comm_type::Alltoall, sp: false },
    Case { comm: amoe_comm_type::FusedMc2, sp: false },
];

fn ok(what: &str, st: amoe_status) {
    assert_eq!(st, amoe_status::Ok, "{what}: {}", last_error());
}

/// Values that are small multiples of 1/8, so every sum in the layer is exact
/// in f32 whatever the order of its terms.
fn inputs(seed: usize, rank: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| (((seed * 131 + rank * 31 + i * 7) % 17) as f32 - 8.0) / 8.0).collect()
}

fn ctx(case: Case, rank: usize) -> amoe_moe_context {
    amoe_moe_context {
        dp_tokens: DP_TOKENS.as_ptr(),
        dp_size: DP_TOKENS.len(),
        tp_size: TP,
        dp_rank: rank / TP,
        tp_rank: rank % TP,
        sp: u8::from(case.sp),
        ..Default::default()
    }
}

fn policy(case: Case) -> amoe_reduce_policy {
    let shared_mode = if case.sp { amoe_shared_mode::SequenceParallelOnly } else { amoe_shared_mode::TensorParallel };
    amoe_reduce_policy {
        shared_mode: shared_mode as u32,
        has_routed_transform: 0,
        sp: u8::from(case.sp),
        tp_size: TP,
        ep_size: WORLD,
    }
}

/// Rows of this rank's layer input.
fn local_rows(case: Case, rank: usize) -> usize {
    let t = DP_TOKENS[rank / TP];
    if case.sp {
        t.div_ceil(TP)
    } else {
        t
    }
}

fn shape_of(what: &str, f: impl FnOnce(*mut usize, usize, *mut usize) -> amoe_status) -> Vec<usize> {
    let mut s = [0usize; 8];
    let mut n = 0usize;
    ok(what, f(s.as_mut_ptr(), s.len(), &mut n));
    s[..n].to_vec()
}

/// Where a tensor lives for one run: host memory or device memory of `ordinal`.
#[derive(Clone, Copy)]
enum Place {
    Host,
    Npu(i32),
}

fn desc(data: *mut c_void, dtype: amoe_dtype, shape: &[usize], place: Place) -> amoe_tensor {
    let (kind, ordinal) = match place {
        Place::Host => (amoe_device_kind::Cpu, 0),
        Place::Npu(o) => (amoe_device_kind::Npu, o),
    };
    capi_common::desc(data, dtype, shape, kind, ordinal)
}

/// The layer's shapes for one rank, from the C ABI's shape functions.
struct Shapes {
    x: Vec<usize>,
    h: Vec<usize>,
    out: Vec<usize>,
}

fn shapes(case: Case, rank: usize) -> Shapes {
    let x = vec![local_rows(case, rank), H];
    let c = ctx(case, rank);
    let xd = desc(null_mut(), amoe_dtype::F32, &x, Place::Host);
    // SAFETY: descriptors and out-pointers valid for the call.
    let h = shape_of("prepare shape", |s, cap, n| unsafe {
        amoe_token_prepare_output_shape(&xd, case.comm as u32, &c, s, cap, n)
    });
    let hd = desc(null_mut(), amoe_dtype::F32, &h, Place::Host);
    // SAFETY: as above.
    let out = shape_of("finalize shape", |s, cap, n| unsafe {
        amoe_token_finalize_output_shape(&hd, case.comm as u32, &c, s, cap, n)
    });
    Shapes { x, h, out }
}

/// The memory of one rank's layer: inputs `x`, `row_idx`, `w`; outputs
/// `out` (token finalize), `shared` and `final_` (the reduction points); the
/// rest intermediates.
struct Bufs {
    x: *mut c_void,
    row_idx: *mut c_void,
    w: *mut c_void,
    h: *mut c_void,
    y: *mut c_void,
    y2: *mut c_void,
    out: *mut c_void,
    shared: *mut c_void,
    final_: *mut c_void,
}

/// Enqueues (or, on the host, runs) one layer forward. Every call writes
/// into memory the caller made; nothing is allocated by the caller here.
#[allow(clippy::too_many_arguments)]
fn forward(
    case: Case,
    rank: usize,
    sh: &Shapes,
    b: &Bufs,
    place: Place,
    groups: *const amoe_moe_groups,
    tp: *const amoe_comm,
    stream: *const amoe_stream,
) {
    let (c, p) = (ctx(case, rank), policy(case));
    let ct = case.comm as u32;
    let rows = sh.h[0];
    let (x, h, out) = (
        desc(b.x, amoe_dtype::F32, &sh.x, place),
        desc(b.h, amoe_dtype::F32, &sh.h, place),
        desc(b.out, amoe_dtype::F32, &sh.out, place),
    );
    let idx_shape = [rows];
    let w_shape = [rows, 1];
    let idx = desc(b.row_idx, amoe_dtype::I32, &idx_shape, place);
    let w = desc(b.w, amoe_dtype::F32, &w_shape, place);
    let (y, y2) = (desc(b.y, amoe_dtype::F32, &sh.h, place), desc(b.y2, amoe_dtype::F32, &sh.h, place));
    let (shared, final_) =
        (desc(b.shared, amoe_dtype::F32, &sh.x, place), desc(b.final_, amoe_dtype::F32, &sh.out, place));
    let args = amoe_finalize_args { scales: &w, ..finalize_args(&h, &idx, 0) };
    // SAFETY: every descriptor points to memory of its shape on `place`,
    // alive until the work has run; handles live.
    unsafe {
        ok("token_prepare", amoe_token_prepare(&x, ct, &c, groups, &h, null(), stream));
        ok("experts (finalize)", amoe_moe_finalize_routing(&args, &y, stream));
        ok("reduce_routed_early", amoe_reduce_routed_early(&p, &y, ct, tp, &y2, stream));
        ok("token_finalize", amoe_token_finalize(&y2, ct, &c, groups, &out, stream));
        ok("reduce_shared", amoe_reduce_shared(&p, &x, ct, tp, &shared, stream));
        ok("reduce_final", amoe_reduce_final(&p, &out, ct, tp, &final_, stream));
    }
}

/// The fixed routing of the experts stand-in: identity rows, weights 1/2 and 1/4.
fn routing(rows: usize) -> (Vec<i32>, Vec<f32>) {
    ((0..rows as i32).collect(), (0..rows).map(|i| if i % 2 == 0 { 0.5 } else { 0.25 }).collect())
}

type Outputs = (Vec<f32>, Vec<f32>, Vec<f32>);

fn tp_ranks(rank: usize) -> [usize; TP] {
    let first = rank / TP * TP;
    [first, first + 1]
}

/// The layer on the CPU communicator, host memory, one input per seed.
fn cpu_layer(case: Case, seeds: &[usize]) -> Vec<Vec<Outputs>> {
    let name = format!("graph-ref-{:?}-{}-{}", case.comm, case.sp, std::process::id());
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..WORLD)
            .map(|rank| {
                let name = std::ffi::CString::new(name.clone()).expect("name");
                s.spawn(move || {
                    let (mut world, mut groups, mut tp) = (null_mut(), null_mut(), null_mut());
                    let ranks = tp_ranks(rank);
                    // SAFETY: out-pointers valid; handles freed below.
                    unsafe {
                        ok("cpu world", amoe_comm_cpu_new(name.as_ptr(), WORLD, rank, 30.0, &mut world));
                        ok("groups", amoe_moe_groups_new(world, 1, TP, &mut groups));
                        ok("tp split", amoe_comm_split(world, ranks.as_ptr(), TP, &mut tp));
                    }
                    let sh = shapes(case, rank);
                    let (idx, w) = routing(sh.h[0]);
                    let mut all = Vec::new();
                    for &seed in seeds {
                        let mut x = inputs(seed, rank, sh.x.iter().product());
                        let n_h: usize = sh.h.iter().product();
                        let n_out: usize = sh.out.iter().product();
                        let (mut h, mut y, mut y2) = (vec![0f32; n_h], vec![0f32; n_h], vec![0f32; n_h]);
                        let (mut out, mut fin) = (vec![0f32; n_out], vec![0f32; n_out]);
                        let mut shared = vec![0f32; x.len()];
                        let (mut idx, mut w) = (idx.clone(), w.clone());
                        let b = Bufs {
                            x: x.as_mut_ptr().cast(),
                            row_idx: idx.as_mut_ptr().cast(),
                            w: w.as_mut_ptr().cast(),
                            h: h.as_mut_ptr().cast(),
                            y: y.as_mut_ptr().cast(),
                            y2: y2.as_mut_ptr().cast(),
                            out: out.as_mut_ptr().cast(),
                            shared: shared.as_mut_ptr().cast(),
                            final_: fin.as_mut_ptr().cast(),
                        };
                        forward(case, rank, &sh, &b, Place::Host, groups, tp, null());
                        all.push((out, shared, fin));
                    }
                    // SAFETY: live handles, not used afterwards.
                    unsafe {
                        amoe_comm_free(tp);
                        amoe_moe_groups_free(groups);
                        amoe_comm_free(world);
                    }
                    all
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("cpu rank")).collect()
    })
}

/// The layer's outputs on every rank for one seed, from SPEC sections 5 and
/// 6 written out here on plain vectors: the experts stand-in scales prepared
/// row `i` by `w[i]`; the policy never reduces early (no routed transform;
/// TP-sharded shared expert, SP-only with SP); values are multiples of 1/32
/// whose sums of at most 4 are exact, so the result is bitwise.
fn reference_layer(case: Case, seed: usize) -> Vec<Outputs> {
    let x: Vec<Vec<f32>> = (0..WORLD).map(|r| inputs(seed, r, local_rows(case, r) * H)).collect();
    let row = |r: usize, i: usize| -> &[f32] { &x[r][i * H..(i + 1) * H] };
    let weight = |i: usize| if i % 2 == 0 { 0.5f32 } else { 0.25 };
    // Row i of rank r's batch zero-padded past its rows.
    let padded = |r: usize, i: usize| -> Vec<f32> {
        if i < local_rows(case, r) {
            row(r, i).to_vec()
        } else {
            vec![0.0; H]
        }
    };
    let scaled = |v: &[f32], w: f32, times: f32| -> Vec<f32> { v.iter().map(|a| a * w * times).collect() };
    let add = |a: &[f32], b: &[f32]| -> Vec<f32> { a.iter().zip(b).map(|(p, q)| p + q).collect() };
    let tp_sum = |r: usize, per: &dyn Fn(usize) -> Vec<f32>| -> Vec<f32> {
        let [a, b] = tp_ranks(r);
        add(&per(a), &per(b))
    };
    let reduced = !matches!(case.comm, amoe_comm_type::Allgather) || case.sp;
    let max_t = DP_TOKENS.iter().copied().max().unwrap_or(0);
    let outs = (0..WORLD)
        .map(|r| {
            let d = r / TP;
            if case.sp {
                // EP gather of every rank's rows in rank order, then the EP
                // reduce-scatter of 4 identical scaled copies: 4 w[i] x.
                let first: usize = (0..r).map(|q| local_rows(case, q)).sum();
                (0..local_rows(case, r)).flat_map(|i| scaled(row(r, i), weight(first + i), WORLD as f32)).collect()
            } else {
                match case.comm {
                    // Pad to max T_d, DP gather (block d at d * 5), DP reduce-scatter of DP identical copies.
                    amoe_comm_type::Allgather => {
                        (0..DP_TOKENS[d]).flat_map(|i| scaled(row(r, i), weight(d * max_t + i), 2.0)).collect()
                    }
                    // Row j of the DP batch comes from the TP rank whose slice holds it.
                    _ => {
                        let sizes: Vec<usize> = if matches!(case.comm, amoe_comm_type::Alltoall) {
                            let n = DP_TOKENS[d].max(TP);
                            (0..TP).map(|q| n / TP + usize::from(q < n % TP)).collect()
                        } else {
                            // MC2 pads every DP rank to ceil_to(max_d T_d, TP).
                            vec![max_t.div_ceil(TP); TP]
                        };
                        (0..DP_TOKENS[d])
                            .flat_map(|j| {
                                let (mut q, mut off) = (0, 0);
                                while j >= off + sizes[q] {
                                    off += sizes[q];
                                    q += 1;
                                }
                                scaled(&padded(d * TP + q, j), weight(j - off), 1.0)
                            })
                            .collect()
                    }
                }
            }
        })
        .collect::<Vec<Vec<f32>>>();
    (0..WORLD)
        .map(|r| {
            // Shared output: TP-sharded without SP is all-reduced iff the
            // routed output already is; SP-only is left as it is.
            let shared = if !case.sp && reduced { tp_sum(r, &|q| x[q].clone()) } else { x[r].clone() };
            // Final: without SP, all-reduced over TP unless the routed output already is.
            let fin = if !case.sp && !reduced { tp_sum(r, &|q| outs[q].clone()) } else { outs[r].clone() };
            (outs[r].clone(), shared, fin)
        })
        .collect()
}

fn dev_ptr<T: ascend_moe::Element>(b: &DeviceBuffer<T>) -> *mut c_void {
    b.as_bytes().as_ptr()
}

/// One NPU rank: an eager warm-up, the capture, then replays with new
/// inputs; returns the outputs of each replay.
fn npu_rank(
    case: Case,
    rank: usize,
    root: &HcclRootInfo,
    seeds: &[usize],
    guarded: bool,
) -> ascend_moe::Result<Vec<Outputs>> {
    let dev = NpuDevice::open(rank as u32)?;
    let engine = dev.new_stream()?;
    let hccl = HcclComm::from_root_info(&dev, root, WORLD, rank, &CommOptions::from_env())?;
    let (mut s, mut world, mut groups, mut tp) = (null_mut(), null_mut(), null_mut(), null_mut());
    let ranks = tp_ranks(rank);
    // SAFETY: live stream and communicator of this device, outliving the handles.
    unsafe {
        ok("stream", amoe_stream_wrap(engine.raw(), rank as u32, &mut s));
        ok("hccl world", amoe_comm_from_hccl(hccl.raw(), rank as u32, AMOE_HCCL_WORLD, &mut world));
        ok("groups", amoe_moe_groups_new(world, 1, TP, &mut groups));
        ok("tp split", amoe_comm_split(world, ranks.as_ptr(), TP, &mut tp));
    }
    // With `guarded`, the engine keeps the live forward context on the device
    // and the layer's ops guard themselves against it.
    let mut live = null_mut();
    let live_fc = |comm: amoe_comm_type| amoe_forward_context {
        comm_type: comm as u32,
        sp: u8::from(case.sp),
        dp_tokens: DP_TOKENS.as_ptr(),
        dp_size: DP_TOKENS.len(),
        num_actual_tokens: AMOE_ALL_TOKENS,
        pcp_size: 1,
    };
    let set_live = |live: *mut amoe_live_context, comm: amoe_comm_type| {
        // SAFETY: live handles; the context's arrays are static.
        ok("live context set", unsafe { amoe_live_context_set(live, &live_fc(comm), s) });
    };
    if guarded {
        // SAFETY: a live stream handle and a writable out-pointer.
        unsafe {
            ok("live context", amoe_live_context_new(s, &mut live));
            ok("attach", amoe_stream_attach_live_context(s, live));
        }
        set_live(live, case.comm);
    }
    let sh = shapes(case, rank);
    let (idx, w) = routing(sh.h[0]);
    let n_h: usize = sh.h.iter().product();
    let n_out: usize = sh.out.iter().product();
    let n_x: usize = sh.x.iter().product();
    let mut x = dev.alloc_zeros::<f32>(n_x)?;
    let (idx_d, w_d) = (dev.clone_htod(&idx)?, dev.clone_htod(&w)?);
    let (h, y, y2) = (dev.alloc_zeros::<f32>(n_h)?, dev.alloc_zeros::<f32>(n_h)?, dev.alloc_zeros::<f32>(n_h)?);
    let (out, fin) = (dev.alloc_zeros::<f32>(n_out)?, dev.alloc_zeros::<f32>(n_out)?);
    let shared = dev.alloc_zeros::<f32>(n_x)?;
    let b = Bufs {
        x: dev_ptr(&x),
        row_idx: dev_ptr(&idx_d),
        w: dev_ptr(&w_d),
        h: dev_ptr(&h),
        y: dev_ptr(&y),
        y2: dev_ptr(&y2),
        out: dev_ptr(&out),
        shared: dev_ptr(&shared),
        final_: dev_ptr(&fin),
    };
    let place = Place::Npu(rank as i32);
    x.copy_from_host(&inputs(999, rank, n_x))?;
    dev.synchronize()?;
    // Eager warm-up: the stream's workspace pool grows outside capture, and
    // the check releases what the eager calls held.
    forward(case, rank, &sh, &b, place, groups, tp, s);
    // SAFETY: a live stream handle.
    ok("warm-up check", unsafe { amoe_stream_check(s) });
    let graph = Graph::capture(engine.raw(), || forward(case, rank, &sh, &b, place, groups, tp, s));
    let mut got = Vec::new();
    for &seed in seeds {
        x.copy_from_host(&inputs(seed, rank, n_x))?;
        dev.synchronize()?;
        graph.replay(engine.raw());
        // SAFETY: a live stream handle.
        ok("stream check", unsafe { amoe_stream_check(s) });
        got.push((out.to_vec()?, shared.to_vec()?, fin.to_vec()?));
    }
    if guarded {
        // The same graph replayed while the live context says another comm
        // type: every rank's check reports it, naming both; set back, the
        // next replay checks clean.
        let other = if case.comm == amoe_comm_type::Mc2 { amoe_comm_type::Allgather } else { amoe_comm_type::Mc2 };
        set_live(live, other);
        graph.replay(engine.raw());
        // SAFETY: a live stream handle.
        let st = unsafe { amoe_stream_check(s) };
        let msg = last_error();
        assert_eq!(st, amoe_status::StaleContext, "{case:?} rank {rank}: {msg}");
        assert!(msg.contains(&format!("comm_type is {}", other as u32)), "{msg}");
        assert!(msg.contains(&format!("captured for {}", case.comm as u32)), "{msg}");
        set_live(live, case.comm);
        graph.replay(engine.raw());
        // SAFETY: a live stream handle.
        ok("check after the context is set back", unsafe { amoe_stream_check(s) });
    }
    drop(graph);
    // SAFETY: live handles, not used afterwards.
    unsafe {
        amoe_live_context_free(live);
        amoe_comm_free(tp);
        amoe_moe_groups_free(groups);
        amoe_comm_free(world);
        amoe_stream_free(s);
    }
    Ok(got)
}

/// An engine stream of `dev` (what torch_npu's current stream would be) and
/// its C ABI handle; free the handle with `amoe_stream_free` before the
/// stream goes.
fn engine_stream(dev: &NpuDevice) -> (ascend_moe::backend::npu::NpuStream, *mut amoe_stream) {
    let engine = dev.new_stream().expect("stream");
    let mut s = null_mut();
    // SAFETY: a live stream of this device that outlives the handle.
    ok("stream", unsafe { amoe_stream_wrap(engine.raw(), dev.ordinal(), &mut s) });
    (engine, s)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

fn run_cases(guarded: bool) {
    let seeds: Vec<usize> = (1..=REPLAYS).collect();
    for case in CASES {
        // Expected: the SPEC's formulas (reference_layer); the same C ABI
        // calls on host memory and the CPU communicator must give them too.
        let want: Vec<Vec<Outputs>> = (0..WORLD)
            .map(|r| seeds.iter().map(|&seed| reference_layer(case, seed).swap_remove(r)).collect())
            .collect();
        let host = cpu_layer(case, &seeds);
        let root = HcclRootInfo::generate(&NpuDevice::open(0).expect("npu:0")).expect("root info");
        let got: Vec<Vec<Outputs>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..WORLD)
                .map(|rank| {
                    let (root, seeds) = (&root, &seeds);
                    s.spawn(move || npu_rank(case, rank, root, seeds, guarded))
                })
                .collect();
            hs.into_iter()
                .enumerate()
                .map(|(r, h)| h.join().expect("npu rank").unwrap_or_else(|e| panic!("{case:?} rank {r}: {e}")))
                .collect()
        });
        for rank in 0..WORLD {
            for (i, (c, w)) in host[rank].iter().zip(&want[rank]).enumerate() {
                let what = format!("{case:?} rank {rank} seed {i} on the host");
                assert_eq!((bits(&c.0), bits(&c.1), bits(&c.2)), (bits(&w.0), bits(&w.1), bits(&w.2)), "{what}");
            }
            for (i, (g, w)) in got[rank].iter().zip(&want[rank]).enumerate() {
                let what = format!("{case:?} rank {rank} replay {i}");
                assert_eq!(bits(&g.0), bits(&w.0), "{what}: token finalize output");
                assert_eq!(bits(&g.1), bits(&w.1), "{what}: shared reduction");
                assert_eq!(bits(&g.2), bits(&w.2), "{what}: final reduction");
            }
            // The replays saw the new inputs: outputs differ between seeds.
            assert_ne!(
                bits(&got[rank][0].2),
                bits(&got[rank][1].2),
                "{case:?} rank {rank}: replays ignored new inputs"
            );
        }
    }
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn a_captured_moe_layer_replays_every_comm_type_bit_for_bit() {
    run_cases(false);
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn a_guarded_layer_graph_replayed_under_another_comm_type_is_reported_on_every_rank() {
    run_cases(true);
}

/// A native finalize through the C ABI on an engine stream of npu:0 that
/// gathers the 6 rows of an [6, 8] f32 input in reverse (drop-less column
/// mode, no scales): what the capture tests below replay.
struct ReversedRows<'a> {
    dev: &'a NpuDevice,
    engine: &'a ascend_moe::backend::npu::NpuStream,
    s: *mut amoe_stream,
    run: &'a dyn Fn() -> amoe_status,
    idx_d: &'a mut DeviceBuffer<i32>,
    good: &'a [i32],
    want: &'a [f32],
    out_d: &'a DeviceBuffer<f32>,
}

impl ReversedRows<'_> {
    fn check(&self) -> amoe_status {
        // SAFETY: a live handle.
        unsafe { amoe_stream_check(self.s) }
    }

    /// An eager run and its check: what a capture of the op needs before it.
    fn warm_up(&self) {
        ok("warm-up", (self.run)());
        ok("warm-up check", self.check());
    }

    /// A graph of one run, captured on the engine stream.
    fn capture(&self) -> Graph {
        Graph::capture(self.engine.raw(), || ok("captured finalize", (self.run)()))
    }

    fn write_index(&mut self, idx: &[i32]) {
        self.idx_d.copy_from_host(idx).expect("index");
        self.dev.synchronize().expect("upload");
    }

    /// Writes the good index with `value` at position `at`.
    fn write_bad_index(&mut self, at: usize, value: i32) {
        let mut bad = self.good.to_vec();
        bad[at] = value;
        self.write_index(&bad);
    }

    /// Writes the good index back.
    fn restore_index(&mut self) {
        let good = self.good;
        self.write_index(good);
    }

    /// One replay of `graph` with index value `value` at position `at`: its
    /// check reports that position and value, once; then the good index.
    fn replay_a_bad_index(&mut self, graph: &Graph, at: usize, value: i32) {
        self.write_bad_index(at, value);
        graph.replay(self.engine.raw());
        assert_bad_index("the check after the replay", self.check(), &last_error(), at, value);
        ok("reported once", self.check());
        self.restore_index();
    }

    fn assert_output(&self, what: &str) {
        assert_eq!(bits(&self.out_d.to_vec().expect("out")), bits(self.want), "{what}");
    }
}

/// A check's status `st` and message `msg` (`what`) report the index value
/// `value` at position `at` of `expanded_row_idx`.
fn assert_bad_index(what: &str, st: amoe_status, msg: &str, at: usize, value: i32) {
    assert_eq!(st, amoe_status::IndexOutOfRange, "{what}: {msg}");
    assert!(msg.contains("expanded_row_idx") && msg.contains(&format!("[{at}] = {value}")), "{what}: {msg}");
}

/// Runs `f` on a [`ReversedRows`] set up on npu:0, then frees its stream handle.
fn with_reversed_rows(seed: usize, f: impl FnOnce(ReversedRows<'_>)) {
    let dev = NpuDevice::open(0).expect("npu:0");
    let (engine, s) = engine_stream(&dev);
    let (n, h) = (6usize, 8usize);
    let x: Vec<f32> = inputs(seed, 0, n * h);
    let good: Vec<i32> = (0..n as i32).rev().collect();
    let x_d = dev.clone_htod(&x).expect("x");
    let mut idx_d = dev.clone_htod(&good).expect("idx");
    let out_d = dev.alloc_zeros::<f32>(n * h).expect("out");
    dev.synchronize().expect("uploads");
    let (xs, is, os) = ([n, h], [n], [n, h]);
    let place = Place::Npu(0);
    let xd = desc(dev_ptr(&x_d), amoe_dtype::F32, &xs, place);
    let id = desc(dev_ptr(&idx_d), amoe_dtype::I32, &is, place);
    let od = desc(dev_ptr(&out_d), amoe_dtype::F32, &os, place);
    let args = finalize_args(&xd, &id, 0);
    // SAFETY: live handles; descriptors over live device memory.
    let run = || unsafe { amoe_moe_finalize_routing(&args, &od, s) };
    let want: Vec<f32> = (0..n).flat_map(|i| x[(n - 1 - i) * h..(n - i) * h].to_vec()).collect();
    f(ReversedRows {
        dev: &dev,
        engine: &engine,
        s,
        run: &run,
        idx_d: &mut idx_d,
        good: &good,
        want: &want,
        out_d: &out_d,
    });
    // SAFETY: a live handle, not used afterwards.
    unsafe { amoe_stream_free(s) };
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn a_bad_index_in_one_replay_is_reported_by_the_check_after_it() {
    with_reversed_rows(7, |mut r| {
        r.warm_up();
        let graph = r.capture();
        for round in 0..3 {
            graph.replay(r.engine.raw());
            ok("check after a clean replay", r.check());
            r.assert_output(&format!("replay {round}"));
        }
        // One replay with an index outside [0, 6) at position 2: its check says so, once.
        r.replay_a_bad_index(&graph, 2, 99);
        graph.replay(r.engine.raw());
        ok("check after the index is fixed", r.check());
        r.assert_output("after the index is fixed");
    });
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn a_bad_index_in_a_replay_is_reported_when_later_replays_before_the_check_are_good() {
    with_reversed_rows(8, |mut r| {
        r.warm_up();
        let graph = r.capture();
        // Replay 1 with 99 at position 4, then two with the good index; the
        // engine checks once, after all three.
        r.write_bad_index(4, 99);
        graph.replay(r.engine.raw());
        // The replay reads the index when it runs: it runs before the good
        // index is written (a host wait, not the check).
        r.engine.synchronize().expect("the first replay ran");
        r.restore_index();
        graph.replay(r.engine.raw());
        graph.replay(r.engine.raw());
        assert_bad_index("the first replay read index 99", r.check(), &last_error(), 4, 99);
        ok("reported once", r.check());
        graph.replay(r.engine.raw());
        ok("a good replay", r.check());
        r.assert_output("after the good replays");
    });
}

/// `torch.npu.graph` captures on its side stream and replays on the current
/// one: a bad index in a replay on another stream than the capture's is
/// reported by the check of the stream it ran on (SPEC section 1), once.
#[test]
#[ignore = "needs an Ascend NPU"]
fn a_bad_index_in_a_replay_on_another_stream_is_reported_by_that_streams_check() {
    with_reversed_rows(9, |mut r| {
        let (current, a) = engine_stream(r.dev);
        // SAFETY: a live handle.
        let check_a = || unsafe { amoe_stream_check(a) };
        r.warm_up();
        let graph = r.capture();
        r.write_bad_index(2, 99);
        graph.replay(current.raw());
        assert_bad_index("the replay on the current stream read index 99", check_a(), &last_error(), 2, 99);
        ok("reported once, by the current stream", check_a());
        ok("and not again by the capture stream", r.check());
        r.restore_index();
        graph.replay(current.raw());
        ok("a good replay", check_a());
        r.assert_output("after a good replay on the current stream");
        // SAFETY: the handle made above, not used afterwards.
        unsafe { amoe_stream_free(a) };
        drop(graph);
    });
}

/// Token unpermute through the C ABI, captured once and replayed with new
/// values and new indices (repeated, negative, past the end: SPEC section 1
/// lets them contribute nothing) written into the same device buffers; each
/// replay equals the same call on host memory bit for bit.
#[test]
#[ignore = "needs an Ascend NPU"]
fn a_captured_token_unpermute_replays_new_indices_bit_for_bit() {
    let dev = NpuDevice::open(0).expect("npu:0");
    let (engine, s) = engine_stream(&dev);
    let (t, k, rows, h) = (4usize, 3usize, 10usize, 8usize);
    let indices = |round: usize| -> Vec<i32> {
        (0..t * k).map(|i| ((i * 5 + round * 3) % (rows + 3)) as i32 - 1 - (round == 2 && i == 4) as i32).collect()
    };
    let mut permuted_d = dev.alloc_zeros::<f32>(rows * h).expect("permuted");
    let mut idx_d = dev.alloc_zeros::<i32>(t * k).expect("indices");
    let probs_d = dev.clone_htod(&inputs(5, 0, t * k)).expect("probs");
    let out_d = dev.alloc_zeros::<f32>(t * h).expect("out");
    let (ps, is, ws, os) = ([rows, h], [t * k], [t, k], [t, h]);
    let place = Place::Npu(0);
    let pd = desc(dev_ptr(&permuted_d), amoe_dtype::F32, &ps, place);
    let id = desc(dev_ptr(&idx_d), amoe_dtype::I32, &is, Place::Npu(0));
    let wd = desc(dev_ptr(&probs_d), amoe_dtype::F32, &ws, Place::Npu(0));
    let od = desc(dev_ptr(&out_d), amoe_dtype::F32, &os, place);
    // SAFETY (every call below): live handles; descriptors over live memory.
    let run = || ok("unpermute", unsafe { amoe_moe_token_unpermute(&pd, &id, &wd, &od, s) });
    let upload = |round: usize, p_d: &mut DeviceBuffer<f32>, idx_d: &mut DeviceBuffer<i32>| -> Vec<f32> {
        let perm = inputs(10 + round, 0, rows * h);
        p_d.copy_from_host(&perm).expect("permuted");
        idx_d.copy_from_host(&indices(round)).expect("indices");
        dev.synchronize().expect("uploads");
        perm
    };
    upload(0, &mut permuted_d, &mut idx_d);
    run();
    ok("warm-up check", unsafe { amoe_stream_check(s) });
    let graph = Graph::capture(engine.raw(), run);
    for round in 1..=3 {
        let perm = upload(round, &mut permuted_d, &mut idx_d);
        graph.replay(engine.raw());
        ok("check after a replay", unsafe { amoe_stream_check(s) });
        // The same call on host memory (the CPU backend).
        let idx = indices(round);
        let probs = inputs(5, 0, t * k);
        let mut want = vec![0f32; t * h];
        let hp = desc(perm.as_ptr() as *mut c_void, amoe_dtype::F32, &ps, Place::Host);
        let hi = desc(idx.as_ptr() as *mut c_void, amoe_dtype::I32, &is, Place::Host);
        let hw = desc(probs.as_ptr() as *mut c_void, amoe_dtype::F32, &ws, Place::Host);
        let ho = desc(want.as_mut_ptr().cast(), amoe_dtype::F32, &os, Place::Host);
        // SAFETY: descriptors over live host memory.
        ok("host unpermute", unsafe { amoe_moe_token_unpermute(&hp, &hi, &hw, &ho, null()) });
        assert!(want.iter().any(|&v| v != 0.0), "round {round}: a non-trivial reference");
        assert_eq!(bits(&out_d.to_vec().expect("out")), bits(&want), "replay {round}");
        // SPEC section 1: out[t] = sum_k probs[t,k] * permuted[S[t*K + k]], an
        // index outside [0, rows) contributing nothing (exact: multiples of 1/64).
        let mut spec = vec![0f32; t * h];
        for ti in 0..t {
            for kk in 0..k {
                let si = idx[ti * k + kk];
                if (0..rows as i32).contains(&si) {
                    for c in 0..h {
                        spec[ti * h + c] += probs[ti * k + kk] * perm[si as usize * h + c];
                    }
                }
            }
        }
        assert_eq!(bits(&want), bits(&spec), "round {round}: SPEC's value");
    }
    drop(graph);
    // SAFETY: a live handle, not used afterwards.
    unsafe { amoe_stream_free(s) };
}

/// Host data an op stages through pinned memory while captured (the padded
/// finalize's slot offsets) is copied again by every replay: eager calls
/// staging other bytes between the replays must not change what the graph
/// computes.
#[test]
#[ignore = "needs an Ascend NPU"]
fn staged_bytes_of_a_captured_op_survive_later_eager_calls() {
    use ascend_moe::backend::{DropPadMode, FinalizeArgs, FinalizeDims, OutputRows};
    use ascend_moe::{DType, Device, Tensor};
    let nd = NpuDevice::open(0).expect("npu:0");
    let dev = Device::Npu(nd.clone());
    let (n, h) = (6usize, 16usize);
    let x: Vec<f32> = inputs(3, 0, n * h);
    let idx: Vec<i32> = (0..n as i32).rev().collect();
    let captured_sizes = [1usize, 3, 0, 2];
    let other_sizes = [3usize, 0, 2, 1];
    let slot_rows = 3;
    let dims = FinalizeDims { n, k: 1, h, expanded_rows: n, experts: 0 };
    let finalize = |d: &Device, sizes: &[usize], out: &mut Tensor| {
        let xd = Tensor::from_slice(&x, &[n, h]).unwrap().to_device(d).unwrap();
        let id = Tensor::from_slice(&idx, &[n]).unwrap().to_device(d).unwrap();
        let args = FinalizeArgs::new(&xd, &id, DropPadMode::DropLessColumn);
        d.backend()
            .finalize_routing(&args, &dims, out, OutputRows::Padded { local_sizes: sizes, slot_rows })
            .expect("finalize");
    };
    let mut want = Tensor::zeros(&[4 * slot_rows, h], DType::F32, &Device::Cpu).unwrap();
    finalize(&Device::Cpu, &captured_sizes, &mut want);
    let spec = padded_unpermute(&x, &idx, &captured_sizes, slot_rows, h);
    assert_eq!(bits(want.as_slice::<f32>().unwrap()), bits(&spec), "the CPU path gives SPEC's value");
    // Inputs live across the capture: upload once, capture the op over them.
    let xd = Tensor::from_slice(&x, &[n, h]).unwrap().to_device(&dev).unwrap();
    let id = Tensor::from_slice(&idx, &[n]).unwrap().to_device(&dev).unwrap();
    let mut out = Tensor::zeros(&[4 * slot_rows, h], DType::F32, &dev).unwrap();
    let args = FinalizeArgs::new(&xd, &id, DropPadMode::DropLessColumn);
    let rows = OutputRows::Padded { local_sizes: &captured_sizes, slot_rows };
    dev.backend().finalize_routing(&args, &dims, &mut out, rows).expect("warm-up");
    nd.check().expect("warm-up check");
    nd.set_current().expect("bind");
    let graph = Graph::capture(nd.stream().raw(), || {
        dev.backend().finalize_routing(&args, &dims, &mut out, rows).expect("captured finalize");
    });
    let mut scratch = Tensor::zeros(&[4 * slot_rows, h], DType::F32, &dev).unwrap();
    for round in 0..3 {
        // An eager padded finalize of another layout stages other offsets.
        finalize(&dev, &other_sizes, &mut scratch);
        nd.check().expect("eager check");
        graph.replay(nd.stream().raw());
        nd.check().expect("replay check");
        let got = out.to_cpu().unwrap();
        assert_eq!(
            bits(got.as_slice::<f32>().unwrap()),
            bits(want.as_slice::<f32>().unwrap()),
            "replay {round} used the captured layout"
        );
    }
}

/// The workspace of a captured launch stays with the graph: the native
/// unpermute's tiling is a workspace block that every replay copies in again
/// and the kernel reads when it runs (the simulator reads device tilings at
/// execution, as a kernel reads GM). Eager work queued between replays on the
/// same stream takes fresh workspace each round; it must never be handed the
/// graph's bytes, so every replay leaves the eager data alone and computes
/// SPEC section 1's unpermute of the captured inputs.
#[test]
#[ignore = "needs an Ascend NPU"]
fn eager_workspace_after_a_capture_never_shares_the_graphs_bytes() {
    use ascend_moe::{DType, Device, Tensor};
    let dev = NpuDevice::open(0).expect("npu:0");
    let (engine, s) = engine_stream(&dev);
    let (t, k, rows, h) = (4usize, 2usize, 8usize, 8usize);
    let permuted = inputs(3, 0, rows * h);
    // A permutation of the T*K rows, so every slot reads another row.
    let idx: Vec<i32> = (0..(t * k) as i32).map(|i| (i * 3 + 1) % (t * k) as i32).collect();
    let probs = inputs(4, 0, t * k);
    // SPEC section 1 in f64: out[t] = sum_k probs[t, k] * permuted[idx[t*K + k]].
    let want: Vec<f32> = (0..t * h)
        .map(|o| {
            let (tok, j) = (o / h, o % h);
            (0..k)
                .map(|kk| probs[tok * k + kk] as f64 * permuted[idx[tok * k + kk] as usize * h + j] as f64)
                .sum::<f64>() as f32
        })
        .collect();
    let permuted_d = dev.clone_htod(&permuted).expect("permuted");
    let idx_d = dev.clone_htod(&idx).expect("indices");
    let probs_d = dev.clone_htod(&probs).expect("probs");
    let mut out_d = dev.alloc_zeros::<f32>(t * h).expect("out");
    let (ps, is, ws, os) = ([rows, h], [t * k], [t, k], [t, h]);
    let pd = desc(dev_ptr(&permuted_d), amoe_dtype::F32, &ps, Place::Npu(0));
    let id = desc(dev_ptr(&idx_d), amoe_dtype::I32, &is, Place::Npu(0));
    let wd = desc(dev_ptr(&probs_d), amoe_dtype::F32, &ws, Place::Npu(0));
    let od = desc(dev_ptr(&out_d), amoe_dtype::F32, &os, Place::Npu(0));
    dev.synchronize().expect("uploads");
    let unpermute = move || {
        // SAFETY: live handles; descriptors over live memory.
        ok("unpermute", unsafe { amoe_moe_token_unpermute(&pd, &id, &wd, &od, s) })
    };
    let run = &unpermute;
    run();
    // SAFETY (every call below): a live handle.
    ok("warm-up check", unsafe { amoe_stream_check(s) });
    assert_eq!(bits(&out_d.to_vec().expect("eager out")), bits(&want), "eager unpermute");
    let graph = Graph::capture(engine.raw(), run);
    // SAFETY: `engine` outlives `on_engine`; both name the same stream and pool.
    let on_engine = Device::Npu(unsafe { NpuDevice::with_borrowed_stream(0, engine.raw()) }.expect("borrow"));
    for round in 0..3 {
        // Eager work between replays: fresh one-unit (512-byte) workspace
        // blocks with this round's bytes. The pool hands out the smallest
        // free range that fits, so had the capture's blocks (its tiling
        // among them) gone back to the pool, these would be given them.
        let keep: Vec<f32> = (0..128).map(|i| i as f32 * 0.5 + 1.0 + round as f32 * 4096.0).collect();
        let host = Tensor::from_slice(&keep, &[128]).expect("host");
        let held: Vec<Tensor> =
            (0..16).map(|_| on_engine.backend().scratch_from_host(&host).expect("eager workspace")).collect();
        assert!(held.iter().all(|t| t.dtype() == DType::F32));
        // The replay must compute from the captured inputs, not from stale output.
        out_d.copy_from_host(&vec![0.0; t * h]).expect("clear out");
        graph.replay(engine.raw());
        ok("check after a replay", unsafe { amoe_stream_check(s) });
        assert_eq!(bits(&out_d.to_vec().expect("out")), bits(&want), "replay {round}");
        for (i, t) in held.iter().enumerate() {
            assert_eq!(t.to_vec::<f32>().expect("held"), keep, "replay {round}: eager block {i} was overwritten");
        }
    }
    drop(graph);
    // SAFETY: a live handle, not used afterwards.
    unsafe { amoe_stream_free(s) };
}

/// SPEC section 1 with K = 1 and no scales, in the padded layout of
/// `sizes.len()` slots of `slot_rows` rows: token i is row `idx[i]` of `x`,
/// block r starts at row `r * slot_rows`, zeros elsewhere.
fn padded_unpermute(x: &[f32], idx: &[i32], sizes: &[usize], slot_rows: usize, h: usize) -> Vec<f32> {
    let mut out = vec![0f32; sizes.len() * slot_rows * h];
    let mut token = 0;
    for (r, &size) in sizes.iter().enumerate() {
        for j in 0..size {
            let src = idx[token] as usize;
            out[(r * slot_rows + j) * h..(r * slot_rows + j + 1) * h].copy_from_slice(&x[src * h..(src + 1) * h]);
            token += 1;
        }
    }
    out
}

fn sim_d2h_copies() -> Option<u64> {
    ascend_moe::testing::runtime::sim_counters().map(|c| c.d2h_copies)
}

/// A model whose graph captures more native launches than a stream keeps
/// records for (256): the first such capture is refused at the 257th launch
/// with an error that says how to reserve; after
/// `amoe_capture_records_reserve` the same capture runs, every launch's
/// record is checked on each replay (a bad index in one replay is reported
/// once, naming its position), the check reads the records in a few copies
/// rather than one per launch, and a second graph of the same size captured
/// after an eager call needs no reservation.
#[test]
#[ignore = "needs an Ascend NPU"]
fn captures_of_many_launches_reserve_their_records_and_report_each_launch() {
    const LAUNCHES: usize = 270;
    with_reversed_rows(3, |mut r| {
        let (run, raw, s) = (r.run, r.engine.raw(), r.s);
        r.warm_up();
        // Without a reservation: the first 256 launches are captured, the next refused.
        let mut refused = Vec::new();
        drop(Graph::capture(raw, || {
            for i in 0..LAUNCHES {
                let st = run();
                if st != amoe_status::Ok {
                    refused.push((i, st, last_error()));
                }
            }
        }));
        assert_eq!(refused.len(), LAUNCHES - 256, "{:?}", refused.first());
        let (i, st, msg) = &refused[0];
        assert_eq!((*i, *st), (256, amoe_status::InvalidArgument), "{msg}");
        assert!(msg.contains("amoe_capture_records_reserve") && msg.contains("256"), "{msg}");
        // Refused under capture: the reservation allocates.
        let mut under = amoe_status::Ok;
        // SAFETY (here and below): a live stream handle.
        drop(Graph::capture(raw, || under = unsafe { amoe_capture_records_reserve(s, LAUNCHES) }));
        assert_eq!(under, amoe_status::InvalidArgument);
        assert!(last_error().contains("captur"), "{}", last_error());

        ok("reserve", unsafe { amoe_capture_records_reserve(s, LAUNCHES) });
        let graph = Graph::capture(raw, || (0..LAUNCHES).for_each(|_| ok("captured finalize", run())));
        graph.replay(raw);
        let before = sim_d2h_copies();
        ok("check after a clean replay", r.check());
        if let (Some(a), Some(b)) = (before, sim_d2h_copies()) {
            // The records of the graphs live in two blocks, the eager ones in a third.
            assert!(b - a <= 3, "{} device-to-host copies for {LAUNCHES} captured records", b - a);
        }
        r.assert_output("a clean replay");
        r.replay_a_bad_index(&graph, 4, -7);

        // An eager call between two captures keeps as many records free as the
        // largest capture took: the next graph of the model needs no reservation.
        ok("eager call", run());
        ok("eager check", r.check());
        let second = Graph::capture(raw, || (0..LAUNCHES).for_each(|_| ok("second graph", run())));
        second.replay(raw);
        graph.replay(raw);
        ok("both graphs", r.check());
        r.assert_output("both graphs");
    });
}

/// Reservations are per stream. A finalize warmed up on the device's stream
/// and first run under capture on another stream of the device (as
/// `torch.npu.graph` captures on its own side stream when given no
/// `stream=`) is refused, saying that reservations are per stream; after
/// `reserve_like(warm)` the capture stream holds what the warm-up stream
/// does, and the captured op replays SPEC section 1's result.
#[test]
#[ignore = "needs an Ascend NPU"]
fn a_capture_stream_reserved_like_the_warm_up_stream_captures_its_ops() {
    use ascend_moe::backend::{DropPadMode, FinalizeArgs, FinalizeDims, OutputRows};
    use ascend_moe::{DType, Device, Tensor};
    let warm = NpuDevice::open(0).expect("npu:0");
    let side_stream = warm.new_stream().expect("a second stream");
    // SAFETY: side_stream is a live stream of npu:0 that outlives `side`.
    let side = unsafe { NpuDevice::with_borrowed_stream(0, side_stream.raw()) }.expect("npu:0 on the side stream");
    let (n, h) = (6usize, 16usize);
    let x: Vec<f32> = inputs(5, 0, n * h);
    let idx: Vec<i32> = (0..n as i32).rev().collect();
    let sizes = [2usize, 1, 0, 3];
    let slot_rows = 3;
    let dims = FinalizeDims { n, k: 1, h, expanded_rows: n, experts: 0 };
    let rows = OutputRows::Padded { local_sizes: &sizes, slot_rows };
    let want = padded_unpermute(&x, &idx, &sizes, slot_rows, h);
    let run = |d: &Device, out: &mut Tensor| {
        let xd = Tensor::from_slice(&x, &[n, h]).unwrap().to_device(d).unwrap();
        let id = Tensor::from_slice(&idx, &[n]).unwrap().to_device(d).unwrap();
        let args = FinalizeArgs::new(&xd, &id, DropPadMode::DropLessColumn);
        d.backend().finalize_routing(&args, &dims, out, rows)
    };
    let on_warm = Device::Npu(warm.clone());
    let mut eager = Tensor::zeros(&[4 * slot_rows, h], DType::F32, &on_warm).unwrap();
    run(&on_warm, &mut eager).expect("warm-up");
    warm.check().expect("warm-up check");
    let on_side = Device::Npu(side.clone());
    let xd = Tensor::from_slice(&x, &[n, h]).unwrap().to_device(&on_side).unwrap();
    let id = Tensor::from_slice(&idx, &[n]).unwrap().to_device(&on_side).unwrap();
    let mut out = Tensor::zeros(&[4 * slot_rows, h], DType::F32, &on_side).unwrap();
    side.check().expect("uploads");
    let args = FinalizeArgs::new(&xd, &id, DropPadMode::DropLessColumn);
    let mut refused = None;
    drop(Graph::capture(side.stream().raw(), || {
        refused = Some(on_side.backend().finalize_routing(&args, &dims, &mut out, rows))
    }));
    let msg = refused.expect("the body ran").expect_err("a stream that never ran the op").to_string();
    assert!(msg.contains("per stream") && msg.contains("torch.npu.graph"), "{msg}");
    side.stream().reserve_like(warm.stream()).expect("reserve_like");
    let graph = Graph::capture(side.stream().raw(), || {
        on_side.backend().finalize_routing(&args, &dims, &mut out, rows).expect("captured finalize")
    });
    for round in 0..2 {
        graph.replay(side.stream().raw());
        side.check().expect("replay check");
        assert_eq!(bits(out.to_cpu().unwrap().as_slice::<f32>().unwrap()), bits(&want), "replay {round}");
    }
    // Once topped up, the capture stream's pool gets no more from a second
    // call, also after the capture took blocks for its graph.
    let reserved = side.stream().workspace_stats().reserved_bytes;
    side.stream().reserve_like(warm.stream()).expect("again");
    assert_eq!(side.stream().workspace_stats().reserved_bytes, reserved, "a second reserve_like grew the pool");
    drop(graph);
    let other = NpuDevice::open(1).expect("npu:1");
    let err = other.stream().reserve_like(warm.stream()).expect_err("streams of two devices").to_string();
    assert!(err.contains("npu:0") && err.contains("npu:1"), "{err}");
}

/// One rank of `a_collective_warmed_up_on_one_stream_is_captured_on_another`:
/// its all-reduce results after the capture's first replay, after an eager
/// call on the warm-up stream, and after a second replay.
fn warm_then_capture_rank(rank: usize, world: usize, root: &HcclRootInfo) -> [Vec<f32>; 3] {
    const N: usize = 8;
    let dev = NpuDevice::open(rank as u32).expect("device");
    let (warm, sw) = engine_stream(&dev);
    let (cap, sc) = engine_stream(&dev);
    let hccl = HcclComm::from_root_info(&dev, root, world, rank, &CommOptions::from_env()).expect("communicator");
    let mut comm = null_mut();
    // SAFETY: a live communicator that outlives the handle.
    ok("comm", unsafe { amoe_comm_from_hccl(hccl.raw(), rank as u32, AMOE_HCCL_WORLD, &mut comm) });
    let x = dev.clone_htod(&[(rank + 1) as f32; N]).expect("x");
    let mut y = dev.alloc_zeros::<f32>(N).expect("y");
    dev.synchronize().expect("uploads");
    let shape = [N];
    let xd = desc(dev_ptr(&x), amoe_dtype::F32, &shape, Place::Npu(rank as i32));
    let yd = desc(dev_ptr(&y), amoe_dtype::F32, &shape, Place::Npu(rank as i32));
    // SAFETY (both closures): live handles; descriptors of live device buffers.
    let reduce_on = |s: *mut amoe_stream| unsafe { amoe_all_reduce(comm, &xd, &yd, amoe_reduce_op::Sum as u32, s) };
    let check = |s: *mut amoe_stream| ok("stream check", unsafe { amoe_stream_check(s) });
    ok("warm-up", reduce_on(sw));
    check(sw);
    let graph = Graph::capture(cap.raw(), || ok("captured all-reduce", reduce_on(sc)));
    let mut results: [Vec<f32>; 3] = Default::default();
    for (i, result) in results.iter_mut().enumerate() {
        // Zeroed first, so that a call that did nothing is not read as one that summed.
        y.copy_from_host(&[0.0; N]).expect("zero y");
        dev.synchronize().expect("zeroed");
        let s = if i == 1 {
            ok("eager after the capture", reduce_on(sw));
            sw
        } else {
            graph.replay(cap.raw());
            sc
        };
        check(s);
        *result = y.to_vec().expect("y");
    }
    drop(graph);
    // SAFETY: handles made above, not used afterwards.
    unsafe {
        amoe_comm_free(comm);
        amoe_stream_free(sw);
        amoe_stream_free(sc);
    }
    drop((warm, cap));
    results
}

/// `torch.npu.graph` captures on its own side stream while the warm-up ran
/// on the current one. The communicator orders each collective after its
/// previous one by an event on that collective's stream, and CANN refuses a
/// capturing stream's wait for an event recorded outside the capture (ACL
/// 107024): that wait is not made across a capture's edge, and the captured
/// all-reduce replays SPEC section 4's sum (1 + 2 on two ranks), as does an
/// eager call between the replays.
#[test]
#[ignore = "needs an Ascend NPU"]
fn a_collective_warmed_up_on_one_stream_is_captured_on_another() {
    const RANKS: usize = 2;
    let root = HcclRootInfo::generate(&NpuDevice::open(0).expect("npu:0")).expect("root info");
    let got: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..RANKS)
            .map(|r| {
                s.spawn({
                    let root = &root;
                    move || warm_then_capture_rank(r, RANKS, root)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    for (rank, results) in got.iter().enumerate() {
        for (what, v) in ["first replay", "eager call", "second replay"].iter().zip(results) {
            assert_eq!(v, &vec![3.0f32; 8], "rank {rank}, {what}");
        }
    }
}

/// Runs `body` while another thread holds a GLOBAL capture (torch_npu's
/// default mode) on a raw stream of npu:0 this crate never wrapped, into
/// which it queued a memset of the 64 bytes at `target` to 7. Returns what
/// `aclmdlRICaptureEnd` answered and, when it made a model, whether a replay
/// of it wrote the 7s.
fn during_a_foreign_global_capture(target: usize, body: impl FnOnce()) -> (i32, bool) {
    let (began_tx, began_rx) = std::sync::mpsc::channel::<()>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|sc| {
        let capturer = sc.spawn(move || {
            let api = acl_sys::acl().expect("ACL loaded");
            let (lib, global) = (&api.lib, acl_sys::aclmdlRICaptureMode::ACL_MODEL_RI_CAPTURE_MODE_GLOBAL);
            // SAFETY: the ACL signatures, with live handles and the 64 bytes
            // of device memory at `target`, which outlive the thread.
            unsafe {
                assert_eq!(lib.aclrtSetDevice(0), 0);
                let mut raw = null_mut();
                assert_eq!(lib.aclrtCreateStream(&mut raw), 0);
                assert_eq!(lib.aclmdlRICaptureBegin(raw, global), 0, "aclmdlRICaptureBegin");
                assert_eq!(lib.aclrtMemsetAsync(target as *mut c_void, 64, 7, 64, raw), 0);
                began_tx.send(()).expect("the engine thread waits");
                // Also when the engine thread panicked (its sender is gone).
                let _ = done_rx.recv();
                let mut model = null_mut();
                let end = lib.aclmdlRICaptureEnd(raw, &mut model);
                let mut replayed = false;
                if end == 0 {
                    assert_eq!(lib.aclrtMemset(target as *mut c_void, 64, 0, 64), 0);
                    assert_eq!(lib.aclmdlRIExecuteAsync(model, raw), 0, "replay");
                    assert_eq!(lib.aclrtSynchronizeStream(raw), 0);
                    let mut back = [0u8; 64];
                    let d2h = acl_sys::aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_HOST;
                    assert_eq!(lib.aclrtMemcpy(back.as_mut_ptr().cast(), 64, target as *const c_void, 64, d2h), 0);
                    replayed = back.iter().all(|&b| b == 7);
                    assert_eq!(lib.aclmdlRIDestroy(model), 0);
                }
                assert_eq!(lib.aclrtDestroyStream(raw), 0);
                assert_eq!(lib.aclrtResetDevice(0), 0);
                (end, replayed)
            }
        });
        let done = done_tx;
        began_rx.recv().expect("the capturing thread began its capture");
        body();
        drop(done);
        capturer.join().expect("capturing thread")
    })
}

/// A thread of the host engine (torch_npu) captures a graph in GLOBAL mode,
/// its default, on a stream this crate never saw, while the engine thread
/// runs an op and checks its stream: the check's blocking reads of the op's
/// status records (CANN refuses a blocking copy on every thread during a
/// GLOBAL capture, and the refusal fails the capture) are made in RELAXED
/// mode, so the check reports the op's bad index, once, and the other
/// thread's capture ends valid and replays.
#[test]
#[ignore = "needs an Ascend NPU"]
fn a_stream_check_during_another_threads_global_capture_reports_and_spares_the_capture() {
    with_reversed_rows(10, |mut r| {
        r.warm_up();
        let target = r.dev.alloc_zeros::<f32>(16).expect("the other thread's 64 bytes");
        r.write_bad_index(3, 99);
        let (mut reported, mut msg, mut again) = (amoe_status::Ok, String::new(), amoe_status::Ok);
        let ended = during_a_foreign_global_capture(dev_ptr(&target) as usize, || {
            ok("the op during the other thread's capture", (r.run)());
            reported = r.check();
            msg = last_error();
            again = r.check();
        });
        assert_bad_index("the check during the capture", reported, &msg, 3, 99);
        assert_eq!(again, amoe_status::Ok, "reported once");
        assert_eq!(ended, (0, true), "the other thread's capture ended valid and its graph replayed");
        r.restore_index();
        ok("after the capture", (r.run)());
        ok("check after the capture", r.check());
        r.assert_output("after the capture");
    });
}
