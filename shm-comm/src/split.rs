//! Sub-groups: members of a rank list meet in a group of their own, named
//! after the parent, the list and how often this list was split before.

use crate::{Error, ErrorKind, Result, ShmComm};

impl ShmComm {
    /// A sub-group of the ranks `ranks` (group-local rank numbers, distinct,
    /// ascending order not required). Called by every member, with the same
    /// list; the new group's rank order is the list order. Members that pass
    /// different lists fail with a [`ErrorKind::Mismatch`] naming both lists.
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
        let n = {
            let mut m = self.inner.splits.lock().unwrap_or_else(|e| e.into_inner());
            let c = m.entry(ranks.to_vec()).or_insert(0);
            *c += 1;
            *c
        };
        let list: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
        let name = format!("{}/[{}]#{n}", self.inner.name, list.join(","));
        // Members meet in the sub-group named by their list, so members with
        // other lists never arrive there. The list is posted in this group's
        // control block meanwhile: a member that times out reads the others'
        // and reports a disagreement as such.
        let ctrl = self.inner.seg.ctrl(me);
        ctrl.post_split(Some(ranks));
        match ShmComm::rendezvous(&name, ranks.len(), pos, self.inner.timeout, &self.inner.cfg) {
            Ok(c) => {
                ctrl.post_split(None);
                Ok(c)
            }
            Err(e @ Error::Comm { kind: ErrorKind::Timeout, .. }) => Err(self.split_mismatch(ranks).unwrap_or(e)),
            Err(e) => Err(e),
        }
    }

    /// After a split timed out: the members of `ranks` whose pending split
    /// has another list, as a [`ErrorKind::Mismatch`] naming both lists.
    fn split_mismatch(&self, ranks: &[usize]) -> Option<Error> {
        let me = self.inner.rank;
        let others: Vec<String> = ranks
            .iter()
            .filter(|&&r| r != me)
            .filter_map(|&r| self.inner.seg.ctrl(r).posted_split().filter(|l| l != ranks).map(|l| (r, l)))
            .map(|(r, l)| format!("rank {r} passed {l:?}"))
            .collect();
        if others.is_empty() {
            return None;
        }
        let detail = format!("members disagree on the rank list: rank {me} passed {ranks:?}, {}", others.join(", "));
        Some(self.err("split", ErrorKind::Mismatch, detail))
    }
}
