//! Host memory that cannot be had is an error naming the call, never an
//! abort of the caller's process.
//!
//! Each case runs in a child process (this test binary again) whose address
//! space is capped a little above what it already maps (`RLIMIT_AS`), so a
//! 1 GiB allocation fails whatever the host's overcommit policy and memory.

use std::process::Command;

use ascend_moe::backend::cpu::CpuBuffer;
use ascend_moe::backend::npu::{DeviceBuffer, NpuBuffer, NpuDevice};
use ascend_moe::backend::FinalizeArgs;
use ascend_moe::moe::prepare_finalize::{dispatch, finalize_into, MoeContext, MoeGroups};
use ascend_moe::moe::shared::{shared_gather_unpad_into, shared_pad_reduce_scatter_into};
use ascend_moe::moe::{maybe_all_gather_and_maybe_unpad_into, moe_finalize_routing, moe_finalize_routing_into};
use ascend_moe::ranks::run_ranks;
use ascend_moe::{CommErrorKind, CommOptions, CommType, DType, DropPadMode, SpLayout, Tensor};

/// Set in the child to the case it runs.
const CASE: &str = "ASCEND_MOE_TEST_HOST_MEMORY_CASE";
const TEST: &str = "host_memory_that_cannot_be_had_is_an_error";
/// f32 elements of 1 GiB.
const GIB_F32: usize = 1 << 28;
/// Rows x hidden size of the 1 GiB finalize case.
const ROWS: usize = 1024;

/// The address space this process maps now, from `/proc/self/status`.
fn mapped_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    let kib = status.lines().find_map(|l| l.strip_prefix("VmSize:")).expect("VmSize in /proc/self/status");
    kib.trim().trim_end_matches("kB").trim().parse::<u64>().expect("VmSize in kB") * 1024
}

/// Caps the address space at what is mapped now plus 256 MiB.
fn cap_address_space() {
    cap_address_space_above(256 << 20);
}

/// Caps the address space at what is mapped now plus `headroom` bytes.
fn cap_address_space_above(headroom: u64) {
    let cap = mapped_bytes() + headroom;
    let lim = libc::rlimit { rlim_cur: cap as libc::rlim_t, rlim_max: libc::RLIM_INFINITY };
    // SAFETY: a plain system call on a valid struct.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &lim) }, 0, "setrlimit(RLIMIT_AS)");
}

/// Lifts the cap of [`cap_address_space`].
fn uncap_address_space() {
    let lim = libc::rlimit { rlim_cur: libc::RLIM_INFINITY, rlim_max: libc::RLIM_INFINITY };
    // SAFETY: a plain system call on a valid struct.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &lim) }, 0, "setrlimit(RLIMIT_AS)");
}

/// `bytes` of memory with protection `prot` that take none until written:
/// an anonymous private mapping, never unmapped.
fn unbacked(bytes: usize, prot: libc::c_int) -> *mut u8 {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    // SAFETY: a new anonymous mapping at an address of the kernel's choice.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), bytes, prot, flags, -1, 0) };
    assert_ne!(p, libc::MAP_FAILED, "mmap of {bytes} bytes");
    p.cast()
}

/// `bytes` of read-only zeros that take no memory (the kernel's zero page).
fn unbacked_zeros(bytes: usize) -> &'static [f32] {
    let p = unbacked(bytes, libc::PROT_READ);
    // SAFETY: `bytes` readable bytes at `p`, page-aligned, for the process's life.
    unsafe { std::slice::from_raw_parts(p.cast::<f32>(), bytes / 4) }
}

/// `bytes` of writable memory that take none until written.
fn unbacked_mut(bytes: usize) -> *mut u8 {
    unbacked(bytes, libc::PROT_READ | libc::PROT_WRITE)
}

