//! Ranks as processes.
//!
//! SIGKILLed at every phase of a group's life: while the world forms, inside
//! a collective, during teardown, and all at once after attaching. After each
//! trial no segment of that trial is left in the shared-memory directory, and
//! the surviving ranks failed with a clear error naming the dead rank (or,
//! when the kill came after their last collective, finished), never hung.
//!
//! Disagreeing on the context tag: every process fails, naming who chose what.
//!
//! Each rank is this test binary run again with `SHM_COMM_TEST_RANK` set
//! (`phase name world rank`); it reports on stdout, one line per event.

use std::io::{BufRead, BufReader, Lines};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use shm_comm::{joined_ranks, live_members, segment_path, shm_dir, Config, DataType, Error, ReduceOp, ShmComm};

const WORLD: usize = 4;
/// Longer than any trial: survivors must notice the death, not time out.
const RANK_TIMEOUT: Duration = Duration::from_secs(60);
/// Upper bound on a trial before it counts as a hang.
const TRIAL_LIMIT: Duration = Duration::from_secs(40);
const ROLE: &str = "SHM_COMM_TEST_RANK";

fn report(e: &Error) -> i32 {
    println!("ERROR\t{:?}\t{e}", e.kind());
    3
}

/// The body of one rank process; returns its exit code.
fn rank_main(role: &str) -> i32 {
    let f: Vec<&str> = role.split(' ').collect();
    let (phase, name, world, rank) = (f[0], f[1], f[2].parse().expect("world"), f[3].parse().expect("rank"));
    let cfg = Config { staging_bytes: 1 << 16 };
    let comm = match ShmComm::rendezvous(name, world, rank, RANK_TIMEOUT, &cfg) {
        Ok(c) => c,
        Err(e) => return report(&e),
    };
    println!("joined");
    match phase {
        "collective" => {
            let src = vec![1u8; 1 << 18];
            let mut dst = vec![0u8; 1 << 18];
            for i in 0..1_000_000u32 {
                if let Err(e) = comm.all_reduce(DataType::F32, ReduceOp::Sum, &src, &mut dst, Ok::<(), Error>(())) {
                    return report(&e);
                }
                if i == 0 {
                    println!("in");
                }
            }
            println!("finished");
            0
        }
        "tag" => {
            comm.set_context_tag(Some((rank / 2) as u64));
            match comm.barrier() {
                Ok(()) => {
                    println!("passed");
                    0
                }
                Err(e) => report(&e),
            }
        }
        "teardown" => {
            if let Err(e) = comm.barrier() {
                return report(&e);
            }
            println!("leaving");
            drop(comm);
            println!("left");
            0
        }
        _ => {
            // "hold": wait until the test kills this rank.
            let _ = std::io::stdin().read_line(&mut String::new());
            0
        }
    }
}

struct Rank {
    child: Child,
    out: Lines<BufReader<ChildStdout>>,
}

