//! Ranks as separate processes: the CLI's hidden `worker` subcommand, fed input
//! files written here and checked against the naive reference of `common`.

mod common;

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ascend_moe::backend::cpu::segment_path;
use ascend_moe::backend::cpu::CpuComm;
use ascend_moe::half::{bf16, f16};
use ascend_moe::{Collectives, CommOptions, DType, ReduceOp};
use common::*;

const EXE: &str = env!("CARGO_BIN_EXE_ascend-moe");
const WORLD: usize = 4;

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("amoe-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

fn worker(name: &str, rank: usize, timeout: f64, task: &[&str]) -> Command {
    let mut c = Command::new(EXE);
    c.args(["worker", "--name", name, "--world", &WORLD.to_string(), "--rank", &rank.to_string()])
        .args(["--timeout", &timeout.to_string(), "--staging-bytes", "4096"])
        .args(task);
    c
}

/// Runs the script in `dir` on WORLD processes; panics with their output on failure.
fn run_script(dir: &Path, name: &str) {
    let kids: Vec<Child> = (0..WORLD)
        .map(|r| {
            worker(name, r, 20.0, &["script", dir.to_str().expect("utf-8 path")])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn worker")
        })
        .collect();
    for (r, k) in kids.into_iter().enumerate() {
        let o = k.wait_with_output().expect("wait");
        assert!(
            o.status.success(),
            "rank {r}: {}\n{}\n{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

fn write<T: TestElem>(dir: &Path, line: usize, rank: usize, v: &[T]) {
    std::fs::write(dir.join(format!("in.{line}.{rank}")), bytemuck::cast_slice::<T, u8>(v)).expect("write input");
}

fn read<T: TestElem>(dir: &Path, line: usize, rank: usize) -> Vec<T> {
    let b = std::fs::read(dir.join(format!("out.{line}.{rank}"))).expect("read output");
    b.chunks_exact(std::mem::size_of::<T>()).map(bytemuck::pod_read_unaligned).collect()
}

fn join(v: &[usize]) -> String {
    v.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(",")
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

/// A script of every collective for `T`; returns the checker.
/// Checks one script line's outputs; returns what was wrong.
type Check = Box<dyn Fn(&Path) -> Vec<String>>;

fn cases<T: TestElem>(dir: &Path, script: &mut Vec<String>, checks: &mut Vec<Check>) {
    let dt = T::DTYPE.name();
    for &n in &[0usize, 1, 37, 2500] {
        let seed = (T::DTYPE as u64) << 20 | n as u64;
        for op in ReduceOp::ALL {
            // all_reduce (out of place and in place)
            for mode in ["out", "inplace"] {
                let line = script.len();
                script.push(format!("all_reduce {dt} {} {mode}", op.name()));
                for r in 0..WORLD {
                    write(dir, line, r, &data::<T>(seed + line as u64, r, n));
                }
                let want = reduced::<T>(seed + line as u64, WORLD, n, op);
                checks.push(Box::new(move |d| {
                    (0..WORLD)
                        .filter_map(|r| {
                            same_bits(&read::<T>(d, line, r), &want).err().map(|e| format!("line {line} r{r}: {e}"))
                        })
                        .collect()
                }));
            }
            // reduce_scatter
            let line = script.len();
            script.push(format!("reduce_scatter {dt} {}", op.name()));
            for r in 0..WORLD {
                write(dir, line, r, &data::<T>(seed + line as u64, r, n * WORLD));
            }
            let full = reduced::<T>(seed + line as u64, WORLD, n * WORLD, op);
            checks.push(Box::new(move |d| {
                (0..WORLD)
                    .filter_map(|r| {
                        same_bits(&read::<T>(d, line, r), &full[r * n..(r + 1) * n])
                            .err()
                            .map(|e| format!("line {line} r{r}: {e}"))
                    })
                    .collect()
            }));
        }
        // all_gather
        let line = script.len();
        script.push(format!("all_gather {dt}"));
        for r in 0..WORLD {
            write(dir, line, r, &data::<T>(seed + line as u64, r, n));
        }
        let want: Vec<T> = (0..WORLD).flat_map(|j| data::<T>(seed + line as u64, j, n)).collect();
        checks.push(Box::new(move |d| {
            (0..WORLD)
                .filter_map(|r| {
                    same_bits(&read::<T>(d, line, r), &want).err().map(|e| format!("line {line} r{r}: {e}"))
                })
                .collect()
        }));
        // all_to_all_v
        let line = script.len();
        let m = a2a_matrix(WORLD, n);
        let rows: Vec<String> = m.iter().map(|r| join(r)).collect();
        script.push(format!("all_to_all_v {dt} {}", rows.join(";")));
        let ins: Vec<Vec<T>> = (0..WORLD).map(|r| data::<T>(seed + line as u64, r, m[r].iter().sum())).collect();
        for (r, v) in ins.iter().enumerate() {
            write(dir, line, r, v);
        }
        checks.push(Box::new(move |d| {
            (0..WORLD)
                .filter_map(|r| {
                    let want: Vec<T> = (0..WORLD)
                        .flat_map(|i| {
                            let off = prefix(&m[i])[r];
                            ins[i][off..off + m[i][r]].to_vec()
                        })
                        .collect();
                    same_bits(&read::<T>(d, line, r), &want).err().map(|e| format!("line {line} r{r}: {e}"))
                })
                .collect()
        }));
        // reduce_scatter_v and all_gather_v, broadcast
        let counts = v_counts(WORLD, n);
        let total: usize = counts.iter().sum();
        let line = script.len();
        script.push(format!("reduce_scatter_v {dt} sum {}", join(&counts)));
        for r in 0..WORLD {
            write(dir, line, r, &data::<T>(seed + line as u64, r, total));
        }
        let full = reduced::<T>(seed + line as u64, WORLD, total, ReduceOp::Sum);
        let (c2, dsp) = (counts.clone(), prefix(&counts));
        checks.push(Box::new(move |d| {
            (0..WORLD)
                .filter_map(|r| {
                    same_bits(&read::<T>(d, line, r), &full[dsp[r]..dsp[r] + c2[r]])
                        .err()
                        .map(|e| format!("line {line} r{r}: {e}"))
                })
                .collect()
        }));
        let line = script.len();
        script.push(format!("all_gather_v {dt} {}", join(&counts)));
        for (r, &c) in counts.iter().enumerate() {
            write(dir, line, r, &data::<T>(seed + line as u64, r, c));
        }
        let want: Vec<T> = (0..WORLD).flat_map(|j| data::<T>(seed + line as u64, j, counts[j])).collect();
        checks.push(Box::new(move |d| {
            (0..WORLD)
                .filter_map(|r| {
                    same_bits(&read::<T>(d, line, r), &want).err().map(|e| format!("line {line} r{r}: {e}"))
                })
                .collect()
        }));
        let line = script.len();
        let root = n % WORLD;
        script.push(format!("broadcast {dt} {root}"));
        for r in 0..WORLD {
            write(dir, line, r, &data::<T>(seed + line as u64, r, n));
        }
        let want = data::<T>(seed + line as u64, root, n);
        checks.push(Box::new(move |d| {
            (0..WORLD)
                .filter_map(|r| {
                    same_bits(&read::<T>(d, line, r), &want).err().map(|e| format!("line {line} r{r}: {e}"))
                })
                .collect()
        }));
    }
}

#[test]
fn four_processes_every_collective_and_dtype() {
    let dir = tmpdir("script");
    let mut script = Vec::new();
    let mut checks = Vec::new();
    for dt in DType::REDUCIBLE {
        match dt {
            DType::F32 => cases::<f32>(&dir, &mut script, &mut checks),
            DType::F16 => cases::<f16>(&dir, &mut script, &mut checks),
            DType::BF16 => cases::<bf16>(&dir, &mut script, &mut checks),
            DType::I32 => cases::<i32>(&dir, &mut script, &mut checks),
            DType::I64 => cases::<i64>(&dir, &mut script, &mut checks),
            // DType::REDUCIBLE holds the reducible dtypes only.
            other => panic!("{other} is not reducible"),
        }
    }
    std::fs::write(dir.join("script"), script.join("\n")).expect("script");
    run_script(&dir, &format!("procs-matrix-{}", std::process::id()));
    let fails: Vec<String> = checks.iter().flat_map(|c| c(&dir)).collect();
    assert!(fails.is_empty(), "{} wrong, first: {:#?}", fails.len(), &fails[..fails.len().min(10)]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bf16_all_reduce_bitwise_identical_across_processes_and_runs() {
    let n = 4099;
    let dir = tmpdir("bf16");
    std::fs::write(dir.join("script"), "all_reduce bf16 sum out\n").expect("script");
    for r in 0..WORLD {
        write(&dir, 0, r, &data::<bf16>(99, r, n));
    }
    let want = reduced::<bf16>(99, WORLD, n, ReduceOp::Sum);
    let mut first: Option<Vec<bf16>> = None;
    for run in 0..2 {
        run_script(&dir, &format!("procs-bf16-{}-{run}", std::process::id()));
        for r in 0..WORLD {
            let got = read::<bf16>(&dir, 0, r);
            let base = first.get_or_insert_with(|| got.clone());
            same_bits(&got, base).unwrap_or_else(|e| panic!("run {run} rank {r}: {e}"));
        }
    }
    same_bits(first.as_deref().expect("ran"), &want).expect("rank-order f32 reference");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Waits for the `joined` line of a worker (an event, not a timer).
fn wait_joined(k: &mut Child) -> BufReader<std::process::ChildStdout> {
    let mut out = BufReader::new(k.stdout.take().expect("piped stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("read");
    assert_eq!(line.trim(), "joined", "unexpected worker output {line:?}");
    out
}

#[test]
fn killed_peer_process_fails_the_others() {
    let name = format!("procs-kill-{}", std::process::id());
    let start = Instant::now();
    // A long timeout: the survivors must notice the death, not time out.
    let mut kids: Vec<Child> = (0..WORLD)
        .map(|r| {
            let task: &[&str] = if r == 3 { &["hold"] } else { &["all-reduce"] };
            worker(&name, r, 60.0, task)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn")
        })
        .collect();
    let mut outs: Vec<_> = kids.iter_mut().map(wait_joined).collect();
    kids[3].kill().expect("kill rank 3");
    kids[3].wait().expect("reap rank 3");
    for (r, k) in kids.iter_mut().enumerate().take(3) {
        let status = k.wait().expect("wait");
        let mut rest = String::new();
        std::io::Read::read_to_string(outs[r].get_mut(), &mut rest).expect("read");
        assert_eq!(status.code(), Some(3), "rank {r}: {status} {rest}");
        assert!(rest.contains("PeerFailed") && rest.contains("rank 3 (pid"), "rank {r}: {rest}");
    }
    assert!(start.elapsed() < Duration::from_secs(30), "took {:?}", start.elapsed());
    assert!(!Path::new(&segment_path(&name)).exists(), "segment left behind");
}

#[test]
fn stale_segment_of_a_crashed_run_is_replaced() {
    let name = format!("procs-stale-{}", std::process::id());
    let path = segment_path(&name);
    // Three ranks of a world of 4 attach, then all of them die before the
    // fourth comes: the world never formed, so its file is still linked.
    // One process group, killed by one signal below.
    let mut group = 0;
    let mut kids: Vec<Child> = (0..WORLD - 1)
        .map(|r| {
            let mut w = worker(&name, r, 20.0, &["hold"]);
            let kid = w.process_group(group).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("spawn");
            if group == 0 {
                group = kid.id() as i32;
            }
            kid
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    while shm_comm::live_members(&name).len() < WORLD - 1 {
        assert!(Instant::now() < deadline, "attached: {:?}", shm_comm::live_members(&name));
        std::thread::sleep(Duration::from_millis(2));
    }
    // All three die by one signal to their group: a rank still alive after
    // another died would see it die, give up on the world and remove the
    // file, which is not the crash this test is about.
    // SAFETY: kill(2) with the group of processes this test spawned.
    assert_eq!(unsafe { libc::kill(-group, libc::SIGKILL) }, 0, "kill the group");
    for k in kids.iter_mut() {
        k.wait().expect("reap");
    }
    // The crashed run leaves its segment, unless a rendezvous of a test
    // running beside this one swept it already (every rendezvous removes
    // the files of worlds whose ranks are all gone). A new world of another
    // size under the same name starts fine either way and cleans up.
    let o = CommOptions::with_timeout(Duration::from_secs(10));
    let res: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let (name, o) = (&name, &o);
                s.spawn(move || -> ascend_moe::Result<()> {
                    let c = CpuComm::rendezvous(name, 2, r, o)?;
                    c.barrier()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("no panic")).collect()
    });
    assert!(res.iter().all(|r| r.is_ok()), "{res:?}");
    assert!(!Path::new(&path).exists(), "segment left behind");
}

#[test]
fn cli_check_passes_on_processes() {
    let o = Command::new(EXE)
        .args(["check", "--world", "2", "--procs", "--timeout", "30", "--section", "collectives"])
        .output()
        .expect("run check");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
    // 5 reducible dtypes x 4 sizes x 10 collectives, and 5 one-byte dtypes x
    // (4 sizes x 4 data moves + 1 refused reduction).
    let cases = 5 * 4 * 10 + 5 * (4 * 4 + 1);
    assert!(out.contains(&format!("all {cases} cases passed on 2 ranks")), "{out}");
    assert!(out.lines().filter(|l| l.starts_with("collectives ")).count() == cases, "{out}");
}
