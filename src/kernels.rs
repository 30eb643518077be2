//! The native finalize kernel (`kernels/finalize_kernel.cpp`, Ascend C): its
//! tiling and a host runner.
//!
//! The same kernel source is built twice by `build.rs`: for the host against
//! `kernels/sim` (always; a host implementation of the Ascend C API subset the
//! kernel uses, enforcing unified-buffer capacity, copy alignment and queue
//! discipline), and for the AI Core when CANN is installed. This module
//!
//! - computes the [`FinalizeTiling`] (the `#[repr(C)]` mirror of
//!   `kernels/finalize_tiling.h`) from the op's sizes, dtypes and flags,
//! - runs the host build on host tensors, every block in turn
//!   ([`finalize_host`]), which is what the tests compare bit for bit with a
//!   plain f32 reference, and
//! - exposes the host entry ([`host_entry`]) with the signature of the
//!   simulated runtime's `cannsim_kernel_entry`, and the status decoding
//!   ([`check_status`]) a device launch needs.
//!
//! Global-memory arguments are passed as an array of [`GM_COUNT`] pointers in
//! the order of the `GM_*` constants. Every core writes a status record of
//! [`STATUS_WORDS`] words; an out-of-range index is reported there (never
//! dereferenced) and becomes an [`Error::IndexOutOfRange`].

use std::ffi::c_void;
use std::path::PathBuf;

use crate::backend::{FinalizeArgs, FinalizeDims, OutputRows};
use crate::{DType, DropPadMode, Error, Result, Tensor};

const OP: &str = "moe_finalize_routing";
const KERNEL: &str = "amoe_finalize";

/// Unified buffer of one AI Core vector unit on the Atlas A2 (910B) class, in
/// bytes (192 KiB); the default budget of [`finalize_tiling`].
pub const UB_BYTES_910B: usize = 192 * 1024;
/// Tiles along H are a multiple of this many elements (32 bytes of 16-bit data).
pub const TILE_ALIGN: usize = 16;
/// `AMOE_FINALIZE_TILING_MAGIC`.
pub const TILING_MAGIC: u32 = 0x3146_4D41;
/// Words (u32) of one core's status record.
pub const STATUS_WORDS: usize = 64;

/// Index of `expanded_x` in the global-memory pointer array.
pub const GM_EXPANDED_X: usize = 0;
/// Index of `expanded_row_idx`.
pub const GM_ROW_IDX: usize = 1;
/// Index of `x1` (NULL when absent).
pub const GM_X1: usize = 2;
/// Index of `x2` (NULL when absent).
pub const GM_X2: usize = 3;
/// Index of `bias` (NULL when absent).
pub const GM_BIAS: usize = 4;
/// Index of `scales` (NULL when absent).
pub const GM_SCALES: usize = 5;
/// Index of `expert_idx` (NULL when absent).
pub const GM_EXPERT_IDX: usize = 6;
/// Index of the output.
pub const GM_OUT: usize = 7;
/// Index of the int32 `[slots + 1]` slot offsets ([`slot_offsets`]; padded output only).
pub const GM_SLOT_OFFSETS: usize = 8;
/// Index of the u32 status array, `block_dim * STATUS_WORDS` words.
pub const GM_STATUS: usize = 9;
/// Number of global-memory pointers the kernel takes.
pub const GM_COUNT: usize = 10;

/// `flags`: `x1` is given.
pub const FLAG_X1: u32 = 0x1;
/// `flags`: `x2` is given.
pub const FLAG_X2: u32 = 0x2;
/// `flags`: `bias` (and `expert_idx`) are given.
pub const FLAG_BIAS: u32 = 0x4;
/// `flags`: `scales` are given.
pub const FLAG_SCALES: u32 = 0x8;
/// `flags`: the output is the padded EP buffer of SPEC section 3.
pub const FLAG_PADDED_OUT: u32 = 0x10;

const ST_OK: u32 = 0;
const ST_ROW_INDEX: u32 = 1;
const ST_EXPERT_INDEX: u32 = 2;
const ST_SLOT_LAYOUT: u32 = 3;
const ST_BAD_TILING: u32 = 4;
const ST_SIM_VIOLATION: u32 = 100;
/// Value the host fills status records with before a launch: a core that
/// never ran is detected.
pub const STATUS_NOT_RUN: u32 = 0xFFFF_FFFF;
const STATUS_MESSAGE_BYTE: usize = 32;

