//! The shared-memory segment: file in `/dev/shm`, layout, rendezvous, teardown.
//!
//! Layout (all offsets from the start of the mapping, every block 4 KiB aligned):
//!
//! | offset | size | what |
//! |---|---|---|
//! | 0 | 4 KiB | [`Header`]: magic, version, world size, staging size, futex word |
//! | 4 KiB | `world` x 4 KiB | one [`Ctrl`] block per rank: state, pid, phase counter, descriptors, error text |
//! | 4 KiB + world x 4 KiB | `world` x [`SLOTS`] x `staging` | per-rank staging slots, used in rotation |
//!
//! A rank writes only its own control block and its own staging; it reads every
//! rank's. Publication is by the per-rank phase counter (release store, acquire
//! load), so everything written before a rank arrives at a phase is visible to a
//! rank that saw the arrival.

use std::ffi::CString;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::CommErrorKind;
use crate::{Error, Result};

/// `"AMOECOMM"` in little-endian.
pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"AMOECOMM");
/// Layout version; a segment of another version is treated as foreign and stale.
pub(crate) const VERSION: u32 = 3;
/// Largest group the CPU communicator supports (descriptors hold per-rank counts).
pub const MAX_WORLD: usize = 64;
/// Staging slots per rank, used in rotation (round `k` uses slot `k % SLOTS`).
pub(crate) const SLOTS: usize = 3;
/// Size of the header and of each control block.
pub(crate) const BLOCK: usize = 4096;
/// Words in one collective descriptor.
pub(crate) const DESC_WORDS: usize = 8 + 2 * MAX_WORLD;
/// Words of a posted split request: generation, length, one byte per rank.
pub(crate) const SPLIT_WORDS: usize = 2 + MAX_WORLD.div_ceil(8);
/// Bytes of error text a rank can publish with an invalid descriptor.
pub(crate) const ERR_BYTES: usize = 768;

/// Rank slot states.
pub(crate) const EMPTY: u32 = 0;
pub(crate) const JOINED: u32 = 1;
pub(crate) const LEFT: u32 = 2;
pub(crate) const ABORTED: u32 = 3;
/// Broken by a timeout or a failed peer (not a root cause itself).
pub(crate) const FAILED: u32 = 4;

/// The segment header (first 4 KiB).
#[repr(C)]
pub(crate) struct Header {
    pub magic: AtomicU64,
    pub version: AtomicU32,
    pub world: AtomicU32,
    pub staging: AtomicU64,
    /// Futex word bumped on every arrival and state change.
    pub bell: AtomicU32,
    /// Number of ranks sleeping on `bell`.
    pub sleepers: AtomicU32,
}

/// One rank's control block (4 KiB).
#[repr(C)]
pub(crate) struct Ctrl {
    pub state: AtomicU32,
    pub pid: AtomicU32,
    /// Start time of process `pid` (clock ticks since boot; 0 if unknown), so a
    /// recycled pid is not mistaken for the rank.
    pub start: AtomicU64,
    _pad0: [u64; 6],
    /// Last phase this rank arrived at (own cache line).
    pub arrive: AtomicU64,
    _pad1: [u64; 7],
    /// Two descriptor slots, used by sequence-number parity.
    pub desc: [[u64; DESC_WORDS]; 2],
    /// NUL-padded UTF-8 error text published with an invalid descriptor (same slot).
    pub err: [[u8; ERR_BYTES]; 2],
    /// The rank list of this rank's pending (or last failed) `split`, so that
    /// members who passed other lists can name it: generation (odd while being
    /// written), length (0: none), then the ranks, one byte each.
    pub split: [AtomicU64; SPLIT_WORDS],
}

const _: () = assert!(std::mem::size_of::<Header>() <= BLOCK);
const _: () = assert!(std::mem::size_of::<Ctrl>() <= BLOCK);
const _: () = assert!(MAX_WORLD <= 256, "split requests store one byte per rank");

/// Total segment size for `world` ranks with `staging` bytes per slot.
pub(crate) fn segment_len(world: usize, staging: usize) -> usize {
    BLOCK + world * BLOCK + world * SLOTS * staging
}

