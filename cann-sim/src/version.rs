//! The CANN release the simulator emulates (`CANNSIM_CANN_VERSION`): what its
//! HCCL reports and accepts in an `HcclCommConfig`, and which library ships
//! which aclnn operator.
//!
//! | version | `HcclGetCommConfigCapability` | config layout | "not set" (0xffffffff) | `hcclDeterministic` | op libraries |
//! |---|---|---|---|---|---|
//! | 8.1 | 4 | version 5 (300 bytes) | refused | 0 or 1 | `libopapi.so` |
//! | 8.3 | 7 | version 6 (312 bytes) | accepted | 0 or 1 | `libopapi.so` |
//! | 8.5 | 11 | version 8 in its header, up to 9 read (2232 bytes) | accepted | 0, 1 or 2 | `libopapi_transformer.so` (MoE ops), `libopapi_math.so` (Add), `libopapi.so` |
//!
//! Sources: the `hccl_types.h` of CANN 8.1.RC1 (config version 5, capability
//! enum ending at `OP_EXPANSION_MODE` = 3), of the torch-npu 2.9.0 wheel
//! (version 6, up to `JOBID` = 6) and of CANN 8.5.0 (hicann/hcomm v8.5.0
//! `include/hccl/hccl_types.h:124,135-165`: version 8, up to `RETRY` = 10;
//! its `CommConfig` reads up to version 9, `bufferName`, in a 2232-byte
//! `CommConfigHandle`, `src/framework/inc/comm_config_pub.h:31-32,52-69`);
//! HCCL's `CommConfig::SetConfigDeterministic` in its
//! three generations (`> 1` refused without a "not set" case; "not set" then
//! `> 1` refused; "not set" then `> DETERMINISTIC_STRICT` (2) refused); torch_npu's
//! `GetTransformerOpApiLibName` (CANN 8.5 moves the transformer ops to
//! `libopapi_transformer.so`) and op-plugin's `GetOpApiFuncAddr` search of
//! `libopapi_*.so`.

/// An emulated CANN release.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum CannVersion {
    /// CANN 8.1 (HCCL config version 5).
    V8_1,
    /// CANN 8.3 (HCCL config version 6).
    V8_3,
    /// CANN 8.5 (HCCL config version 8, split operator libraries).
    V8_5,
}

impl CannVersion {
    /// Parses `8.1`, `8.3` or `8.5` (a `.RC1`-style suffix is ignored).
    pub fn parse(s: &str) -> Option<CannVersion> {
        let mut parts = s.trim().split('.');
        match (parts.next(), parts.next()) {
            (Some("8"), Some("1")) => Some(CannVersion::V8_1),
            (Some("8"), Some("3")) => Some(CannVersion::V8_3),
            (Some("8"), Some("5")) => Some(CannVersion::V8_5),
            _ => None,
        }
    }

    /// `"8.1"`, `"8.3"` or `"8.5"`.
    pub fn name(self) -> &'static str {
        match self {
            CannVersion::V8_1 => "8.1",
            CannVersion::V8_3 => "8.3",
            CannVersion::V8_5 => "8.5",
        }
    }

    /// What `HcclGetCommConfigCapability()` returns: the header's
    /// `HCCL_COMM_CONFIG_RESERVED`.
    pub fn hccl_capabilities(self) -> u32 {
        match self {
            CannVersion::V8_1 => 4,
            CannVersion::V8_3 => 7,
            CannVersion::V8_5 => 11,
        }
    }

    /// The newest `HcclCommConfig` layout version this HCCL reads.
    pub fn comm_config_version(self) -> u32 {
        match self {
            CannVersion::V8_1 => 5,
            CannVersion::V8_3 => 6,
            CannVersion::V8_5 => 9,
        }
    }

    /// `sizeof(HcclCommConfig)` of that layout: the bytes this HCCL reads at most.
    pub fn comm_config_size(self) -> usize {
        match self {
            CannVersion::V8_1 => 300,
            CannVersion::V8_3 => 312,
            CannVersion::V8_5 => 2232,
        }
    }

    /// Whether 0xffffffff means "not set" for `hcclBufferSize` and
    /// `hcclDeterministic` (`HCCL_COMM_*_CONFIG_NOT_SET`, config version 6 on).
    pub fn has_config_not_set(self) -> bool {
        self >= CannVersion::V8_3
    }

    /// The largest `hcclDeterministic` accepted (1 = enable, 2 = strict).
    pub fn max_deterministic(self) -> u32 {
        match self {
            CannVersion::V8_1 | CannVersion::V8_3 => 1,
            CannVersion::V8_5 => 2,
        }
    }

    /// Whether the operator libraries are split by domain
    /// (`libopapi_transformer.so`, `libopapi_math.so`, ...).
    pub fn split_op_libraries(self) -> bool {
        self >= CannVersion::V8_5
    }
}
