//! The C types and numeric values of the simulated API, as CANN defines them
//! (ACL runtime, HCCL, aclnn). Handles are opaque pointers; codes are plain
//! integers so an unknown value never becomes an invalid Rust enum.

// The constants carry CANN's own names and values; their meaning is CANN's documentation.
#![allow(dead_code, missing_docs)]

use std::ffi::c_void;

/// `aclError`.
pub type AclError = i32;
/// `HcclResult`.
pub type HcclResult = i32;
/// `aclnnStatus`.
pub type AclnnStatus = i32;
/// `aclrtStream`.
pub type AclrtStream = *mut c_void;
/// `aclrtEvent`.
pub type AclrtEvent = *mut c_void;
/// `HcclComm`.
pub type HcclComm = *mut c_void;
/// `aclTensor *`.
pub type AclTensor = *mut c_void;
/// `aclScalar *`.
pub type AclScalar = *mut c_void;
/// `aclOpExecutor *`.
pub type AclOpExecutor = *mut c_void;

// ACL error codes (acl_base_rt.h, rt_error_codes.h).
pub const ACL_SUCCESS: AclError = 0;
pub const ACL_ERROR_INVALID_PARAM: AclError = 100000;
pub const ACL_ERROR_UNINITIALIZE: AclError = 100001;
pub const ACL_ERROR_REPEAT_INITIALIZE: AclError = 100002;
pub const ACL_ERROR_REPEAT_FINALIZE: AclError = 100037;
pub const ACL_ERROR_RT_PARAM_INVALID: AclError = 107000;
pub const ACL_ERROR_RT_INVALID_DEVICEID: AclError = 107001;
pub const ACL_ERROR_RT_CONTEXT_NULL: AclError = 107002;
pub const ACL_ERROR_RT_STREAM_CONTEXT: AclError = 107003;
pub const ACL_ERROR_RT_EVENT_TIMESTAMP_INVALID: AclError = 107006;
pub const ACL_ERROR_RT_ADDR_UNALIGNED: AclError = 107008;
pub const ACL_ERROR_RT_INVALID_MEMORY_TYPE: AclError = 107016;
pub const ACL_ERROR_RT_INVALID_HANDLE: AclError = 107017;
pub const ACL_ERROR_RT_FEATURE_NOT_SUPPORT: AclError = 207000;
pub const ACL_ERROR_RT_MEMORY_ALLOCATION: AclError = 207001;
pub const ACL_ERROR_RT_MEMORY_FREE: AclError = 207002;
pub const ACL_ERROR_RT_NO_DEVICE: AclError = 207004;
pub const ACL_ERROR_RT_NO_EVENT_RESOURCE: AclError = 207007;
pub const ACL_ERROR_RT_NO_STREAM_RESOURCE: AclError = 207008;
pub const ACL_ERROR_RT_INTERNAL_ERROR: AclError = 507000;
pub const ACL_ERROR_RT_EVENT_NOT_COMPLETE: AclError = 507006;
pub const ACL_ERROR_RT_CONTEXT_RELEASE_ERROR: AclError = 507007;
pub const ACL_ERROR_RT_AICORE_EXCEPTION: AclError = 507015;
pub const ACL_ERROR_RT_STREAM_SYNC_TIMEOUT: AclError = 507046;
pub const ACL_ERROR_RT_DEVICE_MEM_ERROR: AclError = 507053;
pub const ACL_ERROR_RT_COMM_OP_RETRY_FAIL: AclError = 507904;

// aclrtMemcpyKind.
pub const ACL_MEMCPY_HOST_TO_HOST: i32 = 0;
pub const ACL_MEMCPY_HOST_TO_DEVICE: i32 = 1;
pub const ACL_MEMCPY_DEVICE_TO_HOST: i32 = 2;
pub const ACL_MEMCPY_DEVICE_TO_DEVICE: i32 = 3;
pub const ACL_MEMCPY_DEFAULT: i32 = 4;
pub const ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE: i32 = 5;
pub const ACL_MEMCPY_INNER_DEVICE_TO_DEVICE: i32 = 6;
pub const ACL_MEMCPY_INTER_DEVICE_TO_DEVICE: i32 = 7;

// aclrtEventRecordedStatus.
pub const ACL_EVENT_RECORDED_STATUS_NOT_READY: i32 = 0;
pub const ACL_EVENT_RECORDED_STATUS_COMPLETE: i32 = 1;