/// Tiling of one finalize launch: the `#[repr(C)]` mirror of
/// `AmoeFinalizeTiling` in `kernels/finalize_tiling.h` (field for field, all
/// `u32`, no padding). Pass its bytes ([`FinalizeTiling::as_bytes`]) as the
/// kernel's tiling argument.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct FinalizeTiling {
    /// [`TILING_MAGIC`].
    pub magic: u32,
    /// Tokens (output rows before padding).
    pub n: u32,
    /// Top-k.
    pub k: u32,
    /// Elements per row.
    pub h: u32,
    /// Rows of `expanded_x` viewed as 2-D.
    pub expanded_rows: u32,
    /// Rows of `bias` (0 without bias).
    pub experts: u32,
    /// [`DType`] number of the data tensors and the output.
    pub data_dtype: u32,
    /// [`DType`] number of `scales` (= `data_dtype` without scales).
    pub scales_dtype: u32,
    /// Drop-pad mode 0..=3.
    pub mode: u32,
    /// `FLAG_*` bits.
    pub flags: u32,
    /// Cores the launch uses.
    pub block_dim: u32,
    /// Output rows: `n`, or `slots * slot_rows` when padded.
    pub out_rows: u32,
    /// Slots (EP ranks) of the padded output; 1 when dense.
    pub slots: u32,
    /// Rows per slot; `n` when dense.
    pub slot_rows: u32,
    /// Elements per H tile (a multiple of [`TILE_ALIGN`]).
    pub tile_h: u32,
    /// `ceil(h / tile_h)`.
    pub tiles: u32,
    /// Elements of the last tile.
    pub tail_h: u32,
    /// `out_rows / block_dim`.
    pub rows_per_core: u32,
    /// `out_rows % block_dim`; the first `rows_rem` cores take one more row.
    pub rows_rem: u32,
    /// Unified-buffer bytes the kernel allocates per core ([`ub_bytes`]).
    pub ub_bytes: u32,
}

impl FinalizeTiling {
    /// The bytes handed to the kernel.
    pub fn as_bytes(&self) -> &[u8] {
        bytemuck::bytes_of(self)
    }

    /// Words of the status array a launch with this tiling needs.
    pub fn status_words(&self) -> usize {
        self.block_dim as usize * STATUS_WORDS
    }

    fn padded(&self) -> bool {
        self.flags & FLAG_PADDED_OUT != 0
    }
}

/// Unified-buffer bytes the kernel allocates per core for a tile of `tile_h`
/// elements (the formula of `amoe_finalize_ub_bytes` in the tiling header):
/// a double-buffered input queue, a bias queue and an output queue of the data
/// type plus an f32 scratch, and for 16-bit data an f32 accumulator and an f32
/// bias scratch, plus one 32-byte status block.
pub fn ub_bytes(data: DType, tile_h: usize) -> usize {
    // (bytes of the data type, f32 scratch buffers)
    let (elem, f32_buffers) = if data == DType::F32 { (4, 1) } else { (2, 3) };
    let per_elem = 4 * elem + 4 * f32_buffers;
    per_elem * tile_h + 32
}

/// Everything [`finalize_tiling`] needs: sizes, dtypes, flags and the launch shape.
#[derive(Debug, Clone, Copy)]
pub struct TilingParams<'a> {
    /// Validated sizes of the call.
    pub dims: FinalizeDims,
    /// Dtype of `expanded_x` (and of x1, x2, bias and the output).
    pub data: DType,
    /// Dtype of `scales`, `None` without scales.
    pub scales: Option<DType>,
    /// Drop-pad mode.
    pub mode: DropPadMode,
    /// `x1` is given.
    pub x1: bool,
    /// `x2` is given.
    pub x2: bool,
    /// `bias` and `expert_idx` are given.
    pub bias: bool,
    /// Dense output or the padded EP buffer.
    pub rows: OutputRows<'a>,
    /// Cores to spread the output rows over (at least 1; more than the rows is fine).
    pub block_dim: u32,
    /// Unified-buffer budget per core in bytes ([`UB_BYTES_910B`] on the 910B class).
    pub ub_bytes: usize,
}

