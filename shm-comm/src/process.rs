//! Which process is this one, and is another still alive; the descriptors
//! and mappings a child forked without exec does not keep.

use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Once;

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

/// Start time of this process (0 if unknown). Read afresh each time (only a
/// rank claiming its slot asks): a child forked after the crate was used is
/// another process with its own start time, and peers that checked it
/// against its parent's would take it for dead.
pub(crate) fn my_start() -> u64 {
    proc_stat(my_pid()).map_or(0, |s| s.1)
}

/// This process's id, cached: every collective asks (a handle refuses to run
/// in a process that did not join), and `getpid` is a system call. A child
/// made by `fork` clears the cache before it runs anything else.
pub(crate) fn my_pid() -> u32 {
    static PID: AtomicU32 = AtomicU32::new(0);
    static WATCH_FORKS: Once = Once::new();
    extern "C" fn forget() {
        PID.store(0, Ordering::Relaxed);
    }
    let pid = PID.load(Ordering::Relaxed);
    if pid != 0 {
        return pid;
    }
    // SAFETY: registers a handler that only stores to an atomic, which is
    // async-signal-safe as a forked child of a threaded process needs.
    WATCH_FORKS.call_once(|| unsafe {
        libc::pthread_atfork(None, None, Some(forget));
    });
    let pid = std::process::id();
    PID.store(pid, Ordering::Relaxed);
    pid
}

/// The PID namespace of this process: the inode of `/proc/self/ns/pid` (0
/// where /proc does not tell). Two processes whose namespaces differ cannot
/// tell whether the other is alive by its pid.
pub(crate) fn my_pid_ns() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino())
}

/// The effective user id of this process: the only owner whose segment files
/// and presence names a rendezvous trusts.
pub(crate) fn my_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// `uid (name)` for messages, or just the number when the name is unknown.
pub(crate) fn describe_uid(uid: u32) -> String {
    let mut pw: libc::passwd = unsafe_zeroed();
    let mut buf = vec![0 as libc::c_char; 1024];
    let mut res: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: pw, buf and res are valid for the call; getpwuid_r writes the
    // strings it points pw at into buf, which outlives their use below.
    let r = unsafe { libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr(), buf.len(), &mut res) };
    if r == 0 && !res.is_null() && !pw.pw_name.is_null() {
        // SAFETY: pw_name points at a NUL-terminated string inside buf.
        let name = unsafe { std::ffi::CStr::from_ptr(pw.pw_name) }.to_string_lossy().into_owned();
        format!("uid {uid} ({name})")
    } else {
        format!("uid {uid}")
    }
}

fn unsafe_zeroed<T>() -> T {
    // SAFETY: only used for plain C structs (passwd), for which all-zero bytes
    // (null pointers, zero ids) is a valid value.
    unsafe { std::mem::zeroed() }
}

/// How many descriptors ([`tracked`]) and how many mappings
/// ([`map_tracked`]) are followed at once. Beyond, one is left as without
/// tracking: a child forked without exec keeps its copy until it ends or
/// execs (every descriptor is opened close-on-exec).
const TRACKED: usize = 1024;

/// The descriptors of this process that a child forked without exec closes
/// at once (-1: a free entry): every segment file and presence socket. A
/// child's copy would keep what the descriptor holds after this process let
/// it go, for as long as the child lives (a fork pool, a data loader's
/// workers): the rank's presence name (a later rendezvous of the same rank,
/// by the same process, would be refused as a duplicate), the setup lock of
/// a file this process closes without unlocking (every joiner of the name
/// would wait for it), and the rank's slot lock (from another PID namespace
/// the rank would look alive). The child cannot use any of them: a handle
/// it inherited is refused in it.
static FDS: [AtomicI32; TRACKED] = [const { AtomicI32::new(-1) }; TRACKED];

/// The shared mappings of tracked files (address, 0: a free entry; length),
/// which a child forked without exec replaces at once with private zero
/// pages: a mapping holds the open file description it was made from, and
/// with it the locks (the kernel drops them with the description's last
/// reference), and the file's memory. The range stays reserved in the child,
/// so that its copy of the owner unmaps only what was there.
static MAPS: [(AtomicUsize, AtomicUsize); TRACKED] = [const { (AtomicUsize::new(0), AtomicUsize::new(0)) }; TRACKED];