impl Rank {
    fn spawn(test: &str, phase: &str, name: &str, rank: usize) -> Rank {
        let mut child = Command::new(std::env::current_exe().expect("test binary"))
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env(ROLE, format!("{phase} {name} {WORLD} {rank}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn rank");
        let out = BufReader::new(child.stdout.take().expect("stdout")).lines();
        Rank { child, out }
    }

    /// Reads lines until one ends with `want` (the harness may have printed
    /// the test name before it on the same line); panics on EOF with what was
    /// read.
    fn expect_line(&mut self, want: &str) {
        let mut seen = Vec::new();
        for l in self.out.by_ref() {
            let l = l.expect("read rank output");
            if l.ends_with(want) {
                return;
            }
            seen.push(l);
        }
        panic!("rank never printed {want:?}; printed {seen:?}");
    }

    fn kill(&mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reap");
    }

    /// Exit code and the rest of the output, failing the trial past `deadline`.
    fn finish(mut self, deadline: Instant) -> (Option<i32>, String) {
        loop {
            if let Some(st) = self.child.try_wait().expect("wait") {
                let rest: Vec<String> = self.out.map_while(|l| l.ok()).collect();
                return (st.code(), rest.join("\n"));
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                panic!("a surviving rank hung past {TRIAL_LIMIT:?}");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

fn unique(tag: &str, trial: usize) -> String {
    format!("sigkill-{tag}-{}-{trial}", std::process::id())
}

/// No file of group `name` remains in the shared-memory directory.
fn assert_no_segment(name: &str) {
    let path = segment_path(name);
    assert!(!std::path::Path::new(&path).exists(), "{path} left behind");
    let stem = path.rsplit('/').next().expect("file name").to_string();
    let left: Vec<String> = std::fs::read_dir(shm_dir())
        .expect("shm dir")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|f| *f == stem)
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// Waits until `n` ranks of the forming world `name` have taken their slot
/// (a rank announces its presence before it claims the slot; killed in
/// between, it is one its peers wait for until their timeout, not a rank
/// that failed them).
fn wait_attached(name: &str, n: usize) {
    let deadline = Instant::now() + TRIAL_LIMIT;
    while joined_ranks(name).len() < n {
        assert!(Instant::now() < deadline, "only ranks {:?} took their slot", joined_ranks(name));
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn assert_died(r: usize, code: Option<i32>, out: &str, victim: usize) {
    assert_eq!(code, Some(3), "rank {r}: {out}");
    assert!(out.contains("Some(PeerFailed)") && out.contains(&format!("rank {victim} (pid")), "rank {r}: {out}");
}

#[test]
fn a_rank_killed_while_the_world_forms_fails_the_others_and_leaks_nothing() {
    const TEST: &str = "a_rank_killed_while_the_world_forms_fails_the_others_and_leaks_nothing";
    if let Ok(role) = std::env::var(ROLE) {
        std::process::exit(rank_main(&role));
    }
    // Ranks 0..2 of 4 join; rank 3 never comes; one of the three is killed.
    for victim in 0..3 {
        let name = unique("form", victim);
        let start = Instant::now();
        let mut ranks: Vec<Rank> = (0..3).map(|r| Rank::spawn(TEST, "hold", &name, r)).collect();
        wait_attached(&name, 3);
        assert!(std::path::Path::new(&segment_path(&name)).exists(), "the forming world has its file");
        ranks[victim].kill();
        for (r, rank) in ranks.into_iter().enumerate() {
            if r != victim {
                let (code, out) = rank.finish(start + TRIAL_LIMIT);
                assert_died(r, code, &out, victim);
            }
        }
        assert_no_segment(&name);
        assert!(live_members(&name).is_empty());
    }
}

#[test]
fn a_rank_killed_inside_a_collective_fails_the_others_and_leaks_nothing() {
    const TEST: &str = "a_rank_killed_inside_a_collective_fails_the_others_and_leaks_nothing";
    if let Ok(role) = std::env::var(ROLE) {
        std::process::exit(rank_main(&role));
    }
    for victim in 0..WORLD {
        let name = unique("coll", victim);
        let start = Instant::now();
        let mut ranks: Vec<Rank> = (0..WORLD).map(|r| Rank::spawn(TEST, "collective", &name, r)).collect();
        for r in ranks.iter_mut() {
            r.expect_line("joined");
        }
        // Every rank attached: the file is gone while the world runs.
        assert_no_segment(&name);
        ranks[victim].expect_line("in");
        ranks[victim].kill();
        for (r, rank) in ranks.into_iter().enumerate() {
            if r != victim {
                let (code, out) = rank.finish(start + TRIAL_LIMIT);
                assert_died(r, code, &out, victim);
            }
        }
        assert_no_segment(&name);
    }
}

#[test]
fn a_rank_killed_during_teardown_leaks_nothing_and_hangs_nobody() {
    const TEST: &str = "a_rank_killed_during_teardown_leaks_nothing_and_hangs_nobody";
    if let Ok(role) = std::env::var(ROLE) {
        std::process::exit(rank_main(&role));
    }
    for victim in 0..WORLD {
        let name = unique("down", victim);
        let start = Instant::now();
        let mut ranks: Vec<Rank> = (0..WORLD).map(|r| Rank::spawn(TEST, "teardown", &name, r)).collect();
        ranks[victim].expect_line("leaving");
        ranks[victim].kill();
        // The victim passed the last barrier, so every rank finished its
        // collectives: the survivors leave cleanly.
        for (r, rank) in ranks.into_iter().enumerate() {
            if r != victim {
                let (code, out) = rank.finish(start + TRIAL_LIMIT);
                assert_eq!(code, Some(0), "rank {r}: {out}");
                assert!(out.contains("left"), "rank {r}: {out}");
            }
        }
        assert_no_segment(&name);
        assert!(live_members(&name).is_empty());
    }
}

#[test]
fn every_rank_killed_after_attaching_leaks_nothing() {
    const TEST: &str = "every_rank_killed_after_attaching_leaks_nothing";
    if let Ok(role) = std::env::var(ROLE) {
        std::process::exit(rank_main(&role));
    }
    for trial in 0..2 {
        let name = unique("all", trial);
        let mut ranks: Vec<Rank> = (0..WORLD).map(|r| Rank::spawn(TEST, "hold", &name, r)).collect();
        for r in ranks.iter_mut() {
            r.expect_line("joined");
        }
        for r in ranks.iter_mut() {
            r.kill();
        }
        assert_no_segment(&name);
        assert!(live_members(&name).is_empty());
    }
}

#[test]
fn process_ranks_that_disagree_on_the_tag_all_fail_naming_who_chose_what() {
    const TEST: &str = "process_ranks_that_disagree_on_the_tag_all_fail_naming_who_chose_what";
    if let Ok(role) = std::env::var(ROLE) {
        std::process::exit(rank_main(&role));
    }
    let name = unique("tag", 0);
    let start = Instant::now();
    let ranks: Vec<Rank> = (0..WORLD).map(|r| Rank::spawn(TEST, "tag", &name, r)).collect();
    for (r, rank) in ranks.into_iter().enumerate() {
        let (code, out) = rank.finish(start + TRIAL_LIMIT);
        assert_eq!(code, Some(3), "rank {r}: {out}");
        assert!(out.contains("Some(Mismatch)") && out.contains("ranks [0, 1] chose 0, ranks [2, 3] chose 1"), "{out}");
    }
    assert_no_segment(&name);
}

/// Every rank of a forming world killed at once (a launcher's SIGKILL or
/// SIGTERM while they waited for each other) leaves its file, full size, in
/// the shared-memory directory; the next rendezvous, under any name, removes
/// it. While a rank of it lives, the file is left alone.
#[test]
fn a_world_whose_every_rank_died_while_it_formed_is_swept_by_the_next_rendezvous() {
    const TEST: &str = "a_world_whose_every_rank_died_while_it_formed_is_swept_by_the_next_rendezvous";
    if let Ok(role) = std::env::var(ROLE) {
        std::process::exit(rank_main(&role));
    }
    let name = unique("swept", 0);
    let path = segment_path(&name);
    let mut ranks: Vec<Rank> = (0..2).map(|r| Rank::spawn(TEST, "hold", &name, r)).collect();
    wait_attached(&name, 2);
    let cfg = Config { staging_bytes: 1 << 16 };
    let one_world =
        |trial| drop(ShmComm::rendezvous(&unique("sweeper", trial), 1, 0, RANK_TIMEOUT, &cfg).expect("one"));
    one_world(0);
    assert!(std::path::Path::new(&path).exists(), "the file of a world with live ranks was removed");
    for r in &mut ranks {
        r.kill();
    }
    // Their file stays until a rendezvous sweeps it: this one, or one of a
    // test running beside it. A sweep passes over a file whose lock another
    // sweeper holds at that moment, so a few more rendezvous may be needed.
    let deadline = Instant::now() + Duration::from_secs(10);
    for trial in 1.. {
        one_world(trial);
        if !std::path::Path::new(&path).exists() || Instant::now() >= deadline {
            break;
        }
    }
    assert_no_segment(&name);
}
