//! The forward-context guard (`kernels/guard_kernel.cpp`): the device layout
//! of the live forward context, the guard's tiling, its host run and the
//! decoding of its status record.
//!
//! A graph captured for one forward context bakes that context's layout and
//! reductions into its work. The engine rewrites a small device buffer (the
//! live context, [`CTX_WORDS`] words) before each replay; the guard, captured
//! with the ops, compares the live words with the ones the ops were captured
//! for and writes the first difference into its status record. The host reads
//! the record at the caller's sync point, so a graph replayed under another
//! comm type or other DP token counts is reported instead of reducing twice or
//! not at all.

#[cfg(test)]
use std::ffi::c_void;

pub(crate) use super::abi::{GUARD_GM_COUNT, GUARD_GM_LIVE, GUARD_GM_STATUS};
use super::abi::{STATUS_NOT_RUN, STATUS_WORDS};
use crate::{Error, Result};

/// Words (u32) of the live context buffer: 256 bytes, one DataCopy.
pub(crate) const CTX_WORDS: usize = 64;
/// `AMOE_CTX_MAGIC` ('AMFC'), word 0 of a written context.
pub(crate) const CTX_MAGIC: u32 = 0x4346_4D41;
/// `AMOE_CTX_VERSION`, word 1.
pub(crate) const CTX_VERSION: u32 = 1;
/// Word of the comm type.
pub(crate) const W_COMM_TYPE: usize = 2;
/// Word of SP on/off.
pub(crate) const W_SP: usize = 3;
/// Word of the PCP size.
pub(crate) const W_PCP: usize = 4;
/// Word of this DP rank's actual-token count ([`CTX_ALL`] = every token).
pub(crate) const W_ACTUAL: usize = 5;
/// Word of the DP size.
pub(crate) const W_DP_SIZE: usize = 6;
/// First word of the per-DP-rank token counts.
pub(crate) const W_DP_TOKENS: usize = 7;
/// Most DP ranks a context holds.
pub(crate) const CTX_MAX_DP: usize = CTX_WORDS - W_DP_TOKENS;
/// `AMOE_CTX_ALL`: every token of the DP rank is real.
pub(crate) const CTX_ALL: u32 = u32::MAX;
/// `AMOE_GUARD_TILING_MAGIC` ('AMG2').
pub(crate) const GUARD_TILING_MAGIC: u32 = 0x3247_4D41;
/// `AMOE_GUARD_NO_ALT`: no word takes a second value.
pub(crate) const GUARD_NO_ALT: u32 = u32::MAX;

const ST_OK: u32 = 0;
const ST_BAD_TILING: u32 = 4;
const ST_SIM_VIOLATION: u32 = 100;
const ST_MISMATCH: u32 = 10;
const STATUS_EXPECTED: usize = 3;
/// Words of the status head (`AMOE_FIN_STATUS_HEAD_WORDS`).
pub(crate) const STATUS_HEAD_WORDS: usize = 8;
/// `AMOE_GUARD_STICKY_WORD`: where a mismatch is also written, a copy of the
/// head that a captured guard's replays do not reset.
const STICKY_WORD: usize = 56;
/// `AMOE_GUARD_STICKY_MARK` ('AMGS'), the last word of a sticky copy.
const STICKY_MARK: u32 = 0x5347_4D41;
const KERNEL: &str = "amoe_guard";

/// The words of a forward context, as the engine writes them to the live
/// buffer and as an op records them when it is captured
/// (`moe::ForwardContext::words` encodes them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextWords(pub(crate) [u32; CTX_WORDS]);

