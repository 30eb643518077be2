//! HCCL exports (libhccl) over the simulator's own shared-memory data plane
//! ([`plane`]), which shares no code with the ascend-moe crate.
//!
//! The root info carries a rendezvous name; every rank (a thread or a process)
//! joins the group of that name. Collectives are validated when queued
//! (communicator, stream, dtype, reduce op and device pointers) and run on the
//! stream's worker ([`collectives`]): each rank publishes a descriptor of the
//! call and its device bytes, checks that every rank made the same call, and
//! computes its own result ([`elem`]). The communicators and the table of
//! live ones are [`comms`], the way of a collective from the call to its
//! stream is `queue`; neither uses this module.
//!
//! As in HCCL, the first call of each collective on a communicator sets up
//! its links on the host, inside the call, and checks there that every rank
//! passed the same arguments (EI0005, HCCL_E_PARA returned by the call); later
//! calls are not checked ([`collectives`] says what the simulator does then).
//! A failed collective (timeout, dead peer) is the stream's error (reported by
//! its synchronisation) and later collectives on the communicator fail at once
//! with the same code; `HcclGetCommAsyncError` reports a dead peer
//! (`HCCL_E_REMOTE`, HCCL's "error CQE") and, with HCCL's inconsistent-op
//! check on, ranks that called different collectives (`HCCL_E_PARA`).

#![allow(non_snake_case, clippy::missing_safety_doc)]

pub mod collectives;
pub mod comms;
pub mod elem;
pub mod plane;
mod queue;

pub use collectives::*;
pub use comms::{SimComm, COMMS};

use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::config;
use crate::context;
use crate::ffi::*;
use crate::hccl_rules;
use crate::status::{self, fail, write_out, SimError, SimResult};

use comms::comm;
use plane::Group;

const ROOT_MAGIC: &[u8; 16] = b"CANNSIM-ROOTINFO";

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ *b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// `HcclResult HcclGetRootInfo(HcclRootInfo *rootInfo)`: writes a fresh
/// rendezvous name into the 4108 opaque bytes.
#[no_mangle]
pub unsafe extern "C" fn HcclGetRootInfo(root_info: *mut c_void) -> HcclResult {
    status::hccl("HcclGetRootInfo", || {
        // The current device, then the pointer (op_base.cc `HcclGetRootInfo`,
        // HongminTan/ACNC2025-HCCL
        // src/domain/collective_communication/framework/op_base/src/op_base.cc:826-833).
        current_device()?;
        if root_info.is_null() {
            return fail(HCCL_E_PTR, "rootInfo is NULL");
        }
        // Then the environment, as every creation reads it (hicann/hcomm
        // v8.5.0 `src/framework/op_base/src/op_base.cc:873-874`: `InitExternalInput`,
        // whose HCCL_E_PARA this call returns as it is).
        read_env()?;
        static N: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let name =
            format!("cannsim{}x{}x{:x}", std::process::id(), N.fetch_add(1, Ordering::Relaxed), nanos & 0xffff_ffff);
        let mut buf = [0u8; HCCL_ROOT_INFO_BYTES];
        buf[..16].copy_from_slice(ROOT_MAGIC);
        buf[16..16 + name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: rootInfo points to an HcclRootInfo (4108 bytes) per the C signature.
        unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), root_info as *mut u8, HCCL_ROOT_INFO_BYTES) };
        Ok(())
    })
}

fn root_name(root_info: *const c_void) -> SimResult<String> {
    if root_info.is_null() {
        return fail(HCCL_E_PTR, "rootInfo is NULL");
    }
    // SAFETY: rootInfo points to an HcclRootInfo (4108 bytes) per the C signature.
    let b = unsafe { std::slice::from_raw_parts(root_info as *const u8, HCCL_ROOT_INFO_BYTES) };
    if &b[..16] != ROOT_MAGIC {
        return fail(HCCL_E_PARA, "rootInfo was not produced by HcclGetRootInfo");
    }
    let name = &b[16..];
    let end = name.iter().position(|&c| c == 0).unwrap_or(name.len());
    Ok(String::from_utf8_lossy(&name[..end]).into_owned())
}

/// Settings read from an `HcclCommConfig`.
#[derive(Debug, Default)]
struct ConfigView {
    name: Option<String>,
    /// `hcclExecTimeOut` when the config sets it: `Some(None)` for 0, which
    /// on a 910B never times out, else `Some(Some(seconds))`.
    timeout: Option<Option<Duration>>,
    /// `hcclDeterministic` when the config sets it (anything but "not set").
    deterministic: Option<bool>,
}

