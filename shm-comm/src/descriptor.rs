//! Collective descriptors: what one rank was asked to do, posted in its
//! control block and compared across ranks before any data moves.

use crate::segment::{Segment, DESC_WORDS, MAX_WORLD, SHAPE_DIMS};
use crate::{DataType, ReduceOp};

/// Collective kinds as posted in descriptors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub(crate) enum Kind {
    Barrier = 1,
    AllReduce = 2,
    ReduceScatter = 3,
    AllGather = 4,
    ReduceScatterV = 5,
    AllGatherV = 6,
    AllToAllV = 7,
    Broadcast = 8,
    ReduceScatterRows = 9,
}

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Barrier => "barrier",
            Kind::AllReduce => "all_reduce",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::AllGather => "all_gather",
            Kind::ReduceScatterV => "reduce_scatter_v",
            Kind::AllGatherV => "all_gather_v",
            Kind::AllToAllV => "all_to_all_v",
            Kind::Broadcast => "broadcast",
            Kind::ReduceScatterRows => "reduce_scatter_rows",
        }
    }
    pub(crate) fn from_u64(v: u64) -> Option<Kind> {
        [
            Kind::Barrier,
            Kind::AllReduce,
            Kind::ReduceScatter,
            Kind::AllGather,
            Kind::ReduceScatterV,
            Kind::AllGatherV,
            Kind::AllToAllV,
            Kind::Broadcast,
            Kind::ReduceScatterRows,
        ]
        .into_iter()
        .find(|k| *k as u64 == v)
    }
}

/// A collective descriptor (what one rank was asked to do).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Desc {
    pub(crate) seq: u64,
    pub(crate) kind: u64,
    pub(crate) dtype: u64,
    pub(crate) op: u64,
    pub(crate) root: u64,
    pub(crate) invalid: bool,
    pub(crate) count: u64,
    pub(crate) counts_a: Vec<u64>,
    pub(crate) counts_b: Vec<u64>,
    /// The caller's context tag (e.g. the forward's MoE comm type).
    pub(crate) tag: Option<u64>,
    /// The shape the caller asked the ranks to agree on besides the counts.
    pub(crate) shape: Option<PostedShape>,
}

/// A shape as posted: a label naming it (at most 16 bytes) and its
/// dimensions, the first [`SHAPE_DIMS`] of them as they are; a longer shape
/// keeps its first `SHAPE_DIMS - 1` and a hash of the rest in the last.
/// Ranks agree on the dimensions only: the label just names the shape in
/// errors, and one rank reducing in place (`buf`) while a peer reduces out of
/// place (`src`) is the same collective.
#[derive(Debug, Clone)]
pub(crate) struct PostedShape {
    label: [u8; 16],
    ndim: u64,
    dims: [u64; SHAPE_DIMS],
}

impl PartialEq for PostedShape {
    fn eq(&self, other: &PostedShape) -> bool {
        (self.ndim, self.dims) == (other.ndim, other.dims)
    }
}

impl Eq for PostedShape {}

impl PostedShape {
    pub(crate) fn new(label: &str, dims: &[usize]) -> PostedShape {
        let mut l = [0u8; 16];
        let n = label.len().min(16);
        l[..n].copy_from_slice(&label.as_bytes()[..n]);
        let mut d = [0u64; SHAPE_DIMS];
        for (w, &x) in d.iter_mut().zip(dims) {
            *w = x as u64;
        }
        if dims.len() > SHAPE_DIMS {
            // FNV-1a over the dimensions that do not fit.
            d[SHAPE_DIMS - 1] = dims[SHAPE_DIMS - 1..]
                .iter()
                .flat_map(|&x| (x as u64).to_le_bytes())
                .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
        }
        PostedShape { label: l, ndim: dims.len() as u64, dims: d }
    }