impl<'a> TilingParams<'a> {
    /// The parameters of a finalize call, read off its arguments.
    pub fn from_args(
        args: &FinalizeArgs<'_>,
        dims: &FinalizeDims,
        rows: OutputRows<'a>,
        block_dim: u32,
        ub_bytes: usize,
    ) -> Self {
        TilingParams {
            dims: *dims,
            data: args.expanded_x.dtype(),
            scales: args.scales.map(Tensor::dtype),
            mode: args.drop_pad_mode,
            x1: args.x1.is_some(),
            x2: args.x2.is_some(),
            bias: args.bias.is_some(),
            rows,
            block_dim,
            ub_bytes,
        }
    }
}

fn to_u32(arg: &'static str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::invalid(OP, arg, format!("{v} does not fit the kernel's 32-bit tiling")))
}

/// The tiling of a finalize launch: the largest H tile (a multiple of
/// [`TILE_ALIGN`]) whose buffers fit `ub_bytes`, and the split of the output
/// rows over `block_dim` cores.
pub fn finalize_tiling(p: &TilingParams<'_>) -> Result<FinalizeTiling> {
    let d = &p.dims;
    if p.block_dim == 0 {
        return Err(Error::invalid(OP, "block_dim", "at least one core is needed"));
    }
    if !p.data.is_float() {
        return Err(Error::dtype(OP, "expanded_x", "f32, f16 or bf16", p.data));
    }
    let scales_dtype = match p.scales {
        None => p.data,
        Some(s) if s == p.data || s == DType::F32 => s,
        Some(s) => return Err(Error::dtype(OP, "scales", format!("{} or f32", p.data), s)),
    };
    if d.k == 0 && d.n != 0 {
        return Err(Error::invalid(OP, "k", "top-k must be at least 1"));
    }
    let (slots, slot_rows, out_rows) = match p.rows {
        OutputRows::Dense => (1, d.n, d.n),
        OutputRows::Padded { local_sizes, slot_rows } => {
            let sum: usize = local_sizes.iter().sum();
            if sum != d.n {
                return Err(Error::invalid(
                    OP,
                    "local_sizes",
                    format!("they sum to {sum}, but the finalize has {} tokens", d.n),
                ));
            }
            if let Some((r, &s)) = local_sizes.iter().enumerate().find(|(_, &s)| s > slot_rows) {
                return Err(Error::invalid(
                    OP,
                    "local_sizes",
                    format!("rank {r} has {s} tokens, more than the {slot_rows} rows of a slot"),
                ));
            }
            let total = local_sizes
                .len()
                .checked_mul(slot_rows)
                .ok_or_else(|| Error::invalid(OP, "slot_rows", "slots * slot_rows overflows"))?;
            (local_sizes.len(), slot_rows, total)
        }
    };
    // Flat index positions and slot offsets travel as 32-bit values.
    to_u32("expanded_row_idx", d.n.saturating_mul(d.k))?;
    if i32::try_from(d.n).is_err() {
        return Err(Error::invalid(OP, "n", format!("{} tokens exceed the kernel's int32 offsets", d.n)));
    }

    let budget = p.ub_bytes.min(u32::MAX as usize);
    let per_tile_unit = ub_bytes(p.data, TILE_ALIGN) - 32;
    let max_units = budget.saturating_sub(32) / per_tile_unit;
    if max_units == 0 {
        return Err(Error::invalid(
            OP,
            "ub_bytes",
            format!("{} bytes of unified buffer cannot hold one {TILE_ALIGN}-element tile", p.ub_bytes),
        ));
    }
    let max_tile = max_units * TILE_ALIGN;
    let tile_h = max_tile.min(d.h.max(1).div_ceil(TILE_ALIGN) * TILE_ALIGN);
    let tiles = d.h.div_ceil(tile_h);
    let tail_h = if tiles == 0 { 0 } else { d.h - (tiles - 1) * tile_h };

    let mut flags = 0;
    if p.x1 {
        flags |= FLAG_X1;
    }
    if p.x2 {
        flags |= FLAG_X2;
    }
    if p.bias {
        flags |= FLAG_BIAS;
    }
    if p.scales.is_some() {
        flags |= FLAG_SCALES;
    }
    if matches!(p.rows, OutputRows::Padded { .. }) {
        flags |= FLAG_PADDED_OUT;
    }
    let out_rows = to_u32("out", out_rows)?;
    Ok(FinalizeTiling {
        magic: TILING_MAGIC,
        n: to_u32("n", d.n)?,
        k: to_u32("k", d.k)?,
        h: to_u32("h", d.h)?,
        expanded_rows: to_u32("expanded_x", d.expanded_rows)?,
        experts: to_u32("bias", d.experts)?,
        data_dtype: p.data as u32,
        scales_dtype: scales_dtype as u32,
        mode: p.mode as u32,
        flags,
        block_dim: p.block_dim,
        out_rows,
        slots: to_u32("local_sizes", slots)?,
        slot_rows: to_u32("slot_rows", slot_rows)?,
        tile_h: to_u32("tile_h", tile_h)?,
        tiles: to_u32("tiles", tiles)?,
        tail_h: to_u32("tail_h", tail_h)?,
        rows_per_core: out_rows / p.block_dim,
        rows_rem: out_rows % p.block_dim,
        ub_bytes: to_u32("ub_bytes", ub_bytes(p.data, tile_h))?,
    })
}

