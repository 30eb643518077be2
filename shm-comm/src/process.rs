//! Which process is this one, and is another still alive.

use std::sync::atomic::{AtomicU32, Ordering};
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