impl ContextWords {
    /// Encodes a context: comm type (vLLM-Ascend's number), SP on/off, PCP
    /// size, this DP rank's actual tokens (`None` = all) and the tokens of
    /// every DP rank. Errors name the value that does not fit.
    pub(crate) fn encode(
        comm_type: u32,
        sp: bool,
        pcp_size: usize,
        num_actual_tokens: Option<usize>,
        dp_tokens: &[usize],
    ) -> Result<ContextWords> {
        const OP: &str = "forward_context";
        if dp_tokens.is_empty() || dp_tokens.len() > CTX_MAX_DP {
            return Err(Error::invalid(
                OP,
                "dp_tokens",
                format!("{} DP ranks: a device context holds 1 to {CTX_MAX_DP}", dp_tokens.len()),
            ));
        }
        let word = |arg: &'static str, v: usize| {
            u32::try_from(v)
                .ok()
                .filter(|&w| w != CTX_ALL)
                .ok_or_else(|| Error::invalid(OP, arg, format!("{v} does not fit a 32-bit context word")))
        };
        let mut w = [0u32; CTX_WORDS];
        w[0] = CTX_MAGIC;
        w[1] = CTX_VERSION;
        w[W_COMM_TYPE] = comm_type;
        w[W_SP] = u32::from(sp);
        w[W_PCP] = word("pcp_size", pcp_size)?;
        w[W_ACTUAL] = match num_actual_tokens {
            None => CTX_ALL,
            Some(n) => word("num_actual_tokens", n)?,
        };
        w[W_DP_SIZE] = dp_tokens.len() as u32;
        for (i, &t) in dp_tokens.iter().enumerate() {
            w[W_DP_TOKENS + i] = word("dp_tokens", t)?;
        }
        Ok(ContextWords(w))
    }

    /// The words as bytes, to copy into the live buffer.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }

    /// Words an op captured for this context depends on: the header, comm
    /// type, SP, PCP, the DP size and every DP rank's count, and, when
    /// `actual` is set, the actual-token count (an op that masks padding rows).
    pub(crate) fn mask(&self, actual: bool) -> [u32; CTX_WORDS / 32] {
        let mut m = [0u32; CTX_WORDS / 32];
        let dp = (self.0[W_DP_SIZE] as usize).min(CTX_MAX_DP);
        for i in 0..W_DP_TOKENS + dp {
            if i != W_ACTUAL || actual {
                m[i / 32] |= 1 << (i % 32);
            }
        }
        m
    }
}

/// What a guard compares (`AmoeGuardTiling`, `kernels/guard_tiling.h`): the
/// context words a set of captured ops depends on, and the values they were
/// captured for. `LiveContext::guard_with` enqueues it.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct GuardTiling {
    /// [`GUARD_TILING_MAGIC`].
    pub(crate) magic: u32,
    /// Words compared (at most [`CTX_WORDS`]).
    pub(crate) words: u32,
    /// Bit `i` of `mask[i / 32]`: compare word `i`.
    pub(crate) mask: [u32; CTX_WORDS / 32],
    /// The words the ops were captured for.
    pub(crate) expected: [u32; CTX_WORDS],
    /// A compared word that may also equal `alt_value` ([`GUARD_NO_ALT`]: none).
    pub(crate) alt_word: u32,
    /// The second value `alt_word` may take.
    pub(crate) alt_value: u32,
}

impl GuardTiling {
    /// The guard of ops captured for `expected`: it compares the header, the
    /// comm type, SP, PCP, the DP size and every DP rank's count, and, when
    /// `actual` is set, the actual-token count (ops that mask padding rows).
    pub fn new(expected: &ContextWords, actual: bool) -> GuardTiling {
        GuardTiling {
            magic: GUARD_TILING_MAGIC,
            words: CTX_WORDS as u32,
            mask: expected.mask(actual),
            expected: expected.0,
            alt_word: GUARD_NO_ALT,
            alt_value: 0,
        }
    }