fn read_config(config: *const c_void) -> SimResult<ConfigView> {
    if config.is_null() {
        return Ok(ConfigView::default());
    }
    let p = config as *const u8;
    // SAFETY: an HcclCommConfig starts with {size_t size; uint32_t magic;
    // uint32_t version}; fields beyond the header are read only when `size`
    // says the caller's struct has them.
    unsafe {
        let size = (p as *const usize).read_unaligned();
        let magic = (p.add(comm_config::MAGIC) as *const u32).read_unaligned();
        if magic != HCCL_COMM_CONFIG_MAGIC_WORD {
            return fail(HCCL_E_PARA, format!("config magic word {magic:#x} (call HcclCommConfigInit first)"));
        }
        let mut v = ConfigView::default();
        if size >= comm_config::COMM_NAME + COMM_NAME_MAX_LENGTH {
            let name = std::slice::from_raw_parts(p.add(comm_config::COMM_NAME), COMM_NAME_MAX_LENGTH);
            let end = name.iter().position(|&c| c == 0).unwrap_or(name.len());
            if end > 0 {
                v.name = Some(String::from_utf8_lossy(&name[..end]).into_owned());
            }
        }
        // `hcclExecTimeOut` exists from CANN 8.5 on: an older HCCL copies at
        // most its own struct's bytes (`CommConfig::Load`) and never sees the
        // field, whatever the caller's struct has; CANN 8.5.0's reads it only
        // from a config of version 8 or later (hicann/hcomm v8.5.0
        // `src/framework/communicator/comm_config.cc:204-206`), so a version
        // 6 config's bytes past its end are never looked at. -1
        // (HcclCommConfigInit's value, "not set") and other negative values
        // (a warning, `:360-377`) leave HCCL_EXEC_TIMEOUT in force; on a 910B
        // 0 means never (`:370-372`), and any other value wins over the
        // variable (hicann/hccl docs/zh/user_guide/hccl_env/HCCL_EXEC_TIMEOUT.md,
        // "use constraints").
        let version = (p.add(comm_config::VERSION) as *const u32).read_unaligned();
        let size = size.min(crate::version::CannVersion::current().comm_config_size());
        if version >= 8 && size >= comm_config::EXEC_TIMEOUT + 4 {
            let t = (p.add(comm_config::EXEC_TIMEOUT) as *const i32).read_unaligned();
            if t >= 0 {
                v.timeout = Some((t > 0).then(|| Duration::from_secs(t as u64)));
            }
        }
        // `hcclDeterministic` (every config version; `hccl_rules::comm_config`
        // has checked its value): 0 off, 1 on, 2 strict (8.5), 0xffffffff "not
        // set" from config version 6 on, which leaves HCCL_DETERMINISTIC in
        // force. Before version 6 HcclCommConfigInit writes 0, which is a
        // setting: the config's switch wins over the variable
        // (hicann/hccl `docs/zh/user_guide/hccl_env/HCCL_DETERMINISTIC.md`,
        // "use constraints").
        if size >= comm_config::DETERMINISTIC + 4 {
            let d = (p.add(comm_config::DETERMINISTIC) as *const u32).read_unaligned();
            if d != HCCL_COMM_DETERMINISTIC_CONFIG_NOT_SET
                || !crate::version::CannVersion::current().has_config_not_set()
            {
                v.deterministic = Some(d != 0);
            }
        }
        Ok(v)
    }
}

/// What HCCL reads from the environment before it creates a communicator or
/// a root info, whatever a config says (a bad value fails the call with
/// HCCL_E_PARA, EI0001, even when the config sets the same switch).
/// hicann/hcomm v8.5.0 `src/platform/common/externalinput.cc:43-55`
/// (`InitExternalInput`) runs `InitEnvVarParam` (`:73-...`), which parses
/// `HCCL_CONNECT_TIMEOUT` (`:76`), `HCCL_EXEC_TIMEOUT` (`:95`) and
/// `HCCL_DETERMINISTIC` (`:301`) in that order; `src/framework/op_base/src/op_base.cc`
/// calls it first thing after the argument checks in `HcclGetRootInfo`
/// (`:873`, its own code), `HcclCreateSubCommConfig` (`:833-835`),
/// `HcclCommInitRootInfoInner` (`:1318-1320`) and
/// `HcclCommInitRootInfoConfigInner` (`:1396-1398`, before the config is
/// loaded), the last three turning any failure into HCCL_E_PARA. HCCL keeps
/// what it parsed once a parse succeeded (`g_externalInput.initialized`,
/// `:46-48`, for the process); the simulator reads the variables at every
/// such call, so a value changed after a successful call is seen here only.
struct EnvView {
    /// `HCCL_EXEC_TIMEOUT`, else HCCL's default (`None`: never).
    exec_timeout: Option<Duration>,
    /// `HCCL_CONNECT_TIMEOUT` plus 20 s.
    connect: Duration,
    /// `HCCL_DETERMINISTIC`.
    deterministic: bool,
}

