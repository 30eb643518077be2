//! The C ABI of the finalize kernel: the `#[repr(C)]` mirror of
//! `kernels/finalize_tiling.h` (tiling, pointer order, flags, status record)
//! and the signatures of its host and AI Core entry points.

use std::ffi::c_void;

use crate::DType;

/// Unified buffer of one AI Core vector unit on the Atlas A2 (910B) class, in
/// bytes (192 KiB); the default budget of [`finalize_tiling`].
pub(crate) const UB_BYTES_910B: usize = 192 * 1024;
/// Tiles along H are a multiple of this many elements (32 bytes of 16-bit data).
pub(crate) const TILE_ALIGN: usize = 16;
/// `AMOE_FINALIZE_TILING_MAGIC`.
pub(crate) const TILING_MAGIC: u32 = 0x3146_4D41;
/// Words (u32) of one core's status record.
pub(crate) const STATUS_WORDS: usize = 64;

/// Index of `expanded_x` in the global-memory pointer array.
pub(crate) const GM_EXPANDED_X: usize = 0;
/// Index of `expanded_row_idx`.
pub(crate) const GM_ROW_IDX: usize = 1;
/// Index of `x1` (NULL when absent).
pub(crate) const GM_X1: usize = 2;
/// Index of `x2` (NULL when absent).
pub(crate) const GM_X2: usize = 3;
/// Index of `bias` (NULL when absent).
pub(crate) const GM_BIAS: usize = 4;
/// Index of `scales` (NULL when absent).
pub(crate) const GM_SCALES: usize = 5;
/// Index of `expert_idx` (NULL when absent).
pub(crate) const GM_EXPERT_IDX: usize = 6;
/// Index of the output.
pub(crate) const GM_OUT: usize = 7;
/// Index of the int32 `[slots + 1]` slot offsets ([`slot_offsets`]; padded output only).
pub(crate) const GM_SLOT_OFFSETS: usize = 8;
/// Index of the u32 status array, `block_dim * STATUS_WORDS` words.
pub(crate) const GM_STATUS: usize = 9;
/// Number of global-memory pointers the kernel takes.
pub(crate) const GM_COUNT: usize = 10;

/// `flags`: `x1` is given.
pub(crate) const FLAG_X1: u32 = 0x1;
/// `flags`: `x2` is given.
pub(crate) const FLAG_X2: u32 = 0x2;
/// `flags`: `bias` (and `expert_idx`) are given.
pub(crate) const FLAG_BIAS: u32 = 0x4;
/// `flags`: `scales` are given.
pub(crate) const FLAG_SCALES: u32 = 0x8;
/// `flags`: the output is the padded EP buffer of SPEC section 3.
pub(crate) const FLAG_PADDED_OUT: u32 = 0x10;
/// `flags`: token unpermute (SPEC section 1): a row index outside
/// `[0, expanded_rows)` contributes nothing and is not an error.
pub(crate) const FLAG_SKIP_INVALID_ROWS: u32 = 0x20;
/// `flags`: check the index tensors only, into an int32 `out` of
/// [`checked_indices_len`] elements: `expanded_row_idx` at element 0 and,
/// with bias, `expert_idx` at [`checked_expert_offset`], each value outside
/// its range replaced by a safe one (-1 for a row index in the drop-pad modes,
/// else 0) and the first reported in the status as usual.
pub(crate) const FLAG_CHECK_INDICES: u32 = 0x40;
/// int32 elements a core of the index check moves through UB per step.
#[cfg(test)]
pub(crate) const CHECK_CHUNK: usize = 2048;

/// Element where the checked copy of `expert_idx` starts in the output of a
/// [`FLAG_CHECK_INDICES`] launch over `nk` slots: `nk` rounded up to 128
/// (512 bytes).
pub(crate) fn checked_expert_offset(nk: usize) -> usize {
    nk.div_ceil(128) * 128
}

