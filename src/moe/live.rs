//! [`LiveStream`]: an NPU stream with the live forward context (SPEC section
//! 5) its context-dependent ops guard against, and [`ForwardContext`], one
//! forward pass's context as the engine sets it.
//!
//! Under ACL graph replay the forward context lives in device memory (a
//! [`LiveContext`]) that the engine rewrites before each replay. An op that
//! depends on the context (token prepare / finalize with their
//! [`MoeContext`], a reduction point with its comm type) called on a stream
//! with an attached live context first queues a guard of the context it was
//! called with; a replay under another context is then reported by
//! [`LiveStream::check`], never applied silently.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::backend::npu::kernel::guard::{ContextWords, GuardTiling};
use crate::backend::npu::live_context::LiveContext;
use crate::backend::npu::NpuDevice;
use crate::moe::prepare_finalize::MoeContext;
use crate::{CommType, Error, Result};

/// One forward pass's context as the engine sets it (SPEC section 5): the
/// live comm type, the tokens of every DP rank, this DP rank's actual tokens
/// (`None` = all of them; rows past them are graph padding), SP on/off and
/// the PCP size (0 or 1 = none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardContext {
    /// The live comm type.
    pub comm_type: CommType,
    /// MoE sequence parallelism on.
    pub sp: bool,
    /// Tokens of each DP rank.
    pub dp_tokens: Vec<usize>,
    /// Real tokens of this DP rank; `None` = every token is real.
    pub num_actual_tokens: Option<usize>,
    /// PCP size (0 or 1 = no prefill context parallelism).
    pub pcp_size: usize,
}

impl ForwardContext {
    /// The context's words in the live buffer's layout; an error when
    /// `num_actual_tokens` is more than any DP rank's tokens, or the sizes do
    /// not fit the layout.
    pub fn words(&self) -> Result<ContextWords> {
        if let Some(n) = self.num_actual_tokens {
            if self.dp_tokens.iter().all(|&t| n > t) {
                return Err(Error::invalid(
                    "ForwardContext",
                    "num_actual_tokens",
                    format!("{n} is more than any DP rank's tokens {:?}", self.dp_tokens),
                ));
            }
        }
        ContextWords::encode(
            self.comm_type as u32,
            self.sp,
            self.pcp_size.max(1),
            self.num_actual_tokens,
            &self.dp_tokens,
        )
    }
}

/// An NPU device handle (and so its stream) with the live context attached
/// to it, if any. Cheap to share by reference; attaching and detaching may
/// happen from any thread.
#[derive(Debug)]
pub struct LiveStream {
    device: NpuDevice,
    live: Mutex<Option<Arc<LiveContext>>>,
}

impl LiveStream {
    /// `device`'s stream, with no live context attached.
    pub fn new(device: NpuDevice) -> Self {
        LiveStream { device, live: Mutex::new(None) }
    }

    /// The device handle whose stream this is.
    pub fn device(&self) -> &NpuDevice {
        &self.device
    }

    fn slot(&self) -> MutexGuard<'_, Option<Arc<LiveContext>>> {
        // Each critical section is one replace or clone.
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Attaches `live` (`None` detaches): from then on every op called on
    /// this stream that depends on the forward context first queues a guard
    /// of its own context. The stream keeps `live` alive while attached. A
    /// context of another device is an error naming both.
    pub fn attach(&self, live: Option<Arc<LiveContext>>) -> Result<()> {
        if let Some(c) = &live {
            if c.ordinal() != self.device.ordinal() {
                return Err(Error::Device {
                    op: "LiveStream::attach",
                    arg: "live",
                    expected: format!("npu:{}", self.device.ordinal()),
                    actual: format!("npu:{}", c.ordinal()),
                });
            }
        }
        *self.slot() = live;
        Ok(())
    }

    /// The attached live context.
    pub fn attached(&self) -> Option<Arc<LiveContext>> {
        self.slot().clone()
    }

    /// The guard an op `op` that depends on the forward context queues
    /// first, when a live context is attached: against `ctx` (the MoE
    /// context the call was made with) or, without one, the comm type alone.
    /// `actual`: the op writes what depends on `ctx`'s actual tokens (an MC2
    /// mask), so they are compared too. Only enqueues; nothing when no context
    /// is attached.
    pub fn guard(&self, op: &'static str, comm: CommType, ctx: Option<&MoeContext>, actual: bool) -> Result<()> {
        let Some(live) = self.attached() else { return Ok(()) };
        let tiling = match ctx {
            Some(c) => {
                let words = ContextWords::encode(comm as u32, c.sp(), c.pcp_size().max(1), None, c.dp_tokens())?;
                if actual {
                    GuardTiling::with_actual_tokens(&words, c.num_actual_tokens(), c.dp_tokens()[c.dp_rank()])?
                } else {
                    GuardTiling::new(&words, false)
                }
            }
            None => GuardTiling::comm_type_only(comm as u32),
        };
        live.guard_with(op, &tiling, self.device.stream())
    }

    /// The stream's sync point: waits for its work and returns the first
    /// error the device recorded for it ([`NpuDevice::check`]), then what the
    /// guards of the attached live context found: those enqueued on this
    /// stream and the captured ones ([`LiveContext::check_stream`]).
    pub fn check(&self) -> Result<()> {
        self.device.check()?;
        match self.attached() {
            Some(live) => live.check_stream(self.device.stream()),
            None => Ok(()),
        }
    }
}