/// Held while [`FDS`] or [`MAPS`] change together with what they list (a
/// descriptor or mapping made and entered, or removed and closed or
/// unmapped), and by a forking thread from just before `fork` to just after
/// it in both processes (`pthread_atfork`), so that a child's copies of the
/// lists name exactly the tracked descriptors and mappings it holds. Never
/// held across a wait.
///
/// The word names its holder ([`holder`]: process and thread id; 0: free),
/// for the two forks that would otherwise spin forever on it: one made by
/// the holding thread itself (from a signal handler that interrupted it
/// inside a tracked step, see [`before_fork`]), and a child made while
/// another thread held it by a path that runs no fork handlers (`_Fork`, a
/// raw `clone`), which inherits the word set by a thread it does not have
/// (see [`lock_gate`]).
static GATE: AtomicU64 = AtomicU64::new(0);

/// How many forks the thread holding [`GATE`] made while it already held it
/// and that have not yet returned in the parent (more than one: a signal
/// handler interrupting another's fork). Only that thread changes it, so the
/// gate guards it.
static NESTED_FORKS: AtomicU32 = AtomicU32::new(0);

/// The value of [`GATE`] that names this thread of this process: the process
/// id in the high half, the thread id in the low one (neither is 0). Both are
/// asked of the kernel (`getpid` and `gettid` are system calls, async-signal-
/// safe): a child made without the fork handlers has no cache to trust, and
/// the forking thread has another thread id in the child.
fn holder() -> u64 {
    // SAFETY: getpid and gettid have no preconditions and cannot fail.
    let (pid, tid) = unsafe { (libc::getpid(), libc::syscall(libc::SYS_gettid)) };
    (u64::from(pid as u32) << 32) | (tid as u32 as u64)
}

struct Gate;

impl Gate {
    fn take() -> Gate {
        lock_gate();
        Gate
    }

    /// The gate, once the fork handlers are in place.
    fn watching_forks() -> Gate {
        static WATCH_FORKS: Once = Once::new();
        // SAFETY: the handlers only use atomics, `getpid`, `gettid`, `close`,
        // `mmap` and `munmap` (see after_fork_in_child).
        WATCH_FORKS.call_once(|| unsafe {
            libc::pthread_atfork(Some(before_fork), Some(after_fork_in_parent), Some(after_fork_in_child));
        });
        Gate::take()
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        GATE.store(0, Ordering::Release);
    }
}

/// Takes [`GATE`] for this thread: waits while another thread of this
/// process holds it, and takes it over at once from a holder of another
/// process. Threads share the word only with the process they belong to, so
/// such a holder is the thread of a parent that held it when this process
/// was forked without the fork handlers: this process does not have that
/// thread, and nothing here would ever release the gate. (A child sharing
/// the memory, of `vfork` or `posix_spawn`, only execs: it takes no gate.)
fn lock_gate() {
    let me = holder();
    let mut seen = 0;
    while let Err(now) = GATE.compare_exchange_weak(seen, me, Ordering::Acquire, Ordering::Relaxed) {
        if now != 0 && now >> 32 != me >> 32 {
            seen = now; // inherited: take it over on the next try
        } else {
            seen = 0;
            if now != 0 {
                std::thread::yield_now();
            }
        }
    }
}

/// Takes the gate for the fork, unless this thread holds it already: then it
/// is a fork from a signal handler that interrupted this thread inside a
/// tracked step (or inside another fork), and waiting would be waiting for
/// itself. The lists are then as that step left them, which is safe for the
/// child: a step enters a descriptor or mapping only once it is made and
/// removes it before it closes or unmaps it, so every listed one is held.
extern "C" fn before_fork() {
    if GATE.load(Ordering::Relaxed) == holder() {
        NESTED_FORKS.fetch_add(1, Ordering::Relaxed);
    } else {
        lock_gate();
    }
}

/// Gives the gate back, unless [`before_fork`] found this thread holding it:
/// the interrupted step still does, and releases it when it ends.
extern "C" fn after_fork_in_parent() {
    if NESTED_FORKS.load(Ordering::Relaxed) > 0 {
        NESTED_FORKS.fetch_sub(1, Ordering::Relaxed);
    } else {
        GATE.store(0, Ordering::Release);
    }
}

