//! Decoding the per-core status records a launch writes.

use super::abi::*;
use super::abi::{FINALIZE_KERNEL as KERNEL, FINALIZE_OP as OP};
use crate::{DropPadMode, Error, Result};

/// Decodes the status array of a finished launch (`tiling.block_dim` records
/// of [`STATUS_WORDS`]); the lowest core that reported a problem wins.
pub(crate) fn check_status(status: &[u32], tiling: &FinalizeTiling) -> Result<()> {
    let need = tiling.status_words();
    if status.len() < need {
        return Err(Error::invalid(OP, "status", format!("{} words, a launch needs {need}", status.len())));
    }
    for (block, rec) in status.chunks_exact(STATUS_WORDS).take(tiling.block_dim as usize).enumerate() {
        let block = block as u32;
        // A problem of an earlier replay of a captured launch stays in the
        // sticky copy when a later replay found none (it rewrote the head).
        let sticky = &rec[STICKY_WORD..STICKY_WORD + STATUS_HEAD_WORDS];
        let head = if rec[0] == ST_OK && sticky[STATUS_HEAD_WORDS - 1] == STICKY_MARK && sticky[0] != ST_OK {
            sticky
        } else {
            &rec[..STATUS_HEAD_WORDS]
        };
        let (position, value) = (head[1] as usize, i64::from(head[2] as i32));
        match head[0] {
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
                    detail: format!("host model: {}", String::from_utf8_lossy(&text[..end])),
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
