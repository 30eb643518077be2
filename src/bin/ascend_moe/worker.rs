//! `ascend-moe worker`: one rank of a multi-process world (hidden).
//!
//! Spawned by `check --procs`, `bench collectives --procs` and by the
//! multi-process tests. Exit codes: 0 ok, 1 a check failed, 3 a collective or
//! the rendezvous failed (the error is printed as `ERROR\t<text>` on stdout and
//! on stderr).
//!
//! Task `script DIR` runs the collectives listed in `DIR/script`, one per line,
//! reading this rank's input for line `i` from `DIR/in.<i>.<rank>` (raw
//! little-endian elements) and writing its output to `DIR/out.<i>.<rank>`:
//!
//! ```text
//! all_reduce <dtype> <sum|max|min> <out|inplace>
//! reduce_scatter <dtype> <op>
//! all_gather <dtype>
//! reduce_scatter_v <dtype> <op> <c0,c1,...>
//! all_gather_v <dtype> <c0,c1,...>
//! all_to_all_v <dtype> <m00,m01,...;m10,m11,...;...>   (m[i][j]: elements rank i sends to rank j)
//! broadcast <dtype> <root>
//! ```

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ascend_moe::backend::cpu::CpuComm;
use ascend_moe::backend::cpu::CpuCommConfig;
use ascend_moe::tensor::{CpuBuffer, Storage};
use ascend_moe::{Collectives, Comm, CommOptions, DType, Error, ReduceOp, Tensor};

use crate::{bench_collectives, check};

#[derive(clap::Args)]
pub struct Args {
    /// World (group) name shared by every rank.
    #[arg(long)]
    name: String,
    /// Ranks in the world.
    #[arg(long)]
    world: usize,
    /// This rank.
    #[arg(long)]
    rank: usize,
    /// Timeout of every wait, in seconds (0: ASCEND_MOE_COMM_TIMEOUT, else 60; inf: no limit).
    #[arg(long, default_value = "60", value_parser = crate::launch::parse_timeout)]
    timeout: Duration,
    /// Staging bytes per slot.
    #[arg(long)]
    staging_bytes: Option<usize>,
    #[command(subcommand)]
    task: Task,
}

#[derive(clap::Subcommand)]
enum Task {
    /// Run `check` sections; print one `ROW` line per case.
    Check {
        #[arg(long)]
        section: Vec<String>,
    },
    /// Run the collectives benchmark; rank 0 prints `BENCH` lines.
    Bench(bench_collectives::WorkerArgs),
    /// Run the collectives of DIR/script on files (see the module docs).
    Script { dir: PathBuf },
    /// Join, print `joined`, then wait until stdin closes.
    Hold,
    /// Join, print `joined`, then all-reduce `count` f32 ones and check the sum.
    AllReduce {
        #[arg(long, default_value_t = 1000)]
        count: usize,
    },
}

fn fail(e: impl std::fmt::Display) -> i32 {
    let text = e.to_string().replace('\n', " ");
    println!("ERROR\t{text}");
    eprintln!("error: {text}");
    3
}

pub fn main(a: Args) -> i32 {
    let opts = CommOptions::with_timeout(a.timeout);
    let cfg = a.staging_bytes.map(|b| CpuCommConfig { staging_bytes: b }).unwrap_or_default();
    let comm = match CpuComm::rendezvous_with(&a.name, a.world, a.rank, &opts, &cfg) {
        Ok(c) => Comm::Cpu(c),
        Err(e) => return fail(e),
    };
    match a.task {
        Task::Check { section } => match check::run_rank(&comm, &section) {
            Ok(rows) => {
                for r in &rows {
                    println!("{}", check::encode(r));
                }
                i32::from(rows.iter().any(|r| !r.ok))
            }
            Err(e) => fail(e),
        },
        Task::Bench(w) => match bench_collectives::bench_rank(&comm, &w, a.rank == 0) {
            Ok(ms) => {
                if a.rank == 0 {
                    for m in &ms {
                        println!("{}", bench_collectives::encode(m));
                    }
                }
                0
            }
            Err(e) => fail(e),
        },
        Task::Script { dir } => match script(&comm, &dir) {
            Ok(()) => 0,
            Err(e) => fail(e),
        },
        Task::Hold => {
            println!("joined");
            let mut sink = Vec::new();
            let _ = std::io::stdin().read_to_end(&mut sink);
            0
        }
        Task::AllReduce { count } => {
            println!("joined");
            // A count past memory is this rank's error (its peers then fail
            // in the all-reduce), not an abort.
            let ones = Tensor::zeros(&[count], DType::F32, &ascend_moe::Device::Cpu).and_then(|mut t| {
                t.as_mut_slice::<f32>()?.fill(1.0);
                Ok(t)
            });
            let mut buf = match ones {
                Ok(t) => t,
                Err(e) => return fail(e),
            };
            match comm.all_reduce_in_place(&mut buf, ReduceOp::Sum) {
                Ok(()) => {
                    let ok = buf.as_slice::<f32>().is_ok_and(|v| v.iter().all(|x| *x == a.world as f32));
                    println!("done {}", if ok { "ok" } else { "WRONG" });
                    i32::from(!ok)
                }
                Err(e) => fail(format!("{e:?}")),
            }
        }
    }
}