    /// `label shape [d0, d1, ...]`.
    fn describe(&self) -> String {
        let end = self.label.iter().position(|&b| b == 0).unwrap_or(16);
        let label = String::from_utf8_lossy(&self.label[..end]);
        let n = self.ndim as usize;
        let shown: Vec<String> = if n <= SHAPE_DIMS {
            self.dims[..n].iter().map(u64::to_string).collect()
        } else {
            let mut v: Vec<String> = self.dims[..SHAPE_DIMS - 1].iter().map(u64::to_string).collect();
            v.push(format!("... ({n} dims, the rest hashing to {:#018x})", self.dims[SHAPE_DIMS - 1]));
            v
        };
        format!("{label} shape [{}]", shown.join(", "))
    }
}

const W_SEQ: usize = 0;
const W_KIND: usize = 1;
const W_DTYPE: usize = 2;
const W_OP: usize = 3;
const W_ROOT: usize = 4;
const W_FLAGS: usize = 5;
const W_COUNT: usize = 6;
const W_NA: usize = 7;
const W_TAG: usize = 8;
const W_COUNTS: usize = 9;
const W_SHAPE: usize = W_COUNTS + 2 * MAX_WORLD;
/// Flag bits; bits 32.. hold the posted shape's dimension count.
const F_INVALID: u64 = 1;
const F_TAGGED: u64 = 2;
const F_SHAPED: u64 = 4;

impl Desc {
    pub(crate) fn new(kind: Kind, dtype: DataType, op: Option<ReduceOp>) -> Desc {
        Desc {
            seq: 0,
            kind: kind as u64,
            dtype: dtype as u64,
            op: op.map_or(u64::MAX, |o| o as u64),
            root: u64::MAX,
            invalid: false,
            count: 0,
            counts_a: Vec::new(),
            counts_b: Vec::new(),
            tag: None,
            shape: None,
        }
    }
    pub(crate) fn count(mut self, n: usize) -> Desc {
        self.count = n as u64;
        self
    }
    pub(crate) fn counts(mut self, a: &[usize], b: &[usize]) -> Desc {
        self.counts_a = a.iter().map(|&c| c as u64).collect();
        self.counts_b = b.iter().map(|&c| c as u64).collect();
        self
    }
    pub(crate) fn root(mut self, r: usize) -> Desc {
        self.root = r as u64;
        self
    }
    pub(crate) fn shape(mut self, shape: Option<PostedShape>) -> Desc {
        self.shape = shape;
        self
    }

    pub(crate) fn to_words(&self, world: usize) -> [u64; DESC_WORDS] {
        let mut w = [0u64; DESC_WORDS];
        w[W_SEQ] = self.seq;
        w[W_KIND] = self.kind;
        w[W_DTYPE] = self.dtype;
        w[W_OP] = self.op;
        w[W_ROOT] = self.root;
        w[W_FLAGS] = if self.invalid { F_INVALID } else { 0 } | if self.tag.is_some() { F_TAGGED } else { 0 };
        w[W_TAG] = self.tag.unwrap_or(0);
        if let Some(s) = &self.shape {
            w[W_FLAGS] |= F_SHAPED | s.ndim.min(u64::from(u32::MAX)) << 32;
            w[W_SHAPE] = u64::from_le_bytes(s.label[..8].try_into().unwrap_or_default());
            w[W_SHAPE + 1] = u64::from_le_bytes(s.label[8..].try_into().unwrap_or_default());
            w[W_SHAPE + 2..W_SHAPE + 2 + SHAPE_DIMS].copy_from_slice(&s.dims);
        }
        w[W_COUNT] = self.count;
        // Counts vectors are only posted when valid (len == world).
        let ok = self.counts_a.len() == world && self.counts_b.len() == world && !self.invalid;
        w[W_NA] = if ok { world as u64 } else { 0 };
        if ok {
            w[W_COUNTS..W_COUNTS + world].copy_from_slice(&self.counts_a);
            w[W_COUNTS + MAX_WORLD..W_COUNTS + MAX_WORLD + world].copy_from_slice(&self.counts_b);
        }
        w
    }

