//! Rendezvous: ranks meet by (name, world size, rank) in a file under the
//! shared-memory directory, and the liveness checks that let a crashed
//! earlier run's file be replaced.
//!
//! A group instance is one file (one inode). The file stays linked only while
//! its world forms: the rank whose claim completes the world unlinks it
//! before claiming, so once every rank has attached nothing is left to leak
//! (the memory goes with the last mapping, even on SIGKILL), and a later
//! rendezvous under the name starts a new instance. A world that is complete
//! and still running is found through its ranks' [`crate::presence`] names
//! instead: a joiner of another size, or of a rank that is live there, is
//! refused as before, and one whose rank has left waits for that world to end.
//! A file whose ranks are all dead (a crash while the world formed) is
//! replaced, and such files under other names are swept at every
//! rendezvous ([`sweep_stale`]).

use std::ffi::{CStr, CString};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::clock::Backoff;
use crate::file::{check_dir, ino_at, open_existing_own, open_own, Opened, Refused};
use crate::presence::{members_of, name_hash, Member, Presence};
use crate::process::{my_pid, my_pid_ns, my_start, pid_alive};
use crate::segment::{
    checked_segment_len, describe_refusal, slot_held, Ctrl, Header, Mapping, Segment, BLOCK, EMPTY, JOINED, MAGIC,
    MAX_WORLD, VERSION,
};
use crate::{Error, ErrorKind, Result};

