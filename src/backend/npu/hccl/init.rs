//! Making communicators: from a root info, borrowed from the host engine,
//! and split into sub-communicators.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use crate::backend::npu::result::hccl::{self as hc, hccl};
use crate::backend::npu::NpuDevice;
use crate::comm::CommOptions;
use crate::{Error, Result};

use super::api::{config_for, fnv1a, query_name, query_rank_info, FNV_SEED};
use super::root_info::HcclRootInfo;
use super::{CommInner, HcclComm};

impl HcclRootInfo {
    /// Asks HCCL for a new root info (`HcclGetRootInfo`), on `device`. Call it
    /// on one rank only.
    pub fn generate(device: &NpuDevice) -> Result<Self> {
        // A missing HCCL is reported before the device is bound.
        hccl()?;
        device.stream().enter()?;
        let raw = hc::get_root_info()?;
        Ok(Self::from_raw(&raw))
    }
}

/// A rank of this process inside `HcclCommInitRootInfo[Config]`: the world
/// (its root info and size), the rank, its NPU, and the ranks refused for
/// asking for the same NPU while it joined.
struct Joiner {
    key: u64,
    rank: usize,
    device: u32,
    refused: Vec<usize>,
}

/// The ranks of this process that are joining a world now.
static JOINING: Mutex<Vec<Joiner>> = Mutex::new(Vec::new());

/// This rank's entry in [`JOINING`] while it joins; dropping it leaves.
struct Joining {
    key: u64,
    rank: usize,
}

impl Joining {
    /// Enters `rank` of world `key` on NPU `device`, or refuses it when a
    /// rank of this process already joins that world on that NPU.
    ///
    /// HCCL refuses two ranks of one communicator on one device: every rank
    /// checks the gathered rank table once all have joined, and two ranks of
    /// one server with one device physical id fail `HcclCommInitRootInfo` on
    /// every rank with HCCL_E_PARA (EI0015; hicann/hcomm v8.5.0
    /// `src/framework/common/src/topo/topoinfo_exchange_agent.cc:822-849`).
    /// The API reference also forbids concurrent calls from two threads on
    /// one device. Ranks in other processes cannot be seen here: HCCL's
    /// refusal (with its message) is what they get.
    fn claim(op: &'static str, key: u64, rank: usize, device: u32) -> Result<Joining> {
        let mut joining = JOINING.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(other) = joining.iter_mut().find(|j| j.key == key && j.device == device) {
            other.refused.push(rank);
            return Err(Error::invalid(
                op,
                "device",
                format!(
                    "rank {rank} and rank {} of one HCCL world would both be on npu:{device}: HCCL refuses two \
                     ranks of one communicator on one device (HcclCommInitRootInfo fails with HCCL_E_PARA, EI0015); \
                     give each rank its own NPU (rank {} waits in HCCL for rank {rank} until it joins on another \
                     NPU or the connect timeout passes)",
                    other.rank, other.rank
                ),
            ));
        }
        joining.push(Joiner { key, rank, device, refused: Vec::new() });
        Ok(Joining { key, rank })
    }

    /// `e`, HCCL's failure of this rank's join, naming the ranks refused for
    /// this rank's NPU (for which it waited).
    fn explain(&self, e: Error) -> Error {
        let joining = JOINING.lock().unwrap_or_else(|e| e.into_inner());
        let Some(me) = joining.iter().find(|j| j.key == self.key && j.rank == self.rank) else { return e };
        match e {
            Error::Hccl { call, code, msg } if !me.refused.is_empty() => Error::Hccl {
                call,
                code,
                msg: format!(
                    "{msg}; rank(s) {:?} of this world were refused before joining, for asking for npu:{} as this \
                     rank did",
                    me.refused, me.device
                ),
            },
            e => e,
        }
    }
}

impl Drop for Joining {
    fn drop(&mut self) {
        let mut joining = JOINING.lock().unwrap_or_else(|e| e.into_inner());
        joining.retain(|j| !(j.key == self.key && j.rank == self.rank));
    }
}

/// The communicators this process made from a root info, by the root info
/// and the NPU (see [`refuse_a_live_root`]).
static LIVE_ROOTS: Mutex<Vec<(u64, u32, Weak<CommInner>)>> = Mutex::new(Vec::new());

/// Refuses a second communicator of root info `root_id` on NPU `device`
/// while this process holds one. HCCL names a root-info communicator after
/// its root info and keeps each device's communicators by name until
/// `HcclCommDestroy`: a second one of a live name fails with HCCL_E_PARA
/// ("The comm name[..] already exists in Group2Comm map", op_base.cc
/// `InitCommRootInfo`; HongminTan/ACNC2025-HCCL
/// `src/domain/collective_communication/framework/op_base/src/op_base.cc:1048-1057`),
/// which says nothing of why. One whose destruction timed out (left to
/// HCCL, see `CommInner`'s drop) is not seen here: HCCL refuses it.
fn refuse_a_live_root(op: &'static str, root_id: u64, device: u32, rank: usize) -> Result<()> {
    let mut live = LIVE_ROOTS.lock().unwrap_or_else(|e| e.into_inner());
    live.retain(|(_, _, c)| c.strong_count() > 0);
    let Some(held) = live.iter().filter(|(r, d, _)| *r == root_id && *d == device).find_map(|(_, _, c)| c.upgrade())
    else {
        return Ok(());
    };
    Err(Error::invalid(
        op,
        "root",
        format!(
            "npu:{device} already holds a communicator of this root info (rank {} of {}) in this process; HCCL \
             names a communicator after its root info and refuses a second one of a live name on one device \
             (HCCL_E_PARA): drop the first before rank {rank} joins again, or join a new root info",
            held.rank, held.world
        ),
    ))
}

