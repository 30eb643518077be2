//! Processes forked after the crate was used, without exec: a child that
//! joins a world of its own, a child that holds (and drops) a copy of its
//! parent's handle, and a helper that outlives the rank that forked it.
//!
//! Each test runs its scenario in a process of its own (this test binary run
//! again with `SHM_COMM_FORK_ROLE` set, one test, one test thread), so that
//! `fork` copies no other test's threads. That process prints one line per
//! verdict and `END`; the test reads them with a bound and kills it past it.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use shm_comm::{live_members, Config, ShmComm};

const ROLE: &str = "SHM_COMM_FORK_ROLE";
/// Bound on every wait of the ranks: far longer than any scenario takes.
const RANK_TIMEOUT: Duration = Duration::from_secs(20);
/// Bound on a scenario process before it counts as a hang.
const LIMIT: Duration = Duration::from_secs(60);

fn cfg() -> Config {
    Config { staging_bytes: 1 << 16 }
}

/// Writes `line` to stdout with one `write` (a forked child must not take
/// the locks of Rust's stdout, which another thread may have held at fork).
fn say(line: &str) {
    let l = format!("{line}\n");
    // SAFETY: the buffer is valid for its length.
    unsafe { libc::write(1, l.as_ptr() as *const libc::c_void, l.len()) };
}

fn show<T>(r: &Result<T, shm_comm::Error>) -> String {
    match r {
        Ok(_) => "Ok".into(),
        Err(e) => format!("Err({:?}: {e})", e.kind()),
    }
}

/// Forks; the child runs `child` and exits at once with `_exit` (no
/// destructors or atexit handlers of the parent's state run twice).
fn fork(child: impl FnOnce()) -> libc::pid_t {
    // SAFETY: the scenario process runs one test thread besides the harness's
    // idle main thread; the child only uses this crate, `write` and `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        child();
        // SAFETY: ends the child without running the parent's destructors.
        unsafe { libc::_exit(0) };
    }
    pid
}

fn reap(pid: libc::pid_t) {
    let mut st = 0;
    // SAFETY: pid is our child.
    unsafe { libc::waitpid(pid, &mut st, 0) };
}

/// Start time (clock ticks since boot) of process `pid`.
fn start_of(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    let rest: Vec<&str> = s[s.rfind(')').expect(")") + 1..].split_whitespace().collect();
    rest[19].parse().expect("starttime")
}

/// Returns once a process forked now gets another start time than this one
/// (start times count clock ticks): reads the clock, never sleeps.
fn await_next_tick() {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let mine = start_of(std::process::id());
    loop {
        let up: f64 =
            std::fs::read_to_string("/proc/uptime").expect("uptime").split(' ').next().unwrap().parse().unwrap();
        if (up * hz) as u64 > mine + 1 {
            return;
        }
        std::thread::yield_now();
    }
}

/// Returns once a rank of group `name` holds its slot (its presence name is
/// bound under the setup lock, with its claim).
fn wait_for_member(name: &str) {
    let deadline = std::time::Instant::now() + LIMIT;
    while live_members(name).is_empty() {
        assert!(std::time::Instant::now() < deadline, "no rank of {name} ever joined");
        std::thread::yield_now();
    }
}

/// Runs the scenario of test `test` in a process of its own and returns its
/// lines up to `END` (and the process, still to be reaped).
fn scenario(test: &str) -> (Vec<String>, Child) {
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(ROLE, test)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn scenario");
    let out = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        // Read to the end (also after END), so the scenario never writes
        // into a closed pipe.
        for l in BufReader::new(out).lines().map_while(|l| l.ok()) {
            let _ = tx.send(l);
        }
    });
    let deadline = std::time::Instant::now() + LIMIT;
    let mut lines = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) if l.ends_with("END") => return (lines, child),
            Ok(l) => lines.push(l),
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("scenario {test} ended or hung without END; printed {lines:?}");
            }
        }
    }
}

/// The line of `lines` that starts with `key`, without the key.
fn verdict<'a>(lines: &'a [String], key: &str) -> &'a str {
    // The harness may have printed the test's name on the same line first.
    lines
        .iter()
        .find_map(|l| l.find(key).map(|i| &l[i + key.len()..]))
        .unwrap_or_else(|| panic!("no {key:?} line in {lines:?}"))
}