    /// The guard of ops that write the MC2 mask of `real` real tokens out of
    /// this DP rank's `tokens` (captured for `expected`, which holds the
    /// other words): the actual-token count is compared too. When every token
    /// is real, the live context may say so either way, "all" or `tokens`.
    pub fn with_actual_tokens(expected: &ContextWords, real: usize, tokens: usize) -> Result<GuardTiling> {
        let mut w = *expected;
        if real < tokens {
            w.0[W_ACTUAL] = u32::try_from(real).ok().filter(|&v| v != CTX_ALL).ok_or_else(|| {
                Error::invalid(
                    "forward_context",
                    "num_actual_tokens",
                    format!("{real} does not fit a 32-bit context word"),
                )
            })?;
            return Ok(GuardTiling::new(&w, true));
        }
        w.0[W_ACTUAL] = CTX_ALL;
        let mut t = GuardTiling::new(&w, true);
        // `tokens` is one of the DP counts `expected` holds, so it fits a word.
        (t.alt_word, t.alt_value) = (W_ACTUAL as u32, tokens as u32);
        Ok(t)
    }

    /// The guard of ops that depend on the comm type alone (the reduction
    /// points): only the header and the comm type are compared.
    pub fn comm_type_only(comm_type: u32) -> GuardTiling {
        let mut expected = [0u32; CTX_WORDS];
        expected[0] = CTX_MAGIC;
        expected[1] = CTX_VERSION;
        expected[W_COMM_TYPE] = comm_type;
        let mut mask = [0u32; CTX_WORDS / 32];
        mask[0] = 0b111;
        GuardTiling {
            magic: GUARD_TILING_MAGIC,
            words: CTX_WORDS as u32,
            mask,
            expected,
            alt_word: GUARD_NO_ALT,
            alt_value: 0,
        }
    }

    /// The tiling's bytes.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        bytemuck::bytes_of(self)
    }
}

fn word_name(i: usize) -> String {
    match i {
        0 => "the context header (magic)".into(),
        1 => "the context version".into(),
        W_COMM_TYPE => "comm_type".into(),
        W_SP => "sp".into(),
        W_PCP => "pcp_size".into(),
        W_ACTUAL => "num_actual_tokens".into(),
        W_DP_SIZE => "the DP size".into(),
        i => format!("dp_tokens[{}]", i - W_DP_TOKENS),
    }
}

fn word_value(i: usize, v: u32) -> String {
    match (i, v) {
        (W_COMM_TYPE, 0) => "0 (ALLGATHER)".into(),
        (W_COMM_TYPE, 1) => "1 (MC2)".into(),
        (W_COMM_TYPE, 2) => "2 (ALLTOALL)".into(),
        (W_COMM_TYPE, 3) => "3 (FUSED_MC2)".into(),
        (W_ACTUAL, CTX_ALL) => "all".into(),
        (0, CTX_MAGIC) => "set".into(),
        (0, _) => format!("{v:#x} (the live context was never written)"),
        _ => v.to_string(),
    }
}

/// Decodes the guard's status record (one core, [`STATUS_WORDS`] words) for
/// the ops of `op`: a differing word becomes [`Error::StaleContext`].
pub(crate) fn check_guard_status(op: &'static str, status: &[u32]) -> Result<()> {
    decode_guard_status(op, status, |i, live, captured| Error::StaleContext {
        op,
        field: word_name(i),
        captured: word_value(i, captured),
        live: word_value(i, live),
    })
}

