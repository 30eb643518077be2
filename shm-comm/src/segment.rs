//! The shared-memory segment: layout, mapping, rank slots, teardown.
//!
//! Layout (all offsets from the start of the mapping, every block 4 KiB aligned):
//!
//! | offset | size | what |
//! |---|---|---|
//! | 0 | 4 KiB | [`Header`]: magic, version, world size, staging size, futex word, phase verdict, refused joiner, PID namespace |
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

use crate::file::ino_at;
use crate::presence::Presence;
use crate::process::{my_pid, my_start, pid_alive};
use crate::{Error, Result};

/// `"AMOECOMM"` in little-endian.
pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"AMOECOMM");
/// Layout and protocol version (how phases are numbered in
/// [`Header::verdict`] included); a rendezvous that finds a segment of
/// another version under its name fails naming both versions and leaves the
/// file alone (its ranks' liveness cannot be read in a layout not ours).
pub(crate) const VERSION: u32 = 9;
/// Largest group the transport supports (descriptors hold per-rank counts).
pub const MAX_WORLD: usize = 64;
/// Bytes per staging slot unless the caller chooses ([`crate::Config`]'s
/// default, which the C API and Python always use).
pub(crate) const DEFAULT_STAGING: usize = 4 << 20;
/// Staging slots per rank, used in rotation (round `k` uses slot `k % SLOTS`).
pub(crate) const SLOTS: usize = 3;
/// Size of the header and of each control block.
pub(crate) const BLOCK: usize = 4096;
/// Dimensions of a shape a descriptor holds as they are (a longer shape
/// keeps its first `SHAPE_DIMS - 1` and a hash of the rest).
pub(crate) const SHAPE_DIMS: usize = 8;
/// Words in one collective descriptor: the call, two per-rank count
/// vectors, then the shape the ranks also compare (a 16-byte label and
/// [`SHAPE_DIMS`] dimensions).
pub(crate) const DESC_WORDS: usize = 9 + 2 * MAX_WORLD + 2 + SHAPE_DIMS;
/// Words of a posted split request: generation, length, the parent's
/// sequence number, one byte per rank.
pub(crate) const SPLIT_WORDS: usize = 3 + MAX_WORLD.div_ceil(8);
/// Bytes of error text a rank can publish with an invalid descriptor.
pub(crate) const ERR_BYTES: usize = 752;

/// The phase of the rendezvous in [`Header::verdict`]: every rank has taken
/// its slot. The word starts at 0, which reads as "phase 0 passed", so the
/// first phase settled is 1; a collective's barriers are the phases after it.
pub(crate) const RENDEZVOUS: u64 = 1;

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
    /// How the phases went, agreed by compare-and-swap (same cache line as
    /// `bell`, which every arrival bumps anyway): the highest phase that
    /// every rank arrived at, or the phase a rank gave up on, with that
    /// rank, and `wait`'s failed bit (the phases before it passed, no later
    /// one passes). The first phase is the rendezvous ([`RENDEZVOUS`]: every
    /// slot taken), the collectives' barriers follow; 0, as the header
    /// starts, is nothing settled yet.
    pub verdict: AtomicU64,
    /// The first joiner refused while the world formed because it asked for
    /// another world size or staging size (0: none): `1 << 63 | rank << 32 |
    /// its world size`, written under the setup lock after `refused_staging`.
    /// The world can then never form: waiting ranks fail naming it, later
    /// joiners are refused too.
    pub refused: AtomicU64,
    /// The refused joiner's staging size.
    pub refused_staging: AtomicU64,
    /// The PID namespace the world was formed in (the inode of its
    /// creator's `/proc/self/ns/pid`; 0: unknown). Ranks judge each other's
    /// liveness by pid, which only means something inside one namespace.
    pub pid_ns: AtomicU64,
}

impl Header {
    /// Records that `rank` of a world of `world` ranks with `staging` bytes
    /// was refused (setup lock held; the first refusal stays), and wakes the
    /// waiting ranks.
    pub(crate) fn refuse(&self, rank: usize, world: usize, staging: usize) {
        if self.refused.load(Ordering::Acquire) == 0 {
            self.refused_staging.store(staging as u64, Ordering::Relaxed);
            self.refused.store(1 << 63 | (rank as u64) << 32 | world as u64, Ordering::Release);
        }
        self.bell.fetch_add(1, Ordering::SeqCst);
        futex_wake(&self.bell);
    }

