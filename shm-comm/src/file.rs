//! The file that backs a group's segment: opened without following links and
//! used only when it is this user's own.
//!
//! The path of a group's file follows from the group name alone, so any local
//! user can create it first. A file is therefore joined only when it is a
//! regular file owned by this process's effective uid, with mode 0600 and one
//! link: another user can neither have written it nor open it, and no other
//! name leads to the same inode. Anything else under the name is refused with
//! an error naming the path, its owner and mode, and is left in place (it is
//! not ours to remove). A symbolic link is never followed, so the file it
//! points to is never opened, read or written; a link of this user's own is
//! removed like any other name that holds no segment, and another user's is
//! refused and left in place like their files. (A link is removed by name
//! once `lstat` said what the name holds: were another user's link removed,
//! as root may, a rank of this world could have replaced it with the
//! world's new file in between, and that file would be removed instead.)

use std::ffi::CStr;

use crate::process::{describe_uid, my_uid};
use crate::Error;

/// The group's file, open read-write, checked as this user's own.
pub(crate) struct OwnFile {
    pub fd: libc::c_int,
    /// (device, inode).
    pub ino: (u64, u64),
}

impl OwnFile {
    /// The file's size now (read it under the setup lock: a rank that held
    /// the lock before may have sized it since it was opened).
    pub(crate) fn size(&self, path: &str) -> Result<u64, Error> {
        fstat_fd(self.fd).map(|st| st.st_size as u64).ok_or_else(|| Error::os(format!("fstat of {path}")))
    }
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

/// Checks that no other user can rename or remove names in directory
/// `dir`, where the group's files are made. The owner of a directory (and
/// root) may rename or remove any entry of it, and so may everyone who can
/// write to it unless it is sticky (`S_ISVTX`: then only the owner of an
/// entry may, POSIX `rename`/`unlink`, EACCES/EPERM). In a directory that
/// others could change, another user could move a forming world's file under
/// the name of another world, whose ranks would join it, or remove it. So
/// the directory (what the name resolves to, and the link itself when it is
/// one) must belong to this user or root (see [`unmapped_uid`] for a user
/// namespace), and be sticky when group or others may write to it.
pub(crate) fn check_dir(dir: &str) -> Result<(), Refused> {
    let c = std::ffi::CString::new(dir)
        .map_err(|_| Refused::Foreign(format!("invalid shared-memory directory {dir:?} (NUL byte)")))?;
    let unmapped = unmapped_uid();
    let trusted = |uid: libc::uid_t| uid == my_uid() || uid == 0 || Some(uid) == unmapped;
    let refuse = |found: String, why: &str| {
        Refused::Foreign(format!(
            "refusing shared-memory directory {dir}: it is {found}; {why}, so another user could rename or \
             remove this group's files there (move them under the name of another group, or replace them). \
             A CPU world only uses a directory of its own user ({}) or root that only its owner may write \
             to, or that is sticky (like /dev/shm and /tmp, mode 1777)",
            describe_uid(my_uid())
        ))
    };
    let Some(l) = lstat_path(&c) else {
        return Err(Refused::Os(Error::os(format!("shared-memory directory {dir}"))));
    };
    if l.st_mode & libc::S_IFMT == libc::S_IFLNK && !trusted(l.st_uid) {
        return Err(refuse(describe_dir(&l), "its owner may point it elsewhere at any time"));
    }
    let mut st = zeroed_stat();
    // SAFETY: c is NUL-terminated and st a valid out-parameter.
    if unsafe { libc::stat(c.as_ptr(), &mut st) } != 0 {
        return Err(Refused::Os(Error::os(format!("shared-memory directory {dir}"))));
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
        return Err(refuse(describe_dir(&st), "it is not a directory"));
    }
    if !trusted(st.st_uid) {
        return Err(refuse(describe_dir(&st), "its owner may rename or remove any file in it"));
    }
    let others_write = st.st_mode & (libc::S_IWGRP | libc::S_IWOTH) != 0;
    if others_write && st.st_mode & libc::S_ISVTX == 0 {
        return Err(refuse(describe_dir(&st), "others may write to it and it is not sticky"));
    }
    Ok(())
}

/// In a user namespace other than the first, the uid that every user the
/// namespace does not map shows as (`/proc/sys/kernel/overflowuid`,
/// user_namespaces(7)); `None` in the initial namespace, where that uid is
/// a user of its own (`nobody`). The host's root is one of the unmapped
/// users there, and its /dev/shm shows as theirs: a directory of that uid
/// is trusted like root's, as the namespace cannot tell them apart.
fn unmapped_uid() -> Option<libc::uid_t> {
    let map = std::fs::read_to_string("/proc/self/uid_map").ok()?;
    let whole: Vec<&str> = map.split_whitespace().collect();
    if whole == ["0", "0", "4294967295"] {
        return None;
    }
    std::fs::read_to_string("/proc/sys/kernel/overflowuid").ok()?.trim().parse().ok()
}

/// "a directory owned by uid 0 (root) with mode 0777".
fn describe_dir(st: &libc::stat) -> String {
    format!("{} owned by {} with mode {:04o}", kind_of(st.st_mode), describe_uid(st.st_uid), st.st_mode & 0o7777)
}

/// Opens (creating when absent) the file at `path` and checks it is this
/// user's own segment file.
pub(crate) fn open_own(cpath: &CStr, path: &str) -> Result<Opened, Refused> {
    // O_NOFOLLOW: a link is never followed. O_NONBLOCK: nothing planted
    // under the name can make the open wait: not a FIFO (which POSIX leaves
    // free to wait for the other end when opened for both), nor a file whose
    // owner holds a lease on it (fcntl F_SETLEASE), which an open for writing
    // waits to break for up to /proc/sys/fs/lease-break-time (45 s by
    // default) unless it fails with EWOULDBLOCK instead. Creating with
    // O_EXCL tells a file made here from one found.
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
            if err == Some(libc::ELOOP) && st.st_mode & libc::S_IFMT == libc::S_IFLNK && st.st_uid == my_uid() {
                // A link of our own holds no segment: remove the link itself
                // (never what it points to) and start over.
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
    Ok(Opened::File(OwnFile { fd, ino: dev_ino(&st) }))
}