/// The file backing group `name`: `<shm dir>/ascend-moe.<readable prefix>.<hash>`.
pub fn segment_path(name: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    let readable: String =
        name.chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_').take(40).collect();
    format!("{}/ascend-moe.{readable}.{h:016x}", shm_dir())
}

/// The directory segments live in (`/dev/shm`, or the temp dir where it is missing).
pub fn shm_dir() -> String {
    if std::path::Path::new("/dev/shm").is_dir() {
        "/dev/shm".into()
    } else {
        std::env::temp_dir().display().to_string()
    }
}

/// A mapped segment; unmapped (and unlinked by the last rank out) on drop.
pub(crate) struct Segment {
    base: *mut u8,
    len: usize,
    fd: libc::c_int,
    path: String,
    ino: (u64, u64),
    pub world: usize,
    pub staging: usize,
    rank: usize,
}

// SAFETY: the mapping is plain shared memory; all cross-rank accesses go through
// atomics or are ordered by the phase protocol, so the handle may move between
// and be shared by threads.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

fn os_err(what: String) -> Error {
    Error::io(what, std::io::Error::last_os_error())
}

fn setup_err(name: &str, rank: usize, world: usize, detail: String, kind: CommErrorKind) -> Error {
    Error::Comm { collective: "rendezvous".into(), group: name.into(), rank, world, detail, kind }
}

/// Whether process `pid`, started at `start` (0: unknown), is alive. A zombie
/// counts as dead, and so does a recycled pid (another start time).
pub(crate) fn pid_alive(pid: u32, start: u64) -> bool {
    if pid == 0 {
        return false;
    }
    // SAFETY: kill with signal 0 only checks for existence and permission.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    if r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return false;
    }
    // Exists (or exists under another user); look closer where /proc allows.
    match proc_stat(pid) {
        Some((state, started)) => !(state == 'Z' || state == 'X' || (start != 0 && started != start)),
        None => true,
    }
}

/// (state, start time) of a process from `/proc/<pid>/stat`.
fn proc_stat(pid: u32) -> Option<(char, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may contain spaces): state is field
    // 3 of the file, starttime field 22.
    let rest: Vec<&str> = s[s.rfind(')')? + 1..].split_whitespace().collect();
    Some((rest.first()?.chars().next()?, rest.get(19)?.parse().ok()?))
}

/// Start time of this process (0 if unknown).
pub(crate) fn my_start() -> u64 {
    static START: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *START.get_or_init(|| proc_stat(my_pid()).map_or(0, |s| s.1))
}

/// This process's id.
pub(crate) fn my_pid() -> u32 {
    std::process::id()
}

fn stat_path(path: &CString) -> Option<(u64, u64)> {
    // SAFETY: zeroed stat is a valid out-parameter; path is NUL-terminated.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let r = unsafe { libc::stat(path.as_ptr(), &mut st) };
    (r == 0).then_some((st.st_dev as u64, st.st_ino as u64))
}

fn fstat_fd(fd: libc::c_int) -> Option<((u64, u64), u64)> {
    // SAFETY: zeroed stat is a valid out-parameter; fd is open.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let r = unsafe { libc::fstat(fd, &mut st) };
    (r == 0).then_some(((st.st_dev as u64, st.st_ino as u64), st.st_size as u64))
}

/// What the rendezvous found under a name.
enum Found {
    /// Fresh or stale: (re)initialise it.
    Init,
    /// A forming or running world we may join.
    Join,
    /// Replace: unlink and start over.
    Stale,
    /// A previous world with our rank slot is still shutting down: retry later.
    Busy(String),
}

