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
//! points to is never opened, read or written, and it is refused and left in
//! place, also one of this user's own: a link could only be removed by name
//! once `lstat` said what the name holds, and a rank of this world could
//! have removed it and put the world's new file there in between, which
//! would be removed instead.

use std::ffi::CStr;

use crate::process::{describe_uid, my_uid, tracked};
use crate::Error;

/// The group's file, open read-write, checked as this user's own. Its
/// descriptor is tracked: close it with [`crate::process::close_fd`].
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
    refused(
        path,
        found,
        "Another user may have created it to read or change this group's data, so it was neither joined nor \
         removed: check who made it, remove it as its owner or root, or use another group name",
    )
}

/// A symbolic link of this user's own under the name: refused too. Removing
/// it by name, after `lstat` said it was a link, would race with a rank of
/// the world that removed it first and created the world's file in its
/// place: that file would be removed, and the world never form.
fn own_link_refusal(path: &str, st: &libc::stat) -> Refused {
    refused(
        path,
        &describe(st),
        "A CPU world neither follows nor removes a link under its group's name: remove it, or use another \
         group name",
    )
}

fn refused(path: &str, found: &str, then: &str) -> Refused {
    Refused::Foreign(format!(
        "refusing shared-memory file {path}: it is {found}, but a CPU world only uses a regular file of its own \
         user ({}) with mode 0600 and one link. {then}",
        describe_uid(my_uid())
    ))
}

fn close(fd: libc::c_int) {
    crate::process::close_fd(fd);
}

fn errno() -> Option<i32> {
    std::io::Error::last_os_error().raw_os_error()
}

/// Checks that no other user can rename or remove names in directory
/// `dir`, where the group's files are made, or on the way to it. The owner
/// of a directory (and root) may rename or remove any entry of it, and so
/// may everyone who can write to it unless it is sticky (`S_ISVTX`: then
/// only the owner of an entry may, POSIX `rename`/`unlink`, EACCES/EPERM).
/// In a directory that others could change, another user could move a
/// forming world's file under the name of another world, whose ranks would
/// join it, or remove it; in one on the way to it, they could move the whole
/// directory aside and put one of their own in its place. So every directory
/// from `/` to `dir` (links resolved one by one) must belong to this user
/// or root (see [`unmapped_uid`] for a user namespace) and be sticky when
/// group or others may write to it, and every symbolic link met on the way
/// must belong to this user or root (its owner may point it elsewhere at
/// any time).
pub(crate) fn check_dir(dir: &str) -> Result<(), Refused> {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    use std::path::{Component, Path, PathBuf};
    let unmapped = unmapped_uid();
    let trusted = |uid: libc::uid_t| uid == my_uid() || uid == 0 || Some(uid) == unmapped;
    let refuse = |at: &Path, found: String, why: &str| {
        let at = at.display().to_string();
        let which = if at == dir { String::new() } else { format!(" (on the way to it, {at})") };
        Refused::Foreign(format!(
            "refusing shared-memory directory {dir}{which}: it is {found}; {why}, so another user could rename or \
             remove this group's files there (move them under the name of another group, or replace them). \
             A CPU world only uses a directory of its own user ({}) or root that only its owner may write \
             to, or that is sticky (like /dev/shm and /tmp, mode 1777), reached through directories and links \
             of the same kind",
            describe_uid(my_uid())
        ))
    };
    let os = |at: &Path| Refused::Os(Error::os(format!("shared-memory directory {dir}: {}", at.display())));
    let lstat_of = |at: &Path| {
        std::ffi::CString::new(at.as_os_str().as_bytes()).ok().and_then(|c| lstat_path(&c)).ok_or_else(|| os(at))
    };
    if dir.as_bytes().contains(&0) {
        return Err(Refused::Foreign(format!("invalid shared-memory directory {dir:?} (NUL byte)")));
    }
    let start = Path::new(dir);
    let start = if start.is_absolute() {
        start.to_path_buf()
    } else {
        std::env::current_dir().map_err(|_| os(start))?.join(start)
    };
    // Components still to walk, first at the end; `at` never holds a link.
    let mut todo: Vec<std::ffi::OsString> = Vec::new();
    let push = |todo: &mut Vec<std::ffi::OsString>, p: &Path| {
        for c in p.components().rev() {
            match c {
                Component::Normal(n) => todo.push(n.to_os_string()),
                Component::ParentDir => todo.push(OsStr::new("..").to_os_string()),
                Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
            }
        }
    };
    push(&mut todo, &start);
    let mut at = PathBuf::from("/");
    let mut links = 0;
    let check = |at: &Path, st: &libc::stat| -> Result<(), Refused> {
        if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
            return Err(refuse(at, describe_dir(st), "it is not a directory"));
        }
        if !trusted(st.st_uid) {
            return Err(refuse(at, describe_dir(st), "its owner may rename or remove any file in it"));
        }
        let others_write = st.st_mode & (libc::S_IWGRP | libc::S_IWOTH) != 0;
        if others_write && st.st_mode & libc::S_ISVTX == 0 {
            return Err(refuse(at, describe_dir(st), "others may write to it and it is not sticky"));
        }
        Ok(())
    };
    check(&at, &lstat_of(&at)?)?;
    while let Some(name) = todo.pop() {
        if name == ".." {
            // `at` holds no link, so its parent is the parent on disk.
            at.pop();
            continue;
        }
        let next = at.join(&name);
        let l = lstat_of(&next)?;
        if l.st_mode & libc::S_IFMT == libc::S_IFLNK {
            if !trusted(l.st_uid) {
                return Err(refuse(&next, describe_dir(&l), "its owner may point it elsewhere at any time"));
            }
            links += 1;
            // The kernel's own bound on links followed in one lookup (path_resolution(7)).
            if links > 40 {
                return Err(Refused::Os(Error::Io {
                    what: format!("shared-memory directory {dir}: more than 40 symbolic links"),
                    msg: std::io::Error::from_raw_os_error(libc::ELOOP).to_string(),
                }));
            }
            let target = std::fs::read_link(&next).map_err(|_| os(&next))?;
            if target.is_absolute() {
                at = PathBuf::from("/");
            }
            push(&mut todo, &target);
            continue;
        }
        check(&next, &l)?;
        at = next;
    }
    Ok(())
}