/// The file backing group `name`: `<shm dir>/ascend-moe.<readable prefix>.<hash>`.
pub fn segment_path(name: &str) -> String {
    let h = name_hash(name);
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

fn os_err(what: String) -> Error {
    Error::os(what)
}

fn setup_err(name: &str, rank: usize, world: usize, detail: String, kind: ErrorKind) -> Error {
    Error::Comm { collective: "rendezvous".into(), group: name.into(), rank, world, detail, kind }
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
    /// Creates or joins the segment of group `name` as `rank` of `world`,
    /// within `timeout` of `start` (the rendezvous's own start, so that the
    /// sweep and the join together keep to the caller's timeout).
    pub(crate) fn join(
        name: &str,
        world: usize,
        rank: usize,
        staging: usize,
        timeout: Duration,
        start: Instant,
    ) -> Result<Segment> {
        let len = checked_segment_len(world, staging).ok_or_else(|| {
            setup_err(name, rank, world, too_large(world, staging, &format!("{staging} bytes")), ErrorKind::Setup)
        })?;
        let path = segment_path(name);
        let cpath = CString::new(path.clone()).map_err(|_| Error::invalid("rendezvous", "name", "NUL byte"))?;
        let dir = std::path::Path::new(&path).parent().map_or_else(shm_dir, |d| d.display().to_string());
        match check_dir(&dir) {
            Ok(()) => {}
            Err(Refused::Os(e)) => return Err(e),
            Err(Refused::Foreign(why)) => return Err(setup_err(name, rank, world, why, ErrorKind::Setup)),
        }
        // The sweep is best effort: it may take a quarter of the timeout, so
        // files planted by the thousand in the shared directory cannot
        // stretch a rendezvous past it.
        sweep_stale(&dir, &path, crate::clock::deadline(start, timeout / 4));
        let deadline = crate::clock::deadline(start, timeout);
        let mut backoff = Backoff::default();
        // Why the last attempt started over (`None` before the first).
        // Why the last attempt did not form the world, for the error once the
        // deadline passed.
        let mut again: Option<String> = None;
        loop {
            // A file replaced or removed under every attempt (a link planted
            // again and again, an instance unlinked between open and lock)
            // is bounded by the deadline like every other wait here.
            if let Some(why) = again.take().filter(|_| Instant::now() >= deadline) {
                return Err(setup_err(
                    name,
                    rank,
                    world,
                    format!("timed out after {timeout:?} before the world formed; at the last attempt {why}"),
                    ErrorKind::Timeout,
                ));
            }
            again = Some(format!("{path} was removed while it was being opened"));
            let file = match open_own(&cpath, &path) {
                Ok(Opened::File(f)) => f,
                Ok(Opened::Again) => {
                    backoff.snooze();
                    continue;
                }
                Err(Refused::Os(e)) => return Err(e),
                Err(Refused::Foreign(why)) => return Err(setup_err(name, rank, world, why, ErrorKind::Setup)),
            };
            let (fd, ino) = (file.fd, file.ino);
            let close = crate::process::close_fd;
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
                        ErrorKind::Timeout,
                    ));
                }
                backoff.snooze();
            }
            if ino_at(&cpath) != Some(ino) {
                // Unlinked or replaced between open and lock: start over.
                again = Some(format!("{path} was unlinked or replaced between its opening and its lock"));
                close(fd);
                backoff.snooze();
                continue;
            }
            let size = match file.size(&path) {
                Ok(s) => s,
                Err(e) => {
                    close(fd);
                    return Err(e);
                }
            };
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
                    again = Some(format!("{path} was left by ranks that are all gone, and was removed"));
                    unlink_locked(&cpath, fd);
                    continue;
                }
                Found::Busy(why) => {
                    close(fd);
                    if Instant::now() >= deadline {
                        return Err(setup_err(name, rank, world, why, ErrorKind::Timeout));
                    }
                    again = Some(why);
                    backoff.snooze();
                    continue;
                }
                Found::Init => {
                    // The file is new (or was stale): a complete world of this
                    // name may still run without one.
                    let live = members_of(name_hash(name));
                    let verdict = match live.first() {
                        None => Ok(Found::Init),
                        Some(m) => judge(name, world, rank, staging, (m.world, m.staging), &live_of(&live)),
                    };
                    let wait = match verdict {
                        Ok(Found::Init) => None,
                        Ok(Found::Busy(why)) => Some(Ok(why)),
                        Ok(_) => Some(Ok(format!(
                            "a previous world under this name still runs ({}) and rank {rank}'s slot is not free",
                            describe_live(&live_of(&live))
                        ))),
                        Err(e) => Some(Err(e)),
                    };
                    if let Some(wait) = wait {
                        // Nothing was initialised: drop the empty file again.
                        unlink_locked(&cpath, fd);
                        let why = wait?;
                        if Instant::now() >= deadline {
                            return Err(setup_err(name, rank, world, why, ErrorKind::Timeout));
                        }
                        again = Some(why);
                        backoff.snooze();
                        continue;
                    }
                    // From here until the header's magic is written the
                    // lock stays held, and every failure removes the file
                    // (under the lock, before closing): the sweep of torn
                    // files relies on both (sweep_stale).
                    let give_up = |e: Error| {
                        // Nothing was initialised: drop the file again.
                        unlink_locked(&cpath, fd);
                        e
                    };
                    // SAFETY: fd is open for writing.
                    if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
                        return Err(give_up(os_err(format!("sizing {path} to {len} bytes"))));
                    }
                    if let Err(why) = reserve(fd, len, &path, world, staging) {
                        return Err(give_up(setup_err(name, rank, world, why, ErrorKind::Setup)));
                    }
                    let seg = Segment::map(fd, len, path.clone(), ino, world, staging, rank).map_err(give_up)?;
                    let h = seg.header();
                    h.version.store(VERSION, Ordering::Relaxed);
                    h.world.store(world as u32, Ordering::Relaxed);
                    h.staging.store(staging as u64, Ordering::Relaxed);
                    h.pid_ns.store(my_pid_ns(), Ordering::Relaxed);
                    h.magic.store(MAGIC, Ordering::Release);
                    return Self::attach(seg, name, &cpath);
                }
                Found::Join => {
                    let seg =
                        Segment::map(fd, len, path.clone(), ino, world, staging, rank).inspect_err(|_| close(fd))?;
                    return Self::attach(seg, name, &cpath);
                }
            }
        }
    }

    /// Takes this rank's slot in a mapped segment (lock held, released here):
    /// announces its presence, unlinks the file when this claim completes the
    /// world (before claiming, so that every rank's rendezvous returns after
    /// the unlink), then claims.
    fn attach(mut seg: Segment, name: &str, cpath: &CString) -> Result<Segment> {
        let (world, rank, staging) = (seg.world, seg.rank(), seg.staging);
        let me = Member { rank, world, staging, pid: my_pid() };
        // The same rank of the same world already held by this process (the
        // lock is ours, so no other claim of this name is under way).
        if members_of(name_hash(name))
            .iter()
            .any(|m| (m.rank, m.world, m.staging, m.pid) == (rank, world, staging, me.pid))
        {
            seg.unlock();
            let why = already_joined(rank, me.pid);
            return Err(setup_err(name, rank, world, why, ErrorKind::Setup));
        }
        // Without abstract sockets a running world is only found while its
        // file exists.
        seg.presence = Presence::announce(name_hash(name), &me, my_start());
        let others = (0..world).filter(|&r| r != rank && seg.ctrl(r).state.load(Ordering::Acquire) != EMPTY).count();
        if others + 1 == world && ino_at(cpath) == Some(seg.ino()) {
            // SAFETY: cpath is NUL-terminated; we hold the lock on this inode.
            unsafe { libc::unlink(cpath.as_ptr()) };
        }
        seg.claim();
        seg.unlock();
        Ok(seg)
    }

    /// Reads the header and slots of an existing segment (lock held).
    fn inspect(fd: libc::c_int, size: usize, name: &str, world: usize, rank: usize, staging: usize) -> Result<Found> {
        if let Some(theirs) = Survey::other_version(fd, size)? {
            // Made by another build: its layout (even where its ranks' slots
            // are) is unknown here, so whether they still run cannot be told,
            // and removing the file could split a live world in two. Neither
            // build can join the other's world.
            let why = format!(
                "rank built with segment layout version {VERSION} found layout version {theirs} in {}: every                  rank of a world must load the same ascend-moe build; if no process of that other build still                  runs, remove the file",
                segment_path(name)
            );
            return Err(setup_err(name, rank, world, why, ErrorKind::Mismatch));
        }
        let Some(survey) = Survey::of(fd, size)? else {
            // Initialised segments are complete before the lock is released,
            // so this is a torn or foreign file.
            return Ok(Found::Stale);
        };
        let (w, s, h) = (survey.world, survey.staging, survey.header());
        // Every pid in the file is one of the creator's namespace: from
        // another, live ranks would look dead and their file stale.
        let ours = my_pid_ns();
        if survey.elsewhere(ours) {
            // Its ranks' slot locks tell whether any still runs.
            let held = survey.held(fd);
            if held.is_empty() {
                return Ok(Found::Stale);
            }
            let why = format!(
                "the world forming under this name was made in another PID namespace (pid:[{}]; this \
                 process is in pid:[{ours}]) and ranks {held:?} of it still run: the ranks of one world must \
                 run in one PID namespace (they judge each other's liveness by pid), e.g. one container, or a \
                 pod with shareProcessNamespace",
                survey.pid_ns
            );
            return Err(setup_err(name, rank, world, why, ErrorKind::Mismatch));
        }
        let live = survey.live();
        if live.is_empty() {
            return Ok(Found::Stale);
        }
        // A joiner of another world or staging size is refused; the ranks
        // waiting in this forming world learn it from the header (and so
        // does every later joiner: the world can no longer form).
        if let Some(refused) = h.refusal() {
            if (w, s) == (world, staging) {
                let why = describe_refusal(refused, w, s);
                return Err(setup_err(name, rank, world, why, ErrorKind::Mismatch));
            }
        }
        if (w, s) != (world, staging) {
            h.refuse(rank, world, staging);
        }
        // judge() passed: same world size, so `rank < w`.
        match judge(name, world, rank, staging, (w, s), &live)? {
            Found::Join if survey.slots[rank].0 != EMPTY => Ok(Found::Busy(format!(
                "a previous world under this name still runs ({}) and rank {rank}'s slot is not free",
                describe_live(&live)
            ))),
            f => Ok(f),
        }
    }
}

