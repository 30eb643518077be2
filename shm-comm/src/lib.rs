//! Shared-memory collectives for ranks on one host (SPEC section 8).
//!
//! # What and why
//! [`ShmComm`] is one rank's handle on a group whose ranks are threads of one
//! process or separate processes on one host. It moves bytes: every call takes
//! byte slices, an element type ([`DataType`]) and element counts, and knows
//! nothing of tensors. Reductions (sum / max / min on f32, f16, bf16, i32, i64)
//! run in fixed rank order with f32 accumulation for floats, so every rank gets
//! bitwise-identical results, run after run; data movement (all-gather,
//! all-to-all, broadcast) is an exact byte copy for any element size. Every wait
//! has a timeout, and a call that ranks disagree on fails loudly on every rank:
//! never a hang, never silent garbage.
//!
//! # Transport
//! One file per group in `/dev/shm` (see [`shm_dir`]), mapped by every rank.
//! Ranks meet by (name, world size, rank): the first rank creates and sizes the
//! file under an `flock`, the others map it and take their slot; everybody then
//! waits (up to the timeout) until all slots are taken, and the rendezvous
//! ends the same way on every rank that took a slot, like a phase barrier
//! (see "Waiting and failure"). A file whose ranks are all dead or gone (a
//! crashed run) is replaced, and every rendezvous first removes this user's
//! files of such worlds under other names too (made by this version), so
//! that a world whose ranks were all killed while it formed does not hold
//! its memory until its name comes back; a live world of another size
//! under the same name is an error, and so is a file of another layout
//! version (made by another build, whose ranks' liveness cannot be read
//! here): the rendezvous fails at once naming both versions and the file,
//! and leaves it alone. A joiner that asks a forming world for
//! another world size or staging size is refused, and is recorded in the
//! header: the ranks waiting there fail at once with [`ErrorKind::Mismatch`]
//! naming it, as do later joiners, since that world can no longer form. The
//! rank whose claim completes the world
//! unlinks the file, so once every rank has attached nothing can leak: the
//! memory is freed when the last rank unmaps it, even if every rank is
//! SIGKILLed. A running world stays findable by name through its ranks'
//! presence names (abstract Unix sockets, released by the kernel with the
//! process; see [`live_members`]). Where this user is the overflow uid of a
//! user namespace, the names of every user the namespace does not map look
//! like this user's, so none are read: a running world is then not found
//! by name.
//!
//! A world is open to processes of the same effective user on one host and to
//! no one else. The file is opened without following links and used only when
//! it is a regular file of this user with mode 0600 and one link; anything else
//! under the name (another user's file, whatever its mode, or a hard link) is
//! refused on every rank with an error naming the path, its owner and mode, and
//! is neither joined nor removed. A symbolic link is never followed, and is
//! refused and left in place like another user's file, also one of this
//! user's own (removing it would race with a rank creating the world's file).
//! Presence names count only when the kernel says this user's socket holds
//! them. The directory, and every directory on the way to it from `/`
//! (symbolic links resolved one by one, each of which must be this user's or
//! root's), must belong to this user or root (in a user namespace: or to a
//! user it does not map, as the host's root is there) and be sticky when
//! others may write to it, as /dev/shm and /tmp are: in any other, another
//! user could rename or remove a forming world's file, or move the whole
//! directory aside and put their own in its place, so every rank is refused
//! there with an error naming the directory, its owner and mode. The ranks of
//! a world judge each other's liveness by pid, so they must share a PID
//! namespace: a joiner from another (two containers sharing /dev/shm but not
//! their processes) is refused with [`ErrorKind::Mismatch`] naming both
//! namespaces while a rank of that world runs, and never takes its live
//! ranks for dead. Across namespaces a rank's liveness is its slot lock (an
//! open file description lock on its byte of the file, which the kernel
//! drops with the process), so the file of a world whose ranks are all gone
//! is replaced (and swept) from any namespace. Layout:
//!
//! | block | size |
//! |---|---|
//! | header (magic, version, world, staging size, futex word, phase verdict, refused joiner, PID namespace) | 4 KiB |
//! | per rank: control block (state, pid, phase counter, 2 descriptors, error text) | 4 KiB |
//! | per rank: staging, three slots used in rotation | 3 x `staging_bytes` |
//!
//! **Shared memory per rank** = 4 KiB + 3 x [`Config::staging_bytes`]
//! (default 4 MiB per slot, so 12 MiB + 4 KiB per rank; a world of 8 maps 96 MiB
//! plus the header). Collectives of any size run in rounds of at most one slot, and
//! those that only move data stage at most 1 MiB per rank per round.
//! Sub-groups made by [`ShmComm::split`] have their own segment of the same shape.
//!
//! The rank that creates a segment backs all of it at once (`posix_fallocate`),
//! so the whole size is taken from the shared-memory directory while the world
//! forms, whatever the collectives later touch (about 3.5 ms for the 48 MiB of a
//! default world of 4, 7 ms for 96 MiB with 8, on tmpfs). A directory without
//! room for it (a container's /dev/shm is 64 MiB by default, and any local
//! process can fill it) fails the rendezvous on every rank with
//! [`ErrorKind::Setup`] naming the size, the directory and its free space,
//! where a sparse file would have killed the first collective to touch a page
//! the directory cannot back with SIGBUS. Lower [`Config::staging_bytes`] or
//! enlarge the directory (`docker run --shm-size`).
//!
//! # Protocol
//! Each collective starts with every rank posting a descriptor (sequence number,
//! kind, dtype, op, root, count(s), and an "invalid arguments" flag with the
//! local error text), staging its first round of data (if its own arguments are
//! valid) and arriving at a phase barrier. Every rank then checks all
//! descriptors the same way, before reading anyone's data, so a mismatch fails
//! every rank with [`ErrorKind::Mismatch`] naming the collective, the group,
//! the disagreeing ranks and their sizes (the group stays usable). Data moves
//! in rounds of at most one staging slot, one barrier per round:
//!
//! - all_reduce: round `k` stages chunk `k` of the input; barrier; every rank
//!   copies out the reduced chunk `k - 1`; rank `r` reduces piece `r` of chunk
//!   `k`, reading every other rank's staging and its own input, in rank order
//!   0..n-1 with f32 accumulation, and writes the result into its own staging.
//!   A last barrier precedes the copy-out of the last chunk. Each element is
//!   computed once, by one rank, so all ranks get identical bits, run after run.
//! - reduce_scatter(_v): a slot is split into one region per destination rank;
//!   each rank stages its pieces for every other destination; barrier; rank `r`
//!   reduces region `r` of every other staging and its own piece of its input
//!   straight into its output.
//! - all_gather(_v), broadcast, all_to_all_v: stage, barrier, copy out.
//!
//! Only data a peer reads is staged: a rank's own piece of an all_reduce chunk,
//! its own block of a reduce_scatter and its own block of an all_to_all_v are
//! read from its input directly.
//!
//! Staging is written with plain stores, in rounds of at most 1 MiB per rank
//! for the collectives that only move data, so a round's chunk is still cached
//! when the peers read it after the barrier. A collective of 4 MiB or more per
//! rank copies out into the caller's buffers with non-temporal stores, which
//! skip reading each destination line before writing it; smaller ones copy
//! out plainly (`copy`, where both choices' measurements are).
//!
//! The descriptor also carries the caller's optional context tag
//! ([`ShmComm::set_context_tag`]); ranks that disagree on it are reported by
//! tag first (`ranks [0, 1] chose 0, ranks [2, 3] chose 1`), as the context is
//! the cause of whatever else differs. A call made through
//! [`ShmComm::agreeing`] also carries a [`Shape`] (a label and up to 8
//! dimensions): ranks whose element counts agree but whose shapes differ
//! (`[4, 4]` against `[8, 2]`) fail like any other disagreement, naming each
//! rank's shape, at no extra cost.
//!
//! Round `k` uses staging slot `k % 3`, so a rank may write the next rounds
//! while slower ranks still read round `k`: every rank finishes reading round
//! `k` before it arrives at the barrier of round `k + 2`, and round `k + 3`
//! (the next user of the slot) is written only after that barrier.
//!
//! # Waiting and failure
//! Waits spin briefly, then sleep on a futex in the segment header (woken by every
//! arrival), re-checking at least every few milliseconds whether a peer aborted
//! (its thread panicked inside a collective, or while dropping its
//! handle, or it failed a wait), left,
//! or died (its pid no longer exists). Such a peer fails the wait at once with
//! [`ErrorKind::PeerFailed`]; otherwise the wait fails with
//! [`ErrorKind::Timeout`] at the deadline. After either, the handle is broken:
//! it marks its slot failed so its peers fail fast too, and every later call
//! returns the same error. A panic inside a collective marks the slot
//! aborted instead (a root cause, which dropping the handle later keeps).
//!
//! Every phase barrier ends the same way on every rank: a word in the header
//! holds the last phase every rank arrived at, or the phase a rank gave up on
//! (and which rank), set by compare-and-swap. A rank that sees everyone
//! arrive passes the phase only if no rank gave up on it first, and a rank
//! that gives up (timeout, failed peer) fails only if no rank passed it
//! first; so a rank that arrives late fails with [`ErrorKind::PeerFailed`]
//! naming the rank that gave up, never succeeds in a call its peer failed.
//! Each rank reads the word once per barrier, and the first to see every
//! rank arrive writes it.
//!
//! The rendezvous is the first phase settled in that word (a collective's
//! barriers follow it): a rank that sees every slot taken returns Ok only if
//! no rank gave up on the world first, and a rank that gives up (timeout, a
//! peer that died or left while the world formed, a refused joiner) fails
//! only if no rank saw the world complete first. So every rank that took a
//! slot gets Ok, or every one gets an error: the rank that gave up gets its
//! own cause ([`ErrorKind::Timeout`], [`ErrorKind::PeerFailed`] or
//! [`ErrorKind::Mismatch`]), the others [`ErrorKind::PeerFailed`] naming it
//! (or the same root cause, when they see it themselves), also those whose
//! own wait saw the last slot taken after it gave up, and those still
//! waiting, at once (the world can no longer form). A slot once taken counts
//! as joined, also when its rank already moved on and left, or gave up.
//!
//! # Processes
//! A handle belongs to the process that joined. A child forked later without
//! exec holds a copy of it: collectives and [`ShmComm::split`] called on the
//! copy are refused with [`ErrorKind::Setup`] naming both processes (before
//! anything is written to the group), and dropping the copy, as a child that
//! ends does, only unmaps it: the rank stays in the group. Nor does the child
//! keep anything of the rank: the fork closes its copies of the rank's file
//! and presence socket and puts zero pages in place of the rank's mapping, so
//! the rank's presence, locks and memory go with the rank's own handle also
//! while such children live (a worker pool forked after the rendezvous). A
//! forked child may join worlds of its own.
//!
//! # Caller validation
//! Every collective takes a `check: Result<(), E>`: the caller's own validation
//! of whatever it derived the byte slices from. When it is an error, the rank
//! still takes part in the collective, posting the error text, so every rank
//! fails (the others with a [`ErrorKind::Mismatch`] quoting it) and this rank
//! returns its own error. `E` is the caller's error type (this crate's
//! [`Error`] works).

