//! The leak report: what is still alive when the process exits.
//!
//! Armed once `aclInit` has succeeded ([`context::ever_initialized`]); runs
//! from the library's `.fini_array` entry (at `exit` or unload).
//! `CANNSIM_LEAK_REPORT=1` prints it to stderr, `=fail` also ends the
//! process with `CANNSIM_LEAK_EXIT_CODE` (97) when anything leaked.
//!
//! It reads the tables of live objects where they live (each a leaf of its
//! part of the simulator), not the modules that export the calls filling
//! them.

use crate::aclnn::EXECUTORS;
use crate::capture::MODELS;
use crate::config::{self, LeakMode};
use crate::hccl::comms::COMMS;
use crate::host_bufs::{host_bufs, HostBuf};
use crate::nnop::objects::{SCALARS, TENSORS};
use crate::{arena, context};

/// The report: one line per leaked object kind, plus notes. Empty `leaks`
/// means nothing leaked.
#[derive(Debug, Default)]
pub struct Report {
    /// Leaked objects, one line each.
    pub leaks: Vec<String>,
    /// Things worth knowing that are not leaks.
    pub notes: Vec<String>,
}

/// Collects the current report.
pub fn collect() -> Report {
    let mut r = Report::default();
    for (h, s) in context::STREAMS.all() {
        r.leaks.push(format!("stream {h:#x} (device {}, {} queued tasks not run)", s.device, s.pending()));
    }
    for (h, e) in context::EVENTS.all() {
        r.leaks.push(format!("event {h:#x} (device {})", e.device));
    }
    for a in arena::created() {
        for (addr, size) in a.live() {
            r.leaks.push(format!("device buffer {addr:#x} ({size} bytes, device {})", a.device));
        }
    }
    for (addr, HostBuf { size, .. }) in host_bufs().iter() {
        r.leaks.push(format!("host buffer {addr:#x} ({size} bytes, aclrtMallocHost)"));
    }
    for (h, t) in TENSORS.all() {
        r.leaks.push(format!("aclTensor {h:#x} (shape {:?}, data {:#x})", t.dims, t.data));
    }
    for (h, _) in SCALARS.all() {
        r.leaks.push(format!("aclScalar {h:#x}"));
    }
    for (h, _) in EXECUTORS.all() {
        r.leaks.push(format!("aclOpExecutor {h:#x} (GetWorkspaceSize without the launch)"));
    }
    for (h, m) in MODELS.all() {
        r.leaks.push(format!("aclmdlRI {h:#x} (device {}, {} recorded tasks)", m.device, m.tasks()));
    }
    for (h, c) in COMMS.all() {
        r.leaks.push(format!("HcclComm {h:#x} ({} rank {}/{})", c.name, c.rank, c.size));
    }
    for (d, n) in context::devices_still_set() {
        r.notes.push(format!("device {d} still set ({n} aclrtSetDevice without aclrtResetDevice)"));
    }
    r
}

/// Formats the report.
pub fn render(r: &Report) -> String {
    let mut s = format!("cann-sim leak report: {} leaked object(s)\n", r.leaks.len());
    for l in &r.leaks {
        s += &format!("  leaked: {l}\n");
    }
    for n in &r.notes {
        s += &format!("  note: {n}\n");
    }
    s
}

/// The `.fini_array` entry: a panic must not unwind out of it (that aborts
/// the exiting process), so the report runs inside a boundary.
extern "C" fn at_exit() {
    let _ = std::panic::catch_unwind(report_at_exit);
}

fn report_at_exit() {
    if !context::ever_initialized() {
        return;
    }
    let mode = config::get().leak_report;
    if mode == LeakMode::Off {
        return;
    }
    let r = collect();
    eprint!("{}", render(&r));
    if mode == LeakMode::Fail && !r.leaks.is_empty() {
        // SAFETY: flush C stdio, then end the process with the configured
        // status; nothing else runs after this point.
        unsafe {
            libc::fflush(std::ptr::null_mut());
            libc::_exit(config::get().leak_exit_code)
        }
    }
}

#[used]
#[link_section = ".fini_array"]
static FINI: extern "C" fn() = at_exit;