/// What a segment file of this layout version holds (setup lock held): its
/// header, world and staging sizes, PID namespace and every rank's slot.
struct Survey {
    hdr: Mapping,
    world: usize,
    staging: usize,
    pid_ns: u64,
    /// Per rank: (state, pid, start time).
    slots: Vec<(u32, u32, u64)>,
}

impl Survey {
    /// The survey of the file `fd` of `size` bytes; `None` for a file that
    /// is not a complete segment of this version (torn or foreign).
    fn of(fd: libc::c_int, size: usize) -> Result<Option<Survey>> {
        if size < BLOCK {
            return Ok(None);
        }
        let hdr = Mapping::new(fd, BLOCK).ok_or_else(|| os_err("mapping segment header".into()))?;
        // SAFETY: the mapping is BLOCK bytes, Header fits (asserted) and is made of atomics.
        let h = unsafe { &*(hdr.ptr as *const Header) };
        let (magic, version) = (h.magic.load(Ordering::Acquire), h.version.load(Ordering::Relaxed));
        let (w, s) = (h.world.load(Ordering::Relaxed) as usize, h.staging.load(Ordering::Relaxed) as usize);
        let complete = checked_segment_len(w, s).is_some_and(|len| size >= len);
        if magic != MAGIC || version != VERSION || w == 0 || w > MAX_WORLD || !complete {
            return Ok(None);
        }
        let pid_ns = h.pid_ns.load(Ordering::Relaxed);
        let ctrl = Mapping::new(fd, BLOCK + w * BLOCK).ok_or_else(|| os_err("mapping segment control".into()))?;
        let slots = (0..w)
            .map(|r| {
                // SAFETY: the mapping covers the header and w control blocks.
                let c = unsafe { &*(ctrl.ptr.add(BLOCK + r * BLOCK) as *const Ctrl) };
                (c.state.load(Ordering::Acquire), c.pid.load(Ordering::Acquire), c.start.load(Ordering::Acquire))
            })
            .collect();
        Ok(Some(Survey { hdr, world: w, staging: s, pid_ns, slots }))
    }

    /// The layout version of the file `fd` of `size` bytes when its header
    /// bears our magic (set up completely by some build: the magic is written
    /// last) and another version than ours; `None` otherwise. The magic and
    /// the version lead the header in every version.
    fn other_version(fd: libc::c_int, size: usize) -> Result<Option<u32>> {
        if size < BLOCK {
            return Ok(None);
        }
        let hdr = Mapping::new(fd, BLOCK).ok_or_else(|| os_err("mapping segment header".into()))?;
        // SAFETY: the mapping is BLOCK bytes, Header fits (asserted) and is made of atomics.
        let h = unsafe { &*(hdr.ptr as *const Header) };
        let (magic, version) = (h.magic.load(Ordering::Acquire), h.version.load(Ordering::Relaxed));
        Ok((magic == MAGIC && version != VERSION).then_some(version))
    }

    fn header(&self) -> &Header {
        // SAFETY: as in `of`: the mapping lives as long as self.
        unsafe { &*(self.hdr.ptr as *const Header) }
    }

    /// Whether the world was made in another PID namespace than `ours` (both
    /// known): its pids mean nothing here.
    fn elsewhere(&self, ours: u64) -> bool {
        self.pid_ns != 0 && ours != 0 && self.pid_ns != ours
    }

    /// Whether no rank of the world runs any more: judged by pid within
    /// this PID namespace, by the slot locks from another.
    fn all_gone(&self, fd: libc::c_int, ours: u64) -> bool {
        if self.elsewhere(ours) {
            self.held(fd).is_empty()
        } else {
            self.live().is_empty()
        }
    }