mod api;
mod clock;
mod collectives;
mod copy;
mod counts;
mod descriptor;
mod dtype;
mod error;
mod file;
mod presence;
mod process;
mod reduce;
mod rendezvous;
mod segment;
mod split;
mod wait;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub use counts::{counts_len, counts_sum};
pub use dtype::{DataType, ReduceOp};
pub use error::{Error, ErrorKind, Result};
pub use presence::{live_members, Member};
pub use reduce::{bf16_to_f32_slice, f32_to_bf16_slice};
pub use rendezvous::{joined_ranks, segment_path, shm_dir};
pub use segment::MAX_WORLD;

use descriptor::PostedShape;
use segment::{Segment, ABORTED, EMPTY, FAILED, LEFT, RENDEZVOUS};

/// Why a world of `world_size` ranks cannot form (0, or over [`MAX_WORLD`]),
/// for callers that start the ranks and should refuse before they do.
pub fn check_world_size(world_size: usize) -> std::result::Result<(), String> {
    if world_size == 0 {
        return Err("world size 0: a group needs at least one rank".into());
    }
    if world_size > MAX_WORLD {
        return Err(format!("world size {world_size} exceeds the CPU communicator's limit of {MAX_WORLD} ranks"));
    }
    Ok(())
}

/// Tuning of the shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// Bytes per staging slot (each rank maps three). Rounded up to a multiple of
    /// 64, at least [`Config::MIN_STAGING`]. Every rank of a world must use
    /// the same value. Larger values mean fewer barriers per collective; smaller
    /// values keep the working set in cache.
    pub staging_bytes: usize,
}

