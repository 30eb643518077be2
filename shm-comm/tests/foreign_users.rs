//! Another user on the same host: nothing under a group's name that this user
//! does not own is joined, read, written or removed.
//!
//! Each test plants what another user could plant under the path or presence
//! name of a group (a file of theirs, a link, a squatted abstract socket) and
//! then forms the group on two thread ranks. Files are made as this user and
//! handed to `nobody` with `chown`, which needs root: CI runs as root, and
//! with `CI` set a non-root run fails instead of passing untested.

use std::ffi::CString;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::Duration;

use shm_comm::{live_members, segment_path, Config, DataType, Error, ErrorKind, ReduceOp, ShmComm};

const WORLD: usize = 2;

/// uid and gid of `nobody` (65534 where the name is unknown).
fn nobody() -> (u32, u32) {
    let name = CString::new("nobody").unwrap();
    // SAFETY: getpwnam reads the NUL-terminated name; the result is read at once.
    let pw = unsafe { libc::getpwnam(name.as_ptr()) };
    if pw.is_null() {
        (65534, 65534)
    } else {
        // SAFETY: pw is a valid passwd record.
        unsafe { ((*pw).pw_uid, (*pw).pw_gid) }
    }
}

/// Whether this run can act as another user (root); without it, a CI run
/// fails and a local run says it skipped.
fn as_root(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    assert!(std::env::var_os("CI").is_none(), "{test}: needs root to create files as another user, and CI is set");
    eprintln!("{test}: skipped (needs root to create files as another user)");
    false
}

fn group(tag: &str) -> String {
    format!("foreign-{tag}-{}", std::process::id())
}

/// Both ranks' rendezvous results.
fn form(name: &str) -> Vec<Result<ShmComm, Error>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..WORLD)
            .map(|r| s.spawn(move || ShmComm::rendezvous(name, WORLD, r, Duration::from_secs(10), &Config::default())))
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank panicked")).collect()
    })
}

/// Runs an all-reduce of `rank + 1` on every formed rank; returns the sums.
fn sums(comms: Vec<ShmComm>) -> Vec<f32> {
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(r, c)| {
                s.spawn(move || {
                    let src = ((r + 1) as f32).to_le_bytes();
                    let mut dst = [0u8; 4];
                    c.all_reduce(DataType::F32, ReduceOp::Sum, &src, &mut dst, Ok::<(), Error>(()))
                        .expect("all_reduce");
                    f32::from_le_bytes(dst)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank panicked")).collect()
    })
}

/// Every rank failed at setup with a message naming `path` and each of `words`.
fn assert_refused(results: Vec<Result<ShmComm, Error>>, path: &str, words: &[&str]) {
    for (r, res) in results.into_iter().enumerate() {
        let e = res.err().unwrap_or_else(|| panic!("rank {r} joined a group whose file is not its own ({path})"));
        let s = e.to_string();
        assert_eq!(e.kind(), Some(ErrorKind::Setup), "rank {r}: {s}");
        assert!(s.contains(path), "rank {r}: the error does not name {path}: {s}");
        for w in words {
            assert!(s.contains(w), "rank {r}: the error does not say {w:?}: {s}");
        }
    }
}

/// Creates `path` with `mode`, owned by `owner` (uid, gid).
fn plant(path: &str, mode: u32, owner: (u32, u32), contents: &[u8]) {
    let _ = std::fs::remove_file(path);
    std::fs::write(path, contents).expect("create the planted file");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    std::os::unix::fs::chown(path, Some(owner.0), Some(owner.1)).expect("chown");
}

#[test]
fn a_world_writable_file_of_another_user_is_refused_on_every_rank_and_left_alone() {
    if !as_root("foreign 0666") {
        return;
    }
    let name = group("0666");
    let path = segment_path(&name);
    let who = nobody();
    plant(&path, 0o666, who, b"");
    let res = form(&name);
    let meta = std::fs::symlink_metadata(&path).expect("the planted file must still be there");
    let _ = std::fs::remove_file(&path);
    assert_refused(res, &path, &[&format!("uid {}", who.0), "mode 0666", "0600", "neither joined nor removed"]);
    assert_eq!(meta.len(), 0, "the planted file was written to");
    assert_eq!((meta.uid(), meta.mode() & 0o7777), (who.0, 0o666), "the planted file was changed");
}

#[test]
fn a_0600_file_of_another_user_is_refused() {
    if !as_root("foreign 0600") {
        return;
    }
    let name = group("0600");
    let path = segment_path(&name);
    let who = nobody();
    plant(&path, 0o600, who, b"");
    let res = form(&name);
    let meta = std::fs::symlink_metadata(&path).expect("the planted file must still be there");
    let _ = std::fs::remove_file(&path);
    assert_refused(res, &path, &[&format!("uid {}", who.0), "mode 0600", "regular file"]);
    assert_eq!(meta.len(), 0, "the planted file was written to");
}

#[test]
fn a_file_of_our_own_with_another_mode_is_refused() {
    // A file of this user that others may read (0644) may have been read.
    let name = group("0644");
    let path = segment_path(&name);
    let me = (
        // SAFETY: geteuid / getegid have no preconditions.
        unsafe { libc::geteuid() },
        unsafe { libc::getegid() },
    );
    plant(&path, 0o644, me, b"");
    let res = form(&name);
    let meta = std::fs::symlink_metadata(&path).expect("the file must still be there");
    let _ = std::fs::remove_file(&path);
    assert_refused(res, &path, &["mode 0644"]);
    assert_eq!(meta.len(), 0, "the file was written to");
}

#[test]
fn a_symlink_of_our_own_under_the_name_is_refused_on_every_rank_and_its_target_never_touched() {
    let name = group("symlink");
    let path = segment_path(&name);
    // An empty file of our own: were the link followed, the rendezvous would
    // size and initialise it.
    let target = format!("{}/foreign-target-{}", Path::new(&path).parent().unwrap().display(), std::process::id());
    std::fs::write(&target, b"").unwrap();
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).unwrap();
    let _ = std::fs::remove_file(&path);
    std::os::unix::fs::symlink(&target, &path).unwrap();
    let res = form(&name);
    let target_len = std::fs::metadata(&target).map(|m| m.len());
    let link = std::fs::symlink_metadata(&path);
    let _ = std::fs::remove_file(&target);
    let _ = std::fs::remove_file(&path);
    // Removing it would race with a rank creating the world's file there.
    assert_refused(res, &path, &["symbolic link owned by", "neither follows nor removes a link", "remove it"]);
    assert_eq!(target_len.expect("the link's target must still exist"), 0, "the link's target was written to");
    assert!(link.expect("the link is left in place").file_type().is_symlink(), "the link was replaced");
    // Once it is gone, the name forms a world.
    assert_eq!(sums(form(&name).into_iter().map(|r| r.expect("no link left")).collect()), vec![3.0; WORLD]);
}