    /// The joined ranks whose slot lock a process holds in the file `fd`
    /// (the caller's own description of it): alive, as seen from any PID
    /// namespace. A rank the kernel cannot tell about counts as alive.
    fn held(&self, fd: libc::c_int) -> Vec<usize> {
        (0..self.world).filter(|&r| self.slots[r].0 == JOINED && slot_held(fd, r).unwrap_or(true)).collect()
    }

    /// `(rank, pid)` of the joined ranks whose process is alive.
    fn live(&self) -> Vec<(usize, u32)> {
        (0..self.world)
            .filter(|&r| self.slots[r].0 == JOINED && pid_alive(self.slots[r].1, self.slots[r].2))
            .map(|r| (r, self.slots[r].1))
            .collect()
    }
}

/// The ranks that took their slot in the forming world of group `name`, as
/// its segment file says: empty with no file (none yet, or the world formed
/// and unlinked it). For tests that must act after a rank's claim, not only
/// after its announcement ([`crate::live_members`]).
#[doc(hidden)]
pub fn joined_ranks(name: &str) -> Vec<usize> {
    let path = segment_path(name);
    let Ok(cpath) = CString::new(path.clone()) else { return Vec::new() };
    let Some(f) = open_existing_own(&cpath) else { return Vec::new() };
    let survey = f.size(&path).ok().and_then(|size| Survey::of(f.fd, size as usize).ok().flatten());
    crate::process::close_fd(f.fd);
    survey.map_or_else(Vec::new, |s| (0..s.world).filter(|&r| s.slots[r].0 == JOINED).collect())
}

/// Removes this user's segment files in `dir` (all but `skip`) that a world
/// of this version left when every rank died before the world was complete
/// (a launcher's SIGTERM or SIGKILL while the ranks waited for each other),
/// and torn ones (their creator died while it set them up, see [`torn`]):
/// otherwise such a file holds its memory in the shared-memory directory
/// until a rendezvous under the same name. A world of this PID namespace is
/// judged by its ranks' pids, one of another by their slot locks. Best
/// effort, and nothing waits: a file that is locked (being set up), not
/// this user's own, empty, of another version, or with a live rank is left
/// alone. Another user's entries are passed over without being opened (one
/// `lstat` each), and the sweep stops at `until`, whatever is left: any user
/// may fill the directory with names. Returns how many entries it looked at.
fn sweep_stale(dir: &str, skip: &str, until: Instant) -> usize {
    use std::os::unix::fs::MetadataExt;
    // Without this process's namespace, no file's can be judged.
    let ours = my_pid_ns();
    if ours == 0 {
        return 0;
    }
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let (me, mut seen) = (crate::process::my_uid(), 0);
    for entry in entries.flatten() {
        if Instant::now() >= until {
            break;
        }
        seen += 1;
        let file = entry.file_name();
        let Some(n) = file.to_str().filter(|n| n.starts_with("ascend-moe.")) else { continue };
        // DirEntry::metadata does not follow a link.
        if !entry.metadata().is_ok_and(|m| m.file_type().is_file() && m.uid() == me) {
            continue;
        }
        let path = format!("{dir}/{n}");
        let Ok(cpath) = CString::new(path.clone()) else { continue };
        if path == skip {
            continue;
        }
        let Some(f) = open_existing_own(&cpath) else { continue };
        // SAFETY: f.fd is open; LOCK_NB never waits.
        if unsafe { libc::flock(f.fd, libc::LOCK_EX | libc::LOCK_NB) } == 0 && ino_at(&cpath) == Some(f.ino) {
            let size = f.size(&path).map_or(0, |s| s as usize);
            // The survey maps the file: it is dropped at once, so that closing
            // the file lets the lock go.
            let gone = Survey::of(f.fd, size).ok().flatten().is_some_and(|s| s.pid_ns != 0 && s.all_gone(f.fd, ours));
            if gone || torn(f.fd, size) {
                unlink_locked(&cpath, f.fd);
                continue;
            }
        }
        // Closing releases the lock.
        crate::process::close_fd(f.fd);
    }
    seen
}

/// Removes the segment file `cpath`, whose setup lock this process holds
/// through `fd` (taken while `cpath` still led to that inode), then closes
/// `fd`, which lets the lock go (the caller keeps no mapping of the file,
/// which would hold it). In this order: a process that takes the lock
/// after this one finds the name no longer leads to the inode, and the sweep
/// of torn files counts on no failed setup leaving its file linked once the
/// lock is free ([`torn`]).
fn unlink_locked(cpath: &CStr, fd: libc::c_int) {
    // SAFETY: cpath is NUL-terminated; the caller holds the lock on this inode.
    unsafe { libc::unlink(cpath.as_ptr()) };
    crate::process::close_fd(fd);
}

