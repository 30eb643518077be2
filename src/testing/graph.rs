//! An ACL graph through the loaded runtime's own capture calls
//! (`aclmdlRICaptureBegin` / `End` / `ExecuteAsync` / `Destroy`), for the
//! NPU tests (the crate's and the integration tests) that capture ops and
//! replay them.

use std::ptr::null_mut;

/// A captured model, destroyed on drop.
pub struct Graph(acl_sys::aclmdlRI);

impl Graph {
    /// Captures what `body` enqueues on `raw` in `mode`. THREAD_LOCAL suits
    /// ranks that are threads of one process (the others keep allocating).
    pub fn capture_in(raw: acl_sys::aclrtStream, mode: acl_sys::aclmdlRICaptureMode, body: impl FnOnce()) -> Graph {
        let api = acl_sys::acl().expect("ACL loaded");
        let begin = api.lib.aclmdlRICaptureBegin.as_ref().expect("aclmdlRICaptureBegin");
        let end = api.lib.aclmdlRICaptureEnd.as_ref().expect("aclmdlRICaptureEnd");
        // SAFETY: a live stream of the bound device.
        let st = unsafe { begin(raw, mode) };
        assert_eq!(st, 0, "aclmdlRICaptureBegin");
        body();
        let mut model: acl_sys::aclmdlRI = null_mut();
        // SAFETY: the capturing stream and a writable out-pointer.
        let st = unsafe { end(raw, &mut model) };
        assert_eq!(st, 0, "aclmdlRICaptureEnd: {}", crate::backend::npu::recent_error_message());
        Graph(model)
    }

    /// [`capture_in`](Self::capture_in) THREAD_LOCAL.
    pub fn capture(raw: acl_sys::aclrtStream, body: impl FnOnce()) -> Graph {
        Self::capture_in(raw, acl_sys::aclmdlRICaptureMode::ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL, body)
    }

    /// Queues one replay on `raw`.
    pub fn replay(&self, raw: acl_sys::aclrtStream) {
        let api = acl_sys::acl().expect("ACL loaded");
        let exec = api.lib.aclmdlRIExecuteAsync.as_ref().expect("aclmdlRIExecuteAsync");
        // SAFETY: a live model and stream.
        assert_eq!(unsafe { exec(self.0, raw) }, 0, "aclmdlRIExecuteAsync");
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let api = acl_sys::acl().expect("ACL loaded");
        let destroy = api.lib.aclmdlRIDestroy.as_ref().expect("aclmdlRIDestroy");
        // SAFETY: a live model, destroyed once, its replays run.
        assert_eq!(unsafe { destroy(self.0) }, 0, "aclmdlRIDestroy");
    }
}