/// int32 elements of a [`FLAG_CHECK_INDICES`] launch's output.
pub(crate) fn checked_indices_len(nk: usize, bias: bool) -> usize {
    if bias {
        checked_expert_offset(nk) + nk
    } else {
        nk
    }
}

pub(super) const ST_OK: u32 = 0;
pub(super) const ST_ROW_INDEX: u32 = 1;
pub(super) const ST_EXPERT_INDEX: u32 = 2;
pub(super) const ST_SLOT_LAYOUT: u32 = 3;
pub(super) const ST_BAD_TILING: u32 = 4;
pub(super) const ST_SIM_VIOLATION: u32 = 100;
/// Value the host fills status records with before a launch: a core that
/// never ran is detected.
pub(crate) const STATUS_NOT_RUN: u32 = 0xFFFF_FFFF;
pub(super) const STATUS_MESSAGE_BYTE: usize = 32;
/// Words of a core's status head (`AMOE_FIN_STATUS_HEAD_WORDS`).
pub(crate) const STATUS_HEAD_WORDS: usize = 8;
/// `AMOE_FIN_STICKY_WORD`: where a core that records a problem also writes
/// its head, a copy that a captured launch's replays do not reset.
pub(super) const STICKY_WORD: usize = 56;
/// `AMOE_FIN_STICKY_MARK` ('AMFS'), the last word of a sticky copy.
pub(super) const STICKY_MARK: u32 = 0x5346_4D41;

/// Tiling of one finalize launch: the `#[repr(C)]` mirror of
/// `AmoeFinalizeTiling` in `kernels/finalize_tiling.h` (field for field, all
/// `u32`, no padding). Pass its bytes ([`FinalizeTiling::as_bytes`]) as the
/// kernel's tiling argument.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct FinalizeTiling {
    /// [`TILING_MAGIC`].
    pub(crate) magic: u32,
    /// Tokens (output rows before padding).
    pub(crate) n: u32,
    /// Top-k.
    pub(crate) k: u32,
    /// Elements per row.
    pub(crate) h: u32,
    /// Rows of `expanded_x` viewed as 2-D.
    pub(crate) expanded_rows: u32,
    /// Rows of `bias` (0 without bias).
    pub(crate) experts: u32,
    /// [`DType`] number of the data tensors and the output.
    pub(crate) data_dtype: u32,
    /// [`DType`] number of `scales` (= `data_dtype` without scales).
    pub(crate) scales_dtype: u32,
    /// Drop-pad mode 0..=3.
    pub(crate) mode: u32,
    /// `FLAG_*` bits.
    pub(crate) flags: u32,
    /// Cores the launch uses.
    pub(crate) block_dim: u32,
    /// Output rows: `n`, or `slots * slot_rows` when padded.
    pub(crate) out_rows: u32,
    /// Slots (EP ranks) of the padded output; 1 when dense.
    pub(crate) slots: u32,
    /// Rows per slot; `n` when dense.
    pub(crate) slot_rows: u32,
    /// Elements per H tile (a multiple of [`TILE_ALIGN`]).
    pub(crate) tile_h: u32,
    /// `ceil(h / tile_h)`.
    pub(crate) tiles: u32,
    /// Elements of the last tile.
    pub(crate) tail_h: u32,
    /// `out_rows / block_dim`.
    pub(crate) rows_per_core: u32,
    /// `out_rows % block_dim`; the first `rows_rem` cores take one more row.
    pub(crate) rows_rem: u32,
    /// Unified-buffer bytes the kernel allocates per core ([`ub_bytes`]).
    pub(crate) ub_bytes: u32,
}

impl FinalizeTiling {
    /// The bytes handed to the kernel.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        bytemuck::bytes_of(self)
    }

    /// Words of the status array a launch with this tiling needs.
    pub(crate) fn status_words(&self) -> usize {
        self.block_dim as usize * STATUS_WORDS
    }

    pub(super) fn padded(&self) -> bool {
        self.flags & FLAG_PADDED_OUT != 0
    }
}