    /// The refused joiner, if any: (rank, world size, staging size).
    pub(crate) fn refusal(&self) -> Option<(usize, usize, usize)> {
        let v = self.refused.load(Ordering::Acquire);
        (v != 0).then(|| {
            let s = self.refused_staging.load(Ordering::Relaxed) as usize;
            (((v >> 32) & 0x7fff_ffff) as usize, (v & 0xffff_ffff) as usize, s)
        })
    }
}

/// `fcntl(fd, cmd)` on the open file description lock of `rank`'s byte of
/// the segment file (the first byte of its control block), returning the
/// lock description the kernel gives back. A rank holds a read lock on its
/// byte for as long as its process has the file open: the kernel drops it
/// when the process ends, whatever PID namespace looks, which `pid_alive`
/// cannot tell across namespaces ([`slot_held`]).
fn slot_lock(fd: libc::c_int, rank: usize, cmd: libc::c_int, kind: libc::c_short) -> Option<libc::flock> {
    // SAFETY: flock is plain data; zeroed is a valid value (l_pid must be 0
    // for open file description locks).
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = (BLOCK + rank * BLOCK) as libc::off_t;
    fl.l_len = 1;
    // SAFETY: fd is open; fl is a valid flock the call reads and may write.
    (unsafe { libc::fcntl(fd, cmd, &mut fl) } == 0).then_some(fl)
}

/// Whether a process holds `rank`'s slot lock in the segment file `fd` (an
/// open file description of the caller, which holds no lock there); `None`
/// when the kernel cannot tell.
pub(crate) fn slot_held(fd: libc::c_int, rank: usize) -> Option<bool> {
    slot_lock(fd, rank, libc::F_OFD_GETLK, libc::F_WRLCK as libc::c_short)
        .map(|fl| fl.l_type != libc::F_UNLCK as libc::c_short)
}

/// Why a world whose joiner `(rank, world, staging)` was refused cannot
/// form, as told to a rank of the world of `w` ranks with `s` bytes.
pub(crate) fn describe_refusal(refused: (usize, usize, usize), w: usize, s: usize) -> String {
    let (rank, world, staging) = refused;
    let (what, theirs, ours) = if world != w {
        ("world size", format!("{world} ranks"), format!("{w} ranks"))
    } else {
        ("staging size", format!("{staging} staging bytes per slot"), format!("{s} staging bytes per slot"))
    };
    format!(
        "the ranks disagree on the {what}: rank {rank} asked to join with {theirs}, this world has {ours}, \
         so the world cannot form (rank {rank} was refused)"
    )
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
    /// written), length (0: none), the collectives this rank had started on
    /// the group when it split, then the ranks, one byte each.
    pub split: [AtomicU64; SPLIT_WORDS],
}

const _: () = assert!(std::mem::size_of::<Header>() <= BLOCK);
const _: () = assert!(std::mem::size_of::<Ctrl>() <= BLOCK);
const _: () = assert!(MAX_WORLD <= 256, "split requests store one byte per rank");

/// Total segment size for `world` ranks with `staging` bytes per slot, if it
/// can be mapped: at most `isize::MAX` bytes, which also keeps it a valid
/// file size (`off_t`) and every offset into the mapping a valid pointer
/// offset. `None` when it is larger, or does not even fit a `usize`.
pub(crate) fn checked_segment_len(world: usize, staging: usize) -> Option<usize> {
    let per_rank = SLOTS.checked_mul(staging)?.checked_add(BLOCK)?;
    let len = world.checked_mul(per_rank)?.checked_add(BLOCK)?;
    isize::try_from(len).ok().map(|_| len)
}

/// A mapped segment; unmapped (and unlinked by the last rank out) on drop.
pub(crate) struct Segment {
    base: *mut u8,
    len: usize,
    /// The file, open (tracked: see [`crate::process::tracked`]) by `owner`.
    fd: libc::c_int,
    /// The process that mapped it (a child forked later holds a copy of this
    /// value, its copy of `fd` closed by the fork).
    owner: u32,
    path: String,
    ino: (u64, u64),
    pub world: usize,
    pub staging: usize,
    rank: usize,
    /// This rank's presence name, held as long as the mapping.
    pub(crate) presence: Option<Presence>,
}

