//! Thread ranks: one closure per rank of a fresh world of threads, each given
//! its [`Comm`]: [`run_ranks`] over the CPU communicator, [`npu_run_ranks`]
//! over HCCL, rank `r` on NPU `r`.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::backend::cpu::comm::{check_world_size, CpuComm, CpuCommConfig};
use crate::backend::npu::{device_count, HcclComm, HcclRootInfo, NpuDevice};
use crate::comm::{Comm, CommOptions};
use crate::error::CommErrorKind;
use crate::{Error, Result};

static WORLD_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Runs `f(rank, comm)` on `world` threads joined to a fresh world; returns the
/// per-rank results in rank order, or an error: the first that is a root cause
/// (not a peer's failure), else the first. A panicking rank's panic is resumed
/// after every thread has finished (its peers fail with `PeerFailed`).
pub fn run_ranks<R, F>(world: usize, opts: &CommOptions, f: F) -> Result<Vec<R>>
where
    R: Send,
    F: Fn(usize, Comm) -> Result<R> + Sync,
{
    run_ranks_with(world, opts, &CpuCommConfig::default(), f)
}

/// [`run_ranks`] with explicit shared-memory tuning.
pub fn run_ranks_with<R, F>(world: usize, opts: &CommOptions, cfg: &CpuCommConfig, f: F) -> Result<Vec<R>>
where
    R: Send,
    F: Fn(usize, Comm) -> Result<R> + Sync,
{
    // Refused before a thread starts: every rank would fail its rendezvous
    // anyway, and a very large world fails to start its threads first.
    check_world_size(world).map_err(|why| Error::invalid("run_ranks", "world", why))?;
    let name = format!("run-{}-{}", std::process::id(), WORLD_COUNTER.fetch_add(1, Ordering::Relaxed));
    let f = &f;
    let name = &name;
    let outcomes: Vec<std::thread::Result<Result<R>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|r| {
                std::thread::Builder::new().name(format!("rank-{r}")).spawn_scoped(s, move || {
                    let comm = CpuComm::rendezvous_with(name, world, r, opts, cfg)?;
                    f(r, Comm::Cpu(comm))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h {
                Ok(h) => h.join(),
                Err(e) => Ok(Err(Error::io("spawning a rank thread", e))),
            })
            .collect()
    });
    let mut results = Vec::with_capacity(world);
    let mut errors = Vec::new();
    let mut panic = None;
    for o in outcomes {
        match o {
            Ok(Ok(r)) => results.push(r),
            Ok(Err(e)) => errors.push(e),
            Err(p) => panic = panic.or(Some(p)),
        }
    }
    if let Some(p) = panic {
        std::panic::resume_unwind(p);
    }
    if errors.is_empty() {
        return Ok(results);
    }
    let root = errors
        .iter()
        .position(|e| !matches!(e, Error::Comm { kind: CommErrorKind::PeerFailed | CommErrorKind::Mismatch, .. }));
    Err(errors.swap_remove(root.unwrap_or(0)))
}

/// Runs `f(rank, comm)` on `world` threads, rank `r` on NPU `r`, all joined to
/// one fresh HCCL world (root info created on device 0); returns the results
/// in rank order, or the first error. The NPU twin of the CPU `run_ranks`.
pub fn npu_run_ranks<R, F>(world: usize, opts: &CommOptions, f: F) -> Result<Vec<R>>
where
    R: Send,
    F: Fn(usize, Comm) -> Result<R> + Sync,
{
    const OP: &str = "npu_run_ranks";
    if world == 0 {
        return Err(Error::invalid(OP, "world", "a world needs at least one rank"));
    }
    let count = device_count()? as usize;
    if count < world {
        return Err(Error::invalid(OP, "world", format!("{world} ranks need {world} devices, {count} visible")));
    }
    let root = HcclRootInfo::generate(&NpuDevice::open(0)?)?;
    let results: Vec<Result<R>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (root, f) = (&root, &f);
                std::thread::Builder::new().name(format!("rank-{rank}")).spawn_scoped(s, move || -> Result<R> {
                    let device = NpuDevice::open(rank as u32)?;
                    let comm = HcclComm::from_root_info(&device, root, world, rank, opts)?;
                    f(rank, Comm::Npu(comm))
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h {
                Ok(h) => h.join().unwrap_or_else(|_| Err(Error::invalid(OP, "f", format!("rank {rank} panicked")))),
                Err(e) => Err(Error::io("spawning a rank thread", e)),
            })
            .collect()
    });
    results.into_iter().collect()
}
