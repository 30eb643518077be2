//! A shared-memory directory too small for a world: the rendezvous fails on
//! every rank with an error naming the size and the directory, instead of a
//! SIGBUS in the first collective that touches memory the directory cannot
//! back.
//!
//! The world runs in a process of its own (this test binary again, with
//! `SHM_COMM_SPACE_ROLE` set) inside a private mount namespace whose
//! /dev/shm is a 2 MiB tmpfs (`unshare -m`, which needs root or user
//! namespaces). Where that is not allowed the test says so and passes; the
//! error text is also checked by unit tests that need no namespace.
//!
//! Likewise a /dev/shm that other users could rename files in (writable by
//! all and not sticky, or owned by another user): no world forms there.
//!
//! A creator that cannot size or map its segment (resource limits, in a
//! process of its own) removes its file instead of leaving it there.

use std::process::Command;
use std::time::Duration;

use shm_comm::{Config, DataType, Error, ReduceOp, ShmComm};

const ROLE: &str = "SHM_COMM_SPACE_ROLE";
const TMPFS: &str = "mount -t tmpfs -o size=2m,mode=1777 ascend-moe-test /dev/shm";

/// `sh -c script` in a private mount namespace; `None` when one cannot be made.
fn in_namespace(script: &str, args: &[&str], env: Option<(&str, &str)>) -> Option<std::process::Output> {
    let mut cmd = Command::new("unshare");
    cmd.args(["-m", "--propagation", "private", "sh", "-c", script, "sh"]).args(args);
    if let Some((k, v)) = env {
        cmd.env(k, v);
    }
    cmd.output().ok()
}

/// Two thread ranks of a world whose segment (about 6 MiB) does not fit,
/// then one of a world that fits, each reporting one line.
fn scenario() {
    let name = format!("space-{}", std::process::id());
    let cfg = Config { staging_bytes: 1 << 20 };
    let t = Duration::from_secs(20);
    let run = |name: &str, world: usize, r: usize| -> Result<(), Error> {
        let c = ShmComm::rendezvous(name, world, r, t, &cfg)?;
        let src = vec![0u8; 1 << 20];
        let mut dst = vec![0u8; 1 << 20];
        c.all_reduce(DataType::F32, ReduceOp::Sum, &src, &mut dst, Ok::<(), Error>(()))
    };
    let (big, run) = (&format!("{name}-big"), &run);
    let res: Vec<Result<(), Error>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2).map(|r| s.spawn(move || run(big, 2, r))).collect();
        hs.into_iter().map(|h| h.join().expect("rank panicked")).collect()
    });
    for (r, x) in res.iter().enumerate() {
        match x {
            Ok(()) => println!("big rank {r}: Ok"),
            Err(e) => println!("big rank {r}: {:?}: {e}", e.kind()),
        }
    }
    let small = ShmComm::rendezvous(&format!("{name}-small"), 1, 0, t, &Config { staging_bytes: 1 << 16 })
        .and_then(|c| c.barrier());
    println!("small: {:?}", small.map_err(|e| e.to_string()));
    println!("END");
}

#[test]
fn a_world_too_large_for_the_shared_memory_directory_fails_its_rendezvous_on_every_rank() {
    if std::env::var(ROLE).is_ok() {
        scenario();
        return;
    }
    const TEST: &str = "a_world_too_large_for_the_shared_memory_directory_fails_its_rendezvous_on_every_rank";
    match in_namespace(TMPFS, &[], None) {
        Some(o) if o.status.success() => {}
        other => {
            let why = other.map_or("unshare is missing".into(), |o| String::from_utf8_lossy(&o.stderr).into_owned());
            eprintln!("skipped: no private mount namespace with its own /dev/shm here ({})", why.trim());
            return;
        }
    }
    let exe = std::env::current_exe().expect("test binary");
    let exe = exe.to_str().expect("utf-8 path");
    let script = format!("{TMPFS} && exec \"$@\"");
    let out = in_namespace(&script, &[exe, "--exact", TEST, "--nocapture", "--test-threads=1"], Some((ROLE, "1")))
        .expect("unshare ran before");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("END"), "the world's process died ({}): {text}", out.status);
    for r in 0..2 {
        let line = text.lines().find_map(|l| l.split_once(&format!("big rank {r}: ")).map(|x| x.1)).expect("line");
        assert!(line.starts_with("Some(Setup)"), "rank {r}: {line}");
        for part in ["No space left on device", "in /dev/shm", "a world of 2 ranks with 1048576-byte staging slots"] {
            assert!(line.contains(part), "rank {r} does not say {part:?}: {line}");
        }
    }
    assert!(text.contains("small: Ok(())"), "a world that fits still forms: {text}");
}

const DIR_ROLE: &str = "SHM_COMM_DIR_ROLE";

