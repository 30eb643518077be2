//! The CPU backend: the reference implementation of every op, and the
//! production fallback where no NPU is present.

mod backend_impl;
mod buffer;
pub mod comm;
pub mod finalize;
pub(crate) mod host_pool;

pub use backend_impl::CpuBackend;
pub use buffer::CpuBuffer;
pub use comm::CpuComm;
