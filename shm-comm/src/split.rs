//! Sub-groups: members of a rank list meet in a group of their own, named
//! after the parent, the list, the parent's collectives so far and how often
//! this list was split since, successfully.
//!
//! Every name part is one the members agree on whatever happened before: the
//! parent's sequence number is the same on every rank of the group (each
//! collective involves them all), and a failed split counts for nothing, so
//! after members disagreed on a list (and failed), a split of one list meets
//! again.

use std::collections::HashMap;

use std::sync::atomic::Ordering;

use crate::descriptor::{Desc, Kind};
use crate::process;
use crate::segment::{Posted, ABORTED, JOINED, LEFT};
use crate::{DataType, Error, ErrorKind, Result, ShmComm};

/// Why `ranks` is no rank list for rank `me` of a world of `w` to split.
fn invalid_list(ranks: &[usize], w: usize, me: usize) -> Option<String> {
    if ranks.is_empty() {
        return Some("empty rank list".into());
    }
    for (i, &r) in ranks.iter().enumerate() {
        if r >= w {
            return Some(format!("rank {r} in {ranks:?} is out of range for world size {w}"));
        }
        if ranks[..i].contains(&r) {
            return Some(format!("rank {r} appears more than once in {ranks:?}"));
        }
    }
    if !ranks.contains(&me) {
        return Some(format!("rank {me} is not in {ranks:?}: only members call split"));
    }
    None
}

