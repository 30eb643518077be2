//! A collective's way from the call to the stream: the communicator, the
//! stream and the device buffers validated, the link setup of a first call
//! made on the host, then the job queued; and the device bytes the job
//! reads and writes.

use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::arena;
use crate::capture;
use crate::config;
use crate::context;
use crate::ffi::*;
use crate::lease::{self, Lease};
use crate::status::{fail, SimError, SimResult};
use crate::stream::Stream;

use super::comms::{comm, SimComm};
use super::elem::DType;
use super::plane::Group;

/// The `n` counts of a host array of uint64 (`what` names it in the error).
pub(super) fn counts(p: *const c_void, n: u32, what: &str) -> SimResult<Vec<usize>> {
    if p.is_null() {
        return fail(HCCL_E_PTR, format!("{what} is NULL"));
    }
    // SAFETY: host array of rankSize uint64 values (C contract); copied now,
    // as HCCL does, so the caller may reuse it after the call returns.
    let s = unsafe { std::slice::from_raw_parts(p as *const u64, n as usize) };
    Ok(s.iter().map(|&v| v as usize).collect())
}

/// A device buffer operand: address and element count.
#[derive(Debug, Clone, Copy)]
pub(super) struct Buf {
    pub(super) addr: usize,
    pub(super) elems: usize,
}

impl Buf {
    /// The `elems` elements of `dt` from element `at` of this buffer on.
    pub(super) fn part(self, dt: DType, at: usize, elems: usize) -> Buf {
        Buf { addr: self.addr + at * dt.size(), elems }
    }
}

/// Checks that `b` lies in one live allocation of the communicator's device;
/// returns the lease its task checks again when it runs (None when empty).
fn check_buf(c: &SimComm, b: Buf, dt: DType, what: &str) -> SimResult<Option<Lease>> {
    if b.elems == 0 {
        return Ok(None);
    }
    let s = arena::resolve(b.addr, b.elems * dt.size(), what).map_err(|e| SimError::new(HCCL_E_PTR, e.msg))?;
    if s.device != c.device {
        return fail(HCCL_E_PARA, format!("{what} is on device {}, the communicator on device {}", s.device, c.device));
    }
    Ok(Some(Lease::device(&s, what)))
}

/// The host address of the bytes of `b` (in a live allocation), or None
/// when `b` is empty.
fn host(b: Buf, dt: DType) -> SimResult<Option<*mut u8>> {
    let bytes = b.elems * dt.size();
    if bytes == 0 {
        return Ok(None);
    }
    let s = arena::resolve(b.addr, bytes, "buffer").map_err(|e| SimError::new(HCCL_E_PTR, e.msg))?;
    Ok(Some(s.host))
}

/// Runs `f` on the bytes of `b` in device memory.
pub(super) fn with_bytes<T>(b: Buf, dt: DType, f: impl FnOnce(&[u8]) -> SimResult<T>) -> SimResult<T> {
    match host(b, dt)? {
        None => f(&[]),
        // SAFETY: `p` starts `b.elems * dt.size()` bytes inside a live
        // allocation; the collective is the stream's only task while it runs.
        Some(p) => f(unsafe { std::slice::from_raw_parts(p, b.elems * dt.size()) }),
    }
}

/// Runs `f` on the bytes of `b` in device memory, to overwrite them.
pub(super) fn with_bytes_mut<T>(b: Buf, dt: DType, f: impl FnOnce(&mut [u8]) -> SimResult<T>) -> SimResult<T> {
    match host(b, dt)? {
        None => f(&mut []),
        // SAFETY: as in `with_bytes`; no other slice of these bytes is alive
        // (the payload was written before the result is).
        Some(p) => f(unsafe { std::slice::from_raw_parts_mut(p, b.elems * dt.size()) }),
    }
}

/// The link setup of a call: the communicator, and what lets the stream's
/// queued work run before it waits.
pub(super) type LinkSetup = dyn Fn(&SimComm, &dyn Fn()) -> SimResult<()>;

/// A collective's work on the group; `Fn` so that a captured collective replays.
pub(super) type CollJob = Box<dyn Fn(&SimComm, &mut Group) -> SimResult<()> + Send + Sync>;

/// The tasks of a collective go on `s` through the runtime's task calls
/// (notify record and wait, asynchronous copies), which need the calling
/// thread's current context and refuse a stream outside it: runtime v8.5.0
/// `src/runtime/feature/src/api_impl/api_impl.cc` `ApiImpl::NotifyRecord`
/// (:4606-4616, CHECK_CONTEXT_VALID_WITH_RETURN then RT_ERROR_STREAM_CONTEXT)
/// and `ApiImpl::MemcpyAsync` (:2753-2762, the same two checks). HCCL's runtime
/// adapters return HCCL_E_RUNTIME for a failed runtime call.
fn tasks_can_go_on(s: &Stream) -> SimResult<()> {
    let runtime = |m: String| SimError::new(HCCL_E_RUNTIME, m);
    let cur = context::current().map_err(|e| runtime(format!("{}: a collective queues its tasks there", e.msg)))?;
    if s.device != cur {
        return Err(runtime(format!(
            "the stream belongs to device {} but the calling thread's current device is {cur} \
             (RT_ERROR_STREAM_CONTEXT on the collective's first task)",
            s.device
        )));
    }
    Ok(())
}