impl Segment {
    /// Creates or joins the segment of group `name` as `rank` of `world`.
    pub(crate) fn join(name: &str, world: usize, rank: usize, staging: usize, timeout: Duration) -> Result<Segment> {
        let path = segment_path(name);
        let cpath =
            CString::new(path.clone()).map_err(|_| Error::invalid("CpuComm::rendezvous", "name", "NUL byte"))?;
        let deadline = Instant::now() + timeout;
        let mut backoff = Backoff::default();
        loop {
            // SAFETY: cpath is NUL-terminated; flags and mode are plain integers.
            let fd = unsafe { libc::open(cpath.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC, 0o600) };
            if fd < 0 {
                return Err(os_err(format!("opening shared-memory segment {path}")));
            }
            let close = |fd| {
                // SAFETY: fd is an open descriptor owned here.
                unsafe { libc::close(fd) };
            };
            // Lock the file for the whole setup (released on close, also on crash).
            loop {
                // SAFETY: fd is open.
                if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                    break;
                }
                if Instant::now() >= deadline {
                    close(fd);
                    return Err(setup_err(
                        name,
                        rank,
                        world,
                        format!("timed out after {timeout:?} waiting for the setup lock on {path}"),
                        CommErrorKind::Timeout,
                    ));
                }
                backoff.snooze();
            }
            let Some((ino, size)) = fstat_fd(fd) else {
                close(fd);
                return Err(os_err(format!("fstat of {path}")));
            };
            if stat_path(&cpath) != Some(ino) {
                // Unlinked or replaced between open and lock: start over.
                close(fd);
                continue;
            }
            let found = if size == 0 {
                Found::Init
            } else {
                match Self::inspect(fd, size as usize, name, world, rank, staging) {
                    Ok(f) => f,
                    Err(e) => {
                        close(fd);
                        return Err(e);
                    }
                }
            };
            match found {
                Found::Stale => {
                    // SAFETY: cpath is NUL-terminated; we hold the lock on this inode.
                    unsafe { libc::unlink(cpath.as_ptr()) };
                    close(fd);
                    continue;
                }
                Found::Busy(why) => {
                    close(fd);
                    if Instant::now() >= deadline {
                        return Err(setup_err(name, rank, world, why, CommErrorKind::Timeout));
                    }
                    backoff.snooze();
                    continue;
                }
                Found::Init => {
                    let len = segment_len(world, staging);
                    // SAFETY: fd is open for writing.
                    if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
                        let e = os_err(format!("sizing {path} to {len} bytes"));
                        close(fd);
                        return Err(e);
                    }
                    let seg = Segment::map(fd, len, path.clone(), ino, world, staging, rank)?;
                    let h = seg.header();
                    h.version.store(VERSION, Ordering::Relaxed);
                    h.world.store(world as u32, Ordering::Relaxed);
                    h.staging.store(staging as u64, Ordering::Relaxed);
                    h.magic.store(MAGIC, Ordering::Release);
                    seg.claim();
                    seg.unlock();
                    return Ok(seg);
                }
                Found::Join => {
                    let len = segment_len(world, staging);
                    let seg = Segment::map(fd, len, path.clone(), ino, world, staging, rank)?;
                    seg.claim();
                    seg.unlock();
                    return Ok(seg);
                }
            }
        }
    }

    /// Reads the header and slots of an existing segment (lock held).
    fn inspect(fd: libc::c_int, size: usize, name: &str, world: usize, rank: usize, staging: usize) -> Result<Found> {
        if size < BLOCK {
            return Ok(Found::Stale);
        }
        let hdr = Mapping::new(fd, BLOCK).ok_or_else(|| os_err("mapping segment header".into()))?;
        // SAFETY: the mapping is BLOCK bytes, Header fits (asserted) and is made of atomics.
        let h = unsafe { &*(hdr.ptr as *const Header) };
        let (magic, version) = (h.magic.load(Ordering::Acquire), h.version.load(Ordering::Relaxed));
        let (w, s) = (h.world.load(Ordering::Relaxed) as usize, h.staging.load(Ordering::Relaxed) as usize);
        drop(hdr);
        if magic != MAGIC || version != VERSION || w == 0 || w > MAX_WORLD || size < segment_len(w, s) {
            // Initialised segments are complete before the lock is released, so
            // this is a torn or foreign file.
            return Ok(Found::Stale);
        }
        let ctrl = Mapping::new(fd, BLOCK + w * BLOCK).ok_or_else(|| os_err("mapping segment control".into()))?;
        let slots: Vec<(u32, u32, u64)> = (0..w)
            .map(|r| {
                // SAFETY: the mapping covers the header and w control blocks.
                let c = unsafe { &*(ctrl.ptr.add(BLOCK + r * BLOCK) as *const Ctrl) };
                (c.state.load(Ordering::Acquire), c.pid.load(Ordering::Acquire), c.start.load(Ordering::Acquire))
            })
            .collect();
        drop(ctrl);
        let live: Vec<usize> = (0..w).filter(|&r| slots[r].0 == JOINED && pid_alive(slots[r].1, slots[r].2)).collect();
        if live.is_empty() {
            return Ok(Found::Stale);
        }
        let pids: Vec<String> = live.iter().map(|&r| format!("rank {r} pid {}", slots[r].1)).collect();
        if w != world {
            return Err(setup_err(
                name,
                rank,
                world,
                format!(
                    "the name is used by a live world of size {w} (this rank asked for size {world}; live: {})",
                    pids.join(", ")
                ),
                CommErrorKind::Setup,
            ));
        }
        if s != staging {
            return Err(setup_err(
                name,
                rank,
                world,
                format!(
                    "the live world under this name uses {s} staging bytes per slot, this rank asked for {staging}"
                ),
                CommErrorKind::Setup,
            ));
        }
        let (st, pid, start) = slots[rank];
        if st == JOINED && pid_alive(pid, start) {
            return Err(setup_err(
                name,
                rank,
                world,
                format!("rank {rank} is already joined (pid {pid}): duplicate rank"),
                CommErrorKind::Setup,
            ));
        }
        if st != EMPTY {
            return Ok(Found::Busy(format!(
                "a previous world under this name still runs ({}) and rank {rank}'s slot is not free",
                pids.join(", ")
            )));
        }
        Ok(Found::Join)
    }

    fn map(
        fd: libc::c_int,
        len: usize,
        path: String,
        ino: (u64, u64),
        world: usize,
        staging: usize,
        rank: usize,
    ) -> Result<Segment> {
        // SAFETY: fd is open read-write and the file is at least len bytes.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        if p == libc::MAP_FAILED {
            let e = os_err(format!("mapping {len} bytes of {path}"));
            // SAFETY: fd is open and owned here.
            unsafe { libc::close(fd) };
            return Err(e);
        }
        Ok(Segment { base: p as *mut u8, len, fd, path, ino, world, staging, rank })
    }

    /// Takes this rank's slot (lock held).
    fn claim(&self) {
        let c = self.ctrl(self.rank);
        c.arrive.store(0, Ordering::Relaxed);
        c.pid.store(my_pid(), Ordering::Relaxed);
        c.start.store(my_start(), Ordering::Relaxed);
        c.state.store(JOINED, Ordering::Release);
        self.ring();
    }

    fn unlock(&self) {
        // SAFETY: fd is open.
        unsafe { libc::flock(self.fd, libc::LOCK_UN) };
    }

    /// The header.
    pub(crate) fn header(&self) -> &Header {
        // SAFETY: the mapping starts with a Header made of atomics.
        unsafe { &*(self.base as *const Header) }
    }

    /// Control block of `rank`.
    pub(crate) fn ctrl(&self, rank: usize) -> &Ctrl {
        debug_assert!(rank < self.world);
        // SAFETY: rank < world, so the block lies inside the mapping; Ctrl is
        // atomics plus plain words ordered by the phase protocol.
        unsafe { &*(self.base.add(BLOCK + rank * BLOCK) as *const Ctrl) }
    }

    /// Raw pointer to this rank's control block (for writing descriptors).
    pub(crate) fn ctrl_ptr(&self, rank: usize) -> *mut Ctrl {
        // SAFETY: as in `ctrl`.
        unsafe { self.base.add(BLOCK + rank * BLOCK) as *mut Ctrl }
    }

    /// Start of `rank`'s staging slot `slot` (< SLOTS), `staging` bytes long.
    pub(crate) fn staging_ptr(&self, rank: usize, slot: usize) -> *mut u8 {
        debug_assert!(rank < self.world && slot < SLOTS);
        let off = BLOCK + self.world * BLOCK + (rank * SLOTS + slot) * self.staging;
        debug_assert!(off + self.staging <= self.len);
        // SAFETY: off + staging <= len by the layout.
        unsafe { self.base.add(off) }
    }

    /// Wakes every sleeper.
    pub(crate) fn ring(&self) {
        let h = self.header();
        h.bell.fetch_add(1, Ordering::SeqCst);
        if h.sleepers.load(Ordering::SeqCst) > 0 {
            futex_wake(&h.bell);
        }
    }

    /// Marks this rank gone with `state` (LEFT, ABORTED or FAILED); the last
    /// rank out unlinks the file.
    pub(crate) fn leave(&self, state: u32) {
        self.ctrl(self.rank).state.store(state, Ordering::Release);
        self.ring();
        // Best effort: a failure here leaves a stale segment the next run replaces.
        // SAFETY: fd is open.
        if unsafe { libc::flock(self.fd, libc::LOCK_EX) } != 0 {
            return;
        }
        let anyone = (0..self.world).any(|r| {
            let c = self.ctrl(r);
            c.state.load(Ordering::Acquire) == JOINED
                && pid_alive(c.pid.load(Ordering::Acquire), c.start.load(Ordering::Acquire))
        });
        if !anyone {
            if let Ok(c) = CString::new(self.path.clone()) {
                if stat_path(&c) == Some(self.ino) {
                    // SAFETY: c is NUL-terminated; we hold the lock on this inode.
                    unsafe { libc::unlink(c.as_ptr()) };
                }
            }
        }
        self.unlock();
    }

    /// Path of the backing file.
    pub(crate) fn path(&self) -> &str {
        &self.path
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: base/len are the live mapping and fd is open; both are owned here.
        unsafe {
            libc::munmap(self.base as *mut libc::c_void, self.len);
            libc::close(self.fd);
        }
    }
}

