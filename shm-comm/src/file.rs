//! The file that backs a group's segment: opened without following links and
//! used only when it is this user's own.
//!
//! The path of a group's file follows from the group name alone, so any local
//! user can create it first. A file is therefore joined only when it is a
//! regular file owned by this process's effective uid, with mode 0600 and one
//! link: another user can neither have written it nor open it, and no other
//! name leads to the same inode. Anything else under the name is refused with
//! an error naming the path, its owner and mode, and is left in place (it is
//! not ours to remove). The one exception is a symbolic link: it is never
//! followed, and is removed like any other name that holds no segment, so the
//! file it points to is never opened, read or written.

use std::ffi::CStr;

use crate::process::{describe_uid, my_uid};
use crate::Error;

/// The group's file, open read-write, checked as this user's own.
pub(crate) struct OwnFile {
    pub fd: libc::c_int,
    /// (device, inode).
    pub ino: (u64, u64),
    pub size: u64,
}

/// What opening the name gave.
pub(crate) enum Opened {
    File(OwnFile),
    /// The name changed under us (removed, or a link that was removed): open again.
    Again,
}

/// Why the name cannot be used.
pub(crate) enum Refused {
    /// An OS call failed.
    Os(Error),
    /// The name holds something that is not this user's own segment file.
    Foreign(String),
}

fn stat_of(r: libc::c_int, st: libc::stat) -> Option<libc::stat> {
    (r == 0).then_some(st)
}

fn zeroed_stat() -> libc::stat {
    // SAFETY: libc::stat is plain data; all-zero bytes is a valid value.
    unsafe { std::mem::zeroed() }
}

/// `lstat` of `path` (links not followed).
pub(crate) fn lstat_path(path: &CStr) -> Option<libc::stat> {
    let mut st = zeroed_stat();
    // SAFETY: path is NUL-terminated and st a valid out-parameter.
    let r = unsafe { libc::lstat(path.as_ptr(), &mut st) };
    stat_of(r, st)
}

/// (device, inode) of a stat record.
// The field types differ between targets (u64 on x86_64).
#[allow(clippy::unnecessary_cast)]
fn dev_ino(st: &libc::stat) -> (u64, u64) {
    (st.st_dev as u64, st.st_ino as u64)
}

/// (device, inode) at `path`, links not followed.
pub(crate) fn ino_at(path: &CStr) -> Option<(u64, u64)> {
    lstat_path(path).map(|st| dev_ino(&st))
}

fn fstat_fd(fd: libc::c_int) -> Option<libc::stat> {
    let mut st = zeroed_stat();
    // SAFETY: fd is open and st a valid out-parameter.
    let r = unsafe { libc::fstat(fd, &mut st) };
    stat_of(r, st)
}

fn kind_of(mode: libc::mode_t) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFREG => "a regular file",
        libc::S_IFDIR => "a directory",
        libc::S_IFLNK => "a symbolic link",
        libc::S_IFIFO => "a FIFO",
        libc::S_IFSOCK => "a socket",
        libc::S_IFCHR => "a character device",
        libc::S_IFBLK => "a block device",
        _ => "a file of unknown type",
    }
}

/// "a regular file owned by uid 65534 (nobody) with mode 0666 and 1 link".
fn describe(st: &libc::stat) -> String {
    let links = st.st_nlink;
    format!(
        "{} owned by {} with mode {:04o} and {links} link{}",
        kind_of(st.st_mode),
        describe_uid(st.st_uid),
        st.st_mode & 0o7777,
        if links == 1 { "" } else { "s" }
    )
}

fn refusal(path: &str, found: &str) -> Refused {
    Refused::Foreign(format!(
        "refusing shared-memory file {path}: it is {found}, but a CPU world only uses a regular file of its \
         own user ({}) with mode 0600 and one link. Another user may have created it to read or change this \
         group's data, so it was neither joined nor removed: check who made it, remove it as its owner or \
         root, or use another group name",
        describe_uid(my_uid())
    ))
}

fn close(fd: libc::c_int) {
    // SAFETY: fd is an open descriptor owned by the caller, closed once.
    unsafe { libc::close(fd) };
}

fn errno() -> Option<i32> {
    std::io::Error::last_os_error().raw_os_error()
}

/// Opens (creating when absent) the file at `path` and checks it is this
/// user's own segment file.
pub(crate) fn open_own(cpath: &CStr, path: &str) -> Result<Opened, Refused> {
    // O_NOFOLLOW: a link is never followed; O_NONBLOCK: a FIFO planted under
    // the name cannot block the open. Creating with O_EXCL tells a file made
    // here from one found.
    let flags = libc::O_RDWR | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK;
    // SAFETY: cpath is NUL-terminated; flags and mode are plain integers.
    let fd = unsafe { libc::open(cpath.as_ptr(), flags | libc::O_CREAT | libc::O_EXCL, 0o600) };
    let fd = if fd >= 0 {
        // The umask may have cleared bits of the mode asked for.
        // SAFETY: fd is open.
        if unsafe { libc::fchmod(fd, 0o600) } != 0 {
            let e = Error::os(format!("setting mode 0600 on {path}"));
            close(fd);
            return Err(Refused::Os(e));
        }
        fd
    } else if errno() == Some(libc::EEXIST) {
        // SAFETY: as above.
        let fd = unsafe { libc::open(cpath.as_ptr(), flags) };
        if fd < 0 {
            let err = errno();
            let Some(st) = lstat_path(cpath) else {
                // Removed since: look again.
                return Ok(Opened::Again);
            };
            if err == Some(libc::ELOOP) && st.st_mode & libc::S_IFMT == libc::S_IFLNK {
                // A link holds no segment: remove the link itself (never what
                // it points to) and start over.
                // SAFETY: cpath is NUL-terminated; unlink does not follow links.
                if unsafe { libc::unlink(cpath.as_ptr()) } != 0 && errno() != Some(libc::ENOENT) {
                    let why = std::io::Error::last_os_error();
                    return Err(refusal(path, &format!("{} that could not be removed ({why})", describe(&st))));
                }
                return Ok(Opened::Again);
            }
            return Err(refusal(path, &describe(&st)));
        }
        fd
    } else {
        return Err(Refused::Os(Error::os(format!("creating shared-memory file {path}"))));
    };
    let Some(st) = fstat_fd(fd) else {
        let e = Error::os(format!("fstat of {path}"));
        close(fd);
        return Err(Refused::Os(e));
    };
    let own = st.st_mode & libc::S_IFMT == libc::S_IFREG
        && st.st_uid == my_uid()
        && st.st_mode & 0o7777 == 0o600
        && st.st_nlink == 1;
    if !own {
        close(fd);
        return Err(refusal(path, &describe(&st)));
    }
    Ok(Opened::File(OwnFile { fd, ino: dev_ino(&st), size: st.st_size as u64 }))
}