/// Whether the segment file `fd` of `size` bytes, whose setup lock the
/// caller took without waiting while the file was still linked under its
/// name, is torn: sized, but its header's magic never written. Only the
/// process that set the file up sizes it, under that lock, which it holds
/// from before the `ftruncate` until the magic is stored, and every failure
/// in between unlinks the file before the lock is let go
/// ([`Segment::join`]). So the process that sized this file let the lock go
/// without either: it died (the lock goes with the last descriptor of the
/// file, and no forked child keeps one, see [`crate::process::tracked`]).
/// No rank can be set up in it: a joiner that opened the file before it is
/// removed finds the name no longer leads to it once it has the lock, and
/// starts over. An empty file is never torn: its creator may be between
/// creating it and taking the lock.
fn torn(fd: libc::c_int, size: usize) -> bool {
    if size < BLOCK {
        return false;
    }
    let Some(hdr) = Mapping::new(fd, BLOCK) else { return false };
    // SAFETY: the mapping is BLOCK bytes of the file, Header fits (asserted)
    // and is made of atomics.
    let h = unsafe { &*(hdr.ptr as *const Header) };
    h.magic.load(Ordering::Acquire) == 0
}

/// Backs all `len` bytes of a new segment file at once. A file only sized
/// by `ftruncate` is sparse: in a shared-memory directory too small for it
/// (a container's default /dev/shm is 64 MiB) or filled meanwhile by anyone,
/// the first collective to touch a page without memory would die of SIGBUS.
/// The error names the size, the directory and its free space.
fn reserve(fd: libc::c_int, len: usize, path: &str, world: usize, staging: usize) -> std::result::Result<(), String> {
    loop {
        // SAFETY: fd is open for writing; posix_fallocate returns the error
        // number instead of setting errno.
        match unsafe { libc::posix_fallocate(fd, 0, len as libc::off_t) } {
            0 => return Ok(()),
            libc::EINTR => continue,
            errno => return Err(reserve_failed(errno, len, path, world, staging)),
        }
    }
}

/// Why rank `rank` cannot join: process `pid` holds it. When that is this
/// process, through a handle not closed yet (one of a world that failed
/// too: a retry that joins before it lets go of the old handle).
fn already_joined(rank: usize, pid: u32) -> String {
    if pid == my_pid() {
        format!(
            "rank {rank} is already joined by this process (pid {pid}), through a handle of this name not closed \
             yet (also one of a world that failed: close or drop it before joining again): duplicate rank"
        )
    } else {
        format!("rank {rank} is already joined (pid {pid}): duplicate rank")
    }
}

/// Why `len` bytes of segment file `path` could not be backed.
fn reserve_failed(errno: i32, len: usize, path: &str, world: usize, staging: usize) -> String {
    let dir = std::path::Path::new(path).parent().map_or_else(shm_dir, |d| d.display().to_string());
    let mib = |b: u64| b as f64 / f64::from(1u32 << 20);
    let free = free_bytes(&dir).map_or(String::new(), |b| format!(" ({:.1} MiB free there)", mib(b)));
    // What each caller can do: anyone can free or enlarge the directory;
    // only a Rust caller chooses the staging size.
    let hint = if errno == libc::ENOSPC {
        format!(
            "; free space in it or make it larger (e.g. docker run --shm-size, or remount a tmpfs with a larger \
             size=). Each rank needs 4 KiB + 3 x the staging size: a Rust caller may choose a smaller one \
             (Config::staging_bytes; ascend-moe: CpuComm::rendezvous_with, ascend-moe check and bench --staging-bytes), \
             while the C API and Python always use the default of {} bytes",
            crate::segment::DEFAULT_STAGING
        )
    } else {
        String::new()
    };
    format!(
        "cannot back the shared memory of a world of {world} ranks with {staging}-byte staging slots: \
         {len} bytes ({:.1} MiB) for {path} in {dir}{free}: {}{hint}",
        mib(len as u64),
        std::io::Error::from_raw_os_error(errno)
    )
}

/// Bytes available to this user in the file system holding `dir`.
fn free_bytes(dir: &str) -> Option<u64> {
    let c = CString::new(dir).ok()?;
    // SAFETY: statvfs is plain data; zeroed is a valid value to fill in.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is NUL-terminated and st a valid out-parameter.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    #[allow(clippy::unnecessary_cast)] // the field types differ between targets
    Some(st.f_bavail as u64 * st.f_frsize as u64)
}

/// `(rank, pid)` of live members.
fn live_of(members: &[Member]) -> Vec<(usize, u32)> {
    members.iter().map(|m| (m.rank, m.pid)).collect()
}

fn describe_live(live: &[(usize, u32)]) -> String {
    live.iter().map(|(r, p)| format!("rank {r} pid {p}")).collect::<Vec<_>>().join(", ")
}

/// Why a world of `world` ranks cannot use staging slots of `staging` (how
/// the caller asked for them): its segment cannot be mapped.
pub(crate) fn too_large(world: usize, staging: usize, asked: &str) -> String {
    format!(
        "staging size {asked} per slot (Config::staging_bytes) is too large: a world of {world} ranks maps \
         4 KiB + {world} x (4 KiB + 3 x {staging} bytes), more than the largest mapping of {} bytes",
        isize::MAX
    )
}