/// In the child, before anything else runs there: puts private zero pages
/// in place of the tracked mappings, closes its copies of the tracked
/// descriptors and forgets both (they are not the child's to track). Only
/// atomics, `getpid`, `gettid` and `close`, which are async-signal-safe as a
/// child of a threaded process needs, and `mmap` and `munmap`, bare system
/// calls in the C libraries (they take no lock).
///
/// The gate then passes to the child's one thread. After a nested fork (see
/// [`before_fork`]) that thread is the copy of the one interrupted inside a
/// tracked step, which still believes it holds the gate and releases it when
/// the signal handler returns to it: the gate stays held, now in the child's
/// name (were it cleared, that step would go on unguarded; left in the
/// parent's name, the child's next tracked step would take it over from
/// under it). Should that step resume in the child (a handler that returns
/// rather than exec or `_exit`), it closes or unmaps once more what was let
/// go here: the zero pages, or a descriptor number now free (`EBADF`) unless
/// the handler opened another under it meanwhile. Otherwise the child holds
/// nothing and the gate is free.
extern "C" fn after_fork_in_child() {
    for (a, l) in &MAPS {
        let addr = a.swap(0, Ordering::Relaxed);
        if addr != 0 {
            // SAFETY: the gate held across fork made the entry name a mapping
            // of the child's copy of the address space.
            unsafe { replace_with_private(addr as *mut libc::c_void, l.load(Ordering::Relaxed), libc::mmap) };
        }
    }
    for e in &FDS {
        let fd = e.swap(-1, Ordering::Relaxed);
        if fd >= 0 {
            // SAFETY: the gate held across fork made this entry name a
            // descriptor of the child's table, a copy of the parent's.
            unsafe { libc::close(fd) };
        }
    }
    if NESTED_FORKS.load(Ordering::Relaxed) > 0 {
        NESTED_FORKS.fetch_sub(1, Ordering::Relaxed);
        GATE.store(holder(), Ordering::Release);
    } else {
        GATE.store(0, Ordering::Release);
    }
}

/// The `mmap` of the C library, or a stand-in in tests.
type Mmap = unsafe extern "C" fn(
    *mut libc::c_void,
    libc::size_t,
    libc::c_int,
    libc::c_int,
    libc::c_int,
    libc::off_t,
) -> *mut libc::c_void;

/// Replaces the shared mapping of `len` bytes at `addr` in place (with
/// `mmap`), so that this process no longer holds the file it maps (and with
/// it the file's locks and memory). Private zero pages first: every pointer
/// into the range stays valid. Under strict overcommit
/// (`vm.overcommit_memory=2`) the kernel ignores `MAP_NORESERVE` and charges
/// writable private pages, so that can fail with ENOMEM, which would leave the
/// shared mapping in place; then inaccessible pages (`PROT_NONE`, which are
/// not charged), and if even those fail (the process's limit of mappings),
/// no mapping at all: a pointer into the range then faults instead of
/// reaching the file, which a child cannot use anyway (a handle it inherited
/// is refused in it). Only this last case gives up the range's reservation
/// ([`MAPS`]); keeping the file, and its locks, for the child's lifetime
/// would be worse.
///
/// # Safety
/// The range is a mapping of this process that nothing uses as the file's.
unsafe fn replace_with_private(addr: *mut libc::c_void, len: usize, mmap: Mmap) {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE;
    for prot in [libc::PROT_READ | libc::PROT_WRITE, libc::PROT_NONE] {
        // SAFETY: MAP_FIXED over the caller's range only.
        if unsafe { mmap(addr, len, prot, flags, -1, 0) } != libc::MAP_FAILED {
            return;
        }
    }
    // SAFETY: as above.
    unsafe { libc::munmap(addr, len) };
}

/// Runs `make`, which returns a new descriptor (negative when it failed,
/// errno then untouched), and tracks the descriptor so that every child
/// forked without exec from then on closes its copy before it runs anything
/// else. Made and entered as one step as far as `fork` can tell, so no child
/// holds an untracked copy. Close it with [`close_fd`].
pub(crate) fn tracked(make: impl FnOnce() -> libc::c_int) -> libc::c_int {
    let _gate = Gate::watching_forks();
    let fd = make();
    if fd >= 0 {
        // A full table leaves the descriptor untracked (see TRACKED).
        let _ = FDS.iter().find(|e| e.compare_exchange(-1, fd, Ordering::Relaxed, Ordering::Relaxed).is_ok());
    }
    fd
}