impl ShmComm {
    /// A sub-group of the ranks `ranks` (group-local rank numbers, distinct,
    /// ascending order not required). Called by every member, with the same
    /// list, after the same collectives of this group; the new group's rank
    /// order is the list order. Members that pass different lists, or split
    /// after different numbers of collectives, fail with a
    /// [`ErrorKind::Mismatch`] naming both: at once when a member waits in
    /// a list that holds this rank (each waits for the other), else after
    /// the timeout; this group stays usable, and a later split of one list
    /// by every member works.
    /// A member that left this group, aborted or died never splits: the
    /// members waiting for it fail at once with a [`ErrorKind::PeerFailed`]
    /// naming it.
    /// A member whose own list is invalid (empty, out of range, repeated, or
    /// without it) fails at once, and so do the members waiting for it, with
    /// a Mismatch naming its list. A member that called this group's next
    /// collective instead of the split fails the split at once too: the
    /// members waiting for it take part in that collective as a refusal, so
    /// it fails with a Mismatch naming the split, and they with one naming
    /// its collective (every rank of this group must then have called a
    /// collective there, as the member's was one of this group's).
    pub fn split(&self, ranks: &[usize]) -> Result<ShmComm> {
        self.check_owner("split")?;
        let (w, me) = (self.inner.world, self.inner.rank);
        let (seq, phase) = {
            let st = self.lock();
            (st.seq, st.phase)
        };
        // Held until the sub-group formed or failed, so that splits through
        // clones of this handle count one after the other.
        let mut splits = self.inner.splits.lock().unwrap_or_else(|e| e.into_inner());
        if splits.seq != seq {
            splits.seq = seq;
            splits.made.clear();
            splits.failures = 0;
        }
        let ctrl = self.inner.seg.ctrl(me);
        let attempt = splits.failures;
        if let Some(why) = invalid_list(ranks, w, me) {
            // Posted as refused, so the members waiting for this rank fail now.
            ctrl.post_split(Some((ranks, seq)), attempt, true);
            splits.failures += 1;
            return Err(self.err("split", ErrorKind::Setup, why));
        }
        let pos = ranks.iter().position(|&r| r == me).unwrap_or_default();
        let n = splits.made.get(ranks).copied().unwrap_or(0);
        let list: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
        let name = format!("{}/[{}]@{seq}#{n}", self.inner.name, list.join(","));
        // Members meet in the sub-group named by their list, so members with
        // other lists never arrive there. The list is posted in this group's
        // control block meanwhile: a member that times out reads the others'
        // and reports a disagreement as such, and a member that refused its
        // own list, or waits in another list that holds this rank, fails the
        // wait as soon as it is seen, as does one that left or died.
        ctrl.post_split(Some((ranks, seq)), attempt, false);
        let seen = &splits.seen;
        // Posts of splits this rank knows cannot be waited in for it any more.
        let stale = |p: &Posted| p.attempt < attempt || splits.made.contains_key(&p.ranks);
        let watch = || {
            let gone = self.gone_members(ranks);
            if !gone.is_empty() {
                return Some(self.gone_text(ranks, &gone));
            }
            let refused = self.refused_members(ranks, seq, seen);
            if !refused.is_empty() {
                return Some(self.refusal_text(ranks, &refused));
            }
            let left = self.members_that_left(ranks, seq, attempt);
            if !left.is_empty() {
                return Some(format!("ranks {left:?} failed this split of {ranks:?} and left it"));
            }
            let elsewhere = self.members_waiting_elsewhere(ranks, seq, seen, &stale);
            if !elsewhere.is_empty() {
                let who: Vec<usize> = elsewhere.iter().map(|(r, _)| *r).collect();
                return Some(format!("ranks {who:?} wait to split another list that holds rank {me}"));
            }
            let called = self.members_in_next_call(ranks, seq, phase);
            (!called.is_empty()).then(|| self.next_call_text(ranks, seq, &called))
        };
        let joined =
            ShmComm::rendezvous_watching(&name, ranks.len(), pos, self.inner.timeout, &self.inner.cfg, Some(&watch));
        match joined {
            Ok(c) => {
                ctrl.post_split(None, 0, false);
                splits.made.insert(ranks.to_vec(), n + 1);
                Ok(c)
            }
            // A member that timed out or saw a refusal there fails the others
            // waiting with it (PeerFailed): for them too, a refusal or a
            // disagreement is the cause.
            Err(e @ Error::Comm { kind: ErrorKind::Timeout | ErrorKind::PeerFailed | ErrorKind::Mismatch, .. }) => {
                // Members waiting elsewhere for this rank after as many
                // failed splits fail as it does, seeing it left this split;
                // it returns once they left theirs, so that its next split
                // never meets them in the split they are failing. (One after
                // more failed splits took this rank's post for a stale one:
                // it waits on, for this rank's next split.) Their posts of
                // this split are then reported with this failure, never
                // again. The lists are read first: a member that left may
                // post its next one.
                let elsewhere = self.members_waiting_elsewhere(ranks, seq, &splits.seen, &stale);
                splits.failures += 1;
                let mismatch = self.split_mismatch(ranks, seq);
                ctrl.post_split_left(ranks, seq, attempt);
                let failing: Vec<(usize, u64)> =
                    elsewhere.iter().filter(|(_, p)| p.attempt == attempt).map(|(r, p)| (*r, p.gen)).collect();
                self.await_left(&failing);
                let reported: Vec<(usize, u64)> = self
                    .posts(ranks)
                    .into_iter()
                    .filter(|(_, p)| !p.refused && p.seq == seq)
                    .map(|(r, p)| (r, p.gen))
                    .collect();
                let refused = self.refused_members(ranks, seq, &splits.seen);
                if !refused.is_empty() {
                    let e = self.err("split", ErrorKind::Mismatch, self.refusal_text(ranks, &refused));
                    splits.seen.extend(refused.iter().map(|(r, p)| (*r, p.gen)));
                    return Err(e);
                }
                splits.seen.extend(reported);
                let called = self.members_in_next_call(ranks, seq, phase);
                if !called.is_empty() {
                    return Err(self.refuse_next_call(ranks, seq, &called));
                }
                if let Some(e) = mismatch {
                    return Err(e);
                }
                // Last: a member that failed this split for one of the causes
                // above may have left since.
                let gone = self.gone_members(ranks);
                if !gone.is_empty() {
                    return Err(self.err("split", ErrorKind::PeerFailed, self.gone_text(ranks, &gone)));
                }
                Err(e)
            }
            Err(e) => {
                splits.failures += 1;
                Err(e)
            }
        }
    }

    /// The members of `ranks` other than this rank that can never split: they
    /// left this group (dropped their communicator), aborted, or their
    /// process is gone; each with what happened to it. Members that aborted
    /// or died come alone when there are any: a member that left may have
    /// done so only after failing this split because of them.
    fn gone_members(&self, ranks: &[usize]) -> Vec<String> {
        let me = process::my_pid();
        let gone: Vec<(bool, String)> = ranks
            .iter()
            .filter(|&&r| r != self.inner.rank)
            .filter_map(|&r| {
                let c = self.inner.seg.ctrl(r);
                let (pid, start) = (c.pid.load(Ordering::Acquire), c.start.load(Ordering::Acquire));
                match c.state.load(Ordering::Acquire) {
                    ABORTED => Some((true, format!("rank {r} aborted (its thread panicked)"))),
                    LEFT => Some((false, format!("rank {r} left the group (its communicator was dropped)"))),
                    JOINED if pid != me && !process::pid_alive(pid, start) => {
                        Some((true, format!("rank {r} (pid {pid}) died")))
                    }
                    _ => None,
                }
            })
            .collect();
        let roots = gone.iter().any(|(root, _)| *root);
        gone.into_iter().filter(|(root, _)| *root || !roots).map(|(_, why)| why).collect()
    }