/// A child forked after its parent used the crate joins a new world with its
/// parent: its peers see the child's own start time, not its parent's, and
/// take it for alive.
#[test]
fn a_child_forked_after_the_crate_was_used_joins_a_world_as_itself() {
    const TEST: &str = "a_child_forked_after_the_crate_was_used_joins_a_world_as_itself";
    if std::env::var(ROLE).as_deref() == Ok(TEST) {
        let pid = std::process::id();
        drop(ShmComm::rendezvous(&format!("fork-pre-{pid}"), 1, 0, RANK_TIMEOUT, &cfg()).expect("earlier world"));
        await_next_tick();
        let name = format!("fork-start-{pid}");
        let child = fork(|| {
            let own = start_of(std::process::id());
            say(&format!("forked later: {}", own != start_of(pid)));
            let r = ShmComm::rendezvous(&name, 2, 1, RANK_TIMEOUT, &cfg()).and_then(|c| c.barrier());
            say(&format!("child: {}", show(&r)));
        });
        // Join only once the child has taken its slot: the joiner then checks
        // the child's liveness by the pid and start time in that slot.
        wait_for_member(&name);
        let r = ShmComm::rendezvous(&name, 2, 0, RANK_TIMEOUT, &cfg()).and_then(|c| c.barrier());
        reap(child);
        say(&format!("parent: {}", show(&r)));
        say("END");
        return;
    }
    let (lines, mut p) = scenario(TEST);
    p.wait().expect("reap");
    assert_eq!(verdict(&lines, "forked later: "), "true", "the child must not share its parent's start time");
    assert_eq!(verdict(&lines, "parent: "), "Ok", "{lines:?}");
    assert_eq!(verdict(&lines, "child: "), "Ok", "{lines:?}");
}

/// A child forked by a rank holds a copy of the rank's handle: using it is
/// refused with an error naming both processes, and dropping it (as a child
/// that ends does) leaves the rank in the group: its peers and the rank
/// itself go on.
#[test]
fn a_child_that_inherits_a_handle_is_refused_its_use_and_the_group_goes_on() {
    const TEST: &str = "a_child_that_inherits_a_handle_is_refused_its_use_and_the_group_goes_on";
    if std::env::var(ROLE).as_deref() == Ok(TEST) {
        let name = format!("fork-drop-{}", std::process::id());
        let (go, wait) = mpsc::channel::<()>();
        let peer = {
            let name = name.clone();
            std::thread::spawn(move || {
                let c = ShmComm::rendezvous(&name, 2, 1, RANK_TIMEOUT, &cfg())?;
                wait.recv().expect("go");
                c.barrier()
            })
        };
        let mut mine = Some(ShmComm::rendezvous(&name, 2, 0, RANK_TIMEOUT, &cfg()).expect("rank 0"));
        let child = fork(|| {
            let c = mine.take().expect("handle");
            say(&format!("child barrier: {}", show(&c.barrier())));
            say(&format!("child split: {}", show(&c.split(&[0]))));
            drop(c);
            say("child dropped");
        });
        let c = mine.take().expect("handle");
        reap(child);
        go.send(()).expect("peer");
        say(&format!("rank 0: {}", show(&c.barrier())));
        say(&format!("rank 1: {}", show(&peer.join().expect("peer panicked"))));
        say("END");
        return;
    }
    let (lines, mut p) = scenario(TEST);
    p.wait().expect("reap");
    for key in ["child barrier: ", "child split: "] {
        let v = verdict(&lines, key);
        assert!(v.starts_with("Err(Some(Setup)") && v.contains("inherited it through fork"), "{key}{v}");
    }
    verdict(&lines, "child dropped");
    assert_eq!(verdict(&lines, "rank 0: "), "Ok", "{lines:?}");
    assert_eq!(verdict(&lines, "rank 1: "), "Ok", "{lines:?}");
}

/// A rank forks a helper (no exec) that outlives it and so holds the rank's
/// presence socket: once the rank's process has ended, a new world under the
/// name forms, and the name is not listed as a live member.
#[test]
fn a_helper_forked_by_a_rank_does_not_keep_the_ended_rank_joined() {
    const TEST: &str = "a_helper_forked_by_a_rank_does_not_keep_the_ended_rank_joined";
    if std::env::var(ROLE).as_deref() == Ok(TEST) {
        let name = format!("fork-helper-{}", std::process::id());
        let c = ShmComm::rendezvous(&name, 1, 0, RANK_TIMEOUT, &cfg()).expect("rank 0");
        let helper = fork(|| {
            // Lives until the test closes this scenario's stdin.
            let mut byte = 0u8;
            // SAFETY: reads at most one byte into `byte`.
            while unsafe { libc::read(0, &mut byte as *mut u8 as *mut libc::c_void, 1) } > 0 {}
        });
        say(&format!("helper: {helper}"));
        say(&format!("world: {name}"));
        c.barrier().expect("barrier");
        drop(c);
        say("END");
        return;
    }
    let (lines, mut p) = scenario(TEST);
    let name = verdict(&lines, "world: ").to_string();
    let helper: i32 = verdict(&lines, "helper: ").parse().expect("helper pid");
    // Child::wait would close stdin first, ending the helper too early.
    let release = p.stdin.take();
    p.wait().expect("the rank's process ends");
    // SAFETY: signal 0 only checks that the helper exists.
    assert_eq!(unsafe { libc::kill(helper, 0) }, 0, "the helper must still live (and hold the socket)");
    let members = live_members(&name);
    let again = ShmComm::rendezvous(&name, 1, 0, RANK_TIMEOUT, &cfg()).and_then(|c| c.barrier().map(|_| c));
    drop(release); // lets the helper end
    again.expect("a new world under the name of an ended one");
    assert!(members.is_empty(), "an ended rank is listed: {members:?}");
}
