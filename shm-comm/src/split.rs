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

use crate::{Error, ErrorKind, Result, ShmComm};

impl ShmComm {
    /// A sub-group of the ranks `ranks` (group-local rank numbers, distinct,
    /// ascending order not required). Called by every member, with the same
    /// list, after the same collectives of this group; the new group's rank
    /// order is the list order. Members that pass different lists, or split
    /// after different numbers of collectives, fail with a
    /// [`ErrorKind::Mismatch`] naming both (after the timeout); this group
    /// stays usable, and a later split of one list by every member works.
    pub fn split(&self, ranks: &[usize]) -> Result<ShmComm> {
        self.check_owner("split")?;
        let (w, me) = (self.inner.world, self.inner.rank);
        let bad = |detail: String| self.err("split", ErrorKind::Setup, detail);
        if ranks.is_empty() {
            return Err(bad("empty rank list".into()));
        }
        for (i, &r) in ranks.iter().enumerate() {
            if r >= w {
                return Err(bad(format!("rank {r} in {ranks:?} is out of range for world size {w}")));
            }
            if ranks[..i].contains(&r) {
                return Err(bad(format!("rank {r} appears more than once in {ranks:?}")));
            }
        }
        let Some(pos) = ranks.iter().position(|&r| r == me) else {
            return Err(bad(format!("rank {me} is not in {ranks:?}: only members call split")));
        };
        let seq = self.lock().seq;
        // Held until the sub-group formed or failed, so that splits through
        // clones of this handle count one after the other.
        let mut splits = self.inner.splits.lock().unwrap_or_else(|e| e.into_inner());
        if splits.0 != seq {
            *splits = (seq, HashMap::new());
        }
        let n = splits.1.get(ranks).copied().unwrap_or(0);
        let list: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
        let name = format!("{}/[{}]@{seq}#{n}", self.inner.name, list.join(","));
        // Members meet in the sub-group named by their list, so members with
        // other lists never arrive there. The list is posted in this group's
        // control block meanwhile: a member that times out reads the others'
        // and reports a disagreement as such.
        let ctrl = self.inner.seg.ctrl(me);
        ctrl.post_split(Some((ranks, seq)));
        match ShmComm::rendezvous(&name, ranks.len(), pos, self.inner.timeout, &self.inner.cfg) {
            Ok(c) => {
                ctrl.post_split(None);
                splits.1.insert(ranks.to_vec(), n + 1);
                Ok(c)
            }
            // A member that timed out there fails the others waiting with
            // it (PeerFailed): for them too, a disagreement is the cause.
            Err(e @ Error::Comm { kind: ErrorKind::Timeout | ErrorKind::PeerFailed, .. }) => {
                Err(self.split_mismatch(ranks, seq).unwrap_or(e))
            }
            Err(e) => Err(e),
        }
    }

    /// After a split of `ranks` (after `seq` collectives) timed out, or
    /// failed because a member waiting with this one gave up: the members
    /// whose pending split has another list, or came after another number
    /// of collectives, as a [`ErrorKind::Mismatch`] naming both.
    fn split_mismatch(&self, ranks: &[usize], seq: u64) -> Option<Error> {
        let me = self.inner.rank;
        let posted: Vec<(usize, Vec<usize>, u64)> = ranks
            .iter()
            .filter(|&&r| r != me)
            .filter_map(|&r| self.inner.seg.ctrl(r).posted_split().map(|(l, s)| (r, l, s)))
            .collect();
        let lists: Vec<String> =
            posted.iter().filter(|(_, l, _)| l != ranks).map(|(r, l, _)| format!("rank {r} passed {l:?}")).collect();
        if !lists.is_empty() {
            let detail = format!("members disagree on the rank list: rank {me} passed {ranks:?}, {}", lists.join(", "));
            return Some(self.err("split", ErrorKind::Mismatch, detail));
        }
        let seqs: Vec<String> =
            posted.iter().filter(|(_, _, s)| *s != seq).map(|(r, _, s)| format!("rank {r} after {s}")).collect();
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
