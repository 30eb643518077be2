//! `libhccl`: loading, status mapping, and one function per HCCL call, named
//! for the call without its `Hccl` prefix (`HcclAllReduce` is [`all_reduce`]).
//!
//! Every call that acts on a device needs that device bound on the calling
//! thread; a collective is queued on the stream it is given and returns.

use std::ffi::{c_char, c_void, CStr};

use acl_sys::aclrtStream;
use hccl_sys::{Hccl, HcclComm, HcclCommConfig, HcclDataType, HcclReduceOp, HcclResult, HcclRootInfo};

use super::{require, status_fns, sym};
use crate::backend::npu::runtime::load::recent_error_message;
use crate::{Error, Result};

/// The loaded HCCL library, or [`Error::Unavailable`] naming every path tried.
pub fn hccl() -> Result<&'static Hccl> {
    hccl_sys::hccl().map_err(|e| Error::Unavailable(e.to_string()))
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
        let recent = recent_error_message();
        if !recent.is_empty() {
            msg = if msg.is_empty() { recent } else { format!("{msg}; {recent}") };
        }
        Err(Error::Hccl { call, code: code.0 as i32, msg })
    }
}

/// `HcclGetRootInfo`: a new root info, made on the bound device.
pub fn get_root_info() -> Result<HcclRootInfo> {
    let f = sym!(hccl()?, HcclGetRootInfo)?;
    let mut raw = HcclRootInfo::default();
    // SAFETY: valid out-pointer to a 4108-byte root info.
    check("HcclGetRootInfo", unsafe { f(&mut raw) })?;
    Ok(raw)
}

/// True when HCCL exports `HcclCommInitRootInfoConfig` (older releases have
/// only [`comm_init_root_info`]).
pub fn has_comm_init_root_info_config() -> Result<bool> {
    Ok(hccl()?.lib.HcclCommInitRootInfoConfig.is_ok())
}

/// `HcclCommInitRootInfoConfig(n_ranks, root, rank, config)`: joins the
/// communicator of `root` as `rank`, blocking until every rank joined. HCCL
/// copies the config.
pub fn comm_init_root_info_config(
    n_ranks: u32,
    root: &HcclRootInfo,
    rank: u32,
    config: &HcclCommConfig,
) -> Result<HcclComm> {
    let f = sym!(hccl()?, HcclCommInitRootInfoConfig)?;
    let mut raw: HcclComm = std::ptr::null_mut();
    // SAFETY: root info, config and out-pointer are valid for the call.
    check("HcclCommInitRootInfoConfig", unsafe { f(n_ranks, root, rank, config, &mut raw) })?;
    Ok(raw)
}

/// `HcclCommInitRootInfo(n_ranks, root, rank)`: as
/// [`comm_init_root_info_config`] with HCCL's default config.
pub fn comm_init_root_info(n_ranks: u32, root: &HcclRootInfo, rank: u32) -> Result<HcclComm> {
    let f = sym!(hccl()?, HcclCommInitRootInfo)?;
    let mut raw: HcclComm = std::ptr::null_mut();
    // SAFETY: root info and out-pointer are valid for the call.
    check("HcclCommInitRootInfo", unsafe { f(n_ranks, root, rank, &mut raw) })?;
    Ok(raw)
}

/// `HcclCreateSubCommConfig(parent, rank_ids.len(), rank_ids, sub_comm_id,
/// sub_rank, config)`: the sub-communicator of the global ranks `rank_ids`.
///
/// # Safety
/// `*parent` is a live global communicator (HCCL takes a pointer to its
/// handle); `rank_ids` is ascending and `sub_rank` is the calling rank's
/// index in it (HCCL API reference, HcclCreateSubCommConfig). HCCL retains
/// neither `rank_ids` nor `config`.
pub unsafe fn create_sub_comm_config(
    parent: &mut HcclComm,
    rank_ids: &mut [u32],
    sub_comm_id: u64,
    sub_rank: u32,
    config: &mut HcclCommConfig,
) -> Result<HcclComm> {
    let f = sym!(hccl()?, HcclCreateSubCommConfig)?;
    let mut sub: HcclComm = std::ptr::null_mut();
    // SAFETY: the caller's contract; every pointer is valid for the call.
    check("HcclCreateSubCommConfig", unsafe {
        f(parent, rank_ids.len() as u32, rank_ids.as_mut_ptr(), sub_comm_id, sub_rank, config, &mut sub)
    })?;
    Ok(sub)
}

