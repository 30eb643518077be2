//! The codes of dtypes and reductions, and the queries and config every
//! communicator is made with.

use hccl_sys::{HcclCommConfig, HcclDataType, HcclReduceOp};

use crate::backend::npu::result::hccl as hc;
use crate::types::{CommOptions, ReduceOp};
use crate::{DType, Result};

/// Size of an HCCL root info.
pub const ROOT_INFO_BYTES: usize = 4108;

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

/// `(rank, world)` of the live communicator `raw`.
pub(super) fn query_rank_info(raw: hccl_sys::HcclComm) -> Result<(usize, usize)> {
    // SAFETY: live communicator (the callers' contract).
    let rank = unsafe { hc::get_rank_id(raw) }?;
    // SAFETY: as above.
    let world = unsafe { hc::get_rank_size(raw) }?;
    Ok((rank as usize, world as usize))
}

/// The name HCCL gave the live communicator `raw`, if any.
pub(super) fn query_name(raw: hccl_sys::HcclComm) -> Option<String> {
    // SAFETY: live communicator (the callers' contract).
    unsafe { hc::get_comm_name(raw) }
}

/// A config for the running HCCL: the layout generation its capability
/// count says it understands, initialised with that generation's
/// `HcclCommConfigInit` defaults (HCCL API reference, HcclCommInitRootInfoConfig
/// and HcclCreateSubCommConfig: "the config must be initialized by calling
/// HcclCommConfigInit"; version 5's HCCL rejects the later "not set" values),
/// carrying the execution timeout of `opts` (whole seconds, rounded up) when
/// the capability `EXEC_TIMEOUT` is reported. The name is left to HCCL: ranks
/// that are threads of one process must not share one.
pub(super) fn config_for(opts: &CommOptions) -> HcclCommConfig {
    let cap = hc::get_comm_config_capability();
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
