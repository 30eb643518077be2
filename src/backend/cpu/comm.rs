//! The shared-memory CPU communicator (SPEC section 8).

use crate::comm::{Collectives, Comm, CommOptions, ReduceOp};
use crate::{Device, Error, Result, Tensor};

/// A rank's handle on a shared-memory group.
#[derive(Debug, Clone)]
pub struct CpuComm {
    name: String,
    rank: usize,
    world: usize,
}

impl CpuComm {
    /// Joins (or creates) the world `name` of `world_size` ranks as `rank`.
    /// Ranks may be threads of this process or separate processes.
    pub fn rendezvous(name: &str, world_size: usize, rank: usize, opts: &CommOptions) -> Result<CpuComm> {
        let _ = opts;
        let _ = CpuComm { name: name.into(), rank, world: world_size };
        Err(Error::invalid("CpuComm::rendezvous", "name", "the CPU communicator is not built yet"))
    }
}

/// Runs `f(rank, comm)` on `world` threads joined to a fresh world; returns the
/// per-rank results in rank order, or the first error.
pub fn run_ranks<R, F>(world: usize, opts: &CommOptions, f: F) -> Result<Vec<R>>
where
    R: Send,
    F: Fn(usize, Comm) -> Result<R> + Sync,
{
    let _ = (world, opts, &f);
    Err(Error::invalid("run_ranks", "world", "the CPU communicator is not built yet"))
}

fn todo_err() -> Error {
    Error::invalid("CpuComm", "self", "the CPU communicator is not built yet")
}

impl Collectives for CpuComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn name(&self) -> &str {
        &self.name
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn split(&self, _ranks: &[usize]) -> Result<Comm> {
        Err(todo_err())
    }
    fn all_reduce(&self, _src: &Tensor, _dst: &mut Tensor, _op: ReduceOp) -> Result<()> {
        Err(todo_err())
    }
    fn all_reduce_in_place(&self, _buf: &mut Tensor, _op: ReduceOp) -> Result<()> {
        Err(todo_err())
    }
    fn reduce_scatter(&self, _src: &Tensor, _dst: &mut Tensor, _op: ReduceOp) -> Result<()> {
        Err(todo_err())
    }
    fn all_gather(&self, _src: &Tensor, _dst: &mut Tensor) -> Result<()> {
        Err(todo_err())
    }
    fn reduce_scatter_v(&self, _src: &Tensor, _dst: &mut Tensor, _counts: &[usize], _op: ReduceOp) -> Result<()> {
        Err(todo_err())
    }
    fn all_gather_v(&self, _src: &Tensor, _dst: &mut Tensor, _counts: &[usize]) -> Result<()> {
        Err(todo_err())
    }
    fn all_to_all_v(&self, _src: &Tensor, _sc: &[usize], _dst: &mut Tensor, _rc: &[usize]) -> Result<()> {
        Err(todo_err())
    }
    fn broadcast(&self, _buf: &mut Tensor, _root: usize) -> Result<()> {
        Err(todo_err())
    }
    fn barrier(&self) -> Result<()> {
        Err(todo_err())
    }
}