impl Config {
    /// Default staging slot: 4 MiB. A data-moving collective stages at most
    /// 1 MiB of it per round, which stays in the cache between its staging
    /// and the peers' reads (measured in `copy`); the fused
    /// finalize-and-reduce-scatter, whose rounds are compute-bound, fills
    /// the whole slot and so passes fewer barriers.
    pub const DEFAULT_STAGING: usize = segment::DEFAULT_STAGING;
    /// Smallest staging slot: one 64-byte region per rank of the largest world.
    pub const MIN_STAGING: usize = 64 * MAX_WORLD;

    /// The staging size actually used. Saturates at the largest multiple of
    /// 64 (a world cannot map that much: [`ShmComm::rendezvous`] refuses
    /// it, naming the size).
    pub fn effective_staging(&self) -> usize {
        let s = self.staging_bytes.max(Self::MIN_STAGING);
        s.checked_next_multiple_of(64).unwrap_or(usize::MAX / 64 * 64)
    }

    /// Staging slots per rank.
    pub const SLOTS: usize = segment::SLOTS;

    /// Shared memory one rank maps, in bytes (control block + staging slots);
    /// saturates at `usize::MAX`.
    pub fn bytes_per_rank(&self) -> usize {
        segment::SLOTS.saturating_mul(self.effective_staging()).saturating_add(segment::BLOCK)
    }
}