/// The int32 `[slots + 1]` prefix sums of `local_sizes` the padded kernel
/// reads (empty for dense output).
pub fn slot_offsets(rows: OutputRows<'_>) -> Result<Vec<i32>> {
    match rows {
        OutputRows::Dense => Ok(Vec::new()),
        OutputRows::Padded { local_sizes, .. } => {
            let mut v = Vec::with_capacity(local_sizes.len() + 1);
            let mut acc = 0usize;
            v.push(0);
            for &s in local_sizes {
                acc += s;
                v.push(i32::try_from(acc).map_err(|_| Error::invalid(OP, "local_sizes", "more than 2^31 tokens"))?);
            }
            Ok(v)
        }
    }
}

/// Checks the geometry fields of a tiling against each other, so that any
/// tiling that passes keeps every kernel access inside the buffers whose sizes
/// [`finalize_host_with_tiling`] checks. The tile size and its fit in the
/// unified buffer are deliberately not checked here: the hardware (and the host
/// simulation) is what enforces those.
fn check_geometry(t: &FinalizeTiling) -> Result<()> {
    let bad = |why: String| Err(Error::invalid(OP, "tiling", why));
    if t.magic != TILING_MAGIC {
        return bad(format!("magic {:#x}, expected {TILING_MAGIC:#x}", t.magic));
    }
    if t.block_dim == 0 {
        return bad("block_dim is 0".into());
    }
    let covered = u64::from(t.rows_per_core) * u64::from(t.block_dim) + u64::from(t.rows_rem);
    if covered != u64::from(t.out_rows) || t.rows_rem >= t.block_dim {
        return bad(format!(
            "{} cores x {} rows + {} do not split {} output rows",
            t.block_dim, t.rows_per_core, t.rows_rem, t.out_rows
        ));
    }
    if t.h != 0 {
        let tiled = u64::from(t.tiles.saturating_sub(1)) * u64::from(t.tile_h) + u64::from(t.tail_h);
        if t.tile_h == 0 || t.tiles == 0 || t.tail_h == 0 || t.tail_h > t.tile_h || tiled != u64::from(t.h) {
            return bad(format!("{} tiles of {} (tail {}) do not cover h = {}", t.tiles, t.tile_h, t.tail_h, t.h));
        }
    } else if t.tiles != 0 {
        return bad("tiles over an empty row".into());
    }
    if t.padded() {
        if u64::from(t.slots) * u64::from(t.slot_rows) != u64::from(t.out_rows) {
            return bad(format!("{} slots x {} rows != {} output rows", t.slots, t.slot_rows, t.out_rows));
        }
    } else if t.out_rows != t.n {
        return bad(format!("dense output of {} rows for {} tokens", t.out_rows, t.n));
    }
    Ok(())
}

