//! HCCL, safely: root info, communicators (from root info, sub-communicators,
//! borrowed from the host engine) and the collectives of SPEC section 8.
//!
//! Every collective is queued on the stream of its call (the stream of its
//! operands: for the C ABI the caller's `amoe_stream`) and returns: the host
//! never waits inside a collective. The HCCL API reference gives each
//! collective's `stream` argument as "the stream of the rank" (HcclAllReduce,
//! HcclAllGather, ..., hcclcpp_07_0021 and neighbours, CANN 8.0), any stream of
//! the communicator's device, on which the collective is one more task.
//! A collective whose operands live on other streams, or whose communicator
//! last ran on another stream, is ordered after them on the device (event
//! record and wait), so one communicator's collectives run in call order.
//! What only the device can tell (a mismatch between ranks, a hung peer:
//! `HcclGetCommAsyncError`) is reported by [`NpuStream::check`] of that
//! stream, naming the collective, the group and the rank.

use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::sync::{Arc, Mutex};

use hccl_sys::{Hccl, HcclCommConfig, HcclDataType, HcclReduceOp, HcclResult, HcclRootInfo as RawRootInfo};

use super::memory::NpuBuffer;
use super::runtime::{record_drop_error, NpuStream, Pending};
use super::NpuDevice;
use crate::comm::{Collectives, Comm, CommOptions, ReduceOp};
use crate::tensor::Storage;
use crate::{DType, Device, Error, Result, Tensor};

/// Size of an HCCL root info.
pub const ROOT_INFO_BYTES: usize = 4108;

/// The loaded HCCL library, or [`Error::Unavailable`] naming every path tried.
pub fn hccl() -> Result<&'static Hccl> {
    hccl_sys::hccl().map_err(|e| Error::Unavailable(e.to_string()))
}

macro_rules! hccl_fn {
    ($api:expr, $name:ident) => {
        $api.lib.$name.as_ref().map_err(|_| {
            Error::Unavailable(format!(
                "{} is not exported by {}",
                stringify!($name),
                $api.origin.path.to_string_lossy()
            ))
        })
    };
}

/// `HcclGetErrorString(code)`, or an empty string.
pub fn error_string(code: HcclResult) -> String {
    let Ok(api) = hccl() else { return String::new() };
    let Ok(f) = api.lib.HcclGetErrorString.as_ref() else { return String::new() };
    // SAFETY: any code is accepted; the result is NULL or a static string.
    let p = unsafe { f(code) };
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-NULL and NUL-terminated per the HCCL contract.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// `Ok` for `HCCL_SUCCESS`, otherwise [`Error::Hccl`] with the vendor
/// messages (`HcclGetErrorString`, then `aclGetRecentErrMsg` when it has one).
pub fn check(call: &'static str, code: HcclResult) -> Result<()> {
    if code == HcclResult::HCCL_SUCCESS {
        Ok(())
    } else {
        let mut msg = error_string(code);
        let recent = super::runtime::recent_error_message();
        if !recent.is_empty() {
            msg = if msg.is_empty() { recent } else { format!("{msg}; {recent}") };
        }
        Err(Error::Hccl { call, code: code.0 as i32, msg })
    }
}

/// HCCL's code for a dtype.
pub fn hccl_dtype(d: DType) -> HcclDataType {
    match d {
        DType::F32 => HcclDataType::HCCL_DATA_TYPE_FP32,
        DType::F16 => HcclDataType::HCCL_DATA_TYPE_FP16,
        DType::BF16 => HcclDataType::HCCL_DATA_TYPE_BFP16,
        DType::I32 => HcclDataType::HCCL_DATA_TYPE_INT32,
        DType::I64 => HcclDataType::HCCL_DATA_TYPE_INT64,
        // The one-byte dtypes only travel in data movement (all-gather,
        // all-to-all, broadcast), which copies `count` one-byte elements
        // whatever their type: moved as HCCL int8 / uint8 (both in
        // HcclDataType of hccl_types.h), never reduced (`Comm` refuses).
        DType::I8 => HcclDataType::HCCL_DATA_TYPE_INT8,
        DType::U8 | DType::Bool | DType::F8E4M3 | DType::F8E5M2 => HcclDataType::HCCL_DATA_TYPE_UINT8,
    }
}

/// HCCL's code for a reduction.
pub fn hccl_op(op: ReduceOp) -> HcclReduceOp {
    match op {
        ReduceOp::Sum => HcclReduceOp::HCCL_REDUCE_SUM,
        ReduceOp::Max => HcclReduceOp::HCCL_REDUCE_MAX,
        ReduceOp::Min => HcclReduceOp::HCCL_REDUCE_MIN,
    }
}

/// The 4108 opaque bytes rank 0 creates and every rank needs to join a
/// communicator. Plain bytes: send them out of band in any form
/// ([`HcclRootInfo::to_hex`] / [`HcclRootInfo::from_hex`] for text channels).
#[derive(Clone, PartialEq, Eq)]
pub struct HcclRootInfo {
    bytes: Box<[u8; ROOT_INFO_BYTES]>,
}

impl std::fmt::Debug for HcclRootInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HcclRootInfo({}..)", &self.to_hex()[..16])
    }
}