    fn gone_text(&self, ranks: &[usize], gone: &[String]) -> String {
        format!("{} while rank {} waited to split {ranks:?}: it never splits", gone.join(", "), self.inner.rank)
    }

    /// The members of `ranks` other than this rank that wait, after the
    /// same `seq` collectives, in a split of another list that holds this
    /// rank, or failed and left one (in a post no failed split of this rank
    /// reported yet): neither that split nor this one can form. Not counted
    /// (`stale`): a post of a list this rank already split after these
    /// collectives, and one of a split the poster tried after fewer failed
    /// splits than this rank's (one this rank failed too): the poster has
    /// yet to return from that split, or to withdraw its post of it.
    fn members_waiting_elsewhere(
        &self,
        ranks: &[usize],
        seq: u64,
        seen: &HashMap<usize, u64>,
        stale: &dyn Fn(&Posted) -> bool,
    ) -> Vec<(usize, Posted)> {
        let me = self.inner.rank;
        let mut posts = self.posts(ranks);
        posts.retain(|(r, p)| {
            !p.refused
                && p.seq == seq
                && seen.get(r) != Some(&p.gen)
                && p.len == p.ranks.len()
                && p.ranks.contains(&me)
                && p.ranks != ranks
                && !stale(p)
        });
        posts
    }

    /// The members of `ranks` other than this rank that failed and left
    /// this split (the same list after the same `seq` collectives) when
    /// `attempt` splits after those collectives had failed for them, as for
    /// this rank now, or more: this rank came late to a split they left,
    /// which cannot form any more.
    fn members_that_left(&self, ranks: &[usize], seq: u64, attempt: u64) -> Vec<usize> {
        let mut posts = self.posts(ranks);
        posts.retain(|(_, p)| {
            p.left && p.seq == seq && p.attempt >= attempt && p.len == ranks.len() && p.ranks == ranks
        });
        posts.into_iter().map(|(r, _)| r).collect()
    }

