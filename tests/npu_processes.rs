//! One HCCL world of four processes, one card each, as vLLM-Ascend runs
//! it: every worker process sees only its own card
//! (`ASCEND_RT_VISIBLE_DEVICES=r`, hicann/runtime
//! `docs/zh/env_vars/ASCEND_RT_VISIBLE_DEVICES.md`), uses it as device 0,
//! and joins the world through the root info rank 0 made (`HcclGetRootInfo`
//! is called on the root only, hicann/hcomm
//! `docs/zh/api_ref/comm_mgr_c/HcclGetRootInfo.md:23`; its server runs in
//! the calling process, `src/legacy/ascend910/framework/op_base/src/op_base.cc:1378-1398`),
//! passed on as hex. Every other HCCL test runs its ranks as threads of one
//! process. Ignored without an NPU; `ci/sim.sh` runs it on the simulated
//! runtime, `ci/npu-4card.sh` on a 4-card host.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ascend_moe::backend::npu::{self, HcclComm, HcclRootInfo, NpuDevice};
use ascend_moe::backend::{DropPadMode, FinalizeArgs};
use ascend_moe::moe::finalize_and_reduce;
use ascend_moe::{Collectives, Comm, CommOptions, Device, ReduceOp, Result, SpLayout, Tensor};

const WORLD: usize = 4;
const NAME: &str = "four_processes_one_card_each_all_reduce_and_finalize_and_reduce";
/// Set in a child: its rank.
const RANK_ENV: &str = "AMOE_TEST_NPU_PROCESS_RANK";
/// Set in a child: the file rank 0 writes the root info's hex to.
const ROOT_ENV: &str = "AMOE_TEST_NPU_PROCESS_ROOT_FILE";
/// How long the parent waits for every child, and a child for the root info.
const PARENT_TIMEOUT: Duration = Duration::from_secs(600);
const ROOT_TIMEOUT: Duration = Duration::from_secs(300);

/// Tokens each rank holds after the reduce (SPEC section 2), uneven, one rank
/// with none; `N` is their sum.
const LOCAL_SIZES: [usize; WORLD] = [3, 0, 4, 1];
const K: usize = 2;
const H: usize = 40;
const ELEMS: usize = 1000;

/// Rank `r`'s all-reduce input: small integers, exact in f32 and in any
/// order of summation.
fn reduce_input(r: usize) -> Vec<f32> {
    (0..ELEMS).map(|i| ((i * 7 + r * 13) % 23) as f32 - 11.0).collect()
}

/// Rank `r`'s finalize inputs: `expanded_x [N*K, H]` of small integers, a
/// row-layout index (a permutation of `0..N*K` per rank) and scales that are
/// multiples of 1/4, so every product and sum is exact in f32.
fn finalize_inputs(r: usize) -> (Vec<f32>, Vec<i32>, Vec<f32>) {
    let n: usize = LOCAL_SIZES.iter().sum();
    let x = (0..n * K * H).map(|i| ((i * 5 + r * 3) % 17) as f32 - 8.0).collect();
    // 5 is coprime with N*K = 16, so this is a permutation.
    let idx = (0..n * K).map(|j| ((j * 5 + r) % (n * K)) as i32).collect();
    let scales = (0..n * K).map(|j| ((j + r) % 4) as f32 * 0.25 + 0.25).collect();
    (x, idx, scales)
}

