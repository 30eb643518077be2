//! Thread ranks: one closure per rank of a fresh world of threads.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{CpuComm, CpuCommConfig};
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
    if world == 0 {
        return Err(Error::invalid("run_ranks", "world", "world size 0: a group needs at least one rank"));
    }
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
