//! Host memory for results, from the library's reuse pool: what a binding
//! allocates a large output in, so that producing a result does not cost new
//! pages on every call.

use std::ffi::c_void;

use super::ffi::{ffi, try_out, write_out, Failure};
use super::handle::{box_out, release};
use super::types::{amoe_host_block, amoe_status};
use crate::backend::cpu::host_pool::{Block, MIN_POOLED};

/// Host memory of `len` bytes (`len` > 0) for a result: `*data` receives its
/// address (aligned to 2 MiB, so any dtype fits), `*out` a handle the caller
/// frees with `amoe_host_block_free` once nothing reads or writes the memory
/// any more. The contents are unspecified (the bytes of an earlier, freed
/// block). From `amoe_host_block_min_len()` bytes on, a freed block's memory
/// serves the next block of the same size, so neither the system allocator
/// nor first-touch page faults are paid again; the library keeps at most
/// `ASCEND_MOE_HOST_POOL_BYTES` of freed blocks per process (read at the
/// first block; 1 GiB when unset, 0 keeps none). Smaller results are better
/// allocated as usual. `AMOE_STATUS_HOST_MEMORY` when the system refuses the
/// memory, `AMOE_STATUS_INVALID_ARGUMENT` naming the variable when it is set
/// to something other than a number of bytes.
///
/// # Safety
/// `data` and `out` writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_host_block_new(
    len: usize,
    data: *mut *mut c_void,
    out: *mut *mut amoe_host_block,
) -> amoe_status {
    const F: &str = "amoe_host_block_new";
    ffi!(F, {
        let data = try_out!(F, data, "data");
        let out = try_out!(F, out, "out");
        if len == 0 {
            return Err(Failure::invalid(F, "len", "a host block holds at least one byte"));
        }
        let block = Block::take(F, len)?;
        write_out(data, block.as_ptr().cast::<c_void>());
        box_out(out, block);
        Ok(())
    })
}

/// The size from which `amoe_host_block_new` reuses freed blocks.
#[no_mangle]
pub extern "C" fn amoe_host_block_min_len() -> usize {
    MIN_POOLED
}

/// Gives a block's memory back to the pool (NULL is a no-op). The memory may
/// be handed out again at once: nothing may use it afterwards.
///
/// # Safety
/// `block` NULL or a live handle not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn amoe_host_block_free(block: *mut amoe_host_block) {
    release(block);
}
