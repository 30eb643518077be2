//! Waiting: phase barriers over the per-rank arrival counters, sleeping on a
//! futex in the segment header, with a deadline on every wait and a check for
//! peers that aborted, left or died. Each phase is settled once for the whole
//! group (passed or failed) in the header's verdict word; the first phase,
//! [`RENDEZVOUS`], is the world forming (every slot taken).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::clock::deadline;
use crate::descriptor::last_call;
use crate::segment::{self, Ctrl, ABORTED, FAILED, JOINED, LEFT, RENDEZVOUS};
use crate::{process, ErrorKind, Result, ShmComm, State};

/// A phase settled as failed in [`crate::segment::Header::verdict`]: this
/// bit, the failing rank at [`FAILED_RANK_SHIFT`], the phase below. Every
/// earlier phase was passed (the failing rank passed them to get there); no
/// later one can be.
const FAILED_PHASE: u64 = 1 << 63;
const FAILED_RANK_SHIFT: u32 = 56;
const PHASE_MASK: u64 = (1 << FAILED_RANK_SHIFT) - 1;

/// The rank that settled `phase` (or an earlier phase) as failed, in the
/// verdict word `v`.
fn failed_by(v: u64, phase: u64) -> Option<usize> {
    // A rank that gave up on a later phase had passed this one.
    (v & FAILED_PHASE != 0 && v & PHASE_MASK <= phase).then_some(((v & !FAILED_PHASE) >> FAILED_RANK_SHIFT) as usize)
}

/// How the error of a rank failed by rank `j`'s giving up on the rendezvous starts.
fn gave_up_on_rendezvous(j: usize) -> String {
    format!("rank {j} gave up on the rendezvous (it timed out, saw a peer fail or saw a joiner refused)")
}

/// How a phase was settled.
enum Settled {
    /// Every rank arrived.
    Passed,
    /// Rank `.0` failed it first.
    Failed(usize),
}