/// The expected values, computed here in f64 from the definitions: the
/// all-reduce is the element-wise sum over ranks; `finalize_and_reduce` is
/// this rank's block of rows of the sum over ranks of each rank's finalize
/// (SPEC section 1, mode 2: `out[i] = sum_k s(i,k) * x[idx[i*K + k]]`;
/// sections 3-4 for the block).
fn expected(rank: usize) -> (Vec<f64>, Vec<f64>) {
    let inputs: Vec<Vec<f32>> = (0..WORLD).map(reduce_input).collect();
    let sum: Vec<f64> = (0..ELEMS).map(|i| inputs.iter().map(|x| x[i] as f64).sum()).collect();
    let n: usize = LOCAL_SIZES.iter().sum();
    let mut total = vec![0f64; n * H];
    for r in 0..WORLD {
        let (x, idx, scales) = finalize_inputs(r);
        for i in 0..n {
            for k in 0..K {
                let row = idx[i * K + k] as usize;
                for c in 0..H {
                    total[i * H + c] += scales[i * K + k] as f64 * x[row * H + c] as f64;
                }
            }
        }
    }
    let first: usize = LOCAL_SIZES[..rank].iter().sum();
    (sum, total[first * H..(first + LOCAL_SIZES[rank]) * H].to_vec())
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn four_processes_one_card_each_all_reduce_and_finalize_and_reduce() {
    match std::env::var(RANK_ENV) {
        Ok(rank) => {
            let rank: usize = rank.parse().unwrap_or_else(|_| panic!("{RANK_ENV}={rank:?}"));
            let root_file = PathBuf::from(std::env::var_os(ROOT_ENV).expect(ROOT_ENV));
            child(rank, &root_file).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            println!("rank {rank} checked");
        }
        Err(_) => parent(),
    }
}

/// Starts the four ranks, each seeing only its card, and waits for all of
/// them; when one fails (or the time is up) the others are killed.
fn parent() {
    let dir = std::env::temp_dir().join(format!("amoe-npu-processes-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    let root_file = dir.join("root-info.hex");
    let exe = std::env::current_exe().expect("this test binary");
    let log = |r: usize| dir.join(format!("rank-{r}.log"));
    let cards = cards();
    let mut children: Vec<Option<Child>> = (0..WORLD)
        .map(|r| {
            let out = File::create(log(r)).expect("a log file");
            let err = out.try_clone().expect("a log file");
            let child = Command::new(&exe)
                .args([NAME, "--exact", "--ignored", "--nocapture", "--test-threads=1"])
                .env(RANK_ENV, r.to_string())
                .env(ROOT_ENV, &root_file)
                .env("ASCEND_RT_VISIBLE_DEVICES", &cards[r])
                .stdin(Stdio::null())
                .stdout(out)
                .stderr(err)
                .spawn()
                .unwrap_or_else(|e| panic!("starting rank {r}: {e}"));
            Some(child)
        })
        .collect();
    let start = Instant::now();
    let mut status: Vec<Option<std::process::ExitStatus>> = vec![None; WORLD];
    let mut failed = None;
    while status.iter().any(Option::is_none) && failed.is_none() {
        for r in 0..WORLD {
            if let Some(c) = children[r].as_mut() {
                if let Some(s) = c.try_wait().expect("waiting for a rank") {
                    status[r] = Some(s);
                    children[r] = None;
                    if !s.success() {
                        failed = Some(format!("rank {r} exited with {s}"));
                    }
                }
            }
        }
        if failed.is_none() && start.elapsed() > PARENT_TIMEOUT {
            failed = Some(format!("the ranks did not all finish within {PARENT_TIMEOUT:?}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for c in children.iter_mut().flatten() {
        let _ = c.kill();
        let _ = c.wait();
    }
    let logs: Vec<String> = (0..WORLD)
        .map(|r| {
            let what = status[r].map_or("killed".to_string(), |s| s.to_string());
            format!("--- rank {r} ({what}) ---\n{}", std::fs::read_to_string(log(r)).unwrap_or_default())
        })
        .collect();
    let logs = logs.join("\n");
    let _ = std::fs::remove_dir_all(&dir);
    if let Some(why) = failed {
        panic!("{why}\n{logs}");
    }
    for r in 0..WORLD {
        // The child ran the test (a name that matches nothing also exits 0).
        assert!(logs.contains(&format!("rank {r} checked")), "rank {r} did not run the test:\n{logs}");
    }
}

/// The card of each rank: the first `WORLD` of `ASCEND_RT_VISIBLE_DEVICES`
/// when the run was given a list (a job holding cards 4-7 of an 8-card host
/// tests those, as the rest of the suite does), else cards `0..WORLD`.
fn cards() -> Vec<String> {
    match std::env::var("ASCEND_RT_VISIBLE_DEVICES") {
        Ok(list) if !list.trim().is_empty() => {
            let cards: Vec<String> = list.split(',').map(|c| c.trim().to_string()).collect();
            assert!(
                cards.len() >= WORLD && cards.iter().all(|c| !c.is_empty()),
                "ASCEND_RT_VISIBLE_DEVICES={list:?} lists fewer than the {WORLD} cards this test runs one process on each"
            );
            cards.into_iter().take(WORLD).collect()
        }
        _ => (0..WORLD).map(|r| r.to_string()).collect(),
    }
}

/// One rank: its card is device 0, the only one it sees.
fn child(rank: usize, root_file: &Path) -> Result<()> {
    let count = npu::device_count()?;
    let visible = std::env::var("ASCEND_RT_VISIBLE_DEVICES").unwrap_or_default();
    assert_eq!(count, 1, "rank {rank}: ASCEND_RT_VISIBLE_DEVICES={visible} leaves one device visible");
    let device = NpuDevice::open(0)?;
    let root = if rank == 0 {
        let root = HcclRootInfo::generate(&device)?;
        // Written whole, then renamed: a peer never reads half of it.
        let tmp = root_file.with_extension("tmp");
        std::fs::write(&tmp, root.to_hex()).expect("writing the root info");
        std::fs::rename(&tmp, root_file).expect("publishing the root info");
        root
    } else {
        let start = Instant::now();
        loop {
            if let Ok(hex) = std::fs::read_to_string(root_file) {
                break HcclRootInfo::from_hex(&hex)?;
            }
            assert!(start.elapsed() < ROOT_TIMEOUT, "rank 0 wrote no root info to {} in time", root_file.display());
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let comm = Comm::Npu(HcclComm::from_root_info(&device, &root, WORLD, rank, &CommOptions::from_env())?);
    let dev = Device::Npu(device);
    let (want_sum, want_finalize) = expected(rank);

    let mut t = Tensor::from_slice(&reduce_input(rank), &[ELEMS])?.to_device(&dev)?;
    comm.all_reduce_in_place(&mut t, ReduceOp::Sum)?;
    check(rank, "all_reduce", &t, &want_sum)?;

    let n: usize = LOCAL_SIZES.iter().sum();
    let (x, idx, scales) = finalize_inputs(rank);
    let x = Tensor::from_slice(&x, &[n * K, H])?.to_device(&dev)?;
    let idx = Tensor::from_slice(&idx, &[n * K])?.to_device(&dev)?;
    let scales = Tensor::from_slice(&scales, &[n, K])?.to_device(&dev)?;
    let layout = SpLayout::new(&LOCAL_SIZES)?;
    let args = FinalizeArgs::new(&x, &idx, DropPadMode::DropLessRow).with_scales(&scales);
    let out = finalize_and_reduce(&args, Some(&layout), &comm)?;
    assert_eq!(out.shape(), [LOCAL_SIZES[rank], H], "rank {rank}: finalize_and_reduce shape");
    check(rank, "finalize_and_reduce", &out, &want_finalize)
}

/// Fails naming the first element of `got` that is not `want` (every
/// expected value is exact in f32).
fn check(rank: usize, what: &str, got: &Tensor, want: &[f64]) -> Result<()> {
    let got: Vec<f64> = got.to_vec::<f32>()?.into_iter().map(f64::from).collect();
    assert_eq!(got.len(), want.len(), "rank {rank}: {what}: element count");
    let wrong: Vec<usize> = (0..got.len()).filter(|&i| got[i] != want[i]).collect();
    if let Some(&i) = wrong.first() {
        panic!(
            "rank {rank}: {what}: {} of {} elements wrong, first at {i}: {} (expected {})",
            wrong.len(),
            got.len(),
            got[i],
            want[i]
        );
    }
    Ok(())
}