impl HcclComm {
    /// Joins the communicator of `world` ranks described by `root` as `rank`
    /// (`HcclCommInitRootInfo`); blocks until every rank joined. A rank that
    /// asks for an NPU another rank of this process is joining the same
    /// world on is refused before HCCL is called: HCCL refuses two ranks of
    /// one communicator on one device.
    pub fn from_root_info(
        device: &NpuDevice,
        root: &HcclRootInfo,
        world: usize,
        rank: usize,
        opts: &CommOptions,
    ) -> Result<Self> {
        const OP: &str = "HcclComm::from_root_info";
        if world == 0 || rank >= world {
            return Err(Error::invalid(OP, "rank", format!("rank {rank} of a world of {world}")));
        }
        let raw_root = root.to_raw();
        // The root info alone names HCCL's communicator; with the world size
        // (FNV-1a continued from it) it keys this world.
        let root_id = fnv1a(FNV_SEED, raw_root.internal.iter().map(|&c| c as u8));
        let key = fnv1a(root_id, (world as u64).to_le_bytes());
        let joining = Joining::claim(OP, key, rank, device.ordinal())?;
        refuse_a_live_root(OP, root_id, device.ordinal(), rank)?;
        // A missing HCCL is reported before the device is bound.
        hccl()?;
        device.stream().enter()?;
        let made = if hc::has_comm_init_root_info_config()? {
            let config = config_for(opts);
            hc::comm_init_root_info_config(world as u32, &raw_root, rank as u32, &config)
        } else {
            hc::comm_init_root_info(world as u32, &raw_root, rank as u32)
        };
        let raw = made.map_err(|e| joining.explain(e))?;
        drop(joining);
        let name = query_name(raw).unwrap_or_else(|| format!("hccl-world-{world}"));
        let comm = Self::wrap(raw, (true, true), device, (rank, world), (name, key), opts, None);
        let held = Arc::downgrade(&comm.inner);
        LIVE_ROOTS.lock().unwrap_or_else(|e| e.into_inner()).push((root_id, device.ordinal(), held));
        Ok(comm)
    }

    /// Wraps a communicator created by the host engine (e.g. torch's
    /// ProcessGroupHCCL); it is never destroyed by us. Rank and size are
    /// queried from HCCL.
    ///
    /// # Safety
    /// `raw` must be a live communicator whose device is `device`, and must
    /// outlive every use of the returned handle.
    pub unsafe fn borrow_raw(device: &NpuDevice, raw: hccl_sys::HcclComm, opts: &CommOptions) -> Result<Self> {
        // SAFETY: the caller's contract.
        unsafe { Self::borrow_with(device, raw, opts, false) }
    }

    /// # Safety
    /// As for [`HcclComm::borrow_raw`].
    unsafe fn borrow_with(
        device: &NpuDevice,
        raw: hccl_sys::HcclComm,
        opts: &CommOptions,
        splittable: bool,
    ) -> Result<Self> {
        // A missing HCCL is reported before the device is bound.
        hccl()?;
        device.stream().enter()?;
        let (rank, world) = query_rank_info(raw)?;
        let name = query_name(raw).unwrap_or_else(|| format!("hccl-borrowed-{world}"));
        // The host engine names its groups identically on every member.
        let key = fnv1a(FNV_SEED, name.bytes());
        Ok(Self::wrap(raw, (false, splittable), device, (rank, world), (name, key), opts, None))
    }

    /// [`HcclComm::borrow_raw`] of the engine's world communicator (e.g.
    /// torch.distributed's default group): one made from a root info, not by
    /// `HcclCreateSubCommConfig`, so [`HcclComm::split_hccl`] may split it.
    ///
    /// # Safety
    /// As for [`HcclComm::borrow_raw`]; and `raw` must be a global
    /// communicator: splitting a sub-communicator is the nested split HCCL
    /// refuses (HCCL API reference, `HcclCreateSubCommConfig`).
    pub unsafe fn borrow_raw_world(device: &NpuDevice, raw: hccl_sys::HcclComm, opts: &CommOptions) -> Result<Self> {
        // SAFETY: the caller's contract is borrow_raw's.
        unsafe { Self::borrow_with(device, raw, opts, true) }
    }