/// Decodes the status array of a finished launch (`tiling.block_dim` records
/// of [`STATUS_WORDS`]); the lowest core that reported a problem wins.
pub fn check_status(status: &[u32], tiling: &FinalizeTiling) -> Result<()> {
    let need = tiling.status_words();
    if status.len() < need {
        return Err(Error::invalid(OP, "status", format!("{} words, a launch needs {need}", status.len())));
    }
    for (block, rec) in status.chunks_exact(STATUS_WORDS).take(tiling.block_dim as usize).enumerate() {
        let block = block as u32;
        let (position, value) = (rec[1] as usize, i64::from(rec[2] as i32));
        match rec[0] {
            ST_OK => {}
            ST_ROW_INDEX => {
                let lo = if DropPadMode::from_u32(tiling.mode).is_some_and(DropPadMode::is_drop_pad) { -1 } else { 0 };
                return Err(Error::IndexOutOfRange {
                    op: OP,
                    arg: "expanded_row_idx",
                    position,
                    value,
                    valid: format!("[{lo}, {})", tiling.expanded_rows),
                });
            }
            ST_EXPERT_INDEX => {
                return Err(Error::IndexOutOfRange {
                    op: OP,
                    arg: "expert_idx",
                    position,
                    value,
                    valid: format!("[0, {})", tiling.experts),
                });
            }
            ST_SLOT_LAYOUT => {
                return Err(Error::invalid(
                    OP,
                    "local_sizes",
                    format!("slot {position} starts at token {value}: not a layout of {} tokens", tiling.n),
                ));
            }
            ST_BAD_TILING => {
                return Err(Error::invalid(OP, "tiling", format!("rejected by the kernel on core {block}")));
            }
            ST_SIM_VIOLATION => {
                let bytes: &[u8] = bytemuck::cast_slice(rec);
                let text = &bytes[STATUS_MESSAGE_BYTE..];
                let end = text.iter().position(|&b| b == 0).unwrap_or(text.len());
                return Err(Error::Kernel {
                    kernel: KERNEL,
                    block,
                    detail: format!("host simulation: {}", String::from_utf8_lossy(&text[..end])),
                });
            }
            STATUS_NOT_RUN => {
                return Err(Error::Kernel { kernel: KERNEL, block, detail: "the core did not run".into() });
            }
            code => {
                return Err(Error::Kernel { kernel: KERNEL, block, detail: format!("unknown status code {code}") });
            }
        }
    }
    Ok(())
}

/// Signature of one core of a kernel launch; identical to the simulated
/// runtime's `cannsim_kernel_entry`.
pub type KernelEntry =
    unsafe extern "C" fn(block_idx: u32, block_dim: u32, gm: *const *mut c_void, tiling: *const c_void);

#[cfg(amoe_host_kernel)]
mod ffi {
    use std::ffi::c_void;
    extern "C" {
        pub fn amoe_finalize_kernel_host(block_idx: u32, block_dim: u32, gm: *const *mut c_void, tiling: *const c_void);
        pub fn amoe_finalize_tiling_layout(out: *mut u32, cap: usize) -> usize;
        pub fn amoe_finalize_ub_bytes_host(data_dtype: u32, tile_h: u32) -> u32;
        pub fn amoe_sim_ub_capacity() -> u32;
        pub fn amoe_sim_selftest(which: u32, msg: *mut std::ffi::c_char, cap: usize) -> i32;
    }
}

/// The host build of the kernel (`amoe_finalize_kernel_host`), `None` when
/// `build.rs` could not compile it. This is the entry a simulated runtime's
/// `cannsim_launch_kernel` runs for every block.
pub fn host_entry() -> Option<KernelEntry> {
    #[cfg(amoe_host_kernel)]
    {
        Some(ffi::amoe_finalize_kernel_host)
    }
    #[cfg(not(amoe_host_kernel))]
    {
        None
    }
}

fn host_unavailable() -> Error {
    Error::Unavailable("the host build of kernels/finalize_kernel.cpp is not in this crate (build.rs failed)".into())
}

/// Byte offsets of every `AmoeFinalizeTiling` field as the C compiler laid
/// them out, in declaration order, followed by `sizeof`.
pub fn c_tiling_layout() -> Result<Vec<u32>> {
    #[cfg(amoe_host_kernel)]
    {
        let mut v = vec![0u32; 64];
        // SAFETY: the callee writes at most `cap` = v.len() values into v.
        let n = unsafe { ffi::amoe_finalize_tiling_layout(v.as_mut_ptr(), v.len()) };
        v.truncate(n.min(64));
        Ok(v)
    }
    #[cfg(not(amoe_host_kernel))]
    {
        Err(host_unavailable())
    }
}

/// The unified-buffer bytes the C header's formula gives (the kernel's own
/// allocation plan), to check [`ub_bytes`] against.
pub fn c_ub_bytes(data: DType, tile_h: u32) -> Result<u32> {
    #[cfg(amoe_host_kernel)]
    {
        // SAFETY: a pure function of two integers.
        Ok(unsafe { ffi::amoe_finalize_ub_bytes_host(data as u32, tile_h) })
    }
    #[cfg(not(amoe_host_kernel))]
    {
        let _ = (data, tile_h);
        Err(host_unavailable())
    }
}

