//! Thread ranks at the edges of the protocol: timeouts too large for a
//! deadline, and calls whose failure on one rank must not leave another
//! rank succeeding or waiting without a cause.

use std::time::Duration;

use shm_comm::{Config, DataType, Error, ErrorKind, ShmComm};

fn group(tag: &str) -> String {
    format!("outcomes-{tag}-{}", std::process::id())
}

/// Runs `f(rank, comm)` on `world` threads of a fresh group joined with `timeout`.
fn ranks<R: Send>(tag: &str, world: usize, timeout: Duration, f: impl Fn(usize, ShmComm) -> R + Sync) -> Vec<R> {
    let name = group(tag);
    let f = &f;
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let name = &name;
                s.spawn(move || {
                    let cfg = Config { staging_bytes: 1 << 16 };
                    let c = ShmComm::rendezvous(name, world, r, timeout, &cfg).expect("rendezvous");
                    f(r, c)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank panicked")).collect()
    })
}

/// `Duration::MAX` cannot be added to an instant: it means no practical
/// bound, for the rendezvous, every collective and a split alike.
#[test]
fn a_timeout_too_large_for_a_deadline_bounds_nothing_and_panics_nowhere() {
    let out = ranks("huge-timeout", 2, Duration::MAX, |r, c| -> Result<u8, Error> {
        c.barrier()?;
        let mut buf = vec![r as u8 + 7; 4];
        c.broadcast(DataType::U8, &mut buf, 1, Ok::<(), Error>(()))?;
        let sub = c.split(&[1, 0])?;
        sub.barrier()?;
        assert_eq!(sub.timeout(), Duration::MAX);
        Ok(buf[0])
    });
    assert_eq!(out, vec![Ok(8), Ok(8)]);
}

/// Members that pass different lists fail together, naming both lists (the
/// group stays usable); after that, a split of one list meets again.
#[test]
fn after_members_disagreed_on_a_split_the_same_list_splits_again() {
    let out = ranks("split-retry", 2, Duration::from_secs(2), |r, c| -> Result<usize, Error> {
        let first = if r == 0 { [0, 1] } else { [1, 0] };
        let e = c.split(&first).map(|_| ()).expect_err("members passed different lists");
        assert_eq!(e.kind(), Some(ErrorKind::Mismatch), "rank {r}: {e}");
        assert!(
            e.to_string().contains("rank 0 passed [0, 1]") || e.to_string().contains("rank 1 passed [1, 0]"),
            "{e}"
        );
        c.barrier()?;
        let again = c.split(&[0, 1])?;
        again.barrier()?;
        let twice = c.split(&[0, 1])?;
        twice.barrier()?;
        Ok(again.rank() + twice.rank())
    });
    assert_eq!(out, vec![Ok(0), Ok(2)]);
}

/// Members whose lists differ and hold each other ([0, 1] and [1, 0]) each
/// wait for the other in a sub-group the other never joins: both fail at
/// once (not at the 60 s timeout) with a Mismatch naming both lists. Right
/// after, with no collective between, a split of one list meets, and so
/// does the next split of another list, whichever member reaches it first.
#[test]
fn members_whose_lists_hold_each_other_fail_at_once_and_split_again() {
    let timeout = Duration::from_secs(60);
    let start = std::time::Instant::now();
    let out = ranks("split-hold-each-other", 2, timeout, |r, c| {
        let first = if r == 0 { [0, 1] } else { [1, 0] };
        let e = c.split(&first).map(|_| ()).expect_err("members passed different lists");
        let again = c.split(&[0, 1]).and_then(|s| c.split(&[1, 0]).map(|t| (s.rank(), t.rank())));
        (e.kind(), e.to_string(), again.map_err(|e| e.to_string()))
    });
    let took = start.elapsed();
    assert!(took < timeout / 4, "the members failed only after {took:?}");
    for (r, (kind, text, again)) in out.iter().enumerate() {
        assert_eq!(*kind, Some(ErrorKind::Mismatch), "rank {r}: {text}");
        assert!(text.contains("rank 0 passed [0, 1]") && text.contains("rank 1 passed [1, 0]"), "rank {r}: {text}");
        assert_eq!(*again, Ok((r, 1 - r)), "rank {r}: the splits after the disagreement");
    }
}