fn read_env() -> SimResult<EnvView> {
    let para = |m: String| SimError::new(HCCL_E_PARA, m);
    let connect = config::connect_timeout().map_err(para)?;
    let exec_timeout = config::exec_timeout().map_err(para)?;
    Ok(EnvView { exec_timeout, connect, deterministic: config::deterministic().map_err(para)? })
}

/// The calling thread's current device, which every creation asks for
/// first (HCCL_E_RUNTIME without one).
fn current_device() -> SimResult<u32> {
    context::current().map_err(|e| SimError::new(HCCL_E_RUNTIME, e.msg))
}

/// `HcclCommInitRootInfo` (`config` `None`) and `HcclCommInitRootInfoConfig`:
/// HCCL's checks before the communicator meets its peers, in HCCL's order.
/// `HcclCommInitRootInfoInner`: the current device, `rootInfo` non-NULL,
/// `nRanks` > 0, `rank` < `nRanks`, `comm` non-NULL, then the environment;
/// `HcclCommInitRootInfoConfigInner`: `rootInfo` non-NULL, `config` non-NULL
/// (EI0003), the device, the same three, the environment, then the config's
/// own rules (any failure of `CommConfig::Load` is HCCL_E_PARA); both then
/// the name ([`name_is_free`]). HongminTan/ACNC2025-HCCL
/// `src/domain/collective_communication/framework/op_base/src/op_base.cc:1210-1241`
/// and `:1283-1330`. The root info's format is the simulator's own (one of
/// another format is refused where HCCL checks it for NULL).
unsafe fn init_root_info(
    n_ranks: u32,
    root_info: *const c_void,
    rank: u32,
    config: Option<*const c_void>,
    comm: *mut HcclComm,
) -> SimResult<()> {
    let (key, device) = match config {
        None => {
            let device = current_device()?;
            (root_name(root_info)?, device)
        }
        Some(c) => {
            let key = root_name(root_info)?;
            if c.is_null() {
                return fail(HCCL_E_PTR, "config is NULL (EI0003; initialise one with HcclCommConfigInit)");
            }
            (key, current_device()?)
        }
    };
    if n_ranks == 0 {
        return fail(HCCL_E_PARA, "nRanks 0: should be greater than 0");
    }
    if rank >= n_ranks {
        return fail(HCCL_E_PARA, format!("rank {rank} should be less than nRanks {n_ranks}"));
    }
    if comm.is_null() {
        return fail(HCCL_E_PTR, "comm is NULL");
    }
    let env = read_env()?;
    let cfg = match config {
        Some(c) => {
            // SAFETY: non-NULL (checked above); the C contract makes it an HcclCommConfig.
            unsafe { hccl_rules::comm_config(c) }?;
            read_config(c)?
        }
        None => ConfigView::default(),
    };
    let h = join(key, None, (n_ranks, rank, rank), device, env, cfg)?;
    write_out(comm, h as HcclComm, HCCL_E_PTR, "comm")
}