/// Closes descriptor `fd` of this process (tracked or not) and stops
/// tracking it, as one step as far as `fork` can tell: no child forked
/// meanwhile closes a number that no longer is the descriptor.
pub(crate) fn close_fd(fd: libc::c_int) {
    let _gate = Gate::take();
    if let Some(e) = FDS.iter().find(|e| e.load(Ordering::Relaxed) == fd) {
        e.store(-1, Ordering::Relaxed);
    }
    // SAFETY: the caller owns fd and uses it no more.
    unsafe { libc::close(fd) };
}

/// `mmap` of the first `len` bytes of file `fd`, shared and read-write
/// (`MAP_FAILED` when it fails), tracked as one step as far as `fork` can
/// tell: every child forked without exec from then on replaces it with
/// private zero pages before it runs anything else. Unmap it with
/// [`unmap_tracked`].
pub(crate) fn map_tracked(fd: libc::c_int, len: usize) -> *mut libc::c_void {
    let _gate = Gate::watching_forks();
    // SAFETY: a new mapping at an address of the kernel's choosing; the
    // caller keeps to the file's size.
    let p =
        unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
    if p != libc::MAP_FAILED {
        // A full table leaves the mapping untracked (see TRACKED).
        if let Some((a, l)) = MAPS.iter().find(|(a, _)| a.load(Ordering::Relaxed) == 0) {
            l.store(len, Ordering::Relaxed);
            a.store(p as usize, Ordering::Relaxed);
        }
    }
    p
}

/// Unmaps the `len` bytes at `ptr` (a mapping of [`map_tracked`], or the
/// zero pages a fork put in its place) and stops tracking them.
pub(crate) fn unmap_tracked(ptr: *mut libc::c_void, len: usize) {
    let _gate = Gate::take();
    if let Some((a, _)) = MAPS.iter().find(|(a, _)| a.load(Ordering::Relaxed) == ptr as usize) {
        a.store(0, Ordering::Relaxed);
    }
    // SAFETY: the caller owns the range and uses it no more.
    unsafe { libc::munmap(ptr, len) };
}

/// Closes descriptor `fd`, tracked by process `owner`, when this is that
/// process. In a child it forked, `fork` closed the child's copy already and
/// the number may name another descriptor since: it is left alone.
pub(crate) fn close_owned_fd(fd: libc::c_int, owner: u32) {
    // Asked of the kernel, not of the cache, which a fork made without the
    // atfork handlers would not clear.
    if std::process::id() == owner {
        close_fd(fd);
    }
}

/// A child forked without exec that does nothing but wait until it is
/// released (or its parent ends), for tests of what a child keeps. Returned
/// once the child runs (its fork handlers done).
#[cfg(test)]
pub(crate) struct ForkedWaiter {
    pid: libc::pid_t,
    release: libc::c_int,
}

#[cfg(test)]
impl ForkedWaiter {
    pub(crate) fn fork() -> ForkedWaiter {
        let (mut hold, mut ready) = ([0; 2], [0; 2]);
        // SAFETY: each array holds two descriptors.
        unsafe {
            assert_eq!(libc::pipe2(hold.as_mut_ptr(), libc::O_CLOEXEC), 0);
            assert_eq!(libc::pipe2(ready.as_mut_ptr(), libc::O_CLOEXEC), 0);
        }
        // SAFETY: the child only writes and reads its pipes, closes and ends
        // with _exit (async-signal-safe calls, as a child of a threaded
        // process needs).
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let mut b = 0u8;
            // SAFETY: the descriptors are the child's copies; b is one byte.
            unsafe {
                libc::close(hold[1]);
                libc::write(ready[1], &b as *const u8 as *const libc::c_void, 1);
                while libc::read(hold[0], &mut b as *mut u8 as *mut libc::c_void, 1) > 0 {}
                libc::_exit(0);
            }
        }
        assert!(pid > 0, "fork: {}", std::io::Error::last_os_error());
        let mut b = 0u8;
        // SAFETY: the read ends and ready[1] are ours; b is one byte. The
        // read returns once the child wrote, or ended (its write end closed).
        unsafe {
            libc::close(hold[0]);
            libc::close(ready[1]);
            libc::read(ready[0], &mut b as *mut u8 as *mut libc::c_void, 1);
            libc::close(ready[0]);
        }
        ForkedWaiter { pid, release: hold[1] }
    }
}