    pub(crate) fn from_words(w: &[u64; DESC_WORDS]) -> Desc {
        let na = (w[W_NA] as usize).min(MAX_WORLD);
        Desc {
            seq: w[W_SEQ],
            kind: w[W_KIND],
            dtype: w[W_DTYPE],
            op: w[W_OP],
            root: w[W_ROOT],
            invalid: w[W_FLAGS] & F_INVALID != 0,
            tag: (w[W_FLAGS] & F_TAGGED != 0).then_some(w[W_TAG]),
            shape: (w[W_FLAGS] & F_SHAPED != 0).then(|| {
                let mut label = [0u8; 16];
                label[..8].copy_from_slice(&w[W_SHAPE].to_le_bytes());
                label[8..].copy_from_slice(&w[W_SHAPE + 1].to_le_bytes());
                let mut dims = [0u64; SHAPE_DIMS];
                dims.copy_from_slice(&w[W_SHAPE + 2..W_SHAPE + 2 + SHAPE_DIMS]);
                PostedShape { label, ndim: w[W_FLAGS] >> 32, dims }
            }),
            count: w[W_COUNT],
            counts_a: w[W_COUNTS..W_COUNTS + na].to_vec(),
            counts_b: w[W_COUNTS + MAX_WORLD..W_COUNTS + MAX_WORLD + na].to_vec(),
        }
    }

    /// Human-readable form for error messages.
    pub(crate) fn describe(&self) -> String {
        let kind = Kind::from_u64(self.kind);
        let mut s = kind.map_or_else(|| format!("collective #{}", self.kind), |k| k.name().to_string());
        if kind != Some(Kind::Barrier) {
            let dt = DataType::from_u32(self.dtype as u32).map_or("?", |d| d.name());
            s += &format!(" dtype {dt}");
        }
        if let Some(op) = ReduceOp::from_u32(self.op as u32).filter(|_| self.op != u64::MAX) {
            s += &format!(" op {}", op.name());
        }
        match kind {
            Some(Kind::AllReduce | Kind::ReduceScatter | Kind::AllGather) => s += &format!(" count {}", self.count),
            Some(Kind::Broadcast) => s += &format!(" count {} root {}", self.count, self.root),
            Some(Kind::ReduceScatterV | Kind::AllGatherV) => s += &format!(" counts {:?}", self.counts_a),
            Some(Kind::ReduceScatterRows) => s += &format!(" row_len {} counts {:?}", self.count, self.counts_a),
            Some(Kind::AllToAllV) => s += &format!(" send_counts {:?} recv_counts {:?}", self.counts_a, self.counts_b),
            _ => {}
        }
        if let Some(shape) = &self.shape {
            s += &format!(" {}", shape.describe());
        }
        if let Some(t) = self.tag {
            s += &format!(" tag {t}");
        }
        s += &format!(" (call #{})", self.seq);
        s
    }

    /// The fields all ranks must agree on (all_to_all_v is checked pairwise).
    pub(crate) fn agreement_key(&self) -> Desc {
        let mut k = self.clone();
        if Kind::from_u64(self.kind) == Some(Kind::AllToAllV) {
            k.counts_a.clear();
            k.counts_b.clear();
        }
        k
    }
}

/// The error text rank `j` of `seg` posted with its descriptor in slot
/// `slot`, flagged invalid: why it refused its own arguments to that call.
///
/// # Safety
/// As for reading the descriptor: rank `j` wrote that slot before arriving
/// at the call's first phase, which this rank observed (acquire), and does
/// not rewrite it before this rank arrives at the next phase.
pub(crate) unsafe fn refusal_text(seg: &Segment, j: usize, slot: usize) -> String {
    let p = seg.ctrl_ptr(j);
    // SAFETY: the caller's contract.
    let raw = unsafe { &*std::ptr::addr_of!((*p).err[slot]) };
    let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
    String::from_utf8_lossy(&raw[..end]).into_owned()
}