    /// Waits, at most the group's timeout, until each member of `members`,
    /// `(rank, generation of its post)` as [`Self::members_waiting_elsewhere`]
    /// found it, left the split of that post: it posted that it failed it,
    /// or posted anything else since, or is gone.
    fn await_left(&self, members: &[(usize, u64)]) {
        let deadline = crate::clock::deadline(std::time::Instant::now(), self.inner.timeout);
        // No post: withdrawn (a split formed), or its owner died or stalled
        // while rewriting it.
        let left = |r: usize, gen: u64| self.inner.seg.ctrl(r).posted_split().map_or(true, |p| p.left || p.gen != gen);
        while !members.iter().all(|&(r, gen)| left(r, gen) || !self.gone_members(&[r]).is_empty()) {
            if std::time::Instant::now() >= deadline {
                return;
            }
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }

    /// The members of `ranks` other than this rank that refused their own
    /// list after `seq` collectives, in a post no failed split reported yet.
    fn refused_members(&self, ranks: &[usize], seq: u64, seen: &HashMap<usize, u64>) -> Vec<(usize, Posted)> {
        let mut posts = self.posts(ranks);
        posts.retain(|(r, p)| p.refused && p.seq == seq && seen.get(r) != Some(&p.gen));
        posts
    }

    /// The members of `ranks` (other than this rank) that called this group's
    /// next collective, call #`seq + 1`, instead of splitting `ranks` after
    /// `seq` collectives, each with what it did there: its call described,
    /// or, for a member that refused its own arguments there (a binding that
    /// checks the split's list before the library does refuses so), its
    /// reason. A member arrived at
    /// that call's first phase (`phase + 1`) cannot pass it before this rank
    /// arrives there too, so it will not come to this split while this rank
    /// waits. Not counted: a member that failed a wait since (it no longer
    /// waits there), and one whose posted split came after `seq` collectives
    /// or later (it did split, maybe another list, failed and went on: the
    /// lists' disagreement is reported as such).
    fn members_in_next_call(&self, ranks: &[usize], seq: u64, phase: u64) -> Vec<(usize, String)> {
        let seg = &self.inner.seg;
        let slot = ((seq + 1) % 2) as usize;
        ranks
            .iter()
            .filter(|&&r| r != self.inner.rank)
            .filter(|&&r| {
                let c = seg.ctrl(r);
                c.arrive.load(Ordering::Acquire) > phase && c.state.load(Ordering::Acquire) == JOINED
            })
            .filter(|&&r| seg.ctrl(r).posted_split().map_or(true, |p| p.seq < seq))
            .filter_map(|&r| {
                let p = seg.ctrl_ptr(r);
                // SAFETY: rank r wrote the descriptor of its call #seq + 1
                // before arriving at its first phase (acquire, above), and
                // does not rewrite the slot before every rank passed it.
                let d = Desc::from_words(unsafe { &*std::ptr::addr_of!((*p).desc[slot]) });
                (d.seq == seq + 1).then(|| {
                    let did = if d.invalid {
                        // SAFETY: as the descriptor above.
                        let why = unsafe { crate::descriptor::refusal_text(seg, r, slot) };
                        format!("refused its own arguments ({why})")
                    } else {
                        format!("called {}", d.describe())
                    };
                    (r, did)
                })
            })
            .collect()
    }

    fn next_call_text(&self, ranks: &[usize], seq: u64, called: &[(usize, String)]) -> String {
        let who: Vec<String> = called.iter().map(|(r, did)| format!("rank {r} {did}")).collect();
        format!(
            "{} while rank {} split {ranks:?} after {seq} collectives: every member of the list must call split \
             there",
            who.join(", "),
            self.inner.rank
        )
    }

    /// Takes part in this group's call #`seq + 1`, which members `called`
    /// are waiting in, as a refusal naming this split (they fail with a
    /// Mismatch at once), and returns this rank's Mismatch naming their calls.
    fn refuse_next_call(&self, ranks: &[usize], seq: u64, called: &[(usize, String)]) -> Error {
        let mine = format!("it called split({ranks:?}) after {seq} collectives, not this call");
        let desc = Desc::new(Kind::Barrier, DataType::F32, None);
        let joined = self.drive(Kind::Barrier, desc, Some(&mine), &|_| 0, &mut |_, _| {}, &mut |_, _| {}, false);
        let mut detail = self.next_call_text(ranks, seq, called);
        if let Err(e) = joined {
            detail += &format!("; taking part in that call to fail it failed too: {e}");
        }
        self.err("split", ErrorKind::Mismatch, detail)
    }

    /// The posted split requests of the members of `ranks` other than this rank.
    fn posts(&self, ranks: &[usize]) -> Vec<(usize, Posted)> {
        let me = self.inner.rank;
        ranks
            .iter()
            .filter(|&&r| r != me)
            .filter_map(|&r| self.inner.seg.ctrl(r).posted_split().map(|p| (r, p)))
            .collect()
    }

    fn refusal_text(&self, ranks: &[usize], refused: &[(usize, Posted)]) -> String {
        let who: Vec<String> = refused.iter().map(|(r, p)| format!("rank {r} passed {}", p.describe())).collect();
        format!(
            "{}, which it refused as invalid, while rank {} passed {ranks:?}: members disagree on the rank list",
            who.join(", "),
            self.inner.rank
        )
    }

    /// After a split of `ranks` (after `seq` collectives) timed out, or
    /// failed because a member waiting with this one gave up: the members
    /// whose pending split has another list, or came after another number
    /// of collectives, as a [`ErrorKind::Mismatch`] naming both.
    fn split_mismatch(&self, ranks: &[usize], seq: u64) -> Option<Error> {
        let me = self.inner.rank;
        let posted = self.posts(ranks);
        let lists: Vec<String> = posted
            .iter()
            .filter(|(_, p)| p.ranks != ranks || p.len != ranks.len())
            .map(|(r, p)| format!("rank {r} passed {}", p.describe()))
            .collect();
        if !lists.is_empty() {
            let detail = format!("members disagree on the rank list: rank {me} passed {ranks:?}, {}", lists.join(", "));
            return Some(self.err("split", ErrorKind::Mismatch, detail));
        }
        let seqs: Vec<String> =
            posted.iter().filter(|(_, p)| p.seq != seq).map(|(r, p)| format!("rank {r} after {}", p.seq)).collect();
        if seqs.is_empty() {
            return None;
        }
        let detail = format!(
            "members split {ranks:?} at different points of the group's calls: rank {me} after {seq} collectives, {}",
            seqs.join(", ")
        );
        Some(self.err("split", ErrorKind::Mismatch, detail))
    }
}