impl HcclRootInfo {
    /// Asks HCCL for a new root info (`HcclGetRootInfo`), on `device`. Call it
    /// on one rank only.
    pub fn generate(device: &NpuDevice) -> Result<Self> {
        let api = hccl()?;
        device.stream().enter()?;
        let f = hccl_fn!(api, HcclGetRootInfo)?;
        let mut raw = RawRootInfo::default();
        // SAFETY: valid out-pointer to a 4108-byte root info; device bound.
        check("HcclGetRootInfo", unsafe { f(&mut raw) })?;
        Ok(Self::from_raw(&raw))
    }

    fn from_raw(raw: &RawRootInfo) -> Self {
        let mut bytes = Box::new([0u8; ROOT_INFO_BYTES]);
        for (b, c) in bytes.iter_mut().zip(raw.internal.iter()) {
            *b = *c as u8;
        }
        HcclRootInfo { bytes }
    }

    fn to_raw(&self) -> RawRootInfo {
        let mut raw = RawRootInfo::default();
        for (c, b) in raw.internal.iter_mut().zip(self.bytes.iter()) {
            *c = *b as _;
        }
        raw
    }

    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8; ROOT_INFO_BYTES] {
        &self.bytes
    }

    /// From raw bytes; exactly [`ROOT_INFO_BYTES`] long.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let arr: [u8; ROOT_INFO_BYTES] = bytes.try_into().map_err(|_| {
            Error::invalid(
                "HcclRootInfo::from_bytes",
                "bytes",
                format!("{} bytes, expected {ROOT_INFO_BYTES}", bytes.len()),
            )
        })?;
        Ok(HcclRootInfo { bytes: Box::new(arr) })
    }

    /// Lower-case hex, 8216 characters.
    pub fn to_hex(&self) -> String {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut s = String::with_capacity(ROOT_INFO_BYTES * 2);
        for b in self.bytes.iter() {
            s.push(DIGITS[(b >> 4) as usize] as char);
            s.push(DIGITS[(b & 15) as usize] as char);
        }
        s
    }

    /// Parses [`HcclRootInfo::to_hex`]'s output (either case; surrounding
    /// whitespace ignored).
    pub fn from_hex(hex: &str) -> Result<Self> {
        const OP: &str = "HcclRootInfo::from_hex";
        let hex = hex.trim().as_bytes();
        if hex.len() != ROOT_INFO_BYTES * 2 {
            return Err(Error::invalid(
                OP,
                "hex",
                format!("{} characters, expected {}", hex.len(), ROOT_INFO_BYTES * 2),
            ));
        }
        let digit = |pos: usize| -> Result<u8> {
            let c = hex[pos];
            (c as char).to_digit(16).map(|d| d as u8).ok_or_else(|| {
                Error::invalid(OP, "hex", format!("character {:?} at {pos} is not a hex digit", c as char))
            })
        };
        let mut bytes = Box::new([0u8; ROOT_INFO_BYTES]);
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (digit(2 * i)? << 4) | digit(2 * i + 1)?;
        }
        Ok(HcclRootInfo { bytes })
    }
}

struct CommInner {
    raw: hccl_sys::HcclComm,
    owned: bool,
    device: NpuDevice,
    rank: usize,
    world: usize,
    name: String,
    /// An id identical on every member (from the root info, or the parent's
    /// id and the rank list), from which sub-communicator ids derive.
    key: u64,
    opts: CommOptions,
    /// Per rank list, how many sub-communicators were split off with it (so
    /// a repeated split gets a fresh id, the same on every member).
    splits: Mutex<HashMap<Vec<usize>, u64>>,
    /// The global communicator this one was split from (`None`: this is one).
    /// HcclCreateSubCommConfig (HCCL API reference) splits only a global
    /// communicator, so every split goes to it.
    global: Option<Arc<CommInner>>,
    /// The global rank of each rank of this communicator (ascending).
    global_ranks: Vec<usize>,
    /// A small device allocation passed in place of an empty (NULL) buffer.
    placeholder: std::sync::OnceLock<NpuBuffer>,
    /// The stream the last collective was queued on: the next one, on
    /// whatever stream, is ordered after it, and destruction waits for it.
    last_stream: Mutex<Option<NpuStream>>,
}