/// Runs `case` with the address space capped; the error each call returns.
fn run_case(case: &str) -> Vec<(&'static str, ascend_moe::Result<()>)> {
    let ok = |r: ascend_moe::Result<Tensor>| r.map(drop);
    match case {
        "zeros" => {
            cap_address_space();
            vec![("Tensor::zeros", ok(Tensor::try_zeros_cpu(&[GIB_F32], DType::F32)))]
        }
        "from_slice" => {
            let src = unbacked_zeros(GIB_F32 * 4);
            cap_address_space();
            vec![("Tensor::from_slice", ok(Tensor::from_slice(src, &[GIB_F32])))]
        }
        "copies" => {
            let t = Tensor::try_zeros_cpu(&[GIB_F32], DType::F32).expect("1 GiB before the cap");
            cap_address_space();
            vec![
                ("Tensor::to_cpu", ok(t.try_clone())),
                ("Tensor::to_cpu", ok(t.to_cpu())),
                ("Tensor::to_vec", t.to_vec::<f32>().map(drop)),
            ]
        }
        "finalize" => {
            let idx = Tensor::from_slice(&(0..ROWS as i32).collect::<Vec<_>>(), &[ROWS]).expect("indices");
            // One small call first, so the op's worker threads exist before the cap.
            let small = Tensor::try_zeros_cpu(&[ROWS, 4], DType::F32).expect("small input");
            moe_finalize_routing(&FinalizeArgs::new(&small, &idx, DropPadMode::DropLessRow))
                .expect("the small finalize");
            let x = Tensor::try_zeros_cpu(&[ROWS, GIB_F32 / ROWS], DType::F32).expect("1 GiB before the cap");
            cap_address_space();
            vec![("Tensor::output", ok(moe_finalize_routing(&FinalizeArgs::new(&x, &idx, DropPadMode::DropLessRow))))]
        }
        other => panic!("unknown case {other:?}"),
    }
}

/// Runs test `test` of this binary again in a child with `CASE` set to `case`;
/// its standard output.
fn run_child(test: &str, case: &str) -> String {
    let exe = std::env::current_exe().expect("this test binary");
    let out = Command::new(exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1", "--include-ignored"])
        .env(CASE, case)
        // Rust's default thread stack (2 MiB), which the thread case's cap must not fit.
        .env_remove("RUST_MIN_STACK")
        .output()
        .expect("run the child");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "case {case}: {}\n{stdout}\n{stderr}", out.status);
    stdout.into_owned()
}

#[test]
fn host_memory_that_cannot_be_had_is_an_error() {
    if let Ok(case) = std::env::var(CASE) {
        for (op, r) in run_case(&case) {
            let e = r.expect_err("a 1 GiB allocation under a 256 MiB cap succeeded");
            assert!(matches!(e, ascend_moe::Error::HostMemory { op: o, .. } if o == op), "{case}: {op}: {e:?}");
            let e = e.to_string();
            assert!(e.contains(op) && e.contains("bytes of host memory could not be allocated"), "{case}: {op}: {e}");
            println!("refused: {e}");
        }
        return;
    }
    for case in ["zeros", "from_slice", "copies", "finalize"] {
        let stdout = run_child(TEST, case);
        assert!(stdout.contains("refused: "), "case {case} ran no call: {stdout}");
    }
}

/// Copies of device memory to the host (`DeviceBuffer::to_vec`,
/// `Tensor::to_cpu` of an NPU tensor) that cannot have their host memory are
/// an error naming the call, as on the CPU.
#[test]
#[ignore = "needs an Ascend NPU"]
fn npu_host_copies_that_cannot_be_had_are_an_error() {
    const NPU_TEST: &str = "npu_host_copies_that_cannot_be_had_are_an_error";
    if std::env::var(CASE).is_ok() {
        let device = NpuDevice::open(0).unwrap_or_else(|e| panic!("npu:0: {e}"));
        // 1 GiB of device memory, never written (nothing of it is copied).
        let buf = DeviceBuffer::<f32>::alloc(&device, GIB_F32).expect("1 GiB of device memory");
        let raw = NpuBuffer::alloc(&device, GIB_F32 * 4).expect("1 GiB of device memory");
        let t = Tensor::from_buffer(&[GIB_F32], DType::F32, raw).expect("an NPU tensor");
        cap_address_space();
        for (op, r) in [("DeviceBuffer::to_vec", buf.to_vec().map(drop)), ("Tensor::to_cpu", t.to_cpu().map(drop))] {
            let e = r.expect_err("a 1 GiB host copy under a 256 MiB cap succeeded");
            assert!(
                matches!(e, ascend_moe::Error::HostMemory { op: o, bytes } if o == op && bytes == GIB_F32 * 4),
                "{e:?}"
            );
            println!("refused: {e}");
        }
        return;
    }
    let stdout = run_child(NPU_TEST, "npu");
    assert_eq!(stdout.matches("refused: ").count(), 2, "{stdout}");
}