// aclDataType.
pub const ACL_FLOAT: i32 = 0;
pub const ACL_FLOAT16: i32 = 1;
pub const ACL_INT8: i32 = 2;
pub const ACL_INT32: i32 = 3;
pub const ACL_UINT8: i32 = 4;
pub const ACL_INT16: i32 = 6;
pub const ACL_UINT16: i32 = 7;
pub const ACL_UINT32: i32 = 8;
pub const ACL_INT64: i32 = 9;
pub const ACL_UINT64: i32 = 10;
pub const ACL_DOUBLE: i32 = 11;
pub const ACL_BOOL: i32 = 12;
pub const ACL_BF16: i32 = 27;

// aclFormat.
pub const ACL_FORMAT_ND: i32 = 2;

// aclnn status codes (aclnn/opdev/op_errno.h).
pub const ACLNN_SUCCESS: AclnnStatus = 0;
pub const ACLNN_ERR_PARAM_NULLPTR: AclnnStatus = 161001;
pub const ACLNN_ERR_PARAM_INVALID: AclnnStatus = 161002;
pub const ACLNN_ERR_RUNTIME_ERROR: AclnnStatus = 361001;
pub const ACLNN_ERR_INNER: AclnnStatus = 561000;
/// `ACLNN_ERR_INNER_TILING_ERROR`: an op's tiling refused the shapes.
pub const ACLNN_ERR_INNER_TILING_ERROR: AclnnStatus = 561002;

// HcclResult.
pub const HCCL_SUCCESS: HcclResult = 0;
pub const HCCL_E_PARA: HcclResult = 1;
pub const HCCL_E_PTR: HcclResult = 2;
pub const HCCL_E_MEMORY: HcclResult = 3;
pub const HCCL_E_INTERNAL: HcclResult = 4;
pub const HCCL_E_NOT_SUPPORT: HcclResult = 5;
pub const HCCL_E_NOT_FOUND: HcclResult = 6;
pub const HCCL_E_UNAVAIL: HcclResult = 7;
pub const HCCL_E_SYSCALL: HcclResult = 8;
pub const HCCL_E_TIMEOUT: HcclResult = 9;
pub const HCCL_E_RUNTIME: HcclResult = 15;
pub const HCCL_E_REMOTE: HcclResult = 21;

// HcclDataType.
pub const HCCL_DATA_TYPE_INT8: i32 = 0;
pub const HCCL_DATA_TYPE_INT32: i32 = 2;
pub const HCCL_DATA_TYPE_FP16: i32 = 3;
pub const HCCL_DATA_TYPE_FP32: i32 = 4;
pub const HCCL_DATA_TYPE_INT64: i32 = 5;
pub const HCCL_DATA_TYPE_UINT8: i32 = 7;
pub const HCCL_DATA_TYPE_BFP16: i32 = 11;

// HcclReduceOp.
pub const HCCL_REDUCE_SUM: i32 = 0;
pub const HCCL_REDUCE_PROD: i32 = 1;
pub const HCCL_REDUCE_MAX: i32 = 2;
pub const HCCL_REDUCE_MIN: i32 = 3;

/// `HCCL_ROOT_INFO_BYTES`.
pub const HCCL_ROOT_INFO_BYTES: usize = 4108;
/// `COMM_NAME_MAX_LENGTH`.
pub const COMM_NAME_MAX_LENGTH: usize = 128;
/// `HCCL_COMM_CONFIG_MAGIC_WORD`.
pub const HCCL_COMM_CONFIG_MAGIC_WORD: u32 = 0xf0f0_f0f0;
/// `HCCL_COMM_DETERMINISTIC_CONFIG_NOT_SET` (config version 6 on).
pub const HCCL_COMM_DETERMINISTIC_CONFIG_NOT_SET: u32 = 0xffff_ffff;

/// Byte offsets of the `HcclCommConfig` fields the simulator reads (the
/// same in every layout version: each layout is a prefix of the next,
/// `hccl_types.h` of versions 5, 6, 8 and 10).
pub mod comm_config {
    /// `size_t size` of the 24-byte header.
    pub const SIZE: usize = 0;
    /// `uint32_t magicWord` of the header.
    pub const MAGIC: usize = 8;
    /// `uint32_t version` of the header.
    pub const VERSION: usize = 12;
    /// `uint32_t hcclBufferSize`.
    pub const BUFFER_SIZE: usize = 24;
    /// `uint32_t hcclDeterministic`.
    pub const DETERMINISTIC: usize = 28;
    /// `char hcclCommName[128]`.
    pub const COMM_NAME: usize = 32;
    /// `uint8_t aclGraphZeroCopyEnable`, from layout version 7.
    pub const ZERO_COPY: usize = 312;
    /// `int32_t hcclExecTimeOut` (seconds), from layout version 8.
    pub const EXEC_TIMEOUT: usize = 316;
}