impl Default for Config {
    fn default() -> Self {
        Config { staging_bytes: Self::DEFAULT_STAGING }
    }
}

/// A rank's handle on a shared-memory group. Clones share the handle (calls
/// through clones are serialised); the rank leaves the group when the last clone
/// is dropped.
#[derive(Clone)]
pub struct ShmComm {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    rank: usize,
    world: usize,
    timeout: Duration,
    cfg: Config,
    seg: Segment,
    /// The process that joined: the only one whose calls and drop act on
    /// the group (a child forked later holds a copy of the handle, not the
    /// rank).
    owner: u32,
    state: Mutex<State>,
    /// Sub-groups made by `split` since the group's last collective started:
    /// that collective's sequence number, and per rank list how many.
    splits: Mutex<Splits>,
    /// Busy-wait iterations before yielding: none when the group has more
    /// ranks than this host has cores (a spinning rank would steal the core a
    /// peer needs to arrive).
    spin: u32,
}

/// One rank's record of the splits of its group ([`ShmComm::split`]).
#[derive(Default)]
struct Splits {
    /// The group's sequence number that `made` counts at.
    seq: u64,
    /// Per rank list, how many sub-groups of it were made at `seq`.
    made: HashMap<Vec<usize>, u64>,
    /// How many splits failed for this rank at `seq`, refusals included:
    /// members that fail a split fail it together, so a split's attempt
    /// number is the same on every member.
    failures: u64,
    /// Per member, the post of the last refusal a failed split of this rank
    /// reported: reported once, it fails no later split.
    seen: HashMap<usize, u64>,
}