/// Whether rank `rank` of a world of `world` ranks with `staging` bytes may
/// join the live world of size and staging `found` whose live ranks are
/// `live`: `Join`, or the error naming why not.
fn judge(
    name: &str,
    world: usize,
    rank: usize,
    staging: usize,
    found: (usize, usize),
    live: &[(usize, u32)],
) -> Result<Found> {
    let (w, s) = found;
    if w != world {
        return Err(setup_err(
            name,
            rank,
            world,
            format!(
                "the name is used by a live world of size {w} (this rank asked for size {world}; live: {})",
                describe_live(live)
            ),
            ErrorKind::Setup,
        ));
    }
    if s != staging {
        return Err(setup_err(
            name,
            rank,
            world,
            format!("the live world under this name uses {s} staging bytes per slot, this rank asked for {staging}"),
            ErrorKind::Setup,
        ));
    }
    if let Some((_, pid)) = live.iter().find(|(r, _)| *r == rank) {
        return Err(setup_err(name, rank, world, already_joined(rank, *pid), ErrorKind::Setup));
    }
    Ok(Found::Join)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sweep of stale files stops at its bound, however many names the
    /// directory holds (any user may fill it): past the bound it looks at
    /// none, before it at every one.
    #[test]
    fn the_sweep_of_stale_files_stops_at_its_bound() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("shm-comm-sweep-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        for i in 0..200 {
            std::fs::write(dir.join(format!("ascend-moe.planted{i}")), b"").unwrap();
        }
        let d = dir.display().to_string();
        assert_eq!(sweep_stale(&d, "", Instant::now()), 0, "a bound already passed");
        let far = Instant::now() + Duration::from_secs(3600);
        assert_eq!(sweep_stale(&d, "", far), 200, "every name within the bound");
        // Empty files are no segment of a dead world: all are left alone.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 200);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A torn file (sized by a creator that died before it wrote the
    /// header) is swept once its setup lock is free. Left alone: one whose
    /// lock is held (a creator still setting it up), an empty one (a creator
    /// between creating and locking it), one with a header of another version
    /// and one of another mode (not this user's segment file).
    #[test]
    fn the_sweep_removes_torn_files_whose_setup_lock_is_free() {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};

        let dir = std::env::temp_dir().join(format!("shm-comm-torn-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let plant = |n: &str, bytes: &[u8], mode: u32| {
            let p = dir.join(format!("ascend-moe.{n}"));
            let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(&p).unwrap();
            std::io::Write::write_all(&mut f, bytes).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
            p
        };
        let zeros = vec![0u8; 2 * BLOCK];
        let torn = plant("torn", &zeros, 0o600);
        let busy = plant("busy", &zeros, 0o600);
        let empty = plant("empty", b"", 0o600);
        let other_mode = plant("other-mode", &zeros, 0o644);
        let mut other = zeros.clone();
        other[std::mem::offset_of!(Header, magic)..][..8].copy_from_slice(&MAGIC.to_ne_bytes());
        other[std::mem::offset_of!(Header, version)..][..4].copy_from_slice(&(VERSION + 1).to_ne_bytes());
        let other_version = plant("other-version", &other, 0o600);
        // A creator setting `busy` up holds its lock.
        let holder = std::fs::OpenOptions::new().read(true).write(true).open(&busy).unwrap();
        // SAFETY: holder is an open file.
        assert_eq!(unsafe { libc::flock(holder.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
        let far = Instant::now() + Duration::from_secs(3600);
        assert_eq!(sweep_stale(&dir.display().to_string(), "", far), 5);
        assert!(!torn.exists(), "a torn file whose lock is free was left");
        for p in [&busy, &empty, &other_mode, &other_version] {
            assert!(p.exists(), "{} was removed", p.display());
        }
        // Explicitly: a child forked by another test meanwhile may hold a
        // copy of the description, which closing here would not unlock.
        // SAFETY: holder is an open file.
        unsafe { libc::flock(holder.as_raw_fd(), libc::LOCK_UN) };
        assert_eq!(sweep_stale(&dir.display().to_string(), "", far), 4);
        assert!(!busy.exists(), "a torn file whose creator let its lock go was left");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A child forked by a rank (a worker pool made after the world formed)
    /// and still alive keeps nothing of the rank once its handle is dropped:
    /// no presence name lists it (the same rank of the same process joins
    /// the name again, where it was refused as a duplicate) and no process
    /// holds its slot lock (by which ranks of another PID namespace would
    /// take it for alive).
    #[test]
    fn a_child_forked_by_a_rank_keeps_neither_its_presence_nor_its_slot_lock() {
        use std::os::fd::AsRawFd;

        let name = format!("forked-keeps-nothing-{}", std::process::id());
        let cfg = crate::Config { staging_bytes: 1 << 16 };
        let t = Duration::from_secs(20);
        let first = std::thread::scope(|s| {
            let zero = s.spawn(|| crate::ShmComm::rendezvous(&name, 2, 0, t, &cfg));
            // Once rank 0 holds its slot lock, open the file for a look at
            // the lock later (the world unlinks it once it forms).
            let deadline = Instant::now() + t;
            while joined_ranks(&name) != [0] {
                assert!(Instant::now() < deadline, "rank 0 never took its slot");
                std::thread::yield_now();
            }
            let look = std::fs::OpenOptions::new().read(true).write(true).open(segment_path(&name)).expect("open");
            let one = crate::ShmComm::rendezvous(&name, 2, 1, t, &cfg).expect("rank 1");
            (zero.join().unwrap().expect("rank 0"), one, look)
        });
        let (zero, one, look) = first;
        let child = crate::process::ForkedWaiter::fork();
        drop((zero, one));
        let members = crate::live_members(&name);
        let held = [slot_held(look.as_raw_fd(), 0), slot_held(look.as_raw_fd(), 1)];
        let again = crate::ShmComm::rendezvous(&name, 1, 0, t, &cfg).and_then(|c| c.barrier());
        drop(child);
        assert!(members.is_empty(), "the ended ranks are listed: {members:?}");
        assert_eq!(held, [Some(false); 2], "slot locks held after the ranks ended");
        again.expect("the same rank of the same process joins the name again");
    }

    /// A file system without room names the size, the directory, its free
    /// space and what each caller can do (C and Python callers cannot choose
    /// the staging size).
    #[test]
    fn a_full_directory_is_reported_with_the_size_the_directory_and_a_remedy() {
        let path = format!("{}/ascend-moe.full.0123456789abcdef", shm_dir());
        let why = reserve_failed(libc::ENOSPC, 25_190_400, &path, 2, 4 << 20);
        for part in [
            "a world of 2 ranks with 4194304-byte staging slots",
            "25190400 bytes (24.0 MiB)",
            &format!("for {path} in {}", shm_dir()),
            "MiB free there",
            "No space left on device",
            "--shm-size",
            "Config::staging_bytes",
            "the C API and Python always use the default of 4194304 bytes",
        ] {
            assert!(why.contains(part), "{part:?} missing from: {why}");
        }
    }

    /// A file under the name whose header claims a staging size too large
    /// for any segment (torn or foreign) is stale: it is replaced, and its
    /// size is never computed with wrapping arithmetic.
    /// Creates the segment file of `name` holding only a header: our magic,
    /// layout `version`, a world of one and `staging` bytes of staging (0:
    /// the field left zero). Returns its path.
    fn plant_header(name: &str, version: u32, staging: u64) -> String {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;

        let path = segment_path(name);
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path).expect("create");
        let mut block = vec![0u8; 2 * BLOCK];
        let put = |b: &mut [u8], at: usize, v: &[u8]| b[at..at + v.len()].copy_from_slice(v);
        put(&mut block, std::mem::offset_of!(Header, magic), &MAGIC.to_ne_bytes());
        put(&mut block, std::mem::offset_of!(Header, version), &version.to_ne_bytes());
        put(&mut block, std::mem::offset_of!(Header, world), &1u32.to_ne_bytes());
        put(&mut block, std::mem::offset_of!(Header, staging), &staging.to_ne_bytes());
        f.write_all(&block).expect("write");
        path
    }

    #[test]
    fn a_header_whose_segment_would_overflow_is_replaced() {
        use std::sync::atomic::AtomicU64;

        let name = format!("overflowing-header-{}", std::process::id());
        assert_eq!(std::mem::size_of::<AtomicU64>(), 8);
        plant_header(&name, VERSION, u64::MAX / 2);
        let cfg = crate::Config::default();
        let c = crate::ShmComm::rendezvous(&name, 1, 0, Duration::from_secs(20), &cfg).expect("replaced");
        c.barrier().expect("a world of one");
    }

    /// A file under the name made by another build (our magic, another
    /// layout version) may belong to a live world whose slots this build
    /// cannot read: the rendezvous fails at once naming both versions and
    /// the file, and leaves the file where it is.
    #[test]
    fn a_file_of_another_layout_version_is_refused_and_left_alone() {
        let name = format!("other-layout-{}", std::process::id());
        let theirs = VERSION + 7;
        let path = plant_header(&name, theirs, 0);
        let t0 = Instant::now();
        let cfg = crate::Config::default();
        let r = crate::ShmComm::rendezvous(&name, 1, 0, Duration::from_secs(20), &cfg);
        let (took, left) = (t0.elapsed(), std::path::Path::new(&path).exists());
        let _ = std::fs::remove_file(&path);
        let e = r.expect_err("a world of another build cannot be joined");
        let s = e.to_string();
        assert_eq!(e.kind(), Some(ErrorKind::Mismatch), "{s}");
        assert!(s.contains(&format!("layout version {VERSION} found layout version {theirs} in {path}")), "{s}");
        assert!(s.contains("same ascend-moe build"), "{s}");
        assert!(left, "the file of another build was removed");
        assert!(took < Duration::from_secs(5), "waited {took:?} instead of failing at once");
    }

    /// A descriptor that cannot be backed (a pipe) fails with the system's
    /// reason, never silently.
    #[test]
    fn a_descriptor_that_cannot_be_backed_fails_naming_the_reason() {
        let mut fds = [0; 2];
        // SAFETY: fds holds two descriptors.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let r = reserve(fds[1], 1 << 20, "/nowhere/ascend-moe.pipe", 1, 4096);
        // SAFETY: both are open and ours.
        unsafe {
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
        let why = r.expect_err("a pipe cannot be backed");
        assert!(why.contains("1048576 bytes (1.0 MiB) for /nowhere/ascend-moe.pipe in /nowhere"), "{why}");
        assert!(why.contains(&std::io::Error::from_raw_os_error(libc::ESPIPE).to_string()), "{why}");
        assert!(!why.contains("--shm-size"), "only a full directory gets that hint: {why}");
    }

    /// A joiner in another PID namespace than the one the world was made in
    /// (two containers sharing /dev/shm, not their processes) would see the
    /// live ranks as dead and remove their file as stale: it is refused
    /// naming both namespaces, and the world it found stays whole (here it
    /// forms once the header says the namespace is the joiner's).
    #[test]
    fn a_joiner_from_another_pid_namespace_is_refused_and_the_world_stays() {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::FileExt;

        let ours = my_pid_ns();
        assert_ne!(ours, 0, "/proc/self/ns/pid names this process's namespace");
        let name = format!("other-pid-ns-{}", std::process::id());
        let path = segment_path(&name);
        let cfg = crate::Config { staging_bytes: 1 << 16 };
        let at = std::mem::offset_of!(Header, pid_ns) as u64;
        std::thread::scope(|s| {
            let first = s.spawn(|| crate::ShmComm::rendezvous(&name, 2, 0, Duration::from_secs(20), &cfg));
            // Once rank 0 set the file up (sized, lock released), its header
            // claims another namespace.
            let f = loop {
                if let Ok(f) = std::fs::OpenOptions::new().read(true).write(true).open(&path) {
                    // SAFETY: f is an open file.
                    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                        if f.metadata().is_ok_and(|m| m.len() > 0) {
                            break f;
                        }
                        // SAFETY: as above.
                        unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_UN) };
                    }
                }
                std::thread::yield_now();
            };
            f.write_all_at(&(ours ^ 1).to_ne_bytes(), at).expect("header");
            // SAFETY: f is an open file.
            unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_UN) };
            let ino = ino_at(&CString::new(path.clone()).unwrap());
            match crate::ShmComm::rendezvous(&name, 2, 1, Duration::from_secs(20), &cfg) {
                Err(Error::Comm { kind: ErrorKind::Mismatch, detail, .. }) => {
                    for part in
                        ["another PID namespace", &format!("pid:[{}]", ours ^ 1), &format!("pid:[{ours}]"), "ranks [0]"]
                    {
                        assert!(detail.contains(part), "{part:?} missing from: {detail}");
                    }
                }
                other => panic!("expected a PID namespace mismatch, got {other:?}"),
            }
            assert_eq!(ino_at(&CString::new(path.clone()).unwrap()), ino, "the live world's file was left as it was");
            f.write_all_at(&ours.to_ne_bytes(), at).expect("header");
            let second = crate::ShmComm::rendezvous(&name, 2, 1, Duration::from_secs(20), &cfg).expect("rank 1");
            let first = first.join().unwrap().expect("rank 0");
            std::thread::scope(|s| {
                s.spawn(|| first.barrier().expect("barrier"));
                second.barrier().expect("barrier");
            });
        });
    }

    /// A segment file as a world of another PID namespace left it when its
    /// ranks died: rank 0 joined (its pid is one this namespace sees alive,
    /// but its slot lock is gone), the header names another namespace.
    fn plant_from_another_namespace(name: &str) -> String {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;

        let path = segment_path(name);
        let staging = 4096;
        let len = checked_segment_len(2, staging).unwrap();
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path).expect("create");
        let mut bytes = vec![0u8; len];
        let put = |b: &mut [u8], at: usize, v: &[u8]| b[at..at + v.len()].copy_from_slice(v);
        put(&mut bytes, std::mem::offset_of!(Header, magic), &MAGIC.to_ne_bytes());
        put(&mut bytes, std::mem::offset_of!(Header, version), &VERSION.to_ne_bytes());
        put(&mut bytes, std::mem::offset_of!(Header, world), &2u32.to_ne_bytes());
        put(&mut bytes, std::mem::offset_of!(Header, staging), &(staging as u64).to_ne_bytes());
        put(&mut bytes, std::mem::offset_of!(Header, pid_ns), &(my_pid_ns() ^ 1).to_ne_bytes());
        put(&mut bytes, BLOCK + std::mem::offset_of!(Ctrl, state), &JOINED.to_ne_bytes());
        put(&mut bytes, BLOCK + std::mem::offset_of!(Ctrl, pid), &my_pid().to_ne_bytes());
        put(&mut bytes, BLOCK + std::mem::offset_of!(Ctrl, start), &my_start().to_ne_bytes());
        f.write_all(&bytes).expect("write");
        path
    }

    /// A world of another PID namespace whose ranks all died while it
    /// formed (a container killed and restarted with a shared /dev/shm) is
    /// judged by its ranks' slot locks, not by pids this namespace cannot
    /// see: its file is replaced under its name and swept under any other.
    #[test]
    fn a_world_of_another_pid_namespace_whose_ranks_died_is_replaced_and_swept() {
        let cfg = crate::Config { staging_bytes: 1 << 16 };
        let name = format!("dead-other-ns-{}", std::process::id());
        plant_from_another_namespace(&name);
        let c = crate::ShmComm::rendezvous(&name, 1, 0, Duration::from_secs(20), &cfg).expect("replaced");
        c.barrier().expect("a world of one");
        drop(c);
        let left = format!("dead-other-ns-left-{}", std::process::id());
        let path = plant_from_another_namespace(&left);
        let other = format!("dead-other-ns-sweeper-{}", std::process::id());
        drop(crate::ShmComm::rendezvous(&other, 1, 0, Duration::from_secs(20), &cfg).expect("a world of one"));
        assert!(std::fs::symlink_metadata(&path).is_err(), "{path} was left");
    }
}