impl ShmComm {
    /// Settles `phase` in the header's verdict word, on which every rank of
    /// the group agrees: as passed when `failing` is false (the caller saw
    /// every rank arrive), else as failed by this rank, unless a rank settled
    /// it (or an earlier phase) first. One compare-and-swap decides, so no
    /// rank passes a phase that another failed.
    fn settle(&self, phase: u64, failing: bool) -> Settled {
        #[cfg(test)]
        if failing {
            tests::in_settle_window();
        }
        let verdict = &self.inner.seg.header().verdict;
        let mut v = verdict.load(Ordering::Acquire);
        loop {
            if let Some(j) = failed_by(v, phase) {
                return Settled::Failed(j);
            }
            if v & FAILED_PHASE != 0 || v >= phase {
                return Settled::Passed;
            }
            let mine = if failing {
                FAILED_PHASE | (self.inner.rank as u64) << FAILED_RANK_SHIFT | (phase & PHASE_MASK)
            } else {
                phase
            };
            match verdict.compare_exchange_weak(v, mine, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) if failing => return Settled::Failed(self.inner.rank),
                Ok(_) => return Settled::Passed,
                Err(now) => v = now,
            }
        }
    }

    /// Every rank arrived at `phase`: passes it, unless a rank gave up on it
    /// first (then this rank fails too, naming it).
    fn pass(&self, st: &mut State, coll: &str, phase: u64) -> Result<()> {
        match self.settle(phase, false) {
            Settled::Passed => Ok(()),
            Settled::Failed(j) => {
                let detail = if phase == RENDEZVOUS {
                    format!(
                        "{} before rank {} saw every rank join, so the world did not form",
                        gave_up_on_rendezvous(j),
                        self.inner.rank
                    )
                } else {
                    format!(
                        "rank {j} failed this step (it timed out or saw a peer fail) before rank {} saw every rank \
                         arrive, in its call #{}",
                        self.inner.rank, st.seq
                    )
                };
                let e = self.err(coll, ErrorKind::PeerFailed, detail);
                self.poison(st, &e);
                Err(e)
            }
        }
    }

    /// Waits until `ready(ctrl of j)` holds for every rank `j`, failing on a dead
    /// or departed peer, or at `deadline`. `phase` is the phase barrier waited
    /// at ([`RENDEZVOUS`] while the world forms): every rank passes it, or
    /// every rank fails it. `watch`, asked whenever the wait sleeps, names a
    /// cause outside this group that fails the wait (a Mismatch) as it is seen.
    pub(crate) fn wait_for(
        &self,
        st: &mut State,
        coll: &str,
        deadline: Instant,
        phase: u64,
        ready: impl Fn(&Ctrl) -> bool,
        watch: Option<&dyn Fn() -> Option<String>>,
    ) -> Result<()> {
        let seg = &self.inner.seg;
        let world = self.inner.world;
        let h = seg.header();
        let joining = phase == RENDEZVOUS;
        let mut spins = 0u32;
        loop {
            if (0..world).all(|j| ready(seg.ctrl(j))) {
                return self.pass(st, coll, phase);
            }
            spins += 1;
            if spins < self.inner.spin {
                std::hint::spin_loop();
                continue;
            }
            if spins < self.inner.spin + 8 {
                std::thread::yield_now();
                continue;
            }
            // Slow path: look for failed peers, then sleep on the bell.
            let me = process::my_pid();
            let waiting: Vec<usize> = (0..world).filter(|&j| !ready(seg.ctrl(j))).collect();
            #[cfg(test)]
            tests::in_failure_window();
            // A joiner refused for asking for another world or staging size:
            // this world can no longer form (later joiners are refused too).
            if let Some(refused) = h.refusal().filter(|_| joining) {
                let detail = segment::describe_refusal(refused, world, seg.staging);
                let e = self.err(coll, ErrorKind::Mismatch, detail);
                if let Settled::Passed = self.settle(phase, true) {
                    return Ok(());
                }
                self.poison(st, &e);
                return Err(e);
            }
            if let Some(why) = watch.and_then(|w| w()) {
                let e = self.err(coll, ErrorKind::Mismatch, why);
                if let Settled::Passed = self.settle(phase, true) {
                    return Ok(());
                }
                self.poison(st, &e);
                return Err(e);
            }
            // Report a root cause (panic, departure, death) before a peer that
            // only failed because of it.
            //
            // While a world forms, a rank that already took its slot and then
            // died, aborted or left can never take part: the world cannot
            // complete, so that fails the joiners at once too (a peer that
            // gave up on its own rendezvous wait is not a root cause: the
            // verdict it settled is reported below, naming the rank that gave
            // up first).
            let suspects: Vec<usize> =
                if joining { (0..world).filter(|&j| j != self.inner.rank).collect() } else { waiting.clone() };
            let mut failed: Vec<(bool, String)> = Vec::new();
            for &j in &suspects {
                let c = seg.ctrl(j);
                let state = c.state.load(Ordering::Acquire);
                let (pid, start) = (c.pid.load(Ordering::Acquire), c.start.load(Ordering::Acquire));
                let why = match state {
                    ABORTED => Some((true, format!("rank {j} aborted (its thread panicked)"))),
                    LEFT => Some((true, format!("rank {j} left the group (its communicator was dropped)"))),
                    FAILED => Some((false, format!("rank {j} failed an earlier wait"))),
                    JOINED if pid != me && !process::pid_alive(pid, start) => {
                        Some((true, format!("rank {j} (pid {pid}) died")))
                    }
                    _ => None,
                };
                // Say how far the peer got, so a rank that stopped calling
                // (or called fewer collectives) is told apart from one that
                // failed in this very call.
                let why = why.map(|(root, w)| match last_call(seg, j) {
                    Some(call) if !joining => (root, format!("{w} after its last call, {call},")),
                    _ if !joining => (root, format!("{w} before any call")),
                    _ => (root, w),
                });
                // The peer may have arrived since `waiting` was computed, then
                // finished its part and left (or failed a later wait, or
                // exited): it owes this wait nothing more. Its state store
                // follows its arrival (both release, seen here with acquire), so
                // readiness checked again after the state is current.
                if let Some(why) = why {
                    if joining && why.0 || !ready(c) {
                        failed.push(why);
                    }
                }
            }
            // A world that completed meanwhile is settled like any phase: its
            // ranks may already have moved on (failures show up in the next
            // collective).
            if joining && !failed.is_empty() && (0..world).all(|j| ready(seg.ctrl(j))) {
                return self.pass(st, coll, phase);
            }
            if let Some(i) = failed.iter().position(|f| f.0).or(if failed.is_empty() { None } else { Some(0) }) {
                let why = &failed[i].1;
                let during = if joining { String::new() } else { format!(" in its call #{}", st.seq) };
                let detail = format!("{why} while rank {} waited{during}", self.inner.rank);
                let e = self.err(coll, ErrorKind::PeerFailed, detail);
                // Every rank arrived meanwhile and one passed the phase: so
                // does this one (the peer did its part).
                if let Settled::Passed = self.settle(phase, true) {
                    return Ok(());
                }
                self.poison(st, &e);
                return Err(e);
            }
            // A rank that gave up on the rendezvous settled it as failed: the
            // world can no longer form, so this rank fails now, naming it,
            // instead of waiting out its own timeout (the slot of a rank that
            // gave up counts as taken, so the slots alone do not tell).
            if let Some(j) = failed_by(h.verdict.load(Ordering::Acquire), phase).filter(|_| joining) {
                let missing: Vec<usize> = (0..world).filter(|&k| !ready(seg.ctrl(k))).collect();
                if missing.is_empty() {
                    return self.pass(st, coll, phase);
                }
                let detail = format!(
                    "{} while rank {} was waiting for ranks {missing:?} to join, so the world cannot form",
                    gave_up_on_rendezvous(j),
                    self.inner.rank
                );
                let e = self.err(coll, ErrorKind::PeerFailed, detail);
                self.poison(st, &e);
                return Err(e);
            }
            let now = Instant::now();
            if now >= deadline {
                // The last ranks may have arrived since they were listed.
                if (0..world).all(|j| ready(seg.ctrl(j))) {
                    return self.pass(st, coll, phase);
                }
                let arrived: Vec<usize> = (0..world).filter(|j| !waiting.contains(j)).collect();
                let what = if joining { "to join" } else { "to arrive" };
                let e = self.err(
                    coll,
                    ErrorKind::Timeout,
                    format!(
                        "timed out after {:?} waiting for ranks {waiting:?} {what} (ranks {arrived:?} did)",
                        self.inner.timeout
                    ),
                );
                if let Settled::Passed = self.settle(phase, true) {
                    return Ok(());
                }
                self.poison(st, &e);
                return Err(e);
            }
            let bell = h.bell.load(Ordering::SeqCst);
            h.sleepers.fetch_add(1, Ordering::SeqCst);
            if !(0..world).all(|j| ready(seg.ctrl(j))) {
                segment::futex_wait(&h.bell, bell, (deadline - now).min(Duration::from_millis(5)));
            }
            h.sleepers.fetch_sub(1, Ordering::SeqCst);
            spins = 0;
        }
    }

    /// Arrives at the next phase and waits for every rank to arrive there.
    pub(crate) fn sync(&self, st: &mut State, coll: &str) -> Result<()> {
        st.phase += 1;
        let phase = st.phase;
        let seg = &self.inner.seg;
        seg.ctrl(self.inner.rank).arrive.store(phase, Ordering::Release);
        seg.ring();
        let deadline = deadline(Instant::now(), self.inner.timeout);
        self.wait_for(st, coll, deadline, phase, |c| c.arrive.load(Ordering::Acquire) >= phase, None)
    }
}