// SAFETY: an HcclComm is a library handle; HCCL allows its use from any
// thread bound to the communicator's device, and this crate serialises use
// of one communicator through its (single) stream.
unsafe impl Send for CommInner {}
// SAFETY: as above.
unsafe impl Sync for CommInner {}

impl Drop for CommInner {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let last = self.last_stream.lock().map(|mut l| l.take()).unwrap_or_default();
        let result = hccl().and_then(|api| {
            if let Some(s) = last {
                super::runtime::settled(s.synchronize())?;
            }
            super::runtime::settled(self.device.stream().synchronize())?;
            let f = hccl_fn!(api, HcclCommDestroy)?;
            // SAFETY: created by us, destroyed once, no queued collective left.
            check("HcclCommDestroy", unsafe { f(self.raw) })
        });
        if let Err(e) = result {
            record_drop_error(e);
        }
    }
}

/// An HCCL communicator bound to one device (and its stream).
#[derive(Clone)]
pub struct HcclComm {
    inner: Arc<CommInner>,
}

impl std::fmt::Debug for HcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HcclComm({:?}, rank {} of {}, npu:{}{})",
            self.inner.name,
            self.inner.rank,
            self.inner.world,
            self.inner.device.ordinal(),
            if self.inner.owned { "" } else { ", borrowed" }
        )
    }
}

fn query_rank_info(api: &Hccl, raw: hccl_sys::HcclComm) -> Result<(usize, usize)> {
    let (mut rank, mut world) = (0u32, 0u32);
    let f = hccl_fn!(api, HcclGetRankId)?;
    // SAFETY: live communicator, valid out-pointer.
    check("HcclGetRankId", unsafe { f(raw, &mut rank) })?;
    let f = hccl_fn!(api, HcclGetRankSize)?;
    // SAFETY: as above.
    check("HcclGetRankSize", unsafe { f(raw, &mut world) })?;
    Ok((rank as usize, world as usize))
}

fn query_name(api: &Hccl, raw: hccl_sys::HcclComm) -> Option<String> {
    let f = api.lib.HcclGetCommName.as_ref().ok()?;
    let mut buf = [0 as std::ffi::c_char; 129];
    // SAFETY: HCCL writes at most COMM_NAME_MAX_LENGTH (128) bytes incl. NUL.
    let code = unsafe { f(raw, buf.as_mut_ptr()) };
    if code != HcclResult::HCCL_SUCCESS {
        return None;
    }
    // SAFETY: NUL-terminated (the last byte stays 0 in any case).
    let s = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned();
    (!s.is_empty()).then_some(s)
}

fn capability(api: &Hccl) -> Option<u32> {
    let f = api.lib.HcclGetCommConfigCapability.as_ref().ok()?;
    // SAFETY: no arguments.
    Some(unsafe { f() })
}

/// A config for the running HCCL: the layout generation its capability
/// count says it understands, initialised with that generation's
/// `HcclCommConfigInit` defaults (HCCL API reference, HcclCommInitRootInfoConfig
/// and HcclCreateSubCommConfig: "the config must be initialized by calling
/// HcclCommConfigInit"; version 5's HCCL rejects the later "not set" values),
/// carrying the execution timeout of `opts` (whole seconds, rounded up) when
/// the capability `EXEC_TIMEOUT` is reported. The name is left to HCCL: ranks
/// that are threads of one process must not share one.
fn config_for(api: &Hccl, opts: &CommOptions) -> HcclCommConfig {
    let cap = capability(api);
    let mut config = hccl_sys::CommConfigLayout::for_capability(cap).new_config();
    config.adapt_to_capability(cap);
    if HcclCommConfig::supports(cap, hccl_sys::capability::EXEC_TIMEOUT) {
        let secs = opts.timeout.as_secs() + u64::from(opts.timeout.subsec_nanos() > 0);
        config.hcclExecTimeOut = i32::try_from(secs.max(1)).unwrap_or(i32::MAX);
    }
    config
}