/// Decodes a guard's status record over any words: a differing word `i`
/// becomes `mismatch(i, found, expected)`; the other codes as
/// [`check_guard_status`].
pub(crate) fn decode_guard_status(
    op: &'static str,
    status: &[u32],
    mismatch: impl FnOnce(usize, u32, u32) -> Error,
) -> Result<()> {
    let Some(rec) = status.get(..STATUS_WORDS) else {
        return Err(Error::invalid(op, "status", format!("{} words, the guard writes {STATUS_WORDS}", status.len())));
    };
    // A mismatch of an earlier replay of a captured guard stays in the
    // sticky copy when a later replay matched (it rewrote only the head).
    let sticky = &rec[STICKY_WORD..STICKY_WORD + STATUS_HEAD_WORDS];
    let sticky_mismatch = sticky[0] == ST_MISMATCH && sticky[STATUS_HEAD_WORDS - 1] == STICKY_MARK;
    match rec[0] {
        ST_OK | ST_MISMATCH if sticky_mismatch => Err(mismatch(sticky[1] as usize, sticky[2], sticky[STATUS_EXPECTED])),
        ST_OK => Ok(()),
        ST_MISMATCH => Err(mismatch(rec[1] as usize, rec[2], rec[STATUS_EXPECTED])),
        ST_BAD_TILING => Err(Error::Kernel { kernel: KERNEL, block: 0, detail: "the tiling was rejected".into() }),
        ST_SIM_VIOLATION => {
            let bytes: &[u8] = bytemuck::cast_slice(rec);
            let text = &bytes[32..];
            let end = text.iter().position(|&b| b == 0).unwrap_or(text.len());
            Err(Error::Kernel {
                kernel: KERNEL,
                block: 0,
                detail: format!("host model: {}", String::from_utf8_lossy(&text[..end])),
            })
        }
        STATUS_NOT_RUN => Err(Error::Kernel { kernel: KERNEL, block: 0, detail: "the core did not run".into() }),
        code => Err(Error::Kernel { kernel: KERNEL, block: 0, detail: format!("unknown status code {code}") }),
    }
}

#[cfg(amoe_host_kernel)]
mod ffi {
    use std::ffi::c_void;
    extern "C" {
        pub fn amoe_guard_kernel_host(block_idx: u32, block_dim: u32, gm: *const *mut c_void, tiling: *const c_void);
        #[cfg(test)]
        pub fn amoe_guard_tiling_layout(out: *mut u32, cap: usize) -> usize;
    }
}

/// The host build of the guard, with the signature of the simulated
/// runtime's `cannsim_kernel_entry`; `None` without a host kernel build.
pub(crate) fn guard_host_entry() -> Option<super::abi::KernelEntry> {
    #[cfg(amoe_host_kernel)]
    {
        Some(ffi::amoe_guard_kernel_host)
    }
    #[cfg(not(amoe_host_kernel))]
    {
        None
    }
}

/// Byte offsets of `AmoeGuardTiling`'s fields as the C compiler laid them
/// out, then its `sizeof`.
#[cfg(test)]
pub(crate) fn c_guard_tiling_layout() -> Result<Vec<u32>> {
    #[cfg(amoe_host_kernel)]
    {
        let mut v = vec![0u32; 8];
        // SAFETY: the callee writes at most `cap` = v.len() values.
        let n = unsafe { ffi::amoe_guard_tiling_layout(v.as_mut_ptr(), v.len()) };
        v.truncate(n.min(8));
        Ok(v)
    }
    #[cfg(not(amoe_host_kernel))]
    {
        Err(super::library::host_unavailable())
    }
}

/// Runs the host build of the guard on a live context in host memory and
/// returns the raw status record (what a device launch leaves in its status
/// buffer), for tests of the kernel itself.
#[cfg(test)]
pub(crate) fn guard_host_status(live: &[u32; CTX_WORDS], tiling: &GuardTiling) -> Result<Vec<u32>> {
    let entry = guard_host_entry().ok_or_else(super::library::host_unavailable)?;
    let mut status = vec![STATUS_NOT_RUN; STATUS_WORDS];
    let mut gm = [std::ptr::null_mut::<c_void>(); GUARD_GM_COUNT];
    gm[GUARD_GM_LIVE] = live.as_ptr() as *mut c_void;
    gm[GUARD_GM_STATUS] = status.as_mut_ptr().cast();
    // SAFETY: `live` holds CTX_WORDS words and is only read; `status` holds one
    // record of STATUS_WORDS words, exclusively borrowed; `tiling` is a valid
    // AmoeGuardTiling; one core.
    unsafe { entry(0, 1, gm.as_ptr(), (tiling as *const GuardTiling).cast()) };
    Ok(status)
}

/// [`guard_host_status`], decoded by [`check_guard_status`].
#[cfg(test)]
pub(crate) fn guard_host(op: &'static str, live: &[u32; CTX_WORDS], tiling: &GuardTiling) -> Result<()> {
    check_guard_status(op, &guard_host_status(live, tiling)?)
}