/// Unified-buffer capacity per core that the host simulation enforces.
pub fn sim_ub_capacity() -> Result<usize> {
    #[cfg(amoe_host_kernel)]
    {
        // SAFETY: returns a constant.
        Ok(unsafe { ffi::amoe_sim_ub_capacity() } as usize)
    }
    #[cfg(not(amoe_host_kernel))]
    {
        Err(host_unavailable())
    }
}

/// Runs self-test kernel `which` of the host simulation (`kernels/sim/host_entry.cpp`):
/// case 0 follows every rule, cases 1..=8 each break one (queue balance,
/// use after free, bounds, alignment). Returns the violation message that
/// aborted the run, `None` if it ran clean.
#[doc(hidden)]
pub fn sim_selftest(which: u32) -> Result<Option<String>> {
    #[cfg(amoe_host_kernel)]
    {
        let mut buf = vec![0u8; 512];
        // SAFETY: the callee writes at most `cap` bytes, NUL-terminated, into buf.
        let hit = unsafe { ffi::amoe_sim_selftest(which, buf.as_mut_ptr().cast(), buf.len()) };
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        Ok((hit != 0).then(|| String::from_utf8_lossy(&buf[..end]).into_owned()))
    }
    #[cfg(not(amoe_host_kernel))]
    {
        let _ = which;
        Err(host_unavailable())
    }
}

/// The AI Core build (`libamoe_kernels_npu.so`, exporting
/// [`NPU_LAUNCH_SYMBOL`]): `ASCEND_MOE_KERNEL_LIB` if set, else the library
/// `build.rs` compiled when CANN was present; `None` otherwise.
pub fn npu_kernel_library() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("ASCEND_MOE_KERNEL_LIB") {
        return Some(PathBuf::from(p));
    }
    option_env!("AMOE_NPU_KERNEL_LIB").map(PathBuf::from)
}

/// Signature of [`NPU_LAUNCH_SYMBOL`] in the AI Core build.
pub type NpuLaunchFn =
    unsafe extern "C" fn(block_dim: u32, stream: *mut c_void, gm: *const *mut c_void, tiling: *mut c_void) -> i32;

/// The AI Core build of the kernel (`libamoe_kernels_npu.so`), loaded at run
/// time so the crate never links CANN.
pub struct NpuKernelLib {
    launch: NpuLaunchFn,
    path: PathBuf,
    // Keeps `launch` valid; dropped last.
    _lib: libloading::Library,
}

impl std::fmt::Debug for NpuKernelLib {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NpuKernelLib").field("path", &self.path).finish_non_exhaustive()
    }
}

impl NpuKernelLib {
    /// Loads [`npu_kernel_library`]; [`Error::Unavailable`] when there is none
    /// (no CANN at build time and no `ASCEND_MOE_KERNEL_LIB`).
    pub fn load() -> Result<Self> {
        let path = npu_kernel_library().ok_or_else(|| {
            Error::Unavailable(
                "no AI Core build of the finalize kernel: CANN was not found at build time and \
                 ASCEND_MOE_KERNEL_LIB is not set"
                    .into(),
            )
        })?;
        Self::load_from(path)
    }

    /// Loads the kernel library at `path`.
    pub fn load_from(path: impl Into<PathBuf>) -> Result<Self> {
        let path = path.into();
        // SAFETY: loading runs the library's initialisers; the AI Core build
        // has none beyond the CANN runtime's kernel registration.
        let lib = unsafe { libloading::Library::new(&path) }
            .map_err(|e| Error::Unavailable(format!("loading {}: {e}", path.display())))?;
        let sym = format!("{NPU_LAUNCH_SYMBOL}\0");
        // SAFETY: the symbol has the C signature NpuLaunchFn (kernels/npu_launch.cpp).
        let launch = unsafe { lib.get::<NpuLaunchFn>(sym.as_bytes()) }
            .map(|s| *s)
            .map_err(|e| Error::Unavailable(format!("{}: no {NPU_LAUNCH_SYMBOL}: {e}", path.display())))?;
        Ok(NpuKernelLib { launch, path, _lib: lib })
    }