/// Why the descriptors `descs` (slot `slot` of every rank of `seg`) disagree,
/// if they do.
pub(crate) fn disagreement(seg: &Segment, kind: Kind, descs: &[Desc], slot: usize) -> Option<String> {
    if let Some(d) = tag_disagreement(descs) {
        return Some(d);
    }
    {
        let bad: Vec<usize> = (0..descs.len()).filter(|&j| descs[j].invalid).collect();
        if !bad.is_empty() {
            let texts: Vec<String> = bad
                .iter()
                // SAFETY: written by rank j before its arrival, as the descriptor.
                .map(|&j| format!("rank {j}: {}", unsafe { refusal_text(seg, j, slot) }))
                .collect();
            return Some(format!("ranks {bad:?} passed invalid arguments to {}: {}", kind.name(), texts.join("; ")));
        }
        // Group ranks by what they called.
        let mut groups: Vec<(Desc, Vec<usize>)> = Vec::new();
        for (j, d) in descs.iter().enumerate() {
            let key = d.agreement_key();
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, v)) => v.push(j),
                None => groups.push((key, vec![j])),
            }
        }
        if groups.len() > 1 {
            let parts: Vec<String> =
                groups.iter().map(|(d, r)| format!("ranks {r:?} called {}", d.describe())).collect();
            let odd: Vec<usize> = groups.iter().skip(1).flat_map(|(_, r)| r.iter().copied()).collect();
            return Some(format!("ranks disagree (ranks {odd:?} differ from rank 0): {}", parts.join("; ")));
        }
        if kind == Kind::AllToAllV {
            let n = descs.len();
            let mut errs = Vec::new();
            for (i, di) in descs.iter().enumerate() {
                for (j, dj) in descs.iter().enumerate() {
                    let (s, r) = (di.counts_a.get(j).copied().unwrap_or(0), dj.counts_b.get(i).copied().unwrap_or(0));
                    if s != r {
                        errs.push(format!("rank {i} sends {s} elements to rank {j}, which expects {r}"));
                    }
                }
            }
            if !errs.is_empty() {
                let shown = errs.len().min(8);
                let more =
                    if errs.len() > shown { format!(" (and {} more)", errs.len() - shown) } else { String::new() };
                return Some(format!("send/recv counts disagree across {n} ranks: {}{more}", errs[..shown].join("; ")));
            }
        }
        None
    }
}

/// Ranks grouped by context tag, when they differ: the caller's context
/// (say, the comm type a forward chose) is the root cause of whatever else
/// differs, so it is reported first.
fn tag_disagreement(descs: &[Desc]) -> Option<String> {
    let mut groups: Vec<(Option<u64>, Vec<usize>)> = Vec::new();
    for (j, d) in descs.iter().enumerate() {
        match groups.iter_mut().find(|(t, _)| *t == d.tag) {
            Some((_, v)) => v.push(j),
            None => groups.push((d.tag, vec![j])),
        }
    }
    if groups.len() < 2 {
        return None;
    }
    let parts: Vec<String> = groups
        .iter()
        .map(|(t, r)| match t {
            Some(t) => format!("ranks {r:?} chose {t}"),
            None => format!("ranks {r:?} set no tag"),
        })
        .collect();
    let calls: Vec<String> =
        groups.iter().map(|(_, r)| format!("rank {} called {}", r[0], descs[r[0]].describe())).collect();
    Some(format!("ranks disagree on the context tag: {} ({})", parts.join(", "), calls.join("; ")))
}

/// The last collective rank `j` of `seg` posted, described, if any. Read only
/// for a peer that stopped taking part (it left, aborted, failed or died), so
/// its control block no longer changes.
pub(crate) fn last_call(seg: &Segment, j: usize) -> Option<String> {
    let p = seg.ctrl_ptr(j);
    let descs: Vec<Desc> = (0..2)
        // SAFETY: the block lies inside the mapping; a peer that stopped no
        // longer writes it (a torn read would only garble this message).
        .map(|k| Desc::from_words(unsafe { &std::ptr::addr_of!((*p).desc[k]).read_volatile() }))
        .collect();
    descs.into_iter().filter(|d| d.seq > 0).max_by_key(|d| d.seq).map(|d| d.describe())
}