/// Validates the communicator and stream, runs `setup` (the link setup of a
/// first call) on the host, then queues `job` on the stream.
pub(super) fn enqueue(
    call: &'static str,
    comm_h: HcclComm,
    stream_h: AclrtStream,
    bufs: &[(Buf, DType, &str)],
    setup: &LinkSetup,
    job: CollJob,
) -> SimResult<()> {
    let c = comm(comm_h)?;
    let e = c.failed.load(Ordering::SeqCst);
    if e != HCCL_SUCCESS {
        return fail(e, format!("communicator {} failed in an earlier collective (HCCL error {e})", c.name));
    }
    let s: Arc<Stream> = capture::stream(stream_h as usize).map_err(|e| SimError::new(HCCL_E_PARA, e.msg))?;
    if s.device != c.device {
        return fail(HCCL_E_PARA, format!("stream on device {} but communicator on device {}", s.device, c.device));
    }
    let mut leases = Vec::with_capacity(bufs.len());
    for (b, dt, what) in bufs {
        leases.extend(check_buf(&c, *b, *dt, what)?);
    }
    tasks_can_go_on(&s)?;
    setup(&c, &|| s.release(s.last()))?;
    s.enqueue(
        call,
        Box::new(move || {
            let cfg = config::get();
            if cfg.die_rank == Some(c.world_rank) {
                eprintln!("cann-sim: CANNSIM_DIE_RANK: world rank {} exits during {call}", c.world_rank);
                // SAFETY: fflush(NULL) flushes every C stdio stream; _exit ends the
                // process at once (the simulated crash).
                unsafe {
                    libc::fflush(std::ptr::null_mut());
                    libc::_exit(cfg.die_exit_code)
                }
            }
            // A buffer freed while the collective was queued: this rank's
            // task faults before it sends or receives anything (see
            // [`crate::lease`]); its peers wait for it until
            // their execution timeout.
            lease::check_all(&leases)?;
            if c.destroyed.load(Ordering::SeqCst) {
                // Its resources are freed (see `HcclCommDestroy`): the task
                // faults before it moves anything; its peers wait for it.
                return Err(SimError::new(
                    ACL_ERROR_RT_INTERNAL_ERROR,
                    format!(
                        "{call} on {} runs after HcclCommDestroy freed the communicator's resources (a model that \
                         captured it outlived it: destroy the model first)",
                        c.name
                    ),
                ));
            }
            let prior = c.failed.load(Ordering::SeqCst);
            let r = if prior != HCCL_SUCCESS {
                fail(prior, format!("communicator {} already failed", c.name))
            } else if cfg.hccl_timeout_rank == Some(c.world_rank) {
                // A hung rank: it stays silent (and alive) past its peers'
                // timeout, so they see a timeout rather than a dead peer.
                match c.timeout {
                    Some(t) => std::thread::sleep(t * 2),
                    None => loop {
                        std::thread::park();
                    },
                }
                fail(
                    HCCL_E_TIMEOUT,
                    format!("CANNSIM_HCCL_TIMEOUT_RANK: world rank {} never joins {call} on {}", c.world_rank, c.name),
                )
            } else {
                let mut group = c.group.lock().unwrap_or_else(|e| e.into_inner());
                job(&c, &mut group)
            };
            r.map_err(|e| {
                let _ = c.failed.compare_exchange(HCCL_SUCCESS, e.code, Ordering::SeqCst, Ordering::SeqCst);
                if e.code == HCCL_E_REMOTE {
                    let _ = c.async_error.compare_exchange(HCCL_SUCCESS, e.code, Ordering::SeqCst, Ordering::SeqCst);
                }
                let acl = if matches!(e.code, HCCL_E_TIMEOUT | HCCL_E_REMOTE) {
                    ACL_ERROR_RT_STREAM_SYNC_TIMEOUT
                } else {
                    ACL_ERROR_RT_INTERNAL_ERROR
                };
                SimError::new(
                    acl,
                    format!(
                        "{call} on {} (rank {}/{}, execution timeout {}): HCCL error {}: {}",
                        c.name,
                        c.rank,
                        c.size,
                        c.timeout.map_or("none".to_string(), |t| format!("{t:?}")),
                        e.code,
                        e.msg
                    ),
                )
            })
        }),
    );
    Ok(())
}