#[cfg(test)]
mod tests {
    use crate::{Config, ErrorKind, ShmComm};
    use std::cell::RefCell;
    use std::sync::mpsc;
    use std::time::Duration;

    thread_local! {
        /// Run once by this thread's next slow-path wait, between listing the
        /// peers it waits for and checking their states.
        static WINDOW: RefCell<Option<Box<dyn FnOnce()>>> = RefCell::new(None);
    }

    pub(super) fn in_failure_window() {
        if let Some(f) = WINDOW.with(|w| w.borrow_mut().take()) {
            f();
        }
    }

    thread_local! {
        /// Run once by this thread when it next gives up on a phase, just
        /// before it settles the phase as failed.
        static SETTLE: RefCell<Option<Box<dyn FnOnce()>>> = RefCell::new(None);
    }

    pub(super) fn in_settle_window() {
        if let Some(f) = SETTLE.with(|w| w.borrow_mut().take()) {
            f();
        }
    }

    /// Rank 0 arrives at a barrier and, while the others are still missing, lists
    /// them as not arrived; before it checks their states, all of them arrive,
    /// pass the barrier (rank 0 is there) and drop their communicators. They did
    /// their whole part, so rank 0's barrier must succeed. (A world of 8 as in
    /// the bench whose last all_reduce hit this window on its last barrier.)
    #[test]
    fn peers_that_arrive_and_leave_while_a_rank_checks_them_do_not_fail_it() {
        const WORLD: usize = 8;
        let name = format!("leave-window-{}", std::process::id());
        let opts = Duration::from_secs(20);
        let limit = Duration::from_secs(20);
        let (go_txs, go_rxs): (Vec<_>, Vec<_>) = (1..WORLD).map(|_| mpsc::channel::<()>()).unzip();
        let (left_tx, left_rx) = mpsc::channel::<usize>();
        let (name, opts) = (&name, &opts);
        let (rank0, peers) = std::thread::scope(|s| {
            let hs: Vec<_> = go_rxs
                .into_iter()
                .enumerate()
                .map(|(i, go)| {
                    let left_tx = left_tx.clone();
                    s.spawn(move || -> std::result::Result<(), String> {
                        let r = i + 1;
                        let comm = ShmComm::rendezvous(name, WORLD, r, *opts, &Config::default())
                            .map_err(|e| e.to_string())?;
                        go.recv_timeout(limit).map_err(|_| format!("rank {r}: rank 0 never reached the window"))?;
                        let res = comm.barrier().map_err(|e| e.to_string());
                        drop(comm);
                        let _ = left_tx.send(r);
                        res
                    })
                })
                .collect();
            drop(left_tx);
            let rank0 = (|| -> std::result::Result<(), String> {
                let comm = ShmComm::rendezvous(name, WORLD, 0, *opts, &Config::default()).map_err(|e| e.to_string())?;
                WINDOW.with(|w| {
                    *w.borrow_mut() = Some(Box::new(move || {
                        for tx in &go_txs {
                            let _ = tx.send(());
                        }
                        for _ in 1..WORLD {
                            if left_rx.recv_timeout(limit).is_err() {
                                break;
                            }
                        }
                    }))
                });
                let res = comm.barrier().map_err(|e| e.to_string());
                let hooked = WINDOW.with(|w| w.borrow_mut().take()).is_none();
                assert!(hooked, "rank 0 never waited on the slow path");
                res
            })();
            let peers: Vec<_> = hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("panicked".into()))).collect();
            (rank0, peers)
        });
        for (i, p) in peers.iter().enumerate() {
            assert_eq!(p, &Ok(()), "rank {}", i + 1);
        }
        assert_eq!(rank0, Ok(()), "rank 0");
    }

    /// A child forked by rank 0 drops its copy of rank 0's handle while rank 1
    /// waits for rank 0 at a barrier (between listing rank 0 as missing and
    /// checking its state). Rank 0 is still in the group: rank 1 must keep
    /// waiting, and both pass the barrier once rank 0 arrives.
    #[test]
    fn a_forked_child_dropping_its_copy_of_a_handle_leaves_the_rank_in_the_group() {
        let name = format!("fork-drop-window-{}", std::process::id());
        let t = Duration::from_secs(20);
        let cfg = Config { staging_bytes: 1 << 16 };
        let (waiting_tx, waiting_rx) = mpsc::channel::<()>();
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let (checked_tx, checked_rx) = mpsc::channel::<()>();
        let peer = {
            let name = name.clone();
            std::thread::spawn(move || {
                let c = ShmComm::rendezvous(&name, 2, 1, t, &cfg).map_err(|e| e.to_string())?;
                WINDOW.with(|w| {
                    *w.borrow_mut() = Some(Box::new(move || {
                        let _ = waiting_tx.send(());
                        let _ = go_rx.recv_timeout(t);
                        // Runs at the next slow-path round, so only after
                        // this round's check of rank 0 passed (dropped
                        // unsent when the thread ends instead).
                        WINDOW.with(|w| {
                            *w.borrow_mut() = Some(Box::new(move || {
                                let _ = checked_tx.send(());
                            }))
                        });
                    }))
                });
                c.barrier().map_err(|e| e.to_string())
            })
        };
        let mut mine = Some(ShmComm::rendezvous(&name, 2, 0, t, &cfg).expect("rank 0"));
        waiting_rx.recv_timeout(t).expect("rank 1 never waited on the slow path");
        // SAFETY: the child only drops the handle (munmap, close, and with the
        // defect a state store and an flock) and ends with _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            drop(mine.take());
            // SAFETY: ends the child without running the parent's destructors.
            unsafe { libc::_exit(0) };
        }
        assert!(pid > 0, "fork failed");
        let mut st = 0;
        // SAFETY: pid is our child.
        unsafe { libc::waitpid(pid, &mut st, 0) };
        go_tx.send(()).expect("rank 1");
        // Arrive only once rank 1 has checked rank 0's state (or failed).
        let _ = checked_rx.recv_timeout(t);
        let c = mine.take().expect("handle");
        let rank0 = c.barrier().map_err(|e| e.to_string());
        let rank1 = peer.join().expect("rank 1 panicked");
        assert_eq!(rank1, Ok(()), "rank 1");
        assert_eq!(rank0, Ok(()), "rank 0");
    }

    /// Rank 0 creates a world of 2 and waits for rank 1; a joiner that asks
    /// for another world size, then one that asks for another staging size,
    /// is refused at once, and rank 0 fails at once too, naming the
    /// disagreement, instead of waiting out its timeout for a rank that
    /// cannot come.
    #[test]
    fn a_refused_joiner_fails_the_ranks_waiting_for_the_world_naming_the_disagreement() {
        let t = Duration::from_secs(20);
        let cfg = Config { staging_bytes: 1 << 16 };
        let other = Config { staging_bytes: 1 << 17 };
        for (case, world, joiner_cfg, says) in [
            (
                "size",
                3,
                cfg,
                "the ranks disagree on the world size: rank 1 asked to join with 3 ranks, this world has 2",
            ),
            ("staging", 2, other, "the ranks disagree on the staging size: rank 1 asked to join with 131072 staging"),
        ] {
            let name = format!("refused-{case}-{}", std::process::id());
            let (waiting_tx, waiting_rx) = mpsc::channel::<()>();
            let started = std::time::Instant::now();
            let rank0 = {
                let name = name.clone();
                std::thread::spawn(move || {
                    WINDOW.with(|w| {
                        *w.borrow_mut() = Some(Box::new(move || {
                            let _ = waiting_tx.send(());
                        }))
                    });
                    ShmComm::rendezvous(&name, 2, 0, t, &cfg).map(|_| ())
                })
            };
            waiting_rx.recv_timeout(t).expect("rank 0 never waited for the world");
            let e = ShmComm::rendezvous(&name, world, 1, t, &joiner_cfg).map(|_| ()).expect_err("refused");
            assert_eq!(e.kind(), Some(crate::ErrorKind::Setup), "{case}: {e}");
            let e = rank0.join().expect("rank 0 panicked").expect_err("the world cannot form");
            assert_eq!(e.kind(), Some(crate::ErrorKind::Mismatch), "{case}: {e}");
            assert!(e.to_string().contains(says), "{case}: rank 0 does not say {says:?}: {e}");
            assert!(started.elapsed() < t, "{case}: rank 0 waited out its timeout");
        }
    }

    /// Rank 0 times out at a barrier and, just before it settles the phase as
    /// failed, rank 1 arrives, sees every rank there and passes. The phase
    /// is settled once for both: rank 0 passes too, instead of failing a
    /// barrier its peer passed.
    #[test]
    fn a_rank_giving_up_as_its_peer_arrives_and_passes_passes_too() {
        let name = format!("settle-window-{}", std::process::id());
        let (t, limit) = (Duration::from_millis(300), Duration::from_secs(20));
        let cfg = Config { staging_bytes: 1 << 16 };
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let peer = {
            let name = name.clone();
            std::thread::spawn(move || {
                let c = ShmComm::rendezvous(&name, 2, 1, limit, &cfg).map_err(|e| e.to_string())?;
                go_rx.recv_timeout(limit).map_err(|_| "rank 0 never gave up".to_string())?;
                let res = c.barrier().map_err(|e| e.to_string());
                let _ = done_tx.send(());
                res
            })
        };
        let c = ShmComm::rendezvous(&name, 2, 0, t, &cfg).expect("rank 0");
        SETTLE.with(|w| {
            *w.borrow_mut() = Some(Box::new(move || {
                let _ = go_tx.send(());
                let _ = done_rx.recv_timeout(limit);
            }))
        });
        let rank0 = c.barrier().map_err(|e| e.to_string());
        let hooked = SETTLE.with(|w| w.borrow_mut().take()).is_none();
        let rank1 = peer.join().expect("rank 1 panicked");
        assert!(hooked, "rank 0 never gave up");
        assert_eq!(rank1, Ok(()), "rank 1");
        assert_eq!(rank0, Ok(()), "rank 0");
    }

    /// Rank 2 waits at a barrier (phase 1); ranks 0 and 1 arrive and pass it,
    /// rank 1 leaves, and rank 0 fails its next barrier (phase 2) for that,
    /// all before rank 2 looks again. Every rank arrived at phase 1, so rank
    /// 2 passes it: a failure settled for a later phase is no failure of an
    /// earlier one.
    #[test]
    fn a_failure_at_a_later_phase_does_not_fail_a_rank_still_passing_an_earlier_one() {
        let name = format!("later-failure-{}", std::process::id());
        let t = Duration::from_secs(20);
        let cfg = Config { staging_bytes: 1 << 16 };
        let (waiting_tx, waiting_rx) = mpsc::channel::<()>();
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let (name, cfg) = (&name, &cfg);
        let (rank0, rank1, rank2) = std::thread::scope(|s| {
            let rank2 = s.spawn(move || {
                let c = ShmComm::rendezvous(name, 3, 2, t, cfg).map_err(|e| e.to_string())?;
                WINDOW.with(|w| {
                    *w.borrow_mut() = Some(Box::new(move || {
                        let _ = waiting_tx.send(());
                        let _ = go_rx.recv_timeout(t);
                    }))
                });
                let first = c.barrier().map_err(|e| e.to_string());
                let hooked = WINDOW.with(|w| w.borrow_mut().take()).is_none();
                assert!(hooked, "rank 2 never waited on the slow path");
                first
            });
            let rank1 = s.spawn(move || -> std::result::Result<(), String> {
                let c = ShmComm::rendezvous(name, 3, 1, t, cfg).map_err(|e| e.to_string())?;
                waiting_rx.recv_timeout(t).map_err(|_| "rank 2 never waited".to_string())?;
                c.barrier().map_err(|e| e.to_string())
            });
            let c = ShmComm::rendezvous(name, 3, 0, t, cfg).expect("rank 0");
            let first = c.barrier().map_err(|e| e.to_string());
            let rank1 = rank1.join().expect("rank 1 panicked"); // rank 1 has left
            let second = c.barrier().map_err(|e| e.to_string());
            go_tx.send(()).expect("rank 2");
            ((first, second), rank1, rank2.join().expect("rank 2 panicked"))
        });
        assert_eq!(rank0.0, Ok(()), "rank 0, first barrier");
        let e = rank0.1.expect_err("rank 1 left before the second barrier");
        assert!(e.contains("rank 1 left the group"), "{e}");
        assert_eq!(rank1, Ok(()), "rank 1");
        assert_eq!(rank2, Ok(()), "rank 2, first barrier");
    }

    /// Rank 0 of a world of 2 reaches its rendezvous deadline and, just
    /// before it settles the rendezvous as failed, rank 1 joins, sees every
    /// slot taken and passes. The rendezvous is settled once for both: rank 0
    /// passes too instead of timing out in a world its peer joined, and the
    /// two then pass a barrier together.
    #[test]
    fn a_rank_giving_up_on_the_rendezvous_as_the_last_rank_joins_and_passes_passes_too() {
        let name = format!("rdv-settle-pass-{}", std::process::id());
        let (t, limit) = (Duration::from_millis(300), Duration::from_secs(20));
        let cfg = Config { staging_bytes: 1 << 16 };
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let (joined_tx, joined_rx) = mpsc::channel::<()>();
        let peer = {
            let name = name.clone();
            std::thread::spawn(move || {
                go_rx.recv_timeout(limit).map_err(|_| "rank 0 never gave up".to_string())?;
                let c = ShmComm::rendezvous(&name, 2, 1, limit, &cfg).map_err(|e| e.to_string());
                let _ = joined_tx.send(());
                c?.barrier().map_err(|e| e.to_string())
            })
        };
        SETTLE.with(|w| {
            *w.borrow_mut() = Some(Box::new(move || {
                let _ = go_tx.send(());
                let _ = joined_rx.recv_timeout(limit);
            }))
        });
        let rank0 = ShmComm::rendezvous(&name, 2, 0, t, &cfg).and_then(|c| c.barrier()).map_err(|e| e.to_string());
        let hooked = SETTLE.with(|w| w.borrow_mut().take()).is_none();
        let rank1 = peer.join().expect("rank 1 panicked");
        assert_eq!(rank0, Ok(()), "rank 0");
        assert!(hooked, "rank 0 never gave up");
        assert_eq!(rank1, Ok(()), "rank 1");
    }

    /// Rank 2 waits for a world of 3 (held in its wait); rank 0 joins and
    /// gives up at its deadline; then rank 1, the last rank, joins and finds
    /// every slot taken (rank 0's still counts, and rank 2 keeps the world's
    /// file). The world did not form for rank 0, so it forms for no one:
    /// rank 0 fails with Timeout, and ranks 1 and 2, whose waits see every
    /// slot taken, fail with PeerFailed naming rank 0, none with Ok.
    #[test]
    fn a_rank_that_gives_up_as_the_last_rank_joins_fails_the_rendezvous_on_every_rank() {
        let name = format!("rdv-settle-fail-{}", std::process::id());
        let (t, limit) = (Duration::from_millis(200), Duration::from_secs(20));
        let cfg = Config { staging_bytes: 1 << 16 };
        let (waiting_tx, waiting_rx) = mpsc::channel::<()>();
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let rank2 = {
            let name = name.clone();
            std::thread::spawn(move || {
                WINDOW.with(|w| {
                    *w.borrow_mut() = Some(Box::new(move || {
                        let _ = waiting_tx.send(());
                        let _ = go_rx.recv_timeout(limit);
                    }))
                });
                ShmComm::rendezvous(&name, 3, 2, limit, &cfg).map(|_| ())
            })
        };
        waiting_rx.recv_timeout(limit).expect("rank 2 never waited for the world");
        let rank0 = ShmComm::rendezvous(&name, 3, 0, t, &cfg).map(|_| ());
        let rank1 = ShmComm::rendezvous(&name, 3, 1, limit, &cfg).map(|_| ());
        go_tx.send(()).expect("rank 2");
        let rank2 = rank2.join().expect("rank 2 panicked");
        let e = rank0.expect_err("rank 0 timed out");
        assert_eq!(e.kind(), Some(ErrorKind::Timeout), "rank 0: {e}");
        assert!(e.to_string().contains("waiting for ranks [1] to join"), "rank 0: {e}");
        for (r, res) in [(1, rank1), (2, rank2)] {
            let e = res.expect_err("rank 0 gave up on the world");
            assert_eq!(e.kind(), Some(ErrorKind::PeerFailed), "rank {r}: {e}");
            let says = format!("rank 0 gave up on the rendezvous (it timed out, saw a peer fail or saw a joiner refused) before rank {r} saw every rank join");
            assert!(e.to_string().contains(&says), "rank {r}: {e}");
        }
    }

    /// Ranks 2 and 0 of a world of 3 wait for rank 1, which never comes;
    /// rank 0 gives up at its short deadline. Rank 2 fails at once with
    /// PeerFailed naming rank 0 and the missing rank, instead of waiting out
    /// its own long timeout to report a timeout of its own.
    #[test]
    fn ranks_waiting_for_a_world_fail_at_once_when_a_rank_gave_up_on_it() {
        let name = format!("rdv-gave-up-{}", std::process::id());
        let (t, long) = (Duration::from_millis(200), Duration::from_secs(10));
        let cfg = Config { staging_bytes: 1 << 16 };
        let (waiting_tx, waiting_rx) = mpsc::channel::<()>();
        let rank2 = {
            let name = name.clone();
            std::thread::spawn(move || {
                WINDOW.with(|w| {
                    *w.borrow_mut() = Some(Box::new(move || {
                        let _ = waiting_tx.send(());
                    }))
                });
                let started = std::time::Instant::now();
                (ShmComm::rendezvous(&name, 3, 2, long, &cfg).map(|_| ()), started.elapsed())
            })
        };
        waiting_rx.recv_timeout(long).expect("rank 2 never waited for the world");
        let e = ShmComm::rendezvous(&name, 3, 0, t, &cfg).map(|_| ()).expect_err("rank 1 never joins");
        assert_eq!(e.kind(), Some(ErrorKind::Timeout), "rank 0: {e}");
        let (rank2, took) = rank2.join().expect("rank 2 panicked");
        let e = rank2.expect_err("rank 1 never joins");
        assert_eq!(e.kind(), Some(ErrorKind::PeerFailed), "rank 2: {e}");
        let says = "rank 0 gave up on the rendezvous (it timed out, saw a peer fail or saw a joiner refused) while \
                    rank 2 was waiting for ranks [1] to join, so the world cannot form";
        assert!(e.to_string().contains(says), "rank 2: {e}");
        assert!(took < long, "rank 2 waited out its timeout ({took:?})");
    }
}