/// Unified-buffer bytes the kernel allocates per core for a tile of `tile_h`
/// elements (the formula of `amoe_finalize_ub_bytes` in the tiling header):
/// a double-buffered input queue, a bias queue and an output queue of the data
/// type plus an f32 scratch, and for 16-bit data an f32 accumulator and an f32
/// bias scratch, plus one 32-byte status block.
pub(crate) fn ub_bytes(data: DType, tile_h: usize) -> usize {
    // (bytes of the data type, f32 scratch buffers)
    let (elem, f32_buffers) = if data == DType::F32 { (4, 1) } else { (2, 3) };
    let per_elem = 4 * elem + 4 * f32_buffers;
    per_elem * tile_h + 32
}

/// Signature of one core of a kernel launch; identical to the simulated
/// runtime's `cannsim_kernel_entry`.
pub(crate) type KernelEntry =
    unsafe extern "C" fn(block_idx: u32, block_dim: u32, gm: *const *mut c_void, tiling: *const c_void);

/// Signature of [`NPU_LAUNCH_SYMBOL`] in the AI Core build.
pub(crate) type NpuLaunchFn =
    unsafe extern "C" fn(block_dim: u32, stream: *mut c_void, gm: *const *mut c_void, tiling: *mut c_void) -> i32;

/// Launcher exported by the AI Core build:
/// `int32_t amoe_finalize_launch_npu(uint32_t block_dim, aclrtStream stream,
/// void *const *gm, void *tiling_dev)`, with `gm` a host array of [`GM_COUNT`]
/// device pointers and the tiling already copied to the device. Returns 0 or
/// an ACL error code.
pub(crate) const NPU_LAUNCH_SYMBOL: &str = "amoe_finalize_launch_npu";

/// Signature of [`NPU_GUARD_LAUNCH_SYMBOL`] in the AI Core build.
pub(crate) type NpuGuardLaunchFn =
    unsafe extern "C" fn(stream: *mut c_void, gm: *const *mut c_void, tiling: *mut c_void) -> i32;

/// Guard launcher exported by the AI Core build:
/// `int32_t amoe_guard_launch_npu(aclrtStream stream, void *const *gm, void *tiling_dev)`.
pub(crate) const NPU_GUARD_LAUNCH_SYMBOL: &str = "amoe_guard_launch_npu";

/// Index of the live context in the guard's global-memory pointers.
pub(crate) const GUARD_GM_LIVE: usize = 0;
/// Index of the status record.
pub(crate) const GUARD_GM_STATUS: usize = 1;
/// Number of global-memory pointers of a guard launch.
pub(crate) const GUARD_GM_COUNT: usize = 2;

/// Index of the destination in the byte-copy kernel's global-memory pointers.
pub(crate) const COPY_GM_DST: usize = 0;
/// Index of the source.
pub(crate) const COPY_GM_SRC: usize = 1;
/// Number of global-memory pointers of a copy launch.
pub(crate) const COPY_GM_COUNT: usize = 2;

/// Signature of [`NPU_COPY_LAUNCH_SYMBOL`] in the AI Core build.
pub(crate) type NpuCopyLaunchFn =
    unsafe extern "C" fn(block_dim: u32, stream: *mut c_void, gm: *const *mut c_void, tiling: *const c_void) -> i32;

/// Byte-copy launcher exported by the AI Core build:
/// `int32_t amoe_copy_launch_npu(uint32_t block_dim, aclrtStream stream,
/// void *const *gm, const AmoeCopyTiling *tiling)`, with `gm` a host array of
/// [`COPY_GM_COUNT`] device pointers and the tiling in host memory (its
/// fields become the kernel's scalar arguments).
pub(crate) const NPU_COPY_LAUNCH_SYMBOL: &str = "amoe_copy_launch_npu";

/// The op name the finalize kernel's argument errors carry.
pub(crate) const FINALIZE_OP: &str = "moe_finalize_routing";
/// The finalize kernel's name in [`crate::Error::Kernel`].
pub(crate) const FINALIZE_KERNEL: &str = "amoe_finalize";
