//! Which process is this one, and is another still alive; the descriptors
//! and mappings a child forked without exec does not keep.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicUsize, Ordering};
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
static GATE: AtomicBool = AtomicBool::new(false);

struct Gate;

impl Gate {
    fn take() -> Gate {
        lock_gate();
        Gate
    }

    /// The gate, once the fork handlers are in place.
    fn watching_forks() -> Gate {
        static WATCH_FORKS: Once = Once::new();
        // SAFETY: the handlers only use atomics, `close` and `mmap` (see
        // after_fork_in_child).
        WATCH_FORKS.call_once(|| unsafe {
            libc::pthread_atfork(Some(before_fork), Some(after_fork_in_parent), Some(after_fork_in_child));
        });
        Gate::take()
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        GATE.store(false, Ordering::Release);
    }
}

fn lock_gate() {
    while GATE.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
        std::thread::yield_now();
    }
}

extern "C" fn before_fork() {
    lock_gate();
}

extern "C" fn after_fork_in_parent() {
    GATE.store(false, Ordering::Release);
}

/// In the child, before anything else runs there: puts private zero pages
/// in place of the tracked mappings, closes its copies of the tracked
/// descriptors and forgets both (they are not the child's to track). Only
/// atomics, `close`, which is async-signal-safe as a child of a threaded
/// process needs, and `mmap`, a bare system call in the C libraries (it
/// takes no lock).
extern "C" fn after_fork_in_child() {
    for (a, l) in &MAPS {
        let addr = a.swap(0, Ordering::Relaxed);
        if addr != 0 {
            // SAFETY: the gate held across fork made the entry name a mapping
            // of the child's copy of the address space; replacing it in place
            // leaves every pointer into it valid (now to zeros).
            unsafe {
                libc::mmap(
                    addr as *mut libc::c_void,
                    l.load(Ordering::Relaxed),
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
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
    GATE.store(false, Ordering::Release);
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
}