/// A temporary read-write mapping of the start of a file.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Mapping {
    fn new(fd: libc::c_int, len: usize) -> Option<Mapping> {
        // SAFETY: fd is open; the caller checked the file holds len bytes.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        (p != libc::MAP_FAILED).then_some(Mapping { ptr: p as *mut u8, len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len are a live mapping owned here.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// Sleeps on `word` while it equals `expected`, at most `timeout`.
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as _ };
    // SAFETY: word is a valid aligned u32 in (possibly shared) memory; FUTEX_WAIT
    // with a relative timeout only reads it.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, expected, &ts as *const libc::timespec);
    }
}

/// Wakes every waiter on `word`.
pub(crate) fn futex_wake(word: &AtomicU32) {
    // SAFETY: word is a valid aligned u32; FUTEX_WAKE does not access memory.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

/// Spin, then yield, then short sleeps (only used while waiting on the setup lock).
#[derive(Default)]
struct Backoff {
    n: u32,
}

impl Backoff {
    fn snooze(&mut self) {
        self.n += 1;
        if self.n < 16 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(200 * u64::from(self.n.min(25))));
        }
    }
}

impl Ctrl {
    /// Posts `ranks` as this rank's split request (`None` withdraws it). Only
    /// the owning rank writes.
    pub fn post_split(&self, ranks: Option<&[usize]>) {
        let ranks = ranks.unwrap_or(&[]);
        let g = self.split[0].load(Ordering::Relaxed);
        self.split[0].store(g.wrapping_add(1) | 1, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Release);
        self.split[1].store(ranks.len() as u64, Ordering::Relaxed);
        for (i, w) in self.split[2..].iter().enumerate() {
            let word =
                (0..8).fold(0u64, |acc, b| acc | ranks.get(i * 8 + b).map_or(0, |&r| (r as u64 & 0xff) << (8 * b)));
            w.store(word, Ordering::Relaxed);
        }
        self.split[0].store((g | 1).wrapping_add(1), Ordering::Release);
    }

    /// The posted split request, if any (`None` also when it is being rewritten).
    pub fn posted_split(&self) -> Option<Vec<usize>> {
        let g = self.split[0].load(Ordering::Acquire);
        if g & 1 == 1 {
            return None;
        }
        let n = (self.split[1].load(Ordering::Relaxed) as usize).min(MAX_WORLD);
        let words: Vec<u64> = self.split[2..].iter().map(|w| w.load(Ordering::Relaxed)).collect();
        std::sync::atomic::fence(Ordering::Acquire);
        if self.split[0].load(Ordering::Relaxed) != g || n == 0 {
            return None;
        }
        Some((0..n).map(|i| ((words[i / 8] >> (8 * (i % 8))) & 0xff) as usize).collect())
    }
}