impl HcclComm {
    /// Joins the communicator of `world` ranks described by `root` as `rank`
    /// (`HcclCommInitRootInfo`); blocks until every rank joined.
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
        let api = hccl()?;
        device.stream().enter()?;
        let raw_root = root.to_raw();
        let mut raw: hccl_sys::HcclComm = std::ptr::null_mut();
        match api.lib.HcclCommInitRootInfoConfig.as_ref() {
            Ok(f) => {
                let config = config_for(api, opts);
                // SAFETY: root info, config and out-pointer are valid for the
                // call (HCCL copies the config); device bound.
                check("HcclCommInitRootInfoConfig", unsafe {
                    f(world as u32, &raw_root, rank as u32, &config, &mut raw)
                })?;
            }
            Err(_) => {
                let f = hccl_fn!(api, HcclCommInitRootInfo)?;
                // SAFETY: root info and out-pointer are valid; device bound.
                check("HcclCommInitRootInfo", unsafe { f(world as u32, &raw_root, rank as u32, &mut raw) })?;
            }
        }
        let name = query_name(api, raw).unwrap_or_else(|| format!("hccl-world-{world}"));
        let key = fnv1a(FNV_SEED, raw_root.internal.iter().map(|&c| c as u8).chain((world as u64).to_le_bytes()));
        Ok(Self::wrap(raw, true, device, (rank, world), (name, key), opts, None))
    }

    /// Wraps a communicator created by the host engine (e.g. torch's
    /// ProcessGroupHCCL); it is never destroyed by us. Rank and size are
    /// queried from HCCL.
    ///
    /// # Safety
    /// `raw` must be a live communicator whose device is `device`, and must
    /// outlive every use of the returned handle.
    pub unsafe fn borrow_raw(device: &NpuDevice, raw: hccl_sys::HcclComm, opts: &CommOptions) -> Result<Self> {
        let api = hccl()?;
        device.stream().enter()?;
        let (rank, world) = query_rank_info(api, raw)?;
        let name = query_name(api, raw).unwrap_or_else(|| format!("hccl-borrowed-{world}"));
        // The host engine names its groups identically on every member.
        let key = fnv1a(FNV_SEED, name.bytes());
        Ok(Self::wrap(raw, false, device, (rank, world), (name, key), opts, None))
    }

    fn wrap(
        raw: hccl_sys::HcclComm,
        owned: bool,
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
        HcclComm {
            inner: Arc::new(CommInner {
                raw,
                owned,
                device: device.clone(),
                rank,
                world,
                name,
                key,
                opts: opts.clone(),
                splits: Mutex::new(HashMap::new()),
                global,
                global_ranks,
                placeholder: std::sync::OnceLock::new(),
                last_stream: Mutex::new(None),
            }),
        }
    }

    /// The device address to pass for `b`: its own, or for an empty buffer
    /// (which has no allocation) a small live one. HCCL checks every buffer
    /// for NULL before it looks at the count (`HcclAllReduceInner`,
    /// `HcclAllGather`, ...: `CHK_PTR_NULL(sendBuf)`, `CHK_PTR_NULL(recvBuf)`),
    /// and in the V collectives a rank with count 0 still takes part.
    fn dev_ptr(&self, b: &NpuBuffer) -> Result<*mut c_void> {
        if !b.as_ptr().is_null() {
            return Ok(b.as_ptr());
        }
        if let Some(p) = self.inner.placeholder.get() {
            return Ok(p.as_ptr());
        }
        let p = NpuBuffer::alloc(&self.inner.device, 32)?;
        Ok(self.inner.placeholder.get_or_init(|| p).as_ptr())
    }

    /// The raw handle (for passing to other HCCL users).
    pub fn raw(&self) -> hccl_sys::HcclComm {
        self.inner.raw
    }

    /// The NPU device.
    pub fn npu_device(&self) -> &NpuDevice {
        &self.inner.device
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
        let api = hccl()?;
        self.inner.device.stream().enter()?;
        let f = hccl_fn!(api, HcclCreateSubCommConfig)?;
        let mut ids: Vec<u32> = global_ids.iter().map(|&r| r as u32).collect();
        let mut config = config_for(api, &self.inner.opts);
        let mut parent = root.raw;
        let mut sub: hccl_sys::HcclComm = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the call; HCCL takes a pointer to
        // the global communicator's handle and does not retain `ids` or
        // `config`; `ids` is ascending and `sub_rank` is this rank's index in
        // it, as the HCCL API reference asks.
        check("HcclCreateSubCommConfig", unsafe {
            f(&mut parent, ids.len() as u32, ids.as_mut_ptr(), id, sub_rank as u32, &mut config, &mut sub)
        })?;
        let name = query_name(api, sub).unwrap_or(name);
        Ok(Self::wrap(
            sub,
            true,
            &self.inner.device,
            (sub_rank, ranks.len()),
            (name, id),
            &self.inner.opts,
            Some((root, global_ids)),
        ))
    }

    fn comm_err(&self, collective: &str, detail: String) -> Error {
        Error::Comm {
            collective: collective.to_string(),
            group: self.inner.name.clone(),
            rank: self.inner.rank,
            world: self.inner.world,
            detail,
            kind: crate::CommErrorKind::Mismatch,
        }
    }

    /// Device buffer of `t`, on this communicator's device.
    fn buffer<'a>(&self, op: &'static str, arg: &'static str, t: &'a Tensor) -> Result<&'a NpuBuffer> {
        match t.storage() {
            Storage::Npu(b) if b.device().ordinal() == self.inner.device.ordinal() => Ok(b),
            _ => Err(Error::Device {
                op,
                arg,
                expected: format!("npu:{}", self.inner.device.ordinal()),
                actual: t.device().to_string(),
            }),
        }
    }

    /// Queues one HCCL call on the stream of the call (the first operand's;
    /// the communicator's device stream when there is none), ordered after the
    /// other operands' streams and after this communicator's previous
    /// collective, records it for [`NpuStream::check`] and returns without
    /// waiting.
    fn run(
        &self,
        call: &'static str,
        operands: &[&NpuBuffer],
        launch: impl FnOnce(&Hccl, acl_sys::aclrtStream) -> Result<()>,
    ) -> Result<()> {
        let stream = operands.first().map_or_else(|| self.inner.device.stream(), |b| b.stream()).clone();
        self.run_on(&stream, call, operands, launch)
    }

    fn run_on(
        &self,
        stream: &NpuStream,
        call: &'static str,
        operands: &[&NpuBuffer],
        launch: impl FnOnce(&Hccl, acl_sys::aclrtStream) -> Result<()>,
    ) -> Result<()> {
        let api = hccl()?;
        if stream.ordinal() != self.inner.device.ordinal() {
            return Err(Error::Device {
                op: call,
                arg: "stream",
                expected: format!("npu:{}", self.inner.device.ordinal()),
                actual: format!("npu:{}", stream.ordinal()),
            });
        }
        for b in operands {
            stream.wait_for(b.stream())?;
        }
        let mut last = self.inner.last_stream.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(prev) = last.as_ref() {
            stream.wait_for(prev)?;
        }
        stream.enter()?;
        launch(api, stream.raw())?;
        *last = Some(stream.clone());
        drop(last);
        stream.record_pending(Box::new(QueuedCollective { call, comm: Arc::downgrade(&self.inner) }));
        Ok(())
    }

    /// [`Collectives::barrier`] queued on `stream` (a stream of this
    /// communicator's device, e.g. the caller's) instead of the device's own.
    pub fn barrier_on(&self, stream: &NpuStream) -> Result<()> {
        self.run_on(stream, "barrier", &[], |api, raw| {
            let f = hccl_fn!(api, HcclBarrier)?;
            // SAFETY: live communicator and stream of its device.
            check("HcclBarrier", unsafe { f(self.inner.raw, raw) })
        })
    }

    fn same_dtype(&self, op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
        if a.dtype() != b.dtype() {
            return Err(Error::dtype(op, "dst", a.dtype().name(), b.dtype()));
        }
        Ok(())
    }

    fn counts_check(
        &self,
        op: &'static str,
        arg: &'static str,
        counts: &[usize],
    ) -> Result<(Vec<u64>, Vec<u64>, usize)> {
        if counts.len() != self.inner.world {
            return Err(Error::invalid(
                op,
                arg,
                format!("{} counts for a group of {}", counts.len(), self.inner.world),
            ));
        }
        let c: Vec<u64> = counts.iter().map(|&n| n as u64).collect();
        let mut displs = Vec::with_capacity(counts.len());
        let mut total = 0u64;
        for &n in &c {
            displs.push(total);
            total += n;
        }
        Ok((c, displs, total as usize))
    }
}