#[derive(Default)]
struct State {
    /// Last phase this rank arrived at ([`RENDEZVOUS`] once it took its slot).
    phase: u64,
    /// Collectives started.
    seq: u64,
    /// Staging rounds done (selects the slot).
    round: u64,
    /// Set after a timeout or a failed peer; every later call returns it.
    broken: Option<Error>,
    /// The caller's context tag, posted with every descriptor.
    tag: Option<u64>,
}

/// A shape the ranks of a collective must agree on besides what the call
/// itself compares (kind, dtype, op, root, counts, tag): `dims`, named
/// `label` (at most 16 bytes are posted) in the error of ranks that
/// disagree, e.g. `src shape [4, 4]` against `src shape [8, 2]`. Equal
/// element counts do not make two shapes the same tensor: the rows of a
/// gather or a reduction would be mixtures. It travels in the descriptor,
/// so comparing it costs no extra exchange. A shape of more than 8
/// dimensions is compared by its first 7 and a hash of the rest.
#[derive(Debug, Clone, Copy)]
pub struct Shape<'a> {
    /// What the error calls it (`"src"`: `src shape [..]`); ranks need not
    /// agree on it, only on `dims`.
    pub label: &'static str,
    /// The dimensions every rank must pass alike.
    pub dims: &'a [usize],
}

/// The collectives of a [`ShmComm`] that also post a [`Shape`] every rank
/// must agree on ([`ShmComm::agreeing`]); every rank of the call must post
/// one, or none.
pub struct Agreeing<'a> {
    pub(crate) comm: &'a ShmComm,
    pub(crate) shape: Option<PostedShape>,
}

impl std::fmt::Debug for ShmComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmComm")
            .field("name", &self.inner.name)
            .field("rank", &self.inner.rank)
            .field("world", &self.inner.world)
            .field("segment", &self.inner.seg.path())
            .finish()
    }
}

/// How long a leaving rank waits for the setup lock (at most its timeout):
/// the lock is held only for a rendezvous's setup or another rank's leave.
const LEAVE_LOCK_BOUND: Duration = Duration::from_secs(1);

impl Drop for Inner {
    fn drop(&mut self) {
        // A copy inherited through fork only unmaps and closes (the fields'
        // own drops): the rank's slot belongs to the process that joined,
        // which may still use it. Asked of the kernel, not of a cache.
        if std::process::id() != self.owner {
            return;
        }
        let broken = self.state.get_mut().map(|s| s.broken.is_some()).unwrap_or(true);
        let aborted = self.seg.ctrl(self.rank).state.load(std::sync::atomic::Ordering::Acquire) == ABORTED;
        let state = if std::thread::panicking() || aborted {
            ABORTED
        } else if broken {
            FAILED
        } else {
            LEFT
        };
        self.seg.leave(state, self.timeout.min(LEAVE_LOCK_BOUND));
    }
}

impl ShmComm {
    /// Joins (or creates) the world `name` of `world_size` ranks as `rank`.
    /// Ranks may be threads of this process or separate processes; every rank
    /// waits until all have joined (at most `timeout`, which also bounds every
    /// later wait). Every rank of the world must pass the same `cfg`.
    ///
    /// Every rank that took its slot in the world returns Ok, or every one
    /// returns an error: a rank that gave up (at its timeout, or on a peer
    /// that died, left or was refused while the world formed) makes the
    /// others fail too, with [`ErrorKind::PeerFailed`] naming it, even those
    /// that saw the last rank join after it gave up. Errors before a slot is
    /// taken (arguments, the file, a live world of another size) are this
    /// rank's alone.
    pub fn rendezvous(name: &str, world_size: usize, rank: usize, timeout: Duration, cfg: &Config) -> Result<ShmComm> {
        Self::rendezvous_watching(name, world_size, rank, timeout, cfg, None)
    }