/// Creates the communicator `key` as `rank` of `size` on `device` once the
/// caller's checks passed: the name ([`name_is_free`]), then the meeting.
fn join(
    key: String,
    name: Option<String>,
    (size, rank, world_rank): (u32, u32, u32),
    device: u32,
    env: EnvView,
    cfg: ConfigView,
) -> SimResult<usize> {
    let (timeout, connect) = (cfg.timeout.unwrap_or(env.exec_timeout), env.connect);
    let comm_name = cfg.name.clone().or(name).unwrap_or_else(|| key.clone());
    name_is_free(&comm_name, device)?;
    // The ranks are told apart by the host device behind their current one.
    let host_device = config::physical(device);
    let mut group = Group::join(&key, size, rank, host_device, connect, timeout)?;
    group.deterministic = cfg.deterministic.unwrap_or(env.deterministic);
    let link = Group::join(&format!("{key}.link"), size, rank, host_device, connect, Some(connect))?;
    let c = SimComm {
        name: comm_name,
        key,
        rank,
        size,
        world_rank,
        device,
        timeout,
        group: Mutex::new(group),
        link: Mutex::new(link),
        linked: Mutex::new(Vec::new()),
        async_error: AtomicI32::new(HCCL_SUCCESS),
        inconsistent: AtomicBool::new(false),
        failed: AtomicI32::new(HCCL_SUCCESS),
        destroyed: AtomicBool::new(false),
    };
    Ok(COMMS.insert(Arc::new(c)))
}

/// Refuses a communicator named `name` on `device` while this process has a
/// live one of that name there: HCCL keeps the communicators of each device
/// by name (`opGroup2CommMap` of the device's `HcclOpInfoCtx`) from their
/// creation to `HcclCommDestroy`, and refuses a second one with HCCL_E_PARA
/// ("The comm name[..] already exists in Group2Comm map") before it meets
/// any peer. The name is the config's `hcclCommName`, else the root info's
/// identifier (a root-info communicator) or the parent's name with the
/// `subCommId` (a sub-communicator). HongminTan/ACNC2025-HCCL (an open 8.x
/// HCCL) `src/domain/collective_communication/framework/op_base/src/op_base.cc`:
/// `InitCommRootInfo` `:1048-1057`, `HcclCreateSubCommConfigInner` `:652-659`,
/// the insert `:1166` and `:727`, the erase in `HcclCommDestroy` `:2563-2566`;
/// later HCCLs keep the check in `InitCommRootInfo`.
fn name_is_free(name: &str, device: u32) -> SimResult<()> {
    match COMMS.all().into_iter().find(|(_, c)| c.device == device && c.name == name) {
        None => Ok(()),
        Some((h, live)) => fail(
            HCCL_E_PARA,
            format!(
                "the comm name {name:?} already exists on device {device}: communicator {:#x} (rank {} of {}) of this \
                 process has it until HcclCommDestroy",
                h, live.rank, live.size
            ),
        ),
    }
}

/// `HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo *rootInfo, uint32_t rank, HcclComm *comm)`.
#[no_mangle]
pub unsafe extern "C" fn HcclCommInitRootInfo(
    n_ranks: u32,
    root_info: *const c_void,
    rank: u32,
    comm: *mut HcclComm,
) -> HcclResult {
    // SAFETY: the C contract of the arguments, checked in HCCL's order.
    status::hccl("HcclCommInitRootInfo", || unsafe { init_root_info(n_ranks, root_info, rank, None, comm) })
}

/// `HcclResult HcclCommInitRootInfoConfig(uint32_t nRanks, const HcclRootInfo *rootInfo, uint32_t rank, const HcclCommConfig *config, HcclComm *comm)`.
/// Reads `hcclCommName` and `hcclExecTimeOut` (seconds) when the config has them.
#[no_mangle]
pub unsafe extern "C" fn HcclCommInitRootInfoConfig(
    n_ranks: u32,
    root_info: *const c_void,
    rank: u32,
    config: *const c_void,
    comm: *mut HcclComm,
) -> HcclResult {
    // SAFETY: the C contract of the arguments, checked in HCCL's order.
    status::hccl("HcclCommInitRootInfoConfig", || unsafe {
        init_root_info(n_ranks, root_info, rank, Some(config), comm)
    })
}