#[test]
fn a_symlink_of_another_user_is_refused_and_left_in_place() {
    if !as_root("foreign symlink") {
        return;
    }
    let name = group("foreign-symlink");
    let path = segment_path(&name);
    let who = nobody();
    // An empty file of our own: were the link followed, the rendezvous would
    // size and initialise it.
    let target = format!("{}/foreign-link-target-{}", Path::new(&path).parent().unwrap().display(), std::process::id());
    std::fs::write(&target, b"").unwrap();
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).unwrap();
    let _ = std::fs::remove_file(&path);
    std::os::unix::fs::symlink(&target, &path).unwrap();
    std::os::unix::fs::lchown(&path, Some(who.0), Some(who.1)).expect("lchown");
    let res = form(&name);
    let link = std::fs::symlink_metadata(&path);
    let target_len = std::fs::metadata(&target).map(|m| m.len());
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(&target);
    assert_refused(res, &path, &[&format!("uid {}", who.0), "a symbolic link", "neither joined nor removed"]);
    let link = link.expect("another user's link must be left in place");
    assert!(link.file_type().is_symlink() && link.uid() == who.0, "the link was replaced: {link:?}");
    assert_eq!(target_len.expect("the link's target must still exist"), 0, "the link's target was written to");
}

#[test]
fn a_hard_link_under_the_name_is_refused_and_both_names_kept() {
    if !as_root("hard link") {
        return;
    }
    let name = group("hardlink");
    let path = segment_path(&name);
    // A file of this user, 0600, reachable under a second name: whoever made
    // the link could reach the data through it.
    let other = format!("{}/foreign-linked-{}", Path::new(&path).parent().unwrap().display(), std::process::id());
    std::fs::write(&other, b"").unwrap();
    std::fs::set_permissions(&other, std::fs::Permissions::from_mode(0o600)).unwrap();
    let _ = std::fs::remove_file(&path);
    std::fs::hard_link(&other, &path).unwrap();
    let res = form(&name);
    let (a, b) = (std::fs::metadata(&path), std::fs::metadata(&other));
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(&other);
    assert_refused(res, &path, &["2 links", "one link"]);
    assert_eq!(a.expect("the name must be kept").len(), 0, "the linked file was written to");
    assert_eq!(b.expect("the other name must be kept").len(), 0);
}