/// An f32 tensor of `shape` over the first bytes of `mem`, borrowed.
fn borrowed(mem: *mut u8, shape: &[usize]) -> Tensor {
    let bytes = shape.iter().product::<usize>() * 4;
    // SAFETY: `mem` is a mapping of at least `bytes` writable bytes that
    // outlives the process's tensors (it is never unmapped).
    let buf = unsafe { CpuBuffer::borrow_raw(mem, bytes, true) }.expect("a borrowed buffer");
    Tensor::from_buffer(shape, DType::F32, buf).expect("a borrowed tensor")
}

/// A rank that cannot have the host memory an op needs fails its peer in
/// the op's collective at once, quoting why, instead of leaving it to wait
/// out the group's timeout (10 s here), which it then failed with, without a
/// word of why: the copy of an `x` its `out` covers (the SP ops, the
/// shared-expert ops, finalize), a DP-gather finalize's slot of `max_d T_d`
/// rows (which a rank with fewer tokens needs and one with the most does
/// not), and the rows a dispatch sends (a rank routing many more than its
/// peers).
#[test]
fn a_rank_without_memory_for_an_op_fails_its_peers_in_the_collective() {
    const REFUSAL_TEST: &str = "a_rank_without_memory_for_an_op_fails_its_peers_in_the_collective";
    // Rows of 64 Ki f32 elements (256 KiB); 2048 of them are 512 MiB, more
    // than the cap leaves.
    const H: usize = 1 << 16;
    const R: usize = 2048;
    if std::env::var(CASE).is_ok() {
        let layout = SpLayout::new(&[2 * R, 1]).expect("layout");
        // (op, rank 0's x, rank 1's x, rank 0's out, rank 1's out, whether
        // rank 0's out covers its x).
        type Case = (&'static str, usize, usize, usize, usize, bool);
        let cases: [Case; 6] = [
            ("maybe_all_gather_and_maybe_unpad", 2 * R, 1, 2 * R + 1, 2 * R + 1, true),
            ("shared_gather_unpad", R, R, 2 * R, 2 * R, true),
            ("shared_pad_reduce_scatter", 2 * R, 2 * R, R, R, true),
            // ALLGATHER over DP 2 (TP 1), dp_tokens [R, R]: y holds 2R rows.
            ("finalize_into (copy of y)", 2 * R, 2 * R, R, R, true),
            // dp_tokens [1, R]: rank 0 finalizes into a slot of R rows.
            ("finalize_into (DP slot)", 2 * R, 2 * R, 1, R, false),
            // Every token to expert 0 of 2 (rank 0's): rank 0 gathers its R
            // rows to send, rank 1 its one (the op allocates; `out` is unused).
            ("dispatch", R, 1, 1, 1, false),
        ];
        let opts = CommOptions::with_timeout(std::time::Duration::from_secs(10));
        for (op, x0, x1, out0, out1, covers) in cases {
            uncap_address_space();
            let barrier = std::sync::Barrier::new(2);
            let results = run_ranks(2, &opts, |rank, comm| {
                let (x_rows, out_rows) = if rank == 0 { (x0, out0) } else { (x1, out1) };
                let x_mem = unbacked_mut(x_rows.max(out_rows) * H * 4);
                let out_mem = if rank == 0 && covers { x_mem } else { unbacked_mut(out_rows * H * 4) };
                let (x, mut out) = (borrowed(x_mem, &[x_rows, H]), borrowed(out_mem, &[out_rows, H]));
                let dp_tokens = if op.ends_with("(DP slot)") { [1, R] } else { [R, R] };
                let ctx = MoeContext::new(&dp_tokens, 1, rank, 0, false)?;
                let groups = MoeGroups::from_world(&comm, 1)?;
                barrier.wait();
                if rank == 0 {
                    cap_address_space();
                }
                barrier.wait();
                let r = match op {
                    "maybe_all_gather_and_maybe_unpad" => {
                        maybe_all_gather_and_maybe_unpad_into(&x, Some(&layout), &comm, &mut out)
                    }
                    "shared_gather_unpad" => shared_gather_unpad_into(&x, 2 * R, &comm, &mut out),
                    "shared_pad_reduce_scatter" => shared_pad_reduce_scatter_into(&x, &comm, &mut out),
                    "dispatch" => dispatch(&x, &vec![0; x_rows], 1, None, 2, &comm).map(drop),
                    _ => finalize_into(&x, CommType::AllGather, &ctx, &groups, &mut out),
                };
                // Each rank keeps its communicator until both are done, as an
                // engine does (a dropped one would tell the peer it left).
                barrier.wait();
                Ok(r)
            })
            .expect("the ranks ran");
            let own = results[0].as_ref().expect_err("rank 0 had 512 MiB under a 256 MiB cap");
            assert!(matches!(own, ascend_moe::Error::HostMemory { .. }), "{op}: rank 0: {own:?}");
            let peer = results[1].as_ref().expect_err("rank 1 went on without rank 0");
            // The refusal channel's error: a mismatched call quoting rank 0's reason.
            let refused = matches!(peer, ascend_moe::Error::Comm { kind: CommErrorKind::Mismatch, .. });
            let why = format!("rank 0: {own}");
            assert!(refused && peer.to_string().contains(&why), "{op}: rank 1: {peer:?}");
            println!("{op} refused: {peer}");
        }
        return;
    }
    let stdout = run_child(REFUSAL_TEST, "refusal");
    assert_eq!(stdout.matches(" refused: ").count(), 6, "{stdout}");
}

/// A finalize asked to use 4 threads where no thread can start (no memory
/// for a stack) does all of its work on the calling thread: the right
/// output, and no panic.
#[test]
fn a_finalize_whose_threads_cannot_start_runs_on_the_calling_thread() {
    const THREADS_TEST: &str = "a_finalize_whose_threads_cannot_start_runs_on_the_calling_thread";
    const H: usize = 64;
    if std::env::var(CASE).is_ok() {
        // Identity indices, one slot per token, no scales, bias or skips:
        // each output row is its input row.
        let values: Vec<f32> = (0..ROWS * H).map(|i| (i % 65_521) as f32).collect();
        let x = Tensor::from_slice(&values, &[ROWS, H]).expect("input");
        let idx = Tensor::from_slice(&(0..ROWS as i32).collect::<Vec<_>>(), &[ROWS]).expect("indices");
        let mut out = Tensor::try_zeros_cpu(&[ROWS, H], DType::F32).expect("output");
        ascend_moe::backend::cpu::set_num_threads(Some(4));
        cap_address_space_above(1 << 20);
        assert!(std::thread::Builder::new().spawn(|| ()).is_err(), "a thread started under the cap");
        moe_finalize_routing_into(&FinalizeArgs::new(&x, &idx, DropPadMode::DropLessRow), &mut out)
            .expect("the finalize");
        let got = out.to_vec::<f32>().expect("the output");
        let bad = got.iter().zip(&values).position(|(g, v)| g != v);
        assert_eq!(bad, None, "output differs from the input rows");
        println!("finalized on the calling thread");
        return;
    }
    let stdout = run_child(THREADS_TEST, "threads");
    assert!(stdout.contains("finalized on the calling thread"), "{stdout}");
}