/// In a user namespace other than the first, the uid that every user the
/// namespace does not map shows as (`/proc/sys/kernel/overflowuid`,
/// user_namespaces(7)); `None` in the initial namespace, where that uid is
/// a user of its own (`nobody`). The host's root is one of the unmapped
/// users there, and its /dev/shm shows as theirs: a directory of that uid
/// is trusted like root's, as the namespace cannot tell them apart.
pub(crate) fn unmapped_uid() -> Option<libc::uid_t> {
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
    // Every descriptor of the file is tracked: a child forked while this
    // process holds it must not keep its locks (crate::process::tracked).
    // SAFETY: cpath is NUL-terminated; flags and mode are plain integers.
    let fd = tracked(|| unsafe { libc::open(cpath.as_ptr(), flags | libc::O_CREAT | libc::O_EXCL, 0o600) });
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
        let fd = tracked(|| unsafe { libc::open(cpath.as_ptr(), flags) });
        if fd < 0 {
            let err = errno();
            let Some(st) = lstat_path(cpath) else {
                // Removed since: look again.
                return Ok(Opened::Again);
            };
            if err == Some(libc::ELOOP) && st.st_mode & libc::S_IFMT == libc::S_IFLNK && st.st_uid == my_uid() {
                return Err(own_link_refusal(path, &st));
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
    match seen(&st) {
        Seen::Own => Ok(Opened::File(OwnFile { fd, ino: dev_ino(&st) })),
        Seen::Gone => {
            close(fd);
            Ok(Opened::Again)
        }
        Seen::Foreign => {
            close(fd);
            Err(refusal(path, &describe(&st)))
        }
    }
}

/// What the `fstat` of a descriptor opened by a group's name says.
#[derive(Debug, PartialEq)]
enum Seen {
    /// This user's own segment file.
    Own,
    /// No link left: another rank removed the file (a stale one, or an
    /// empty one it gave up) between the open and the `fstat`, so the name
    /// no longer leads to it and must be looked up again.
    Gone,
    /// Anything else under the name: never used.
    Foreign,
}

fn seen(st: &libc::stat) -> Seen {
    if st.st_nlink == 0 {
        Seen::Gone
    } else if is_own(st) {
        Seen::Own
    } else {
        Seen::Foreign
    }
}

/// A segment file as this user's own makes it: a regular file of this user,
/// mode 0600, one link.
fn is_own(st: &libc::stat) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFREG
        && st.st_uid == my_uid()
        && st.st_mode & 0o7777 == 0o600
        && st.st_nlink == 1
}

/// The file at `cpath` if it exists and is this user's own (as [`open_own`]
/// takes it), opened without creating, following links or waiting; else
/// `None`.
pub(crate) fn open_existing_own(cpath: &CStr) -> Option<OwnFile> {
    let flags = libc::O_RDWR | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK;
    // SAFETY: cpath is NUL-terminated; flags are plain integers.
    let fd = tracked(|| unsafe { libc::open(cpath.as_ptr(), flags) });
    if fd < 0 {
        return None;
    }
    match fstat_fd(fd).filter(is_own) {
        Some(st) => Some(OwnFile { fd, ino: dev_ino(&st) }),
        None => {
            close(fd);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{symlink, PermissionsExt};
    use std::path::{Path, PathBuf};

    use super::{check_dir, fstat_fd, seen, Refused, Seen};

    /// A fresh directory of this user, mode 0700, under the temp dir.
    fn base(tag: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("shm-comm-dirs-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir(&p).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o700)).unwrap();
        p
    }

    fn dir(p: &Path, mode: u32) {
        std::fs::create_dir(p).unwrap();
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    fn refused(p: &Path) -> String {
        match check_dir(p.to_str().unwrap()) {
            Ok(()) => panic!("{} was accepted", p.display()),
            Err(Refused::Foreign(why)) => why,
            Err(Refused::Os(e)) => e.to_string(),
        }
    }

    fn accepted(p: &Path) {
        match check_dir(p.to_str().unwrap()) {
            Ok(()) => {}
            Err(Refused::Foreign(why)) => panic!("{} was refused: {why}", p.display()),
            Err(Refused::Os(e)) => panic!("{} was refused: {e}", p.display()),
        }
    }

    #[test]
    fn a_directory_reached_through_one_others_may_change_is_refused_naming_it() {
        let b = base("open");
        dir(&b.join("open"), 0o777);
        dir(&b.join("open/shm"), 0o700);
        let why = refused(&b.join("open/shm"));
        let open = b.join("open").display().to_string();
        assert!(why.contains(&format!("(on the way to it, {open})")), "{why}");
        assert!(why.contains("mode 0777") && why.contains("not sticky"), "{why}");
        // Sticky, like /tmp: others cannot rename what is not theirs.
        std::fs::set_permissions(b.join("open"), std::fs::Permissions::from_mode(0o1777)).unwrap();
        accepted(&b.join("open/shm"));
        std::fs::remove_dir_all(&b).unwrap();
    }

    #[test]
    fn links_are_followed_one_by_one_and_what_they_lead_through_is_checked() {
        let b = base("links");
        dir(&b.join("good"), 0o700);
        dir(&b.join("good/shm"), 0o700);
        dir(&b.join("open"), 0o777);
        dir(&b.join("open/shm"), 0o700);
        // A link of our own into a good directory, and one through `..`.
        symlink(b.join("good/shm"), b.join("abs")).unwrap();
        symlink("../good/shm", b.join("good/rel")).unwrap();
        accepted(&b.join("abs"));
        accepted(&b.join("good/rel"));
        accepted(&b.join("good/../abs/."));
        // A relative target that climbs into a directory others may change.
        symlink("../open/shm", b.join("good/bad")).unwrap();
        let why = refused(&b.join("good/bad"));
        assert!(why.contains(&format!("(on the way to it, {})", b.join("open").display())), "{why}");
        // A loop ends with ELOOP's text, not a hang.
        symlink(b.join("loop2"), b.join("loop1")).unwrap();
        symlink(b.join("loop1"), b.join("loop2")).unwrap();
        let why = refused(&b.join("loop1"));
        assert!(why.contains("more than 40 symbolic links"), "{why}");
        // Not a directory at all.
        std::fs::write(b.join("file"), b"x").unwrap();
        let why = refused(&b.join("file"));
        assert!(why.contains("it is a regular file") && why.contains("it is not a directory"), "{why}");
        std::fs::remove_dir_all(&b).unwrap();
    }

    #[test]
    fn a_file_removed_after_its_opening_is_looked_up_again_not_refused() {
        use std::os::fd::AsRawFd;
        let b = base("gone");
        let p = b.join("segment");
        let f = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&p).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(seen(&fstat_fd(f.as_raw_fd()).unwrap()), Seen::Own);
        // A second name for it is not one of ours.
        std::fs::hard_link(&p, b.join("second")).unwrap();
        assert_eq!(seen(&fstat_fd(f.as_raw_fd()).unwrap()), Seen::Foreign);
        std::fs::remove_file(b.join("second")).unwrap();
        // Removed by another rank after this one opened it: gone, not foreign.
        std::fs::remove_file(&p).unwrap();
        assert_eq!(seen(&fstat_fd(f.as_raw_fd()).unwrap()), Seen::Gone);
        std::fs::remove_dir_all(&b).unwrap();
    }

    /// A directory or link of another user on the way: chown needs root (CI
    /// runs as root; with `CI` set a non-root run fails instead of passing
    /// untested).
    #[test]
    fn a_directory_or_link_of_another_user_on_the_way_is_refused() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            assert!(std::env::var_os("CI").is_none(), "needs root to chown, and CI is set");
            eprintln!("skipped: needs root to chown");
            return;
        }
        let nobody = 65534;
        let b = base("foreign");
        dir(&b.join("theirs"), 0o755);
        dir(&b.join("theirs/shm"), 0o700);
        std::os::unix::fs::chown(b.join("theirs"), Some(nobody), Some(nobody)).unwrap();
        let why = refused(&b.join("theirs/shm"));
        assert!(why.contains(&format!("(on the way to it, {})", b.join("theirs").display())), "{why}");
        assert!(why.contains("owned by uid 65534") && why.contains("rename or remove any file in it"), "{why}");
        dir(&b.join("mine"), 0o700);
        symlink(b.join("mine"), b.join("link")).unwrap();
        accepted(&b.join("link"));
        std::os::unix::fs::lchown(b.join("link"), Some(nobody), Some(nobody)).unwrap();
        let why = refused(&b.join("link"));
        assert!(why.contains("a symbolic link owned by uid 65534") && why.contains("point it elsewhere"), "{why}");
        std::fs::remove_dir_all(&b).unwrap();
    }
}