#[test]
fn a_fifo_under_the_name_neither_blocks_the_rendezvous_nor_is_used() {
    // Opening a FIFO only for reading or only for writing waits for the
    // other end (Linux opens one for both at once, as the rendezvous does);
    // one of our own with mode 0600 passes every check but the file type.
    let name = group("fifo");
    let path = segment_path(&name);
    let _ = std::fs::remove_file(&path);
    let c = CString::new(path.clone()).unwrap();
    // SAFETY: c is NUL-terminated.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let n = name.clone();
    std::thread::spawn(move || {
        let _ = tx.send(form(&n));
    });
    let res = rx.recv_timeout(Duration::from_secs(30)).expect("the rendezvous blocked on a FIFO");
    let meta = std::fs::symlink_metadata(&path).expect("the FIFO must still be there");
    let _ = std::fs::remove_file(&path);
    assert_refused(res, &path, &["a FIFO", "neither joined nor removed"]);
    assert!(meta.file_type().is_fifo());
}

/// A process of `nobody` holding a read lease (`F_SETLEASE`) on `path`
/// until dropped: an open of it for writing waits until the lease is given
/// up, at most /proc/sys/fs/lease-break-time seconds (45 by default),
/// unless it is non-blocking (then it fails with EWOULDBLOCK at once).
fn lease(path: &str) -> AsNobody {
    let c = CString::new(path).unwrap();
    AsNobody::spawn(&format!("lease {path}"), move || {
        // SAFETY: c is NUL-terminated; plain system calls.
        unsafe {
            let fd = libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
            fd >= 0 && libc::fcntl(fd, libc::F_SETLEASE, libc::F_RDLCK) == 0
        }
    })
}

#[test]
fn a_leased_file_of_another_user_is_refused_without_waiting_for_the_lease() {
    if !as_root("leased file") {
        return;
    }
    let name = group("lease");
    let path = segment_path(&name);
    let who = nobody();
    plant(&path, 0o644, who, b"");
    let leaser = lease(&path);
    let started = std::time::Instant::now();
    let res = form(&name);
    let took = started.elapsed();
    drop(leaser);
    let _ = std::fs::remove_file(&path);
    assert!(took < Duration::from_secs(10), "the rendezvous waited {took:?} for another user's lease");
    assert_refused(res, &path, &[&format!("uid {}", who.0), "mode 0644"]);
}

#[test]
fn a_stale_file_of_our_own_is_reclaimed() {
    let name = group("stale");
    let path = segment_path(&name);
    let me = (
        // SAFETY: geteuid / getegid have no preconditions.
        unsafe { libc::geteuid() },
        unsafe { libc::getegid() },
    );
    // A crashed run's leftover: ours, 0600, not a segment of this version.
    plant(&path, 0o600, me, &[0xa5; 8192]);
    let res = form(&name);
    let comms: Vec<ShmComm> = res.into_iter().map(|r| r.expect("a stale file of our own is replaced")).collect();
    assert_eq!(sums(comms), vec![3.0; WORLD]);
    assert!(std::fs::symlink_metadata(&path).is_err(), "the formed world left its file under {path}");
}

/// A child process of `nobody` that holds the abstract Unix socket names
/// `names` bound until it is dropped.
fn squat(names: &[String]) -> AsNobody {
    let addrs: Vec<(libc::sockaddr_un, libc::socklen_t)> = names
        .iter()
        .map(|n| {
            // SAFETY: sockaddr_un is plain data.
            let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
            a.sun_family = libc::AF_UNIX as libc::sa_family_t;
            for (d, s) in a.sun_path[1..].iter_mut().zip(n.as_bytes()) {
                *d = *s as libc::c_char;
            }
            (a, (std::mem::size_of::<libc::sa_family_t>() + 1 + n.len()) as libc::socklen_t)
        })
        .collect();
    AsNobody::spawn("bind its names", move || {
        addrs.iter().all(|(a, len)| {
            // SAFETY: a is a valid sockaddr_un of length len; plain system calls.
            unsafe {
                let fd = libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM, 0);
                fd >= 0 && libc::bind(fd, a as *const libc::sockaddr_un as *const libc::sockaddr, *len) == 0
            }
        })
    })
}

/// A child process, forked from this one and running as `nobody`, that does
/// what it is given ([`AsNobody::spawn`]) and keeps what that holds (names,
/// leases, descriptors) until it is dropped. It is not exec'd, so it needs no
/// access to this test binary's directory.
struct AsNobody {
    pid: libc::pid_t,
    release: libc::c_int,
}

