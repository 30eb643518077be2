//! Another user on the same host: nothing under a group's name that this user
//! does not own is joined, read, written or removed.
//!
//! Each test plants what another user could plant under the path or presence
//! name of a group (a file of theirs, a link, a squatted abstract socket) and
//! then forms the group on two thread ranks. Files are made as this user and
//! handed to `nobody` with `chown`, which needs root: CI runs as root, and
//! with `CI` set a non-root run fails instead of passing untested.

use std::ffi::CString;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
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
fn a_symlink_under_the_name_is_removed_and_its_target_never_touched() {
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
    let _ = std::fs::remove_file(&target);
    let comms: Vec<ShmComm> = res.into_iter().map(|r| r.expect("a link holds no segment: it is replaced")).collect();
    assert_eq!(target_len.expect("the link's target must still exist"), 0, "the link's target was written to");
    assert_eq!(sums(comms), vec![3.0; WORLD]);
    assert!(std::fs::symlink_metadata(&path).is_err(), "the link (or a segment) is left under {path}");
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

/// Set in the squatter process: the abstract names it binds, one per line.
const SQUAT: &str = "SHM_COMM_TEST_SQUAT";

/// Binds every name of `names` (newline-separated) to a datagram socket, says
/// `bound` and holds them until its standard input closes.
fn squatter_main(names: &str) -> i32 {
    let mut fds = Vec::new();
    for n in names.lines() {
        // SAFETY: plain socket creation.
        let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM, 0) };
        // SAFETY: sockaddr_un is plain data.
        let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        a.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (d, s) in a.sun_path[1..].iter_mut().zip(n.as_bytes()) {
            *d = *s as libc::c_char;
        }
        let len = (std::mem::size_of::<libc::sa_family_t>() + 1 + n.len()) as libc::socklen_t;
        // SAFETY: a is a valid sockaddr_un of at least len bytes.
        if fd < 0 || unsafe { libc::bind(fd, &a as *const libc::sockaddr_un as *const libc::sockaddr, len) } != 0 {
            let line = format!("failed to bind {n}: {}\n", std::io::Error::last_os_error());
            // SAFETY: the buffer is valid for its length.
            unsafe { libc::write(1, line.as_ptr() as *const libc::c_void, line.len()) };
            return 1;
        }
        fds.push(fd);
    }
    // Straight to the descriptor: the test harness may capture `println!`.
    // SAFETY: getuid has no preconditions; the buffer is valid for its length.
    let line = format!("bound as uid {}\n", unsafe { libc::getuid() });
    unsafe { libc::write(1, line.as_ptr() as *const libc::c_void, line.len()) };
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut std::io::stdin(), &mut rest);
    0
}

/// This test binary run again as `nobody`, holding abstract names bound
/// until it is dropped.
struct Squatter(std::process::Child);

impl Squatter {
    fn bind(test: &str, names: &[String]) -> Squatter {
        use std::io::BufRead;
        use std::os::unix::process::CommandExt;
        let (uid, gid) = nobody();
        let mut child = std::process::Command::new(std::env::current_exe().expect("test binary"))
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env(SQUAT, names.join("\n"))
            .uid(uid)
            .gid(gid)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("spawn the squatter");
        let out = std::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
        // The test harness prints its own text first, also on the same line.
        let said = out
            .map_while(|l| l.ok())
            .find_map(|l| l.find("bound as").or_else(|| l.find("failed to bind")).map(|at| l[at..].to_string()))
            .unwrap_or_default();
        let s = Squatter(child);
        assert_eq!(said, format!("bound as uid {uid}"), "the squatter could not bind its names as nobody");
        s
    }
}

impl Drop for Squatter {
    fn drop(&mut self) {
        // Closing its standard input lets it exit.
        drop(self.0.stdin.take());
        let _ = self.0.wait();
    }
}

#[test]
fn presence_names_squatted_by_another_user_neither_block_nor_pose_as_a_world() {
    const TEST: &str = "presence_names_squatted_by_another_user_neither_block_nor_pose_as_a_world";
    if let Ok(names) = std::env::var(SQUAT) {
        std::process::exit(squatter_main(&names));
    }
    if !as_root("squatted presence") {
        return;
    }
    let name = group("squat");
    let path = segment_path(&name);
    // The hash that keys the group's presence names ends the segment path.
    let hash = &path[path.len() - 16..];
    let staging = Config::default().staging_bytes;
    let me = std::process::id();
    let squatter = Squatter::bind(
        TEST,
        &[
            // A live world of another size under the name: would refuse every joiner.
            format!("ascend-moe/{hash}/3/{staging}/0/{me}"),
            format!("ascend-moe/{hash}/3/{staging}/0/{me}/0000000000000000"),
            // The very names this process's ranks would announce without a nonce.
            format!("ascend-moe/{hash}/{WORLD}/{staging}/0/{me}"),
            format!("ascend-moe/{hash}/{WORLD}/{staging}/1/{me}"),
        ],
    );
    let res = form(&name);
    let comms: Vec<ShmComm> = res.into_iter().map(|r| r.expect("another user's names must not count")).collect();
    let members = live_members(&name);
    assert_eq!(members.len(), WORLD, "members other than this world's ranks: {members:?}");
    assert!(members.iter().all(|m| m.world == WORLD && m.pid == me), "{members:?}");
    assert_eq!(sums(comms), vec![3.0; WORLD]);
    drop(squatter);
    assert!(live_members(&name).is_empty(), "presence outlived the handles");
}
