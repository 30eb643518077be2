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

/// The collectives whose dtype (and reduction) tables differ on Atlas A2.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Table {
    /// `HcclAllReduce`, `HcclReduceScatter`: int8, int16, int32, int64,
    /// float16, float32, bfp16; sum, prod, max, min (hicann/hccl v9.1.0
    /// `docs/zh/api_ref/comm_op_interface/HcclAllReduce.md:49,57`,
    /// `HcclReduceScatter.md:49,57`).
    Reduce,
    /// `HcclReduceScatterV`: int8, int16, int32, float16, float32, bfp16 (no
    /// int64); sum, max, min (`HcclReduceScatterV.md:51,58`).
    ReduceScatterV,
}
// The data movements (`HcclAllGather`, `HcclAllGatherV`, `HcclAlltoAllV`,
// `HcclBroadcast`) take every 1-, 2-, 4- and 8-byte integer, float16,
// float32, float64 and bfp16 on A2 (`HcclAllGather.md:51`,
// `HcclAllGatherV.md:55`, `HcclAlltoAllV.md:52`, `HcclBroadcast.md:48`):
// every dtype of ours, as `hccl_dtype` maps it.

/// Refuses `dtype` for `collective` (the crate's name) when the HCCL call
/// behind it does not take it on Atlas A2 ([`Table`]), naming both. HCCL
/// refuses such a call with HCCL_E_NOT_SUPPORT (`HcomCheckDataType`, hicann/hccl
/// v8.5.0 `src/common/param_check.cc:101-109`, for its global list).
pub(super) fn check_dtype(collective: &'static str, table: Table, dtype: DType) -> Result<()> {
    let ok = match table {
        // The one-byte dtypes other than int8 travel as HCCL uint8, which no
        // reduction takes.
        Table::Reduce => matches!(dtype, DType::F32 | DType::F16 | DType::BF16 | DType::I32 | DType::I64 | DType::I8),
        Table::ReduceScatterV => matches!(dtype, DType::F32 | DType::F16 | DType::BF16 | DType::I32 | DType::I8),
    };
    if ok {
        return Ok(());
    }
    let (call, list) = match table {
        Table::Reduce => ("HcclAllReduce/HcclReduceScatter", "int8, int16, int32, int64, float16, float32, bfloat16"),
        Table::ReduceScatterV => ("HcclReduceScatterV", "int8, int16, int32, float16, float32, bfloat16"),
    };
    Err(crate::Error::dtype(
        collective,
        "src",
        format!("a dtype {call} reduces on Atlas A2 ({list}; HCCL API reference)"),
        dtype,
    ))
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
/// the capability `EXEC_TIMEOUT` is reported and the layout has the field
/// (version 8, CANN 8.5.0's, on: its HCCL reads `hcclExecTimeOut` only from a
/// config of that version or later, hicann/hcomm v8.5.0
/// `src/framework/communicator/comm_config.cc:204-206`). The name is left to
/// HCCL: ranks that are threads of one process must not share one.
pub(super) fn config_for(opts: &CommOptions) -> HcclCommConfig {
    config_with(hc::get_comm_config_capability(), opts)
}

/// [`config_for`] an HCCL reporting `cap`.
fn config_with(cap: Option<u32>, opts: &CommOptions) -> HcclCommConfig {
    let layout = hccl_sys::CommConfigLayout::for_capability(cap);
    let mut config = layout.new_config();
    config.adapt_to_capability(cap);
    // A layout that has the field comes with a capability count past EXEC_TIMEOUT.
    if layout.has_exec_timeout() {
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::config_with;
    use crate::CommOptions;

    /// The communicator's timeout reaches HCCL where its release reads it:
    /// CANN 8.5.0 (capability 11) takes `hcclExecTimeOut` from a config of
    /// version 8 (hicann/hcomm v8.5.0 `comm_config.cc:204-206`), CANN 9.0
    /// (12) from version 10; older releases have no such field, and nothing
    /// is written past the bytes the header gives HCCL.
    #[test]
    fn the_execution_timeout_is_written_where_each_release_reads_it() {
        let opts = CommOptions::with_timeout(Duration::from_millis(2500));
        let at = std::mem::offset_of!(hccl_sys::HcclCommConfig, hcclExecTimeOut);
        for (cap, version, timeout) in
            [(Some(4), 5, 0), (Some(7), 6, 0), (Some(10), 6, 0), (Some(11), 8, 3), (Some(12), 10, 3)]
        {
            let c = config_with(cap, &opts);
            assert_eq!((c.header_version(), c.hcclExecTimeOut), (version, timeout), "capability {cap:?}");
            assert_eq!(at + 4 <= c.header_size(), timeout != 0, "capability {cap:?}: size {}", c.header_size());
        }
    }
}