    /// [`ShmComm::rendezvous`], failing the forming world with a Mismatch
    /// as soon as `watch` names a cause (asked while the rank waits).
    pub(crate) fn rendezvous_watching(
        name: &str,
        world_size: usize,
        rank: usize,
        timeout: Duration,
        cfg: &Config,
        watch: Option<&dyn Fn() -> Option<String>>,
    ) -> Result<ShmComm> {
        let setup = |detail: String| Error::Comm {
            collective: "rendezvous".into(),
            group: name.into(),
            rank,
            world: world_size,
            detail,
            kind: ErrorKind::Setup,
        };
        check_world_size(world_size).map_err(setup)?;
        if rank >= world_size {
            return Err(setup(format!(
                "rank {rank} is out of range for world size {world_size} (valid 0..{world_size})"
            )));
        }
        if name.is_empty() || name.contains('\0') {
            return Err(setup(format!("invalid group name {name:?} (must be non-empty, without NUL)")));
        }
        let staging = cfg.effective_staging();
        if segment::checked_segment_len(world_size, staging).is_none() {
            let asked = format!("{} bytes", cfg.staging_bytes);
            return Err(setup(rendezvous::too_large(world_size, staging, &asked)));
        }
        let start = Instant::now();
        let seg = Segment::join(name, world_size, rank, staging, timeout, start)?;
        let comm = ShmComm {
            inner: Arc::new(Inner {
                name: name.into(),
                rank,
                world: world_size,
                timeout,
                cfg: Config { staging_bytes: staging },
                seg,
                owner: process::my_pid(),
                state: Mutex::new(State { phase: RENDEZVOUS, ..State::default() }),
                splits: Mutex::new(Splits::default()),
                spin: if world_size <= std::thread::available_parallelism().map_or(1, |n| n.get()) { 256 } else { 0 },
            }),
        };
        // Wait until every slot is taken, settled for the whole world like a
        // phase barrier: every rank passes, or every rank fails.
        let deadline = clock::deadline(start, timeout);
        let mut st = comm.lock();
        // A slot once taken counts as joined even if its rank already moved on
        // and left: failures show up in the next collective.
        comm.wait_for(
            &mut st,
            "rendezvous",
            deadline,
            RENDEZVOUS,
            |c| c.state.load(std::sync::atomic::Ordering::Acquire) != EMPTY,
            watch,
        )?;
        drop(st);
        Ok(comm)
    }

    /// This rank in the group.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks in the group.
    pub fn world_size(&self) -> usize {
        self.inner.world
    }

    /// Group name (used in every error message).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The bound on every wait.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// Path the shared-memory file of this group had: it is unlinked as soon
    /// as every rank has attached.
    pub fn segment_path(&self) -> &str {
        self.inner.seg.path()
    }

    /// The shared-memory tuning in use.
    pub fn config(&self) -> Config {
        self.inner.cfg
    }

    /// Sets the context tag posted with every later collective of this
    /// handle (and its clones), e.g. the comm type a forward chose. Ranks
    /// whose tags differ fail their next collective together, with an error
    /// naming which ranks chose which tag (`ranks [0, 1] chose 0, ranks [2, 3]
    /// chose 1`). `None` (the default) posts no tag.
    pub fn set_context_tag(&self, tag: Option<u64>) {
        self.lock().tag = tag;
    }