    /// Where the library was loaded from.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// Enqueues the kernel on `stream` over `block_dim` cores.
    ///
    /// # Safety
    /// `stream` is a live `aclrtStream`; every non-NULL pointer of `gm` is
    /// device memory of that stream's device sized as [`check_launch`]
    /// requires (call it first), NULL exactly where the tiling marks an input
    /// absent; `tiling_dev` is device memory holding the tiling's bytes; the
    /// status buffer holds `block_dim * STATUS_WORDS` words; `block_dim`
    /// equals the tiling's. All of it stays alive until the stream has run it.
    pub unsafe fn launch(
        &self,
        block_dim: u32,
        stream: *mut c_void,
        gm: &[*mut c_void; GM_COUNT],
        tiling_dev: *mut c_void,
    ) -> Result<()> {
        // SAFETY: forwarded from this function's contract.
        let code = unsafe { (self.launch)(block_dim, stream, gm.as_ptr(), tiling_dev) };
        if code == 0 {
            Ok(())
        } else {
            Err(Error::Acl { call: NPU_LAUNCH_SYMBOL, code, msg: String::new() })
        }
    }
}

/// Launcher exported by the AI Core build:
/// `int32_t amoe_finalize_launch_npu(uint32_t block_dim, aclrtStream stream,
/// void *const *gm, void *tiling_dev)`, with `gm` a host array of [`GM_COUNT`]
/// device pointers and the tiling already copied to the device. Returns 0 or
/// an ACL error code.
pub const NPU_LAUNCH_SYMBOL: &str = "amoe_finalize_launch_npu";

fn expect_dtype(t: &Tensor, arg: &'static str, want: DType) -> Result<()> {
    if t.dtype() != want {
        return Err(Error::dtype(OP, arg, want.name(), t.dtype()));
    }
    Ok(())
}

fn expect_len(t: &Tensor, arg: &'static str, what: &str, want: u64) -> Result<()> {
    if t.numel() as u64 != want {
        return Err(Error::shape(OP, arg, format!("{want} elements ({what})"), t.shape()));
    }
    Ok(())
}

fn check_optional(t: Option<&Tensor>, flag: bool, arg: &'static str, dtype: DType, what: &str, len: u64) -> Result<()> {
    match (t, flag) {
        (None, false) => Ok(()),
        (Some(t), true) => {
            expect_dtype(t, arg, dtype)?;
            expect_len(t, arg, what, len)
        }
        (Some(_), false) => Err(Error::invalid(OP, arg, "given, but the tiling says it is absent")),
        (None, true) => Err(Error::invalid(OP, arg, "absent, but the tiling says it is given")),
    }
}

fn host_ptr(t: Option<&Tensor>) -> Result<*mut c_void> {
    Ok(match t {
        Some(t) => t.cpu_bytes()?.as_ptr() as *mut c_void,
        None => std::ptr::null_mut(),
    })
}

/// Runs the host build of the kernel on host tensors, planning the tiling for
/// the 910B unified buffer and `block_dim` cores. `out` is `[N, H]` for
/// [`OutputRows::Dense`] or `[slots * slot_rows, H]` for
/// [`OutputRows::Padded`] (whose padding rows are written with zeros).
///
/// Index values are checked by the kernel: an out-of-range one yields
/// [`Error::IndexOutOfRange`] (the output is then unspecified).
pub fn finalize_host(
    args: &FinalizeArgs<'_>,
    dims: &FinalizeDims,
    out: &mut Tensor,
    rows: OutputRows<'_>,
    block_dim: u32,
) -> Result<()> {
    let tiling = finalize_tiling(&TilingParams::from_args(args, dims, rows, block_dim, UB_BYTES_910B))?;
    finalize_host_with_tiling(args, out, rows, &tiling)
}

