//! ACL graph capture (`aclmdlRICaptureBegin`, `aclmdlRICaptureGetInfo`,
//! `aclmdlRICaptureEnd`, `aclmdlRIExecuteAsync`, `aclmdlRIDestroy`,
//! `aclmdlRICaptureThreadExchangeMode`, and `aclrtSynchronizeDevice`), and the
//! restrictions CANN places on other calls while a stream captures.
//!
//! Between `aclmdlRICaptureBegin` and `aclmdlRICaptureEnd` every task queued
//! on the stream is recorded into a model instead of run (the CANN runtime
//! guide, "Single-Stream Capture" / 基于捕获方式构建模型运行实例). A recorded
//! task is the stream job itself (re-runnable, see [`crate::stream::Job`]), so
//! `aclmdlRIExecuteAsync` runs the same work again on the same buffers, with
//! device and host memory read when the replay runs. An aclnn operator is
//! recorded as the task its second phase launched: its executor is consumed
//! by that launch, as in eager mode, and a replay does not need it (the guide's
//! capture sample launches `aclnnAdd` once inside the capture and executes
//! the model afterwards).
//!
//! A stream that waits (`aclrtStreamWaitEvent`) on an event recorded in a
//! capture joins that capture; its tasks go into the same model. The model
//! keeps every recorded task in the order the host queued them, which
//! respects every dependency between the streams, and a replay runs them in
//! that order on the replay stream.
//!
//! Refused during capture (codes from `rt_error_codes.h`):
//! - synchronising or querying a capturing stream, the device, or an event
//!   recorded in the capture, in every mode (guide, restriction 2);
//! - the unsafe functions (`aclrtMemcpy`, `aclrtMemset`, an
//!   `aclrtMemcpyAsync` with pageable host memory) where the captures' modes
//!   and the calling thread's own mode (`aclmdlRICaptureThreadExchangeMode`)
//!   forbid them, and by the simulator also the allocation calls;
//! - work on a device's default stream (guide, restriction 6).
//!
//! A refused call also invalidates the capture it conflicts with (the guide:
//! the check "reports an error and the capture fails"); `aclmdlRICaptureEnd`
//! then returns `ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED` and no model.

#![allow(non_snake_case, clippy::missing_safety_doc)]

mod api;
mod codes;
mod hooks;
mod state;

pub use api::{
    aclmdlRICaptureBegin, aclmdlRICaptureEnd, aclmdlRICaptureGetInfo, aclmdlRICaptureThreadExchangeMode,
    aclmdlRIDestroy, aclmdlRIExecuteAsync, aclrtSynchronizeDevice,
};
pub use codes::*;
pub use hooks::{
    admit, allocation, async_copy, blocking_copy, blocking_memset, capture_info, check_record, check_wait,
    count_blocking_copy, destroy_stream, elapsed_time, intercept, query_event, record_event, stream, stream_here,
    sync_event, sync_stream, unsafe_call, wait_event, RecordKind,
};
pub use state::{Model, MODELS};
