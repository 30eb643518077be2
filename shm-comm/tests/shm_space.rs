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