/// Checks a launch before it happens, on any device: the tiling's geometry
/// against itself, and every tensor's dtype and element count against the
/// tiling's sizes and flags, so the kernel cannot address memory outside the
/// tensors. The tile size and its unified-buffer footprint are not checked:
/// the hardware (and the host simulation) enforces those. A device launch
/// calls this, then passes the tensors' device pointers in `GM_*` order, the
/// [`slot_offsets`] for padded output, and a status buffer of
/// [`FinalizeTiling::status_words`] words filled with [`STATUS_NOT_RUN`]
/// (bytes `0xFF`), and decodes the status with [`check_status`].
pub fn check_launch(
    args: &FinalizeArgs<'_>,
    out: &Tensor,
    rows: OutputRows<'_>,
    tiling: &FinalizeTiling,
) -> Result<()> {
    let t = tiling;
    check_geometry(t)?;
    let data = DType::from_u32(t.data_dtype)
        .filter(|d| d.is_float())
        .ok_or_else(|| Error::invalid(OP, "tiling", format!("data dtype {} is not f32/f16/bf16", t.data_dtype)))?;
    let scales_dtype = DType::from_u32(t.scales_dtype)
        .ok_or_else(|| Error::invalid(OP, "tiling", format!("scales dtype {}", t.scales_dtype)))?;
    if DropPadMode::from_u32(t.mode) != Some(args.drop_pad_mode) {
        return Err(Error::invalid(
            OP,
            "tiling",
            format!("mode {} but drop_pad_mode {}", t.mode, args.drop_pad_mode as u32),
        ));
    }
    let (n, k, h) = (u64::from(t.n), u64::from(t.k), u64::from(t.h));
    expect_dtype(args.expanded_x, "expanded_x", data)?;
    expect_len(args.expanded_x, "expanded_x", "expanded_rows * h", u64::from(t.expanded_rows) * h)?;
    expect_dtype(args.expanded_row_idx, "expanded_row_idx", DType::I32)?;
    expect_len(args.expanded_row_idx, "expanded_row_idx", "n * k", n * k)?;
    check_optional(args.x1, t.flags & FLAG_X1 != 0, "x1", data, "n * h", n * h)?;
    check_optional(args.x2, t.flags & FLAG_X2 != 0, "x2", data, "n * h", n * h)?;
    let has_bias = t.flags & FLAG_BIAS != 0;
    check_optional(args.bias, has_bias, "bias", data, "experts * h", u64::from(t.experts) * h)?;
    check_optional(args.expert_idx, has_bias, "expert_idx", DType::I32, "n * k", n * k)?;
    check_optional(args.scales, t.flags & FLAG_SCALES != 0, "scales", scales_dtype, "n * k", n * k)?;
    expect_dtype(out, "out", data)?;
    expect_len(out, "out", "out_rows * h", u64::from(t.out_rows) * h)?;
    match rows {
        OutputRows::Dense if t.padded() => {
            Err(Error::invalid(OP, "rows", "dense output, but the tiling is for the padded buffer"))
        }
        OutputRows::Padded { local_sizes, slot_rows }
            if !t.padded() || local_sizes.len() != t.slots as usize || slot_rows != t.slot_rows as usize =>
        {
            Err(Error::invalid(OP, "rows", "padded layout does not match the tiling"))
        }
        _ => Ok(()),
    }
}

/// [`finalize_host`] with a given tiling, checked by [`check_launch`]: a
/// tiling that would break the hardware's rules (tile alignment, unified-buffer
/// capacity) is caught by the host simulation and returned as
/// [`Error::Kernel`].
pub fn finalize_host_with_tiling(
    args: &FinalizeArgs<'_>,
    out: &mut Tensor,
    rows: OutputRows<'_>,
    tiling: &FinalizeTiling,
) -> Result<()> {
    let t = tiling;
    check_launch(args, out, rows, t)?;
    let offsets = slot_offsets(rows)?;
    let entry = host_entry().ok_or_else(host_unavailable)?;
    let mut status = vec![STATUS_NOT_RUN; t.status_words()];
    let mut gm = [std::ptr::null_mut::<c_void>(); GM_COUNT];
    gm[GM_EXPANDED_X] = host_ptr(Some(args.expanded_x))?;
    gm[GM_ROW_IDX] = host_ptr(Some(args.expanded_row_idx))?;
    gm[GM_X1] = host_ptr(args.x1)?;
    gm[GM_X2] = host_ptr(args.x2)?;
    gm[GM_BIAS] = host_ptr(args.bias)?;
    gm[GM_SCALES] = host_ptr(args.scales)?;
    gm[GM_EXPERT_IDX] = host_ptr(args.expert_idx)?;
    gm[GM_OUT] = out.cpu_bytes_mut()?.as_mut_ptr() as *mut c_void;
    gm[GM_SLOT_OFFSETS] = if offsets.is_empty() { std::ptr::null_mut() } else { offsets.as_ptr() as *mut c_void };
    gm[GM_STATUS] = status.as_mut_ptr() as *mut c_void;
    for block in 0..t.block_dim {
        // SAFETY: every pointer in `gm` is a live host buffer of at least the
        // size the kernel derives from `t` (checked above, element for element),
        // or NULL where the tiling's flags say the input is absent; the kernel
        // only reads the inputs and writes `out` and `status`, which are
        // exclusively borrowed here; `t` is a valid `AmoeFinalizeTiling`.
        unsafe { entry(block, t.block_dim, gm.as_ptr(), (t as *const FinalizeTiling).cast()) };
    }
    check_status(&status, t)
}