// SAFETY: the mapping is plain shared memory; all cross-rank accesses go through
// atomics or are ordered by the phase protocol, so the handle may move between
// and be shared by threads.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl Segment {
    /// Maps `len` bytes of the file `fd`, which the segment then owns; on
    /// failure the caller still does.
    pub(crate) fn map(
        fd: libc::c_int,
        len: usize,
        path: String,
        ino: (u64, u64),
        world: usize,
        staging: usize,
        rank: usize,
    ) -> Result<Segment> {
        // fd is open read-write and the file is at least len bytes.
        let p = crate::process::map_tracked(fd, len);
        if p == libc::MAP_FAILED {
            // The caller still owns fd: a creator removes its file first.
            return Err(Error::os(format!("mapping {len} bytes of {path}")));
        }
        let owner = std::process::id();
        Ok(Segment { base: p as *mut u8, len, fd, owner, path, ino, world, staging, rank, presence: None })
    }

    /// Takes this rank's slot (lock held).
    pub(crate) fn claim(&self) {
        let c = self.ctrl(self.rank);
        c.arrive.store(0, Ordering::Relaxed);
        c.pid.store(my_pid(), Ordering::Relaxed);
        c.start.store(my_start(), Ordering::Relaxed);
        // Best effort: without the lock (a kernel before 3.15) the rank is
        // only known alive to processes of its own PID namespace.
        let _ = slot_lock(self.fd, self.rank, libc::F_OFD_SETLK, libc::F_RDLCK as libc::c_short);
        c.state.store(JOINED, Ordering::Release);
        self.ring();
    }

    pub(crate) fn unlock(&self) {
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

    /// Sets this rank's state to `state` (FAILED or ABORTED) and wakes the
    /// peers. ABORTED, the root cause its peers report, is never replaced
    /// by FAILED.
    pub(crate) fn mark(&self, state: u32) {
        let c = &self.ctrl(self.rank).state;
        let _ = c.fetch_update(Ordering::Release, Ordering::Acquire, |now| {
            (now != ABORTED || state == ABORTED).then_some(state)
        });
        self.ring();
    }

    /// Marks this rank gone with `state` (LEFT, ABORTED or FAILED); the last
    /// rank out unlinks the file. Waits for the setup lock at most `bound`:
    /// its holder (a joiner, or a peer leaving) sees this rank's state once
    /// it looks, so giving up leaves the file to it, or to the next
    /// rendezvous under the name, which replaces a file whose ranks are gone.
    /// A holder that never lets go (a joiner stopped inside its setup) must
    /// not turn a rank's failure into a hang.
    pub(crate) fn leave(&self, state: u32, bound: Duration) {
        self.ctrl(self.rank).state.store(state, Ordering::Release);
        self.ring();
        let deadline = crate::clock::deadline(std::time::Instant::now(), bound);
        let mut backoff = crate::clock::Backoff::default();
        // SAFETY: fd is open.
        while unsafe { libc::flock(self.fd, libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            if std::time::Instant::now() >= deadline {
                return;
            }
            backoff.snooze();
        }
        let anyone = (0..self.world).any(|r| {
            let c = self.ctrl(r);
            c.state.load(Ordering::Acquire) == JOINED
                && pid_alive(c.pid.load(Ordering::Acquire), c.start.load(Ordering::Acquire))
        });
        if !anyone {
            if let Ok(c) = CString::new(self.path.clone()) {
                if ino_at(&c) == Some(self.ino) {
                    // SAFETY: c is NUL-terminated; we hold the lock on this inode.
                    unsafe { libc::unlink(c.as_ptr()) };
                }
            }
        }
        self.unlock();
    }

    /// This rank.
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// (device, inode) of the backing file.
    pub(crate) fn ino(&self) -> (u64, u64) {
        self.ino
    }

    /// Path of the backing file.
    pub(crate) fn path(&self) -> &str {
        &self.path
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // The mapping (or in a forked child the zero pages in its place).
        crate::process::unmap_tracked(self.base as *mut libc::c_void, self.len);
        crate::process::close_owned_fd(self.fd, self.owner);
    }
}

/// A temporary read-write mapping of the start of a file.
pub(crate) struct Mapping {
    pub(crate) ptr: *mut u8,
    len: usize,
}

impl Mapping {
    pub(crate) fn new(fd: libc::c_int, len: usize) -> Option<Mapping> {
        // fd is open; the caller checked the file holds len bytes. Tracked,
        // as a child forked meanwhile must not keep the file's setup lock.
        let p = crate::process::map_tracked(fd, len);
        (p != libc::MAP_FAILED).then_some(Mapping { ptr: p as *mut u8, len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        crate::process::unmap_tracked(self.ptr as *mut libc::c_void, self.len);
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

/// A rank's posted split request, as its peers read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Posted {
    /// The list (the first [`MAX_WORLD`] ranks; a rank from 255 up reads as 255).
    pub ranks: Vec<usize>,
    /// Its length as passed.
    pub len: usize,
    /// The number of the group's collectives before the split.
    pub seq: u64,
    /// The poster refused its own list as invalid and left the split.
    pub refused: bool,
    /// The poster failed this split and left it.
    pub left: bool,
    /// How many splits after `seq` collectives failed for the poster before
    /// this one.
    pub attempt: u64,
    /// Changes with every post of the rank (tells a new refusal from one seen).
    pub gen: u64,
}

impl Posted {
    /// The list as a message shows it. An empty one is never a valid list:
    /// it is what a member posts when it has none to pass (a caller that
    /// could not give one), so it reads as no list at all.
    pub fn describe(&self) -> String {
        if self.len == 0 {
            return "no rank list".into();
        }
        if self.len <= MAX_WORLD && self.ranks.iter().all(|&r| r < 0xff) {
            format!("{:?}", self.ranks)
        } else {
            format!("a list of {} ranks", self.len)
        }
    }
}

/// How long a read of a split post waits for one write of its owner to finish.
const REWRITE_WAIT: Duration = Duration::from_millis(200);

/// Set in the length word of a refused split request.
const SPLIT_REFUSED: u64 = 1 << 63;
/// Set in the length word of a split request its poster failed and left.
const SPLIT_LEFT: u64 = 1 << 62;
/// The length word holds the list's length in its low bits, and the attempt
/// number from this bit up to the flags.
const SPLIT_ATTEMPT_SHIFT: u32 = 40;
const SPLIT_LEN_MASK: u64 = (1 << SPLIT_ATTEMPT_SHIFT) - 1;
const SPLIT_ATTEMPT_MASK: u64 = (1 << (62 - SPLIT_ATTEMPT_SHIFT)) - 1;

impl Ctrl {
    /// Posts `ranks`, split after `seq` collectives of the group, as this
    /// rank's split request (`None` withdraws it); `attempt`: how many splits
    /// after `seq` collectives failed for this rank before;
    /// `refused`: the rank found the list invalid and is not joining. Only
    /// the owning rank writes.
    pub(crate) fn post_split(&self, req: Option<(&[usize], u64)>, attempt: u64, refused: bool) {
        self.post(req, attempt, if refused { SPLIT_REFUSED } else { 0 });
    }

    /// Posts `ranks`, split after `seq` collectives, as the request of
    /// `attempt` that this rank failed and left (its peers waiting for it,
    /// in that list or another, see it has).
    pub(crate) fn post_split_left(&self, ranks: &[usize], seq: u64, attempt: u64) {
        self.post(Some((ranks, seq)), attempt, SPLIT_LEFT);
    }

    fn post(&self, req: Option<(&[usize], u64)>, attempt: u64, flag: u64) {
        let (ranks, seq) = req.unwrap_or((&[], 0));
        let g = self.split[0].load(Ordering::Relaxed);
        self.split[0].store(g.wrapping_add(1) | 1, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Release);
        let len = (ranks.len() as u64).min(SPLIT_LEN_MASK);
        let attempt = attempt.min(SPLIT_ATTEMPT_MASK) << SPLIT_ATTEMPT_SHIFT;
        self.split[1].store(len | attempt | flag, Ordering::Relaxed);
        self.split[2].store(seq, Ordering::Relaxed);
        for (i, w) in self.split[3..].iter().enumerate() {
            let word =
                (0..8).fold(0u64, |acc, b| acc | ranks.get(i * 8 + b).map_or(0, |&r| (r.min(0xff) as u64) << (8 * b)));
            w.store(word, Ordering::Relaxed);
        }
        self.split[0].store((g | 1).wrapping_add(1), Ordering::Release);
    }

    /// The posted split request, if any. A post found in mid-write is read
    /// again once its owner wrote it (a few words, unless the owner was
    /// preempted there): taken for no post, it would hide a disagreement from
    /// a member that times out as its peer marks its own post failed. `None`
    /// also when one write stays unfinished for [`REWRITE_WAIT`] (its owner
    /// died there, or was stalled longer than that), never a torn post.
    pub(crate) fn posted_split(&self) -> Option<Posted> {
        // The write in progress (its generation word) and when it was first seen.
        let mut stalled: Option<(u64, Instant)> = None;
        let mut spins = 0u32;
        loop {
            match self.read_split() {
                SplitRead::Read(post) => return post,
                SplitRead::Torn(g) => match stalled {
                    Some((seen, since)) if seen == g => {
                        if since.elapsed() >= REWRITE_WAIT {
                            return None;
                        }
                    }
                    _ => stalled = Some((g, Instant::now())),
                },
            }
            spins = spins.saturating_add(1);
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// One read of the post.
    fn read_split(&self) -> SplitRead {
        let g = self.split[0].load(Ordering::Acquire);
        if g & 1 == 1 {
            return SplitRead::Torn(g);
        }
        let word = self.split[1].load(Ordering::Relaxed);
        let len = usize::try_from(word & SPLIT_LEN_MASK).unwrap_or(usize::MAX);
        let seq = self.split[2].load(Ordering::Relaxed);
        let mut words = [0u64; SPLIT_WORDS - 3];
        for (w, a) in words.iter_mut().zip(&self.split[3..]) {
            *w = a.load(Ordering::Relaxed);
        }
        std::sync::atomic::fence(Ordering::Acquire);
        let now = self.split[0].load(Ordering::Relaxed);
        if now != g {
            return SplitRead::Torn(now);
        }
        if len == 0 && word & SPLIT_REFUSED == 0 {
            return SplitRead::Read(None);
        }
        let ranks = (0..len.min(MAX_WORLD)).map(|i| ((words[i / 8] >> (8 * (i % 8))) & 0xff) as usize).collect();
        SplitRead::Read(Some(Posted {
            ranks,
            len,
            seq,
            refused: word & SPLIT_REFUSED != 0,
            left: word & SPLIT_LEFT != 0,
            attempt: (word >> SPLIT_ATTEMPT_SHIFT) & SPLIT_ATTEMPT_MASK,
            gen: g,
        }))
    }
}

/// One read of a split post.
enum SplitRead {
    /// Written meanwhile: the generation word found (odd while a write is
    /// under way).
    Torn(u64),
    /// The post, or none.
    Read(Option<Posted>),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctrl() -> Box<Ctrl> {
        // SAFETY: Ctrl is atomics and integer arrays, for which all zeros is
        // a value (no post, state 0).
        Box::new(unsafe { std::mem::zeroed() })
    }

    /// A peer reading a post while its owner rewrites it, again and again,
    /// always finds one of the posts written: never none, never a mix.
    #[test]
    fn a_post_read_while_it_is_rewritten_is_one_of_the_posts_written() {
        let c = ctrl();
        c.post_split(Some((&[0, 1], 1)), 0, false);
        let done = std::sync::atomic::AtomicBool::new(false);
        let (mut none, mut torn) = (0, 0);
        std::thread::scope(|s| {
            s.spawn(|| {
                while !done.load(Ordering::Relaxed) {
                    c.post_split(Some((&[1, 0, 2], 7)), 3, false);
                    c.post_split_left(&[0, 1], 1, 0);
                }
            });
            for _ in 0..200_000 {
                match c.posted_split() {
                    None => none += 1,
                    Some(p) => {
                        let a = p.ranks == [1, 0, 2] && p.seq == 7 && p.attempt == 3 && !p.left;
                        let b = p.ranks == [0, 1] && p.seq == 1 && p.attempt == 0;
                        torn += usize::from(!(a || b) || p.refused);
                    }
                }
            }
            done.store(true, Ordering::Relaxed);
        });
        assert_eq!((none, torn), (0, 0), "reads that found no post, torn reads");
    }

    /// A post whose owner stopped in mid-write (it died there) reads as none
    /// once the read waited for it, not before; a withdrawn post reads as none.
    #[test]
    fn a_post_abandoned_in_mid_write_reads_as_none_after_the_wait_and_a_withdrawn_one_as_none() {
        let c = ctrl();
        c.post_split(Some((&[0, 1], 1)), 0, false);
        assert!(c.posted_split().is_some());
        c.post_split(None, 0, false);
        assert_eq!(c.posted_split(), None);
        c.post_split(Some((&[0, 1], 1)), 0, false);
        let g = c.split[0].load(Ordering::Relaxed);
        c.split[0].store(g | 1, Ordering::Relaxed);
        let start = Instant::now();
        assert_eq!(c.posted_split(), None);
        assert!(start.elapsed() >= REWRITE_WAIT, "gave up on the write after {:?}", start.elapsed());
    }
}