/// Two thread ranks forming a world in the shared-memory directory of this
/// process (one line per rank, then `END`).
fn form_in_dir() {
    let name = format!("dir-{}", std::process::id());
    let t = Duration::from_secs(20);
    let res: Vec<Result<ShmComm, Error>> = std::thread::scope(|s| {
        let name = &name;
        let hs: Vec<_> = (0..2)
            .map(|r| s.spawn(move || ShmComm::rendezvous(name, 2, r, t, &Config { staging_bytes: 1 << 16 })))
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank panicked")).collect()
    });
    for (r, x) in res.iter().enumerate() {
        match x {
            Ok(_) => println!("rank {r}: Ok"),
            Err(e) => println!("rank {r}: {:?}: {e}", e.kind()),
        }
    }
    println!("END");
}

/// Runs test `test` of this binary (role `DIR_ROLE`) after mounting a tmpfs
/// with `opts` on /dev/shm in private user and mount namespaces (or only a
/// mount namespace when this is root, so that other uids stay mapped);
/// `None` (after saying why) where such namespaces cannot be made.
fn in_dir(test: &str, opts: &str) -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    let ns = if unsafe { libc::geteuid() } == 0 { "-m" } else { "-Urm" };
    let mount = format!("mount -t tmpfs -o size=2m,{opts} ascend-moe-test /dev/shm");
    let probe = Command::new("unshare").args([ns, "--propagation", "private", "sh", "-c", &mount]).output();
    match probe {
        Ok(o) if o.status.success() => {}
        other => {
            let why = other.map_or("unshare is missing".into(), |o| String::from_utf8_lossy(&o.stderr).into_owned());
            eprintln!("skipped: no private namespaces with a /dev/shm mounted with {opts} here ({})", why.trim());
            return None;
        }
    }
    let exe = std::env::current_exe().expect("test binary");
    let script = format!("{mount} && exec \"$@\"");
    let out = Command::new("unshare")
        .args([ns, "--propagation", "private", "sh", "-c", &script, "sh"])
        .args([exe.to_str().expect("utf-8 path"), "--exact", test, "--nocapture", "--test-threads=1"])
        .env(DIR_ROLE, "1")
        .output()
        .expect("unshare ran before");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.contains("END"), "the world's process died ({}): {text}", out.status);
    Some(text)
}

/// Every rank's line says the rendezvous was refused at setup, naming each of `words`.
fn assert_dir_refused(text: &str, words: &[&str]) {
    for r in 0..2 {
        let line = text.lines().find_map(|l| l.split_once(&format!("rank {r}: ")).map(|x| x.1)).expect("line");
        assert!(line.starts_with("Some(Setup)"), "rank {r} formed a world in an unsafe directory: {line}");
        for w in words {
            assert!(line.contains(w), "rank {r} does not say {w:?}: {line}");
        }
    }
}

/// In a directory that every user may write to and that is not sticky,
/// anyone may rename or remove the files of others: another user could
/// move one forming world's file under the name of another (whose ranks
/// would then join it), or replace it. A world does not form there.
#[test]
fn a_shared_memory_directory_others_may_rename_files_in_is_refused() {
    const TEST: &str = "a_shared_memory_directory_others_may_rename_files_in_is_refused";
    if std::env::var(DIR_ROLE).is_ok() {
        form_in_dir();
        return;
    }
    let Some(text) = in_dir(TEST, "mode=0777") else { return };
    assert_dir_refused(&text, &["/dev/shm", "owned by uid 0", "mode 0777", "not sticky"]);
}

/// The owner of a directory may rename or remove any file in it, sticky or
/// not: a directory of another user (not root) is refused.
#[test]
fn a_shared_memory_directory_of_another_user_is_refused() {
    const TEST: &str = "a_shared_memory_directory_of_another_user_is_refused";
    if std::env::var(DIR_ROLE).is_ok() {
        form_in_dir();
        return;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: a directory owned by another uid needs root to mount");
        return;
    }
    let Some(text) = in_dir(TEST, "mode=1777,uid=65534") else { return };
    assert_dir_refused(&text, &["/dev/shm", "uid 65534", "mode 1777"]);
}

