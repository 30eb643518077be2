//! The sync point a caller owns: the work a stream's check reports, and
//! the record slots of captured launches.

use std::time::Duration;

use super::stream::{lock, NpuStream, Pending};
use crate::backend::npu::result::acl as rt;
use crate::{Error, Result};

impl NpuStream {
    /// Records queued work whose outcome [`check`](Self::check) reports.
    /// Work with the key of an entry already pending reports through that one.
    pub(crate) fn record_pending(&self, p: Box<dyn Pending>) {
        let mut st = lock(self.state());
        if let Some(k) = p.key() {
            if st.pending.iter().any(|q| q.key() == Some(k)) {
                return;
            }
        }
        st.pending.push(p);
    }

    /// The sync point the caller owns: waits for every queued work of this
    /// stream (bounded by the longest communicator timeout of the
    /// collectives queued since the last check, else `default_timeout`), then
    /// returns the first error recorded for it since the last check, in
    /// queue order: a collective's HCCL async error (naming the collective,
    /// group and rank), a kernel's status (a bad index with its position and
    /// value), or the failed wait itself. Each error is reported once.
    /// Refused while the stream is captured into a graph.
    pub fn check_with_timeout(&self, default_timeout: Duration) -> Result<()> {
        // A synchronisation would invalidate the capture (CANN's runtime
        // guide, capture restriction 2): refused before anything is taken.
        self.refuse_under_capture("check", "check after the capture ends (e.g. after a replay)")?;
        let pending = std::mem::take(&mut lock(self.state()).pending);
        let timeout = pending.iter().filter_map(|p| p.timeout()).max().unwrap_or(default_timeout);
        let wait = self.synchronize_timeout(timeout).err();
        let mut first = Ok(());
        for p in &pending {
            // Every entry is looked at (and releases what it holds); the
            // first error in queue order is the one returned.
            let r = p.outcome(wait.as_ref(), self);
            if first.is_ok() {
                first = r;
            }
        }
        // Then what graphs captured on this stream left since the last check.
        let captured = std::mem::take(&mut lock(self.state()).captured);
        for p in &captured {
            let r = p.outcome(wait.as_ref(), self);
            if first.is_ok() {
                first = r;
            }
        }
        lock(self.state()).captured.splice(0..0, captured);
        first?;
        match wait {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Keeps `p` for every check from now on: the check of work captured
    /// into a graph, whose replays rewrite what it reads.
    pub(crate) fn record_captured(&self, p: Box<dyn Pending>) {
        lock(self.state()).captured.push(p);
    }

    /// True once the record slots of captured launches are reserved.
    pub(crate) fn has_capture_records(&self) -> bool {
        lock(self.state()).records.is_some()
    }

    /// Takes `slots` record slots of `slot_bytes` at device address `base`
    /// (a detached pool block whose zeroing is queued on this stream) for
    /// the kernel launches captured later.
    pub(crate) fn set_capture_records(&self, base: usize, slot_bytes: usize, slots: usize) {
        lock(self.state()).records = Some((base, slot_bytes, slots, 0));
    }

    /// A zeroed record slot of at least `bytes` for a launch being captured,
    /// kept for the stream's life. An error says how to reserve them when
    /// none are left (or none were reserved: no launch ran before capture).
    pub(crate) fn take_capture_record(&self, bytes: usize) -> Result<usize> {
        let mut st = lock(self.state());
        match st.records.as_mut() {
            Some((base, slot, slots, used)) if *used < *slots && bytes <= *slot => {
                let p = *base + *used * *slot;
                *used += 1;
                Ok(p)
            }
            other => Err(Error::invalid(
                "capture records",
                "stream",
                match other {
                    None => {
                        "no status records were reserved on this stream: run the op once before capturing it".into()
                    }
                    Some((_, slot, slots, _)) if bytes > *slot => {
                        format!("a launch needs {bytes} bytes of status, a captured record holds {slot}")
                    }
                    Some((_, _, slots, _)) => {
                        format!("all {slots} status records for captured launches are taken by earlier captures on this stream")
                    }
                },
            )),
        }
    }

    /// Writes `len` zero bytes at device address `ptr` (a captured launch's
    /// record, once read) after the stream drained: the check's own write.
    pub(crate) fn zero_drained(&self, ptr: usize, len: usize) -> Result<()> {
        self.enter()?;
        // SAFETY: `ptr` is `len` bytes of this device's memory that no queued
        // work writes (the stream drained).
        unsafe { rt::memset(ptr as *mut std::ffi::c_void, len, 0, len) }
    }

    /// [`check_with_timeout`](Self::check_with_timeout) with the timeout of
    /// `ASCEND_MOE_COMM_TIMEOUT` (or 60 s) when no collective is pending.
    pub fn check(&self) -> Result<()> {
        self.check_with_timeout(crate::CommOptions::from_env().timeout)
    }
}