    /// The context tag set by [`ShmComm::set_context_tag`].
    pub fn context_tag(&self) -> Option<u64> {
        self.lock().tag
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves State consistent (plain counters).
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Refuses a call from a process that did not join (a child forked after
    /// the rendezvous): it would act in the slot of the rank its parent is.
    fn check_owner(&self, coll: &str) -> Result<()> {
        let me = process::my_pid();
        if me == self.inner.owner {
            return Ok(());
        }
        Err(self.err(
            coll,
            ErrorKind::Setup,
            format!(
                "this handle belongs to process {} (which joined as rank {}); process {me} inherited it through \
                 fork and cannot take part in the group: only the joining process calls collectives or split \
                 (join a world of its own instead); the group and its ranks are unaffected",
                self.inner.owner, self.inner.rank
            ),
        ))
    }

    fn err(&self, coll: &str, kind: ErrorKind, detail: String) -> Error {
        Error::Comm {
            collective: coll.into(),
            group: self.inner.name.clone(),
            rank: self.inner.rank,
            world: self.inner.world,
            detail,
            kind,
        }
    }

    /// Marks the handle broken: peers see this rank failed and fail fast.
    fn poison(&self, st: &mut State, e: &Error) {
        st.broken = Some(e.clone());
        self.inner.seg.mark(FAILED);
    }

    /// Marks the handle aborted after a panic inside collective `coll`: the
    /// peers see this rank aborted (a root cause) and fail at once, and every
    /// later call on this handle returns the error.
    pub(crate) fn abort(&self, coll: &str) {
        let mut st = self.lock();
        let detail = format!(
            "rank {} panicked inside its call #{}, so this handle was aborted and its peers failed",
            self.inner.rank, st.seq
        );
        st.broken = Some(self.err(coll, ErrorKind::PeerFailed, detail));
        self.inner.seg.mark(ABORTED);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::sync::Barrier;
    use std::time::Duration;

    use super::*;

    /// A panic in the caller's code inside a collective (here the producer of
    /// a computed-rows reduce-scatter) aborts the handle: the peer fails at
    /// once naming the panic instead of waiting until its timeout, every
    /// later call on the handle fails, and dropping the handle leaves the
    /// rank aborted (the root cause), not merely failed.
    #[test]
    fn a_panic_inside_a_collective_aborts_the_handle_and_fails_its_peers() {
        let name = format!("panic-inside-{}", std::process::id());
        let both = Barrier::new(2);
        let (name, both) = (&name, &both);
        let (r0, r1) = std::thread::scope(|s| {
            let spawn = |rank: usize| {
                s.spawn(move || {
                    let c = ShmComm::rendezvous(name, 2, rank, Duration::from_secs(20), &Config::default())
                        .expect("rendezvous");
                    let mut backing = [0u8; 5 * 4];
                    let at = backing.as_ptr().align_offset(4);
                    let dst = &mut backing[at..at + 4 * 4];
                    let mut call = || {
                        let mut produce = |_: usize, _: usize, out: &mut [u8]| {
                            assert!(rank != 0, "rank 0's producer fails");
                            out.fill(0);
                        };
                        c.reduce_scatter_rows_with(
                            DataType::F32,
                            ReduceOp::Sum,
                            &[1, 1],
                            4,
                            &mut *dst,
                            Ok::<(), Error>(()),
                            &mut produce,
                        )
                    };
                    if rank == 0 {
                        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(call));
                        both.wait();
                        let later = c.barrier();
                        drop(c);
                        both.wait();
                        (caught.is_err(), later.err(), None)
                    } else {
                        let res = call();
                        both.wait();
                        both.wait();
                        let state = c.inner.seg.ctrl(0).state.load(Ordering::Acquire);
                        (false, res.err(), Some(state))
                    }
                })
            };
            let (h0, h1) = (spawn(0), spawn(1));
            (h0.join().expect("rank 0"), h1.join().expect("rank 1"))
        });
        assert!(r0.0, "rank 0's call panicked");
        let later = r0.1.expect("a call on an aborted handle fails");
        assert_eq!(later.kind(), Some(ErrorKind::PeerFailed), "{later}");
        assert!(later.to_string().contains("rank 0 panicked inside its call #1"), "{later}");
        let peer = r1.1.expect("rank 1 fails with rank 0");
        assert_eq!(peer.kind(), Some(ErrorKind::PeerFailed), "{peer}");
        assert!(peer.to_string().contains("rank 0 aborted (its thread panicked)"), "{peer}");
        assert_eq!(r1.2, Some(ABORTED), "dropping an aborted handle keeps it aborted");
    }
}