/// In a user namespace of a user other than root, the host's /dev/shm
/// belongs to a user the namespace does not map (root), shown as the
/// overflow uid: a world still forms there.
#[test]
fn a_world_forms_in_a_user_namespace_that_does_not_map_the_owner_of_dev_shm() {
    const TEST: &str = "a_world_forms_in_a_user_namespace_that_does_not_map_the_owner_of_dev_shm";
    if std::env::var(DIR_ROLE).is_ok() {
        form_in_dir();
        return;
    }
    let exe = std::env::current_exe().expect("test binary");
    let exe = exe.to_str().expect("utf-8 path");
    let run = ["unshare", "-Ur", exe, "--exact", TEST, "--nocapture", "--test-threads=1"];
    // Root is mapped in a namespace of its own: run it as nobody instead.
    let as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"];
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let cmd: Vec<&str> = if root { as_nobody.iter().chain(&run).copied().collect() } else { run.to_vec() };
    // The same namespace, with `stat` instead of the test binary and its
    // arguments; then the test binary itself, which that user may not be
    // allowed to reach (a checkout under a private home directory).
    let probe = Command::new(cmd[0]).args(&cmd[1..cmd.len() - 5]).args(["stat", "-c", "%u", "/dev/shm"]).output();
    let lists = |o: &std::process::Output| {
        o.status.success() && {
            let l = Command::new(cmd[0]).args(&cmd[1..cmd.len() - 5]).args([exe, "--list"]).output();
            l.is_ok_and(|l| l.status.success())
        }
    };
    match probe {
        Ok(o) if o.status.success() && !lists(&o) => {
            eprintln!("skipped: the test binary {exe} cannot be run by that user here");
            return;
        }
        Ok(o) if o.status.success() && String::from_utf8_lossy(&o.stdout).trim() != "0" => {}
        Ok(o) if o.status.success() => {
            eprintln!("skipped: the owner of /dev/shm is mapped in a user namespace here");
            return;
        }
        other => {
            let why = other.map_or_else(|e| e.to_string(), |o| String::from_utf8_lossy(&o.stderr).into_owned());
            eprintln!("skipped: no user namespace of a user other than root here ({})", why.trim());
            return;
        }
    }
    let out = Command::new(cmd[0]).args(&cmd[1..]).env(DIR_ROLE, "1").output().expect("ran before");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("END"), "the world's process died ({}): {text}", out.status);
    for r in 0..2 {
        assert!(text.contains(&format!("rank {r}: Ok")), "rank {r}: {text}");
    }
}

const LIMITS_ROLE: &str = "SHM_COMM_LIMITS_ROLE";

/// Sets the soft limit `res` to `cur` and returns the one it had.
fn set_soft_limit(res: libc::__rlimit_resource_t, cur: libc::rlim_t) -> libc::rlim_t {
    let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: l is a valid rlimit for both calls.
    unsafe {
        assert_eq!(libc::getrlimit(res, &mut l), 0);
        let old = l.rlim_cur;
        l.rlim_cur = cur.min(l.rlim_max);
        assert_eq!(libc::setrlimit(res, &l), 0);
        old
    }
}

/// One world of one rank created under a file size limit too small for its
/// segment, one under an address space limit too small to map it: one line
/// each with the rendezvous's outcome and whether its file is left, then `END`.
fn create_under_limits() {
    let t = Duration::from_secs(20);
    let report = |what: &str, name: &str, r: Result<ShmComm, Error>| {
        let path = shm_comm::segment_path(name);
        let left = std::path::Path::new(&path).exists();
        if left {
            // Not to be left in the directory by a failing test either.
            let _ = std::fs::remove_file(&path);
        }
        let r = r.map(|_| ()).map_err(|e| e.to_string());
        println!("{what}: left {left}: {r:?}");
    };
    // Past the file size limit ftruncate fails with EFBIG (and SIGXFSZ,
    // ignored here).
    // SAFETY: ignoring a signal installs no handler.
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    let name = format!("limit-size-{}", std::process::id());
    let old = set_soft_limit(libc::RLIMIT_FSIZE, 4096);
    let r = ShmComm::rendezvous(&name, 1, 0, t, &Config { staging_bytes: 1 << 16 });
    set_soft_limit(libc::RLIMIT_FSIZE, old);
    report("size", &name, r);
    // The address space may grow by 128 MiB, less than the segment of
    // 192 MiB (3 slots of 64 MiB): backing it works, mapping it does not.
    let status = std::fs::read_to_string("/proc/self/status").expect("status");
    let kib: libc::rlim_t = status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmSize");
    let name = format!("limit-map-{}", std::process::id());
    let old = set_soft_limit(libc::RLIMIT_AS, (kib << 10) + (128 << 20));
    let r = ShmComm::rendezvous(&name, 1, 0, t, &Config { staging_bytes: 64 << 20 });
    set_soft_limit(libc::RLIMIT_AS, old);
    report("map", &name, r);
    println!("END");
}

/// A creator that cannot size its segment's file (a file size limit) or map
/// it (an address space limit, after the file was backed in full) fails its
/// rendezvous naming why, and removes the file: a failed creator left it in
/// the shared-memory directory, the backed one holding its memory (up to
/// 96 MiB for a default world of 8), until a rendezvous under the same name.
#[test]
fn a_creator_that_cannot_size_or_map_its_segment_leaves_no_file() {
    const TEST: &str = "a_creator_that_cannot_size_or_map_its_segment_leaves_no_file";
    if std::env::var(LIMITS_ROLE).is_ok() {
        create_under_limits();
        return;
    }
    let out = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", TEST, "--nocapture", "--test-threads=1"])
        .env(LIMITS_ROLE, "1")
        .output()
        .expect("run the creator");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("END"), "the creator's process died ({}): {text}", out.status);
    for (what, says) in [("size", "sizing"), ("map", "mapping")] {
        let line = text.lines().find_map(|l| l.split_once(&format!("{what}: ")).map(|x| x.1)).expect("line");
        assert!(line.contains("Err(") && line.contains(says), "{what}: {line}");
        assert!(line.starts_with("left false"), "a failed creator left its file ({what}): {line}");
    }
}