/// Rank 0 splits [0, 1] while ranks 1 and 2 split [0, 1, 2]: rank 1 fails
/// at once (rank 0 waits in a list that holds it), and rank 2, which comes
/// to [0, 1, 2] only after rank 1 left it, fails at once too, not at the
/// timeout, with a Mismatch naming the lists. The next split of one list
/// by all three meets.
#[test]
fn a_member_coming_late_to_a_split_its_peer_left_fails_at_once() {
    let timeout = Duration::from_secs(60);
    let (left_tx, left_rx) = std::sync::mpsc::channel::<()>();
    let left_rx = std::sync::Mutex::new(left_rx);
    let start = std::time::Instant::now();
    let out = ranks("split-late", 3, timeout, |r, c| {
        let first: &[usize] = if r == 0 { &[0, 1] } else { &[0, 1, 2] };
        if r == 2 {
            left_rx.lock().expect("lock").recv().expect("rank 1");
        }
        let e = c.split(first).map(|_| ()).expect_err("rank 0 passed another list");
        if r == 1 {
            left_tx.send(()).expect("rank 2");
        }
        let again = c.split(&[2, 1, 0]).map(|s| s.rank()).map_err(|e| e.to_string());
        (e.kind(), e.to_string(), again)
    });
    let took = start.elapsed();
    assert!(took < timeout / 4, "the members failed only after {took:?}");
    for (r, (kind, text, again)) in out.iter().enumerate() {
        assert_eq!(*kind, Some(ErrorKind::Mismatch), "rank {r}: {text}");
        // Rank 2 may read its peers' posts of their next split already.
        let other = if r == 2 { "rank 0 passed" } else { "[0, 1]" };
        assert!(text.contains(other) && text.contains("[0, 1, 2]"), "rank {r}: {text}");
        assert_eq!(*again, Ok(2 - r), "rank {r}: the split after the disagreement");
    }
}

/// A member that split after another number of the group's collectives
/// (here: after a barrier it alone called, which timed out) waits in another
/// sub-group: both fail naming how many collectives each had started.
#[test]
fn members_that_split_after_different_collectives_fail_naming_both_counts() {
    let (failed_tx, failed_rx) = std::sync::mpsc::channel::<()>();
    let failed_rx = std::sync::Mutex::new(failed_rx);
    let out = ranks("split-seq", 2, Duration::from_secs(1), |r, c| {
        if r == 0 {
            assert_eq!(c.barrier().map_err(|e| e.kind()), Err(Some(ErrorKind::Timeout)));
            failed_tx.send(()).expect("rank 1");
        } else {
            failed_rx.lock().expect("lock").recv().expect("rank 0");
        }
        c.split(&[0, 1]).map(|_| ()).map_err(|e| (e.kind(), e.to_string()))
    });
    for (r, o) in out.iter().enumerate() {
        let (kind, text) = o.as_ref().expect_err("the members never meet");
        assert_eq!(*kind, Some(ErrorKind::Mismatch), "rank {r}: {text}");
        let (mine, theirs) = if r == 0 { (1, 0) } else { (0, 1) };
        let want = format!("rank {r} after {mine} collectives, rank {} after {theirs}", 1 - r);
        assert!(text.contains(&want), "rank {r} does not say {want:?}: {text}");
    }
}

/// Rank 1 arrives at a single-round collective only after rank 0 gave up on
/// it (timed out): rank 1 must fail too, naming rank 0, not copy out a
/// result its peer never got.
#[test]
fn a_rank_arriving_after_its_peer_timed_out_fails_the_same_call() {
    let (failed_tx, failed_rx) = std::sync::mpsc::channel::<()>();
    let failed_rx = std::sync::Mutex::new(failed_rx);
    let out = ranks("late", 2, Duration::from_secs(1), |r, c| {
        if r == 1 {
            failed_rx.lock().expect("lock").recv().expect("rank 0");
        }
        let mut buf = vec![r as u8; 16];
        let res = c.broadcast(DataType::U8, &mut buf, 0, Ok::<(), Error>(())).map_err(|e| (e.kind(), e.to_string()));
        if r == 0 {
            failed_tx.send(()).expect("rank 1");
        }
        res
    });
    let (k0, e0) = out[0].as_ref().expect_err("rank 0 waited alone");
    assert_eq!(*k0, Some(ErrorKind::Timeout), "{e0}");
    let (k1, e1) = out[1].as_ref().expect_err("rank 1 must not pass a call rank 0 failed");
    assert_eq!(*k1, Some(ErrorKind::PeerFailed), "{e1}");
    assert!(e1.contains("rank 0 failed this step"), "{e1}");
}

