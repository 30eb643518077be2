//! The CPU backend: the reference implementation of every op, and the
//! production fallback where no NPU is present.

mod backend_impl;
mod buffer;
pub(crate) mod cache;
pub(crate) mod comm;
pub(crate) mod finalize;
pub(crate) mod host_pool;

pub use backend_impl::CpuBackend;
pub(crate) use buffer::no_memory;
pub use buffer::CpuBuffer;
pub use cache::last_level_cache_bytes;
pub use comm::{check_world_size, segment_path, shm_dir, CpuComm, CpuCommConfig, MAX_WORLD};
pub use finalize::{
    default_num_threads, env_num_threads, finalize_threads, set_num_threads, set_streaming_stores, set_wide_simd,
};
pub use host_pool::{env_keep_bytes, DEFAULT_KEEP_BYTES, KEEP_VAR, KEEP_WANTED};
