//! The HCCL library: loading, error mapping, the codes of dtypes and
//! reductions, and the queries and config every communicator is made with.

use std::ffi::CStr;

use hccl_sys::{Hccl, HcclCommConfig, HcclDataType, HcclReduceOp, HcclResult};

use crate::types::{CommOptions, ReduceOp};
use crate::{DType, Error, Result};

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
pub(super) use hccl_fn;

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
        let recent = crate::backend::npu::runtime::recent_error_message();
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

pub(super) fn query_rank_info(api: &Hccl, raw: hccl_sys::HcclComm) -> Result<(usize, usize)> {
    let (mut rank, mut world) = (0u32, 0u32);
    let f = hccl_fn!(api, HcclGetRankId)?;
    // SAFETY: live communicator, valid out-pointer.
    check("HcclGetRankId", unsafe { f(raw, &mut rank) })?;
    let f = hccl_fn!(api, HcclGetRankSize)?;
    // SAFETY: as above.
    check("HcclGetRankSize", unsafe { f(raw, &mut world) })?;
    Ok((rank as usize, world as usize))
}

pub(super) fn query_name(api: &Hccl, raw: hccl_sys::HcclComm) -> Option<String> {
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

pub(super) fn capability(api: &Hccl) -> Option<u32> {
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
pub(super) fn config_for(api: &Hccl, opts: &CommOptions) -> HcclCommConfig {
    let cap = capability(api);
    let mut config = hccl_sys::CommConfigLayout::for_capability(cap).new_config();
    config.adapt_to_capability(cap);
    if HcclCommConfig::supports(cap, hccl_sys::capability::EXEC_TIMEOUT) {
        let secs = opts.timeout.as_secs() + u64::from(opts.timeout.subsec_nanos() > 0);
        config.hcclExecTimeOut = i32::try_from(secs.max(1)).unwrap_or(i32::MAX);
    }
    config
}

pub(super) const FNV_SEED: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a over `bytes`, continuing from `seed`: a stable id, the same on every rank.
pub(super) fn fnv1a(seed: u64, bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(seed, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}