const FNV_SEED: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a over `bytes`, continuing from `seed`: a stable id, the same on every rank.
fn fnv1a(seed: u64, bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(seed, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// A collective queued on a stream, reported by that stream's check.
struct QueuedCollective {
    call: &'static str,
    comm: std::sync::Weak<CommInner>,
}

impl CommInner {
    /// `HcclGetCommAsyncError`: the error HCCL recorded for this communicator
    /// (a collective that failed on the device), `None` when there is none.
    /// HCCL API reference: "queries the asynchronous error of a communicator".
    fn async_error(&self) -> Option<HcclResult> {
        let f = hccl().ok()?.lib.HcclGetCommAsyncError.as_ref().ok()?;
        let mut code = HcclResult::HCCL_SUCCESS;
        // SAFETY: live communicator (held by the caller), valid out-pointer.
        let rc = unsafe { f(self.raw, &mut code) };
        (rc == HcclResult::HCCL_SUCCESS && code != HcclResult::HCCL_SUCCESS).then_some(code)
    }
}

impl Pending for QueuedCollective {
    fn key(&self) -> Option<(usize, &'static str)> {
        Some((self.comm.as_ptr() as usize, self.call))
    }

    fn timeout(&self) -> Option<std::time::Duration> {
        self.comm.upgrade().map(|c| c.opts.timeout)
    }

    fn outcome(&self, wait: Option<&Error>, _stream: &NpuStream) -> Result<()> {
        // A destroyed communicator waited for its work and reported any
        // failure as a drop error.
        let Some(c) = self.comm.upgrade() else { return Ok(()) };
        let err = |kind, detail: String| Error::Comm {
            collective: self.call.to_string(),
            group: c.name.clone(),
            rank: c.rank,
            world: c.world,
            detail,
            kind,
        };
        if let Some(code) = c.async_error() {
            let kind = match code {
                HcclResult::HCCL_E_TIMEOUT => crate::CommErrorKind::Timeout,
                HcclResult::HCCL_E_REMOTE => crate::CommErrorKind::PeerFailed,
                _ => crate::CommErrorKind::Mismatch,
            };
            let how = wait.map(|e| format!(" (the stream reported: {e})")).unwrap_or_default();
            return Err(err(kind, format!("HCCL async error {}: {}{how}", code.0, error_string(code))));
        }
        // A wait that timed out with no error recorded by HCCL: this
        // collective (the first one queued since the last check) is named.
        match wait {
            Some(e @ Error::Acl { code, .. }) if *code == acl_sys::ACL_ERROR_RT_STREAM_SYNC_TIMEOUT => Err(err(
                crate::CommErrorKind::Timeout,
                format!("waiting for the stream (timeout {:?}) failed: {e}", c.opts.timeout),
            )),
            _ => Ok(()),
        }
    }
}

impl Collectives for HcclComm {
    fn rank(&self) -> usize {
        self.inner.rank
    }

    fn world_size(&self) -> usize {
        self.inner.world
    }

    fn name(&self) -> &str {
        &self.inner.name
    }

    fn device(&self) -> Device {
        Device::Npu(self.inner.device.clone())
    }

    fn split(&self, ranks: &[usize]) -> Result<Comm> {
        Ok(Comm::Npu(self.split_hccl(ranks)?))
    }

    fn all_reduce(&self, src: &Tensor, dst: &mut Tensor, op: ReduceOp) -> Result<()> {
        const OP: &str = "all_reduce";
        self.same_dtype(OP, src, dst)?;
        if src.numel() != dst.numel() {
            return Err(self.comm_err(OP, format!("src has {} elements, dst {}", src.numel(), dst.numel())));
        }
        let (s, d) = (self.buffer(OP, "src", src)?, self.buffer(OP, "dst", dst)?);
        let (n, dt) = (src.numel() as u64, hccl_dtype(src.dtype()));
        if n == 0 {
            // Every rank has the same count: nothing moves anywhere.
            return Ok(());
        }
        self.run(OP, &[s, d], |api, stream| {
            let f = hccl_fn!(api, HcclAllReduce)?;
            // SAFETY: both buffers hold `n` elements of `dt` on this device.
            check("HcclAllReduce", unsafe { f(s.as_ptr(), d.as_ptr(), n, dt, hccl_op(op), self.inner.raw, stream) })
        })
    }

    fn all_reduce_in_place(&self, buf: &mut Tensor, op: ReduceOp) -> Result<()> {
        const OP: &str = "all_reduce_in_place";
        let b = self.buffer(OP, "buf", buf)?;
        let (n, dt) = (buf.numel() as u64, hccl_dtype(buf.dtype()));
        if n == 0 {
            return Ok(());
        }
        self.run(OP, &[b], |api, stream| {
            let f = hccl_fn!(api, HcclAllReduce)?;
            // SAFETY: in-place all-reduce is supported; `n` elements of `dt`.
            check("HcclAllReduce", unsafe { f(b.as_ptr(), b.as_ptr(), n, dt, hccl_op(op), self.inner.raw, stream) })
        })
    }

    fn reduce_scatter(&self, src: &Tensor, dst: &mut Tensor, op: ReduceOp) -> Result<()> {
        const OP: &str = "reduce_scatter";
        self.same_dtype(OP, src, dst)?;
        if src.numel() != dst.numel() * self.inner.world {
            return Err(self.comm_err(
                OP,
                format!("src has {} elements, expected world {} x dst {}", src.numel(), self.inner.world, dst.numel()),
            ));
        }
        let (s, d) = (self.buffer(OP, "src", src)?, self.buffer(OP, "dst", dst)?);
        let (n, dt) = (dst.numel() as u64, hccl_dtype(src.dtype()));
        if n == 0 {
            return Ok(());
        }
        self.run(OP, &[s, d], |api, stream| {
            let f = hccl_fn!(api, HcclReduceScatter)?;
            // SAFETY: src holds world*n, dst n elements of `dt`.
            check("HcclReduceScatter", unsafe { f(s.as_ptr(), d.as_ptr(), n, dt, hccl_op(op), self.inner.raw, stream) })
        })
    }

    fn all_gather(&self, src: &Tensor, dst: &mut Tensor) -> Result<()> {
        const OP: &str = "all_gather";
        self.same_dtype(OP, src, dst)?;
        if dst.numel() != src.numel() * self.inner.world {
            return Err(self.comm_err(
                OP,
                format!("dst has {} elements, expected world {} x src {}", dst.numel(), self.inner.world, src.numel()),
            ));
        }
        let (s, d) = (self.buffer(OP, "src", src)?, self.buffer(OP, "dst", dst)?);
        let (n, dt) = (src.numel() as u64, hccl_dtype(src.dtype()));
        if n == 0 {
            return Ok(());
        }
        self.run(OP, &[s, d], |api, stream| {
            let f = hccl_fn!(api, HcclAllGather)?;
            // SAFETY: src holds n, dst world*n elements of `dt`.
            check("HcclAllGather", unsafe { f(s.as_ptr(), d.as_ptr(), n, dt, self.inner.raw, stream) })
        })
    }

    fn reduce_scatter_v(&self, src: &Tensor, dst: &mut Tensor, counts: &[usize], op: ReduceOp) -> Result<()> {
        const OP: &str = "reduce_scatter_v";
        self.same_dtype(OP, src, dst)?;
        let (c, displs, total) = self.counts_check(OP, "counts", counts)?;
        let mine = counts[self.inner.rank];
        if src.numel() != total || dst.numel() != mine {
            return Err(self.comm_err(
                OP,
                format!(
                    "src has {} elements (counts sum to {total}), dst {} (my count {mine})",
                    src.numel(),
                    dst.numel()
                ),
            ));
        }
        let (s, d) = (self.buffer(OP, "src", src)?, self.buffer(OP, "dst", dst)?);
        let dt = hccl_dtype(src.dtype());
        if total == 0 {
            // The counts are the same on every rank: nothing moves anywhere.
            return Ok(());
        }
        let (sp, dp) = (self.dev_ptr(s)?, self.dev_ptr(d)?);
        self.run(OP, &[s, d], |api, stream| {
            let f = hccl_fn!(api, HcclReduceScatterV)?;
            // SAFETY: counts/displacements are host u64 arrays of world length
            // that outlive the call; the buffers hold the sizes checked above.
            check("HcclReduceScatterV", unsafe {
                f(
                    sp,
                    c.as_ptr().cast::<c_void>(),
                    displs.as_ptr().cast::<c_void>(),
                    dp,
                    mine as u64,
                    dt,
                    hccl_op(op),
                    self.inner.raw,
                    stream,
                )
            })
        })
    }

    fn all_gather_v(&self, src: &Tensor, dst: &mut Tensor, counts: &[usize]) -> Result<()> {
        const OP: &str = "all_gather_v";
        self.same_dtype(OP, src, dst)?;
        let (c, displs, total) = self.counts_check(OP, "counts", counts)?;
        let mine = counts[self.inner.rank];
        if src.numel() != mine || dst.numel() != total {
            return Err(self.comm_err(
                OP,
                format!(
                    "src has {} elements (my count {mine}), dst {} (counts sum to {total})",
                    src.numel(),
                    dst.numel()
                ),
            ));
        }
        let (s, d) = (self.buffer(OP, "src", src)?, self.buffer(OP, "dst", dst)?);
        let dt = hccl_dtype(src.dtype());
        if total == 0 {
            return Ok(());
        }
        let (sp, dp) = (self.dev_ptr(s)?, self.dev_ptr(d)?);
        self.run(OP, &[s, d], |api, stream| {
            let f = hccl_fn!(api, HcclAllGatherV)?;
            // SAFETY: as for reduce_scatter_v.
            check("HcclAllGatherV", unsafe {
                f(
                    sp,
                    mine as u64,
                    dp,
                    c.as_ptr().cast::<c_void>(),
                    displs.as_ptr().cast::<c_void>(),
                    dt,
                    self.inner.raw,
                    stream,
                )
            })
        })
    }

    fn all_to_all_v(&self, src: &Tensor, send_counts: &[usize], dst: &mut Tensor, recv_counts: &[usize]) -> Result<()> {
        const OP: &str = "all_to_all_v";
        self.same_dtype(OP, src, dst)?;
        let (sc, sd, stotal) = self.counts_check(OP, "send_counts", send_counts)?;
        let (rc, rd, rtotal) = self.counts_check(OP, "recv_counts", recv_counts)?;
        if src.numel() != stotal || dst.numel() != rtotal {
            return Err(self.comm_err(
                OP,
                format!(
                    "src has {} elements (send counts sum to {stotal}), dst {} (recv counts sum to {rtotal})",
                    src.numel(),
                    dst.numel()
                ),
            ));
        }
        let (s, d) = (self.buffer(OP, "src", src)?, self.buffer(OP, "dst", dst)?);
        let dt = hccl_dtype(src.dtype());
        let (sp, dp) = (self.dev_ptr(s)?, self.dev_ptr(d)?);
        self.run(OP, &[s, d], |api, stream| {
            let f = hccl_fn!(api, HcclAlltoAllV)?;
            // SAFETY: host u64 count/displacement arrays of world length; the
            // buffers hold the totals checked above.
            check("HcclAlltoAllV", unsafe {
                f(
                    sp,
                    sc.as_ptr().cast::<c_void>(),
                    sd.as_ptr().cast::<c_void>(),
                    dt,
                    dp,
                    rc.as_ptr().cast::<c_void>(),
                    rd.as_ptr().cast::<c_void>(),
                    dt,
                    self.inner.raw,
                    stream,
                )
            })
        })
    }

    fn broadcast(&self, buf: &mut Tensor, root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        if root >= self.inner.world {
            return Err(self.comm_err(OP, format!("root {root} outside a group of {}", self.inner.world)));
        }
        let b = self.buffer(OP, "buf", buf)?;
        let (n, dt) = (buf.numel() as u64, hccl_dtype(buf.dtype()));
        if n == 0 {
            // Every rank has the same count: nothing moves, and an empty
            // buffer has no address HCCL would accept.
            return Ok(());
        }
        self.run(OP, &[b], |api, stream| {
            let f = hccl_fn!(api, HcclBroadcast)?;
            // SAFETY: `n` elements of `dt` on this device.
            check("HcclBroadcast", unsafe { f(b.as_ptr(), n, dt, root as u32, self.inner.raw, stream) })
        })
    }

    fn barrier(&self) -> Result<()> {
        self.run("barrier", &[], |api, stream| {
            let f = hccl_fn!(api, HcclBarrier)?;
            // SAFETY: live communicator and stream.
            check("HcclBarrier", unsafe { f(self.inner.raw, stream) })
        })
    }
}

/// Runs `f(rank, comm)` on `world` threads, rank `r` on NPU `r`, all joined to
/// one fresh HCCL world (root info created on device 0); returns the results
/// in rank order, or the first error. The NPU twin of the CPU `run_ranks`.
pub fn npu_run_ranks<R, F>(world: usize, opts: &CommOptions, f: F) -> Result<Vec<R>>
where
    R: Send,
    F: Fn(usize, Comm) -> Result<R> + Sync,
{
    const OP: &str = "npu_run_ranks";
    if world == 0 {
        return Err(Error::invalid(OP, "world", "a world needs at least one rank"));
    }
    let count = super::runtime::device_count()? as usize;
    if count < world {
        return Err(Error::invalid(OP, "world", format!("{world} ranks need {world} devices, {count} visible")));
    }
    let root = HcclRootInfo::generate(&NpuDevice::open(0)?)?;
    let results: Vec<Result<R>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (root, f) = (&root, &f);
                s.spawn(move || -> Result<R> {
                    let device = NpuDevice::open(rank as u32)?;
                    let comm = HcclComm::from_root_info(&device, root, world, rank, opts)?;
                    f(rank, Comm::Npu(comm))
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| h.join().unwrap_or_else(|_| Err(Error::invalid(OP, "f", format!("rank {rank} panicked")))))
            .collect()
    });
    results.into_iter().collect()
}