fn bad(what: String) -> Error {
    Error::invalid("worker script", "script", what)
}

fn list(s: Option<&str>) -> ascend_moe::Result<Vec<usize>> {
    let s = s.ok_or_else(|| bad("missing counts".into()))?;
    s.split(',').filter(|x| !x.is_empty()).map(|x| x.parse().map_err(|e| bad(format!("count {x:?}: {e}")))).collect()
}

fn op(s: Option<&str>) -> ascend_moe::Result<ReduceOp> {
    let s = s.ok_or_else(|| bad("missing op".into()))?;
    ReduceOp::ALL.into_iter().find(|o| o.name() == s).ok_or_else(|| bad(format!("unknown op {s:?}")))
}

fn load(path: &Path, dtype: DType) -> ascend_moe::Result<Tensor> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    let n = bytes.len() / dtype.size();
    Tensor::from_parts(vec![n], dtype, Storage::Cpu(CpuBuffer::from_bytes(&bytes)))
}

fn script(comm: &Comm, dir: &Path) -> ascend_moe::Result<()> {
    let text = std::fs::read_to_string(dir.join("script")).map_err(|e| Error::io("reading script", e))?;
    let (rank, world) = (comm.rank(), comm.world_size());
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let mut f = line.split_whitespace();
        let kind = f.next().unwrap_or_default();
        let dtype: DType = f.next().ok_or_else(|| bad(format!("line {i}: missing dtype")))?.parse()?;
        let src = load(&dir.join(format!("in.{i}.{rank}")), dtype)?;
        let n = src.numel();
        let out = match kind {
            "all_reduce" => {
                let op = op(f.next())?;
                if f.next() == Some("inplace") {
                    let mut buf = src;
                    comm.all_reduce_in_place(&mut buf, op)?;
                    buf
                } else {
                    let mut dst = Tensor::zeros_cpu(&[n], dtype);
                    comm.all_reduce(&src, &mut dst, op)?;
                    dst
                }
            }
            "reduce_scatter" => {
                let op = op(f.next())?;
                let mut dst = Tensor::zeros_cpu(&[n / world], dtype);
                comm.reduce_scatter(&src, &mut dst, op)?;
                dst
            }
            "all_gather" => {
                let mut dst = Tensor::zeros_cpu(&[n * world], dtype);
                comm.all_gather(&src, &mut dst)?;
                dst
            }
            "reduce_scatter_v" => {
                let op = op(f.next())?;
                let counts = list(f.next())?;
                let mut dst = Tensor::zeros_cpu(&[counts.get(rank).copied().unwrap_or(0)], dtype);
                comm.reduce_scatter_v(&src, &mut dst, &counts, op)?;
                dst
            }
            "all_gather_v" => {
                let counts = list(f.next())?;
                let mut dst = Tensor::zeros_cpu(&[counts.iter().sum()], dtype);
                comm.all_gather_v(&src, &mut dst, &counts)?;
                dst
            }
            "all_to_all_v" => {
                let rows: Vec<Vec<usize>> = f
                    .next()
                    .ok_or_else(|| bad("missing matrix".into()))?
                    .split(';')
                    .map(|r| list(Some(r)))
                    .collect::<ascend_moe::Result<_>>()?;
                let send = rows.get(rank).cloned().unwrap_or_default();
                let recv: Vec<usize> = rows.iter().map(|r| r.get(rank).copied().unwrap_or(0)).collect();
                let mut dst = Tensor::zeros_cpu(&[recv.iter().sum()], dtype);
                comm.all_to_all_v(&src, &send, &mut dst, &recv)?;
                dst
            }
            "broadcast" => {
                let root = f.next().and_then(|r| r.parse().ok()).ok_or_else(|| bad(format!("line {i}: bad root")))?;
                let mut buf = src;
                comm.broadcast(&mut buf, root)?;
                buf
            }
            other => return Err(bad(format!("line {i}: unknown collective {other:?}"))),
        };
        let path = dir.join(format!("out.{i}.{rank}"));
        std::fs::write(&path, out.cpu_bytes()?).map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
    }
    Ok(())
}