impl AsNobody {
    /// Forks a child that keeps only its two pipe ends, becomes `nobody`,
    /// runs `act` (true: it did what it should) and waits until dropped; the
    /// parent asserts `act` succeeded (`what` says what it was).
    fn spawn(what: &str, act: impl FnOnce() -> bool) -> AsNobody {
        let (uid, gid) = nobody();
        let (mut ready, mut release) = ([0; 2], [0; 2]);
        // SAFETY: both arrays hold two descriptors.
        unsafe {
            assert_eq!(libc::pipe2(ready.as_mut_ptr(), libc::O_CLOEXEC), 0);
            assert_eq!(libc::pipe2(release.as_mut_ptr(), libc::O_CLOEXEC), 0);
        }
        // SAFETY: the child makes only system calls on memory prepared before
        // the fork (`act` included), then _exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // SAFETY: plain system calls, see above.
            unsafe {
                // Keep only the two pipe ends it uses (moved to 1000 and up):
                // every other descriptor this process had open (other tests'
                // segment files, the release pipe's write end) is closed, so the
                // child holds nothing but what `act` makes.
                let w = libc::fcntl(ready[1], libc::F_DUPFD, 1000);
                let r = libc::fcntl(release[0], libc::F_DUPFD, w + 1);
                libc::syscall(libc::SYS_close_range, 3u32, 999u32, 0u32);
                libc::syscall(libc::SYS_close_range, (w + 1) as u32, (r - 1) as u32, 0u32);
                libc::syscall(libc::SYS_close_range, (r + 1) as u32, u32::MAX, 0u32);
                // A lease break is signalled with SIGIO, which would end the child.
                libc::signal(libc::SIGIO, libc::SIG_IGN);
                let became = w >= 0 && r > w && libc::setgid(gid) == 0 && libc::setuid(uid) == 0;
                let ok = u8::from(became && act());
                libc::write(w, &ok as *const u8 as *const libc::c_void, 1);
                let mut byte = 0u8;
                libc::read(r, &mut byte as *mut u8 as *mut libc::c_void, 1);
                libc::_exit(0);
            }
        }
        let mut ok = 0u8;
        // SAFETY: closing our copies of the child's ends; reading one byte into ok.
        let n = unsafe {
            libc::close(ready[1]);
            libc::close(release[0]);
            let n = libc::read(ready[0], &mut ok as *mut u8 as *mut libc::c_void, 1);
            libc::close(ready[0]);
            n
        };
        let child = AsNobody { pid, release: release[1] };
        assert!(n == 1 && ok == 1, "the child could not become nobody and {what}");
        child
    }
}

impl Drop for AsNobody {
    fn drop(&mut self) {
        // SAFETY: closing the release pipe lets the child exit; then reap it.
        unsafe {
            libc::close(self.release);
            let mut status = 0;
            libc::waitpid(self.pid, &mut status, 0);
        }
    }
}

#[test]
fn presence_names_squatted_by_another_user_neither_block_nor_pose_as_a_world() {
    if !as_root("squatted presence") {
        return;
    }
    let name = group("squat");
    let path = segment_path(&name);
    // The hash that keys the group's presence names ends the segment path.
    let hash = &path[path.len() - 16..];
    let staging = Config::default().staging_bytes;
    let me = std::process::id();
    // This process's start time: names carry it, and a name counts only while
    // its process lives.
    let stat = std::fs::read_to_string("/proc/self/stat").expect("stat");
    let start = stat[stat.rfind(')').expect(")") + 1..].split_whitespace().nth(19).expect("starttime").to_string();
    let squatter = squat(&[
        // A live world of another size under the name: would refuse every joiner.
        format!("ascend-moe/{hash}/3/{staging}/0/{me}"),
        format!("ascend-moe/{hash}/3/{staging}/0/{me}/{start}/0000000000000000"),
        // The very names this process's ranks would announce without a nonce.
        format!("ascend-moe/{hash}/{WORLD}/{staging}/0/{me}"),
        format!("ascend-moe/{hash}/{WORLD}/{staging}/1/{me}"),
    ]);
    let res = form(&name);
    let comms: Vec<ShmComm> = res.into_iter().map(|r| r.expect("another user's names must not count")).collect();
    let members = live_members(&name);
    assert_eq!(members.len(), WORLD, "members other than this world's ranks: {members:?}");
    assert!(members.iter().all(|m| m.world == WORLD && m.pid == me), "{members:?}");
    assert_eq!(sums(comms), vec![3.0; WORLD]);
    drop(squatter);
    assert!(live_members(&name).is_empty(), "presence outlived the handles");
}

#[test]
fn racing_ranks_form_one_world_every_time() {
    // Every rank opens the name at once: one creates the file, the others
    // open it while it is still empty and must see it sized once they hold
    // the setup lock, never take it for a new file of their own.
    for round in 0..40 {
        let name = group(&format!("race{round}"));
        let comms: Vec<ShmComm> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|r| {
                    let name = &name;
                    s.spawn(move || ShmComm::rendezvous(name, 4, r, Duration::from_secs(10), &Config::default()))
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank panicked").expect("rendezvous")).collect()
        });
        assert_eq!(sums(comms), vec![10.0; 4], "round {round}");
    }
}