status_fns! { hccl, check;
    /// `HcclCommDestroy`.
    ///
    /// # Safety
    /// `comm` is ours, destroyed once, with no queued collective left.
    pub unsafe fn comm_destroy = HcclCommDestroy(comm: HcclComm);

    /// `HcclAllReduce`, queued on `stream` (in place when `send == recv`).
    ///
    /// # Safety
    /// `send` and `recv` hold `count` elements of `dtype` on the communicator's
    /// device and stay allocated until the stream has run the collective;
    /// `comm` and `stream` are live, the stream of the communicator's device.
    pub unsafe fn all_reduce = HcclAllReduce(
        send: *mut c_void,
        recv: *mut c_void,
        count: u64,
        dtype: HcclDataType,
        op: HcclReduceOp,
        comm: HcclComm,
        stream: aclrtStream,
    );

    /// `HcclReduceScatter`, queued on `stream`.
    ///
    /// # Safety
    /// As [`all_reduce`], with `send` holding world x `recv_count` elements and
    /// `recv` `recv_count`.
    pub unsafe fn reduce_scatter = HcclReduceScatter(
        send: *mut c_void,
        recv: *mut c_void,
        recv_count: u64,
        dtype: HcclDataType,
        op: HcclReduceOp,
        comm: HcclComm,
        stream: aclrtStream,
    );

    /// `HcclAllGather`, queued on `stream`.
    ///
    /// # Safety
    /// As [`all_reduce`], with `send` holding `send_count` elements and `recv`
    /// world x `send_count`.
    pub unsafe fn all_gather = HcclAllGather(
        send: *mut c_void,
        recv: *mut c_void,
        send_count: u64,
        dtype: HcclDataType,
        comm: HcclComm,
        stream: aclrtStream,
    );

    /// `HcclReduceScatterV`, queued on `stream`; `send_counts` and `send_displs`
    /// are host arrays of world `u64`.
    ///
    /// # Safety
    /// As [`all_reduce`], with the buffers sized by the counts; the count arrays
    /// hold world elements.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce_scatter_v = HcclReduceScatterV(
        send: *mut c_void,
        send_counts: *const c_void,
        send_displs: *const c_void,
        recv: *mut c_void,
        recv_count: u64,
        dtype: HcclDataType,
        op: HcclReduceOp,
        comm: HcclComm,
        stream: aclrtStream,
    );

    /// `HcclAllGatherV`, queued on `stream`; `recv_counts` and `recv_displs` are
    /// host arrays of world `u64`.
    ///
    /// # Safety
    /// As [`reduce_scatter_v`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn all_gather_v = HcclAllGatherV(
        send: *mut c_void,
        send_count: u64,
        recv: *mut c_void,
        recv_counts: *const c_void,
        recv_displs: *const c_void,
        dtype: HcclDataType,
        comm: HcclComm,
        stream: aclrtStream,
    );

    /// `HcclAlltoAllV`, queued on `stream`; the count and displacement arrays
    /// are host arrays of world `u64`.
    ///
    /// # Safety
    /// As [`reduce_scatter_v`], for both directions.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn all_to_all_v = HcclAlltoAllV(
        send: *const c_void,
        send_counts: *const c_void,
        send_displs: *const c_void,
        send_type: HcclDataType,
        recv: *const c_void,
        recv_counts: *const c_void,
        recv_displs: *const c_void,
        recv_type: HcclDataType,
        comm: HcclComm,
        stream: aclrtStream,
    );

    /// `HcclBroadcast` of `root`'s `buf`, queued on `stream`.
    ///
    /// # Safety
    /// As [`all_reduce`], with `buf` holding `count` elements.
    pub unsafe fn broadcast = HcclBroadcast(
        buf: *mut c_void,
        count: u64,
        dtype: HcclDataType,
        root: u32,
        comm: HcclComm,
        stream: aclrtStream,
    );

    /// `HcclBarrier`, queued on `stream`.
    ///
    /// # Safety
    /// `comm` and `stream` are live, the stream of the communicator's device.
    pub unsafe fn barrier = HcclBarrier(comm: HcclComm, stream: aclrtStream);
}

/// `HcclGetRankId`: the calling rank in `comm`.
///
/// # Safety
/// `comm` is a live communicator.
pub unsafe fn get_rank_id(comm: HcclComm) -> Result<u32> {
    let f = sym!(hccl()?, HcclGetRankId)?;
    let mut rank = 0u32;
    // SAFETY: the caller's contract; valid out-pointer.
    check("HcclGetRankId", unsafe { f(comm, &mut rank) })?;
    Ok(rank)
}

/// `HcclGetRankSize`: the number of ranks of `comm`.
///
/// # Safety
/// `comm` is a live communicator.
pub unsafe fn get_rank_size(comm: HcclComm) -> Result<u32> {
    let f = sym!(hccl()?, HcclGetRankSize)?;
    let mut world = 0u32;
    // SAFETY: the caller's contract; valid out-pointer.
    check("HcclGetRankSize", unsafe { f(comm, &mut world) })?;
    Ok(world)
}

/// `HcclGetCommName`: the name of `comm`, `None` when HCCL lacks the call,
/// fails, or the name is empty.
///
/// # Safety
/// `comm` is a live communicator.
pub unsafe fn get_comm_name(comm: HcclComm) -> Option<String> {
    let f = hccl().ok()?.lib.HcclGetCommName.as_ref().ok()?;
    let mut buf = [0 as c_char; 129];
    // SAFETY: the caller's contract; HCCL writes at most COMM_NAME_MAX_LENGTH
    // (128) bytes incl. NUL.
    let code = unsafe { f(comm, buf.as_mut_ptr()) };
    if code != HcclResult::HCCL_SUCCESS {
        return None;
    }
    // SAFETY: NUL-terminated (the last byte stays 0 in any case).
    let s = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned();
    (!s.is_empty()).then_some(s)
}

/// `HcclGetCommConfigCapability`, `None` when HCCL lacks it.
pub fn get_comm_config_capability() -> Option<u32> {
    let f = hccl().ok()?.lib.HcclGetCommConfigCapability.as_ref().ok()?;
    // SAFETY: no arguments.
    Some(unsafe { f() })
}

/// `HcclGetCommAsyncError`: the error HCCL recorded for `comm` (a collective
/// that failed on the device; `HCCL_SUCCESS` when there is none), `None`
/// when HCCL lacks the call or the query fails. HCCL API reference:
/// "queries the asynchronous error of a communicator".
///
/// # Safety
/// `comm` is a live communicator.
pub unsafe fn get_comm_async_error(comm: HcclComm) -> Option<HcclResult> {
    let f = hccl().ok()?.lib.HcclGetCommAsyncError.as_ref().ok()?;
    let mut code = HcclResult::HCCL_SUCCESS;
    // SAFETY: the caller's contract; valid out-pointer.
    let rc = unsafe { f(comm, &mut code) };
    (rc == HcclResult::HCCL_SUCCESS).then_some(code)
}