#[cfg(test)]
impl Drop for ForkedWaiter {
    fn drop(&mut self) {
        let mut st = 0;
        // SAFETY: closing the write end ends the child's read; pid is our child.
        unsafe {
            libc::close(self.release);
            libc::waitpid(self.pid, &mut st, 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lock held through a tracked descriptor goes when this process
    /// closes it, though a child forked while it was held still lives: the
    /// child closed its copy at the fork.
    #[test]
    fn a_forked_child_keeps_no_copy_of_a_tracked_descriptor() {
        use std::os::fd::AsRawFd;

        let path = std::env::temp_dir().join(format!("shm-comm-tracked-{}", std::process::id()));
        std::fs::write(&path, b"x").unwrap();
        let c = std::ffi::CString::new(path.display().to_string()).unwrap();
        // SAFETY: c is NUL-terminated; flags are plain integers.
        let fd = tracked(|| unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) });
        assert!(fd >= 0);
        // SAFETY: fd is open.
        assert_eq!(unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) }, 0);
        let child = ForkedWaiter::fork();
        close_fd(fd);
        let other = std::fs::File::open(&path).unwrap();
        // SAFETY: other is an open file; LOCK_NB never waits.
        let r = unsafe { libc::flock(other.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        drop(child);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(r, 0, "the forked child kept the lock");
    }

    /// A thread that forks while it holds the gate (as a signal handler that
    /// interrupted it inside a tracked step does) neither waits for itself
    /// nor gives the gate away: the interrupted step still holds it.
    #[test]
    fn a_fork_by_the_thread_holding_the_gate_goes_through() {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let fd = tracked(|| {
                let child = ForkedWaiter::fork();
                let held = GATE.load(Ordering::Relaxed) == holder();
                drop(child);
                tx.send(held).unwrap();
                -1
            });
            assert_eq!(fd, -1);
        });
        let held = rx.recv_timeout(std::time::Duration::from_secs(60));
        if held.is_err() {
            GATE.store(0, Ordering::Release); // let the stuck fork end
        }
        assert_eq!(held, Ok(true), "the fork waited for the gate its own thread held, or released it");
    }

    /// A child forked without the fork handlers while another thread held
    /// the gate inherits it set by a thread it does not have: its tracked
    /// steps take the gate over instead of waiting for it forever.
    #[test]
    fn a_gate_inherited_from_another_process_is_taken_over() {
        // Held by this thread first, so that no other test's step is under
        // way when the word is made to name a thread of another process.
        lock_gate();
        let parent = (u64::from(std::process::id().wrapping_add(1)) << 32) | 7;
        GATE.store(parent, Ordering::Relaxed);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            tx.send(tracked(|| -1)).unwrap();
        });
        let r = rx.recv_timeout(std::time::Duration::from_secs(60));
        if r.is_err() {
            GATE.store(0, Ordering::Release);
        }
        assert_eq!(r, Ok(-1), "a tracked step waited for a gate inherited from another process");
    }

    /// The line of `maps` (a `/proc/<pid>/maps` text) of the mapping that
    /// holds `addr`, if any.
    ///
    /// Never panics (it runs in a forked child): a line it cannot read holds
    /// nothing.
    fn maps_line(maps: &str, addr: usize) -> Option<&str> {
        maps.lines().find(|l| {
            let range = l.split_once(' ').and_then(|(r, _)| r.split_once('-'));
            let bound = |h: &str| usize::from_str_radix(h, 16).ok();
            range.and_then(|(lo, hi)| Some((bound(lo)?..bound(hi)?).contains(&addr))) == Some(true)
        })
    }

    /// Where the kernel refuses private writable pages (strict overcommit),
    /// a child's tracked mapping still stops mapping the file: inaccessible
    /// pages, else no mapping at all.
    ///
    /// Checked in a forked child, its only thread: in the test process
    /// another test's thread may map its own pages where the range was let
    /// go, before the check reads the maps (or before the range is unmapped).
    #[test]
    fn a_mapping_is_let_go_even_without_memory_for_zero_pages() {
        unsafe extern "C" fn no_writable(
            a: *mut libc::c_void,
            l: libc::size_t,
            prot: libc::c_int,
            f: libc::c_int,
            fd: libc::c_int,
            o: libc::off_t,
        ) -> *mut libc::c_void {
            if prot & libc::PROT_WRITE != 0 {
                return libc::MAP_FAILED;
            }
            // SAFETY: the caller's arguments, passed on.
            unsafe { libc::mmap(a, l, prot, f, fd, o) }
        }
        unsafe extern "C" fn none(
            _: *mut libc::c_void,
            _: libc::size_t,
            _: libc::c_int,
            _: libc::c_int,
            _: libc::c_int,
            _: libc::off_t,
        ) -> *mut libc::c_void {
            libc::MAP_FAILED
        }
        use std::os::fd::AsRawFd;
        let path = std::env::temp_dir().join(format!("shm-comm-unmapped-{}", std::process::id()));
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        file.set_len(4096).unwrap();
        let maps_path = c"/proc/self/maps";
        // Made before the fork: the child only makes system calls and reads
        // what they return.
        let mut buf = vec![0u8; 1 << 22];
        let fd = file.as_raw_fd();
        // The child's exit code: 0, or what it found wrong.
        let check = |buf: &mut [u8]| -> i32 {
            for (case, (mmap, expect)) in
                [(no_writable as Mmap, Some("---p")), (none as Mmap, None)].into_iter().enumerate()
            {
                let code = 10 * (case as i32 + 1);
                // SAFETY: a new shared mapping of the file, replaced below
                // and never used as the file's.
                let p = unsafe {
                    libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
                };
                if p == libc::MAP_FAILED {
                    return code + 1;
                }
                // SAFETY: p is that mapping.
                unsafe { replace_with_private(p, 4096, mmap) };
                // SAFETY: a NUL-terminated path; buf is writable for its length.
                let read = unsafe {
                    let m = libc::open(maps_path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
                    let mut n = 0;
                    let mut r = if m < 0 { -1 } else { 1 };
                    while r > 0 {
                        r = libc::read(m, buf[n..].as_mut_ptr().cast(), buf.len() - n);
                        n += r.max(0) as usize;
                    }
                    if m >= 0 {
                        libc::close(m);
                    }
                    (r == 0).then_some(n)
                };
                let Some(n) = read else { return code + 6 };
                if n == buf.len() {
                    return code + 2;
                }
                let Ok(maps) = std::str::from_utf8(&buf[..n]) else { return code + 3 };
                match (expect, maps_line(maps, p as usize)) {
                    (None, None) => {}
                    (Some(perms), Some(line))
                        if line.split_whitespace().nth(1) == Some(perms) && !line.contains("shm-comm-unmapped") =>
                    {
                        // SAFETY: this thread's replacement of p, the only thread here.
                        unsafe { libc::munmap(p, 4096) };
                    }
                    (_, Some(_)) => return code + 4,
                    (Some(_), None) => return code + 5,
                }
            }
            0
        };
        // SAFETY: the child makes system calls and parses a buffer made
        // before the fork (no allocation, no lock), then ends with _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let code = check(&mut buf);
            // SAFETY: ends the child without running the parent's destructors.
            unsafe { libc::_exit(code) };
        }
        let fork_error = std::io::Error::last_os_error();
        let mut st = 0;
        // SAFETY: pid is our child.
        let waited = pid > 0 && unsafe { libc::waitpid(pid, &mut st, 0) } == pid;
        std::fs::remove_file(&path).unwrap();
        assert!(pid > 0, "fork: {fork_error}");
        assert!(waited && libc::WIFEXITED(st), "the checking child ended with status {st:#x}");
        // Tens: the case (1 no writable private pages, 2 no pages at all);
        // units: 1 the mapping failed, 2 the maps did not fit, 3 not text,
        // 4 a mapping left other than inaccessible private pages (or still
        // naming the file; in case 2 any mapping), 5 no mapping where
        // inaccessible pages were expected, 6 the maps could not be read.
        assert_eq!(libc::WEXITSTATUS(st), 0, "the child found the range not let go as expected");
    }
}