/// `HcclResult HcclCreateSubCommConfig(HcclComm *comm, uint32_t rankNum, uint32_t *rankIds, uint64_t subCommId, uint32_t subCommRankId, HcclCommConfig *config, HcclComm *subComm)`.
/// Called by the members of the new group only; members must pass the same
/// id and rank list (otherwise they never meet and time out).
#[no_mangle]
pub unsafe extern "C" fn HcclCreateSubCommConfig(
    comm_p: *mut HcclComm,
    rank_num: u32,
    rank_ids: *mut u32,
    sub_comm_id: u64,
    sub_comm_rank_id: u32,
    config: *mut c_void,
    sub_comm: *mut HcclComm,
) -> HcclResult {
    status::hccl("HcclCreateSubCommConfig", || {
        // The current device before anything else, for a rank outside the
        // group too (op_base.cc `HcclCreateSubCommConfig`, HongminTan/ACNC2025-HCCL
        // src/domain/collective_communication/framework/op_base/src/op_base.cc:762-770).
        let device = current_device()?;
        let call = unsafe {
            hccl_rules::create_sub_comm(comm_p, rank_num, rank_ids, sub_comm_id, sub_comm_rank_id, config, sub_comm)
        }?;
        if call == hccl_rules::SubCommCall::NotMember {
            return Ok(());
        }
        // The environment before the config's rules (op_base.cc:833-846:
        // `InitExternalInput`, then `CommConfig::Load`).
        let env = read_env()?;
        unsafe { hccl_rules::comm_config(config) }?;
        if comm_p.is_null() || sub_comm.is_null() || rank_ids.is_null() {
            return fail(HCCL_E_PTR, "comm, rankIds or subComm is NULL");
        }
        // SAFETY: comm points to a parent HcclComm handle (C contract).
        let parent = comm(unsafe { *comm_p })?;
        // SAFETY: rankIds holds rankNum entries (C contract).
        let ids = unsafe { std::slice::from_raw_parts(rank_ids, rank_num as usize) }.to_vec();
        if sub_comm_rank_id >= rank_num {
            return fail(HCCL_E_PARA, format!("subCommRankId {sub_comm_rank_id} of {rank_num} ranks"));
        }
        if ids[sub_comm_rank_id as usize] != parent.rank {
            return fail(
                HCCL_E_PARA,
                format!(
                    "rankIds[{sub_comm_rank_id}] = {} but this rank is {} of the parent",
                    ids[sub_comm_rank_id as usize], parent.rank
                ),
            );
        }
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) || sorted.last().is_some_and(|&m| m >= parent.size) {
            return fail(HCCL_E_PARA, format!("rankIds {ids:?} must be distinct ranks below {}", parent.size));
        }
        let bytes: Vec<u8> = ids.iter().flat_map(|r| r.to_le_bytes()).collect();
        let key = format!("{}.s{:x}.{:x}", parent.key, sub_comm_id, fnv(&bytes));
        let cfg = read_config(config)?;
        let name = format!("{}/sub{sub_comm_id}", parent.name);
        let h = join(key, Some(name), (rank_num, sub_comm_rank_id, parent.world_rank), device, env, cfg)?;
        write_out(sub_comm, h as HcclComm, HCCL_E_PTR, "subComm")?;
        unsafe { hccl_rules::sub_comm_created(comm_p, sub_comm_id, sub_comm) };
        Ok(())
    })
}

/// `HcclResult HcclCommDestroy(HcclComm comm)`: needs a current device; NULL
/// is a success without effect (`hccl_rules::comm_destroy`).
///
/// The communicator's resources go with it: HCCL's destructor frees every
/// algorithm resource its ops were recorded with (hcomm v8.5.0
/// `src/framework/communicator/impl/hccl_communicator_host.cc:166-210`,
/// `DestroyAlgResource` at `:188-189`; captured ops take them per op tag,
/// `:1735-1739`), and `HcclCommDestroy` (`op_base.cc:2352-2373`) refuses
/// only a communicator another thread is calling. hcomm's aclgraph guide
/// (`docs/en/aclgraph/aclgraph_introduction.md:127-133,194`) orders the
/// model's destruction first and calls the reverse a use-after-free. Here a
/// collective recorded before the destroy (in a model replayed after it)
/// faults when it runs.
#[no_mangle]
pub extern "C" fn HcclCommDestroy(comm_h: HcclComm) -> HcclResult {
    status::hccl("HcclCommDestroy", || {
        if !hccl_rules::comm_destroy(comm_h)? {
            return Ok(());
        }
        let c = COMMS.remove(comm_h as usize).ok_or_else(|| {
            SimError::new(HCCL_E_PARA, format!("{comm_h:p} is not a live HcclComm (double destroy?)"))
        })?;
        c.destroyed.store(true, Ordering::SeqCst);
        Ok(())
    })
}

/// `HcclResult HcclGetRankId(HcclComm comm, uint32_t *rank)`.
#[no_mangle]
pub unsafe extern "C" fn HcclGetRankId(comm_h: HcclComm, rank: *mut u32) -> HcclResult {
    status::hccl("HcclGetRankId", || write_out(rank, comm(comm_h)?.rank, HCCL_E_PTR, "rank"))
}