    fn wrap(
        raw: hccl_sys::HcclComm,
        (owned, splittable): (bool, bool),
        device: &NpuDevice,
        (rank, world): (usize, usize),
        (name, key): (String, u64),
        opts: &CommOptions,
        global: Option<(Arc<CommInner>, Vec<usize>)>,
    ) -> Self {
        let (global, global_ranks) = match global {
            Some((g, ranks)) => (Some(g), ranks),
            None => (None, (0..world).collect()),
        };
        let comm = HcclComm {
            inner: Arc::new(CommInner {
                raw,
                owned,
                splittable,
                device: device.clone(),
                rank,
                world,
                name,
                key,
                opts: opts.clone(),
                splits: Mutex::new(HashMap::new()),
                global,
                global_ranks,
                placeholders: std::sync::OnceLock::new(),
                last_stream: Mutex::new(None),
            }),
        };
        // Now rather than under a capture; a failure here is the first
        // empty buffer's to report.
        let _ = comm.placeholders();
        comm
    }

    /// A sub-communicator of `ranks` (ranks of this communicator, in the new
    /// group's order) through `HcclCreateSubCommConfig`. Every member calls it
    /// with the same list; the calling rank must be in it.
    ///
    /// HCCL (API reference, HcclCreateSubCommConfig) splits only a global
    /// communicator ("nested splitting is not supported"), and numbers the new
    /// group's ranks by their position in an ordered list of global ranks
    /// ("the array should be ordered"). So a split of a sub-communicator is
    /// made from its global communicator, with `ranks` mapped to global
    /// ranks; the list must be ascending, since HCCL would otherwise give the
    /// ranks a different order than the caller asked for.
    pub fn split_hccl(&self, ranks: &[usize]) -> Result<HcclComm> {
        const OP: &str = "HcclComm::split";
        let me = self.inner.rank;
        let Some(sub_rank) = ranks.iter().position(|&r| r == me) else {
            return Err(Error::invalid(OP, "ranks", format!("rank {me} is not in {ranks:?}")));
        };
        let mut seen = vec![false; self.inner.world];
        for &r in ranks {
            if r >= self.inner.world || std::mem::replace(&mut seen[r], true) {
                return Err(Error::invalid(
                    OP,
                    "ranks",
                    format!("{ranks:?} must be distinct ranks below {}", self.inner.world),
                ));
            }
        }
        if ranks.windows(2).any(|w| w[0] > w[1]) {
            return Err(Error::invalid(
                OP,
                "ranks",
                format!(
                    "{ranks:?} is not ascending: an HCCL sub-communicator numbers its ranks in ascending order \
                     (HcclCreateSubCommConfig takes an ordered rank list), so pass the ranks sorted"
                ),
            ));
        }
        // A borrowed communicator (the host engine's) may itself be a
        // sub-communicator of the engine's world: torch_npu makes subgroups
        // with HcclCreateSubCommConfig too, and nothing in HCCL tells them
        // apart. Splitting one would be the nested split HCCL refuses.
        if !self.inner.splittable && self.inner.global.is_none() {
            return Err(Error::invalid(
                OP,
                "self",
                format!(
                    "{self:?} is borrowed from the host engine and may be a sub-communicator; \
                     HcclCreateSubCommConfig splits only a global communicator (HCCL API reference: nested \
                     splitting is not supported). Create the group in the engine (e.g. \
                     torch.distributed.new_group) and borrow it, borrow the engine's world with \
                     HcclComm::borrow_raw_world, or split a communicator made with HcclComm::from_root_info"
                ),
            ));
        }
        let global_ids: Vec<usize> = ranks.iter().map(|&r| self.inner.global_ranks[r]).collect();
        let root: Arc<CommInner> = self.inner.global.clone().unwrap_or_else(|| self.inner.clone());
        let serial = {
            let mut splits = root.splits.lock().map_err(|_| Error::invalid(OP, "self", "split state poisoned"))?;
            let n = splits.entry(global_ids.clone()).or_insert(0);
            *n += 1;
            *n
        };
        let name = format!(
            "{}/{}#{serial}",
            root.name,
            global_ids.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(",")
        );
        let id = fnv1a(root.key, global_ids.iter().flat_map(|&r| (r as u64).to_le_bytes()).chain(serial.to_le_bytes()));
        // 0xFFFFFFFF is the subCommId of a rank outside the new group.
        let id = if id == 0xFFFF_FFFF { id ^ 1 } else { id };
        hccl()?;
        self.inner.device.stream().enter()?;
        let mut ids: Vec<u32> = global_ids.iter().map(|&r| r as u32).collect();
        let mut config = config_for(&self.inner.opts);
        let mut parent = root.raw;
        // SAFETY: `parent` is the live global communicator's handle; `ids` is
        // ascending and `sub_rank` is this rank's index in it, as the HCCL
        // API reference asks.
        let sub = unsafe { hc::create_sub_comm_config(&mut parent, &mut ids, id, sub_rank as u32, &mut config) }?;
        let name = query_name(sub).unwrap_or(name);
        Ok(Self::wrap(
            sub,
            (true, false),
            &self.inner.device,
            (sub_rank, ranks.len()),
            (name, id),
            &self.inner.opts,
            Some((root, global_ids)),
        ))
    }
}