/// Ranks 0 and 1 split [0, 1, 2], rank 2 splits [2, 1, 0]. Rank 0 (the
/// shortest timeout) gives up waiting for rank 2 in the sub-group of its
/// list, which fails rank 1, waiting there with it, at once; rank 2 times
/// out alone in the sub-group of its own list. Every member fails with a
/// Mismatch naming both lists, rank 1 too, though its own wait ended on a
/// peer that gave up rather than on its timeout.
#[test]
fn members_failed_by_a_member_that_gave_up_on_a_split_name_the_disagreement() {
    let name = group("split-gave-up");
    let name = &name;
    let out: Vec<Result<(), (Option<ErrorKind>, String)>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|r| {
                s.spawn(move || {
                    let timeout = Duration::from_millis(if r == 0 { 500 } else { 1500 });
                    let cfg = Config { staging_bytes: 1 << 16 };
                    let c = ShmComm::rendezvous(name, 3, r, timeout, &cfg).expect("rendezvous");
                    let list = if r == 2 { [2, 1, 0] } else { [0, 1, 2] };
                    c.split(&list).map(|_| ()).map_err(|e| (e.kind(), e.to_string()))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank panicked")).collect()
    });
    for (r, o) in out.iter().enumerate() {
        let (kind, text) = o.as_ref().expect_err("the members disagree");
        assert_eq!(*kind, Some(ErrorKind::Mismatch), "rank {r}: {text}");
        assert!(text.contains("[0, 1, 2]") && text.contains("[2, 1, 0]"), "rank {r} does not name both lists: {text}");
    }
}

/// A staging size whose segment (4 KiB + world x (4 KiB + 3 x staging))
/// does not fit a mapping is refused before anything is created, naming the
/// staging size, instead of wrapping; the sizes a caller prints saturate.
#[test]
fn a_staging_size_whose_segment_overflows_is_refused_naming_it() {
    let world = 2;
    for staging_bytes in [usize::MAX, usize::MAX / 3, isize::MAX as usize / 4] {
        let cfg = Config { staging_bytes };
        let eff = cfg.effective_staging();
        assert_eq!(eff % 64, 0, "{staging_bytes}: {eff}");
        assert!(eff >= staging_bytes - 63, "{staging_bytes}: {eff} wrapped");
        assert!(cfg.bytes_per_rank() >= eff, "{staging_bytes}: {} wrapped", cfg.bytes_per_rank());
        let name = group(&format!("huge-staging-{staging_bytes}"));
        let e = ShmComm::rendezvous(&name, world, 0, Duration::from_secs(20), &cfg).expect_err("cannot be mapped");
        let s = e.to_string();
        assert_eq!(e.kind(), Some(ErrorKind::Setup), "{s}");
        assert!(s.contains(&format!("staging size {staging_bytes}")), "{s}");
        assert!(s.contains("Config::staging_bytes"), "{s}");
        assert!(!std::path::Path::new(&shm_comm::segment_path(&name)).exists(), "{s}");
    }
}

/// A joiner that a running world under the name refuses (another size, or a
/// rank that is live there) fails naming why and leaves no file under the
/// name: the empty file its attempt created is removed again before it
/// returns.
#[test]
fn a_joiner_refused_by_a_running_world_leaves_no_file_behind() {
    let name = group("refused-joiner");
    let path = shm_comm::segment_path(&name);
    let cfg = Config { staging_bytes: 1 << 16 };
    let out = ranks("refused-joiner", 2, Duration::from_secs(20), |r, c| {
        if r == 0 {
            for (world, rank, words) in [(3, 0, "live world of size 2"), (2, 1, "duplicate rank")] {
                let e = ShmComm::rendezvous(&name, world, rank, Duration::from_secs(20), &cfg)
                    .expect_err("refused by the running world");
                let s = e.to_string();
                assert_eq!(e.kind(), Some(ErrorKind::Setup), "{s}");
                assert!(s.contains(words), "{s}");
                assert!(!std::path::Path::new(&path).exists(), "{path} left behind after: {s}");
            }
        }
        // Rank 1 stays live (its slot taken) until rank 0 has tried.
        c.barrier()
    });
    assert!(out.iter().all(|o| o.is_ok()), "{out:?}");
}

/// A member whose own rank list is invalid fails at once, and the members
/// waiting for it fail with it, naming its list, long before their timeout,
/// whether it refused before they arrived or while they waited. The refusal
/// is reported once: a later split of one valid list by every member works.
#[test]
fn a_member_refusing_its_own_list_fails_the_members_waiting_for_it_at_once() {
    use std::time::Instant;

    let timeout = Duration::from_secs(30);
    for (case, (bad, shown)) in [
        ([0, 1, 7], "rank 2 passed [0, 1, 7]"),
        ([0, 1, 1], "rank 2 passed [0, 1, 1]"),
        ([0, 1, 300], "rank 2 passed a list of 3 ranks"),
    ]
    .into_iter()
    .enumerate()
    {
        // Case 0: rank 2 refuses before the others arrive; else concurrently.
        let (refused_first, failed) = (std::sync::Barrier::new(3), std::sync::Barrier::new(3));
        let start = Instant::now();
        let out = ranks(&format!("split-refused-{case}"), 3, timeout, |r, c| {
            if case == 0 && r != 2 {
                refused_first.wait();
            }
            let first = if r == 2 { c.split(&bad) } else { c.split(&[0, 1, 2]) };
            if case == 0 && r == 2 {
                refused_first.wait();
            }
            let e = first.map(|_| ()).expect_err("rank 2's list is invalid");
            // Rank 2's next split replaces its refusal: only after the others failed.
            failed.wait();
            let again = c.split(&[2, 0, 1]).map(|s| s.rank()).map_err(|e| e.to_string());
            (e.kind(), e.to_string(), again)
        });
        let took = start.elapsed();
        assert!(took < timeout / 4, "case {case}: the members failed only after {took:?}");
        let (kind, text, _) = &out[2];
        assert_eq!(*kind, Some(ErrorKind::Setup), "rank 2: {text}");
        for (r, (kind, text, _)) in out.iter().enumerate().take(2) {
            assert_eq!(*kind, Some(ErrorKind::Mismatch), "case {case}, rank {r}: {text}");
            assert!(
                text.contains(shown) && text.contains("refused"),
                "case {case}, rank {r} does not say {shown:?}: {text}"
            );
            assert!(text.contains(&format!("rank {r} passed [0, 1, 2]")), "case {case}, rank {r}: {text}");
        }
        let again: Vec<_> = out.iter().map(|o| o.2.clone()).collect();
        assert_eq!(again, vec![Ok(1), Ok(2), Ok(0)], "case {case}: the split after the refusal");
    }
}

/// An empty list and one without the caller are refused the same way; the
/// peers read an empty list as none.
#[test]
fn a_member_refusing_an_empty_list_or_one_without_itself_fails_the_others_too() {
    for (case, bad, shown) in [(0, vec![], "no rank list"), (1, vec![0, 1], "[0, 1]")] {
        let out = ranks(&format!("split-refused-own-{case}"), 3, Duration::from_secs(30), |r, c| {
            let list = if r == 2 { bad.clone() } else { vec![0, 1, 2] };
            c.split(&list).map(|_| ()).map_err(|e| (e.kind(), e.to_string()))
        });
        let want = format!("rank 2 passed {shown}, which it refused");
        for (r, o) in out.iter().enumerate().take(2) {
            let (kind, text) = o.as_ref().expect_err("rank 2 refused");
            assert_eq!(*kind, Some(ErrorKind::Mismatch), "rank {r}: {text}");
            assert!(text.contains(&want), "rank {r} does not say {want:?}: {text}");
        }
        assert_eq!(out[2].as_ref().map_err(|e| e.0), Err(Some(ErrorKind::Setup)));
    }
}

/// A sum all-reduce of one f32 per rank (rank + 1), as `Result`.
fn sum_of_ranks(c: &ShmComm) -> Result<f32, Error> {
    let src = (c.rank() as f32 + 1.0).to_ne_bytes();
    let mut dst = [0u8; 4];
    c.all_reduce(DataType::F32, shm_comm::ReduceOp::Sum, &src, &mut dst, Ok::<(), Error>(()))?;
    Ok(f32::from_ne_bytes(dst))
}

/// Rank 1 calls the group's next collective where rank 0 splits [0, 1]:
/// neither can ever meet the other. Both fail at once with a Mismatch, each
/// naming what the other called (not a timeout, which is 60 s here), and the
/// group stays in step: a later split and all-reduce work.
#[test]
fn a_member_calling_a_collective_instead_of_the_split_fails_both_at_once() {
    let out = ranks("split-vs-call", 2, Duration::from_secs(60), |r, c| {
        let first = if r == 0 {
            c.split(&[0, 1]).map(|_| ()).map_err(|e| (e.kind(), e.to_string()))
        } else {
            sum_of_ranks(&c).map(|_| ()).map_err(|e| (e.kind(), e.to_string()))
        };
        let sub = c.split(&[1, 0]).expect("a later split of one list");
        (first, sum_of_ranks(&sub).expect("the sub-group"), sum_of_ranks(&c).expect("the group"))
    });
    let (k0, e0) = out[0].0.as_ref().expect_err("rank 0's split cannot form");
    assert_eq!(*k0, Some(ErrorKind::Mismatch), "{e0}");
    assert!(e0.contains("rank 1 called all_reduce") && e0.contains("split [0, 1]"), "{e0}");
    let (k1, e1) = out[1].0.as_ref().expect_err("rank 1's all_reduce has no rank 0");
    assert_eq!(*k1, Some(ErrorKind::Mismatch), "{e1}");
    assert!(e1.contains("rank 0") && e1.contains("split([0, 1])"), "{e1}");
    for (r, o) in out.iter().enumerate() {
        assert_eq!((o.1, o.2), (3.0, 3.0), "rank {r}");
    }
}

/// Rank 1 refuses its own arguments where rank 0 splits [0, 1] (a binding
/// that checks the list before the library does refuses through the group's
/// next call): rank 0 fails at once quoting rank 1's reason, not naming a
/// call rank 1 never meant to make, and the group stays in step.
#[test]
fn a_member_refusing_instead_of_the_split_fails_the_split_quoting_its_reason() {
    let out = ranks("split-vs-refusal", 2, Duration::from_secs(60), |r, c| {
        let first = if r == 0 {
            c.split(&[0, 1]).map(|_| ())
        } else {
            let why = Error::invalid("split", "ranks", "got [0, -1], a rank below 0");
            let mut dst = [0u8; 4];
            c.all_reduce(DataType::F32, shm_comm::ReduceOp::Sum, &[0u8; 4], &mut dst, Err(why))
        };
        (first.map_err(|e| (e.kind(), e.to_string())), sum_of_ranks(&c).expect("the group"))
    });
    let (k0, e0) = out[0].0.as_ref().expect_err("rank 0's split cannot form");
    assert_eq!(*k0, Some(ErrorKind::Mismatch), "{e0}");
    assert!(e0.contains("rank 1 refused its own arguments") && e0.contains("got [0, -1], a rank below 0"), "{e0}");
    assert!(!e0.contains("rank 1 called"), "{e0}");
    assert!(out[1].0.is_err(), "rank 1 refused: {:?}", out[1].0);
    for (r, o) in out.iter().enumerate() {
        assert_eq!(o.1, 3.0, "rank {r}");
    }
}

/// Ranks 0 and 2 split [0, 1, 2] while rank 1 broadcasts. The member that
/// sees rank 1 first fails the sub-group, which fails the other one waiting
/// there; both take part in rank 1's broadcast as refusals, so all three fail
/// with a Mismatch naming the split or the broadcast, long before the timeout.
#[test]
fn every_member_waiting_for_a_member_in_a_collective_fails_with_it() {
    let out = ranks("split-vs-bcast", 3, Duration::from_secs(60), |r, c| {
        if r == 1 {
            let mut buf = [7u8; 8];
            c.broadcast(DataType::U8, &mut buf, 1, Ok::<(), Error>(())).map_err(|e| (e.kind(), e.to_string()))
        } else {
            c.split(&[0, 1, 2]).map(|_| ()).map_err(|e| (e.kind(), e.to_string()))
        }
    });
    for (r, o) in out.iter().enumerate() {
        let (kind, text) = o.as_ref().expect_err("the members never meet");
        assert_eq!(*kind, Some(ErrorKind::Mismatch), "rank {r}: {text}");
        let want = if r == 1 { "split([0, 1, 2])" } else { "rank 1 called broadcast" };
        assert!(text.contains(want), "rank {r} does not say {want:?}: {text}");
    }
}

/// Splitting is not calling: members that split and go straight on to a
/// collective, while other ranks already wait in it or in the next split,
/// are never taken for members that skipped the split (many rounds, so a
/// member that sees its peer in the collective before its own wait noticed
/// the sub-group formed is exercised).
#[test]
fn members_moving_on_from_a_split_to_a_collective_are_not_a_mismatch() {
    let out = ranks("split-then-call", 4, Duration::from_secs(60), |r, c| -> Result<f32, Error> {
        let mut total = 0.0;
        for round in 0..40 {
            if r < 2 || round % 2 == 0 {
                let list: &[usize] = if r < 2 { &[0, 1] } else { &[3, 2] };
                let sub = c.split(list)?;
                total += sum_of_ranks(&sub)?;
            }
            let pair = c.split(if r % 2 == 0 { &[0, 2] } else { &[1, 3] })?;
            total += sum_of_ranks(&pair)?;
            total += sum_of_ranks(&c)?;
        }
        Ok(total)
    });
    // Per round: the pair split sums 1 + 2 = 3, the group 10; ranks 0 and 1
    // add 3 every round, ranks 2 and 3 add 3 on the 20 even rounds.
    let want = [40.0 * 16.0, 40.0 * 16.0, 40.0 * 13.0 + 20.0 * 3.0, 40.0 * 13.0 + 20.0 * 3.0];
    for (r, o) in out.iter().enumerate() {
        assert_eq!(o.as_ref().map_err(|e| e.to_string()), Ok(&want[r]), "rank {r}");
    }
}

/// A rank that gives up on a forming world returns at its timeout even while
/// another process holds the setup lock (a joiner stopped inside its setup):
/// leaving waits for the lock only briefly, and the lock's holder (or the
/// next rendezvous) deals with the file.
#[test]
fn a_rank_that_times_out_returns_while_another_holds_the_setup_lock() {
    use std::os::fd::AsRawFd;
    use std::sync::mpsc;
    use std::time::Instant;

    let name = group("held-lock");
    let path = shm_comm::segment_path(&name);
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let (locked_tx, locked_rx) = mpsc::channel::<()>();
    let holder = {
        let path = path.clone();
        std::thread::spawn(move || {
            // Take the lock once rank 0 initialised the file and let go of
            // it (a sized file: the setup sizes it under the lock).
            let start = Instant::now();
            let f = loop {
                assert!(start.elapsed() < Duration::from_secs(20), "rank 0 never set up {path}");
                if let Ok(f) = std::fs::File::open(&path) {
                    // SAFETY: f is an open file.
                    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                        if f.metadata().map(|m| m.len() > 0).unwrap_or(false) {
                            break f;
                        }
                        // SAFETY: f is an open file.
                        unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_UN) };
                    }
                }
                std::thread::yield_now();
            };
            locked_tx.send(()).unwrap();
            // Held until rank 0 returned, or 30 s at most.
            let _ = done_rx.recv_timeout(Duration::from_secs(30));
            drop(f);
        })
    };
    let timeout = Duration::from_millis(300);
    let start = Instant::now();
    let cfg = Config { staging_bytes: 1 << 16 };
    let joined = std::thread::scope(|s| {
        let h = s.spawn(|| ShmComm::rendezvous(&name, 2, 0, timeout, &cfg));
        locked_rx.recv_timeout(Duration::from_secs(25)).expect("the lock was taken");
        h.join().unwrap()
    });
    let took = start.elapsed();
    done_tx.send(()).ok();
    holder.join().unwrap();
    let _ = std::fs::remove_file(&path);
    match joined {
        Err(Error::Comm { kind: ErrorKind::Timeout, ref detail, .. }) => {
            assert!(detail.contains("waiting for ranks [1]"), "{detail}")
        }
        other => panic!("expected rank 0 to time out waiting for rank 1, got {other:?}"),
    }
    assert!(took < Duration::from_secs(10), "rank 0 returned after {took:?}, held by the setup lock");
}