/// `HcclResult HcclGetRankSize(HcclComm comm, uint32_t *rankSize)`.
#[no_mangle]
pub unsafe extern "C" fn HcclGetRankSize(comm_h: HcclComm, rank_size: *mut u32) -> HcclResult {
    status::hccl("HcclGetRankSize", || write_out(rank_size, comm(comm_h)?.size, HCCL_E_PTR, "rankSize"))
}

/// `HcclResult HcclGetCommName(HcclComm comm, char *commName)`: at most 127
/// bytes plus NUL (the caller's buffer is `COMM_NAME_MAX_LENGTH` = 128).
#[no_mangle]
pub unsafe extern "C" fn HcclGetCommName(comm_h: HcclComm, comm_name: *mut c_char) -> HcclResult {
    status::hccl("HcclGetCommName", || {
        let c = comm(comm_h)?;
        if comm_name.is_null() {
            return fail(HCCL_E_PTR, "commName is NULL");
        }
        let b = c.name.as_bytes();
        let n = b.len().min(COMM_NAME_MAX_LENGTH - 1);
        // SAFETY: the caller's buffer holds COMM_NAME_MAX_LENGTH bytes; we write n + 1 <= 128.
        unsafe {
            std::ptr::copy_nonoverlapping(b.as_ptr(), comm_name as *mut u8, n);
            *comm_name.add(n) = 0;
        }
        Ok(())
    })
}

/// `const char *HcclGetErrorString(HcclResult code)`: never fails, whatever
/// the configuration (it explains the other calls' codes).
#[no_mangle]
pub extern "C" fn HcclGetErrorString(code: HcclResult) -> *const c_char {
    status::infallible("HcclGetErrorString", std::ptr::null(), || error_string(code).as_ptr())
}

fn error_string(code: HcclResult) -> &'static CStr {
    match code {
        0 => c"HCCL_SUCCESS: success",
        1 => c"HCCL_E_PARA: parameter error",
        2 => c"HCCL_E_PTR: empty pointer",
        3 => c"HCCL_E_MEMORY: memory error",
        4 => c"HCCL_E_INTERNAL: internal error",
        5 => c"HCCL_E_NOT_SUPPORT: not support feature",
        6 => c"HCCL_E_NOT_FOUND: not found specific resource",
        7 => c"HCCL_E_UNAVAIL: resource unavailable",
        8 => c"HCCL_E_SYSCALL: call system interface error",
        9 => c"HCCL_E_TIMEOUT: timeout",
        15 => c"HCCL_E_RUNTIME: call runtime api fail",
        21 => c"HCCL_E_REMOTE: error cqe",
        _ => c"unknown HcclResult",
    }
}

/// `HcclResult HcclGetCommAsyncError(HcclComm comm, HcclResult *asyncError)`:
/// the error CQE first (HCCL_E_REMOTE once a collective of the communicator
/// met a dead peer), else HCCL_E_PARA once its inconsistent-op check found a
/// collective whose ranks disagree, else success; a timeout is never
/// reported here. hcomm v8.5.0 `src/framework/op_base/src/op_base.cc:3191-3204`
/// (`CommCheckErrorCqe`, then `CommCheckOpInconsistentError` only on
/// success), `heartbeat.cc:1941-1956` (HCCL_E_PARA, only with the check on:
/// [`crate::config::inconsistent_check`]).
#[no_mangle]
pub unsafe extern "C" fn HcclGetCommAsyncError(comm_h: HcclComm, async_error: *mut HcclResult) -> HcclResult {
    status::hccl("HcclGetCommAsyncError", || {
        let c = comm(comm_h)?;
        let code = match c.async_error.load(Ordering::SeqCst) {
            HCCL_SUCCESS if c.inconsistent.load(Ordering::SeqCst) => HCCL_E_PARA,
            code => code,
        };
        write_out(async_error, code, HCCL_E_PTR, "asyncError")
    })
}

/// `uint32_t HcclGetCommConfigCapability()`: the emulated release's count, or
/// 0 (no capability) when the call fails, with the message for
/// `aclGetRecentErrMsg`.
#[no_mangle]
pub extern "C" fn HcclGetCommConfigCapability() -> u32 {
    let mut cap = 0;
    let rc = status::hccl("HcclGetCommConfigCapability", || {
        cap = hccl_rules::capability();
        Ok(())
    });
    if rc == HCCL_SUCCESS {
        cap
    } else {
        0
    }
}
