//! The argument rules of real HCCL that the simulated HCCL enforces, as
//! functions over the raw C arguments. Each exported HCCL function calls the
//! rules that apply to it once, at its entry, before it does anything else,
//! so a violation is refused with HCCL's code whatever the implementation
//! behind the export does. Every check names its source next to it.

#![allow(clippy::missing_safety_doc)]

use std::collections::HashSet;
use std::ffi::c_void;
use std::sync::Mutex;

use crate::arena;
use crate::capture::capture_info;
use crate::capture::ACL_MODEL_RI_CAPTURE_STATUS_NONE;
use crate::context;
use crate::ffi::*;
use crate::hccl::comms;
use crate::status::{self, fail, SimError, SimResult};
use crate::version::CannVersion;

/// `HCCL_COMM_*_CONFIG_NOT_SET` (config version 6 and later).
const NOT_SET: u32 = 0xffff_ffff;
/// `HCCL_CCL_COMM_BUFFER_MIN`: the smallest `hcclBufferSize`, in MB.
const BUFFER_MIN_MB: u32 = 1;

/// `HcclGetCommConfigCapability()` of the emulated release: the
/// `HCCL_COMM_CONFIG_RESERVED` of its `hccl_types.h` (see [`crate::version`]).
pub fn capability() -> u32 {
    CannVersion::current().hccl_capabilities()
}

/// Reads the `u32` at `off` of a config whose header says it has `size` bytes
/// (`None` past the end: HCCL copies only `size` bytes, `CommConfig::Load`).
unsafe fn field(config: *const c_void, size: usize, off: usize) -> Option<u32> {
    // SAFETY: the caller's struct holds `size` bytes (its header says so).
    (off + 4 <= size).then(|| unsafe { (config as *const u8).add(off).cast::<u32>().read_unaligned() })
}

/// The rules for the `config` of `HcclCommInitRootInfoConfig` and
/// `HcclCreateSubCommConfig`, as the emulated release's HCCL applies them.
pub unsafe fn comm_config(config: *const c_void) -> SimResult<()> {
    // HCCL `CommConfig::Load`: `CHK_PTR_NULL(userConfig)`.
    if config.is_null() {
        return fail(HCCL_E_PTR, "config is NULL (initialise one with HcclCommConfigInit)");
    }
    let v = CannVersion::current();
    // SAFETY: every HcclCommConfig starts with the 24-byte header
    // {size_t size; uint32_t magicWord; uint32_t version; uint64_t reserved}.
    let (size, magic, version) = unsafe {
        let p = config as *const u8;
        (
            p.add(comm_config::SIZE).cast::<usize>().read_unaligned(),
            p.add(comm_config::MAGIC).cast::<u32>().read_unaligned(),
            p.add(comm_config::VERSION).cast::<u32>().read_unaligned(),
        )
    };
    // HCCL `CommConfig::CheckMagicWord`: "Please make sure the config has been
    // initialized by HcclCommConfigInit()" (HCCL_E_PARA); HCCL API reference,
    // HcclCreateSubCommConfig: "the config must be initialized by calling
    // HcclCommConfigInit". A header whose size does not even cover the magic
    // word leaves HCCL comparing bytes it never copied.
    if size < comm_config::VERSION + 4 || magic != HCCL_COMM_CONFIG_MAGIC_WORD {
        return fail(
            HCCL_E_PARA,
            format!(
                "config header size {size}, magic word {magic:#x}: not initialised by HcclCommConfigInit (magic 0xf0f0f0f0)"
            ),
        );
    }
    // `CommConfig::Load` copies at most sizeof(its own config) bytes; a newer
    // version's extra fields are ignored (`SetConfigByVersion` warns).
    let size = size.min(v.comm_config_size());
    if version == 0 {
        return fail(HCCL_E_PARA, "config version 0 (HcclCommConfigInit writes HCCL_COMM_CONFIG_VERSION >= 1)");
    }
    // SAFETY: `field` reads only inside the `size` bytes the header declares.
    let (buffer, deterministic) =
        unsafe { (field(config, size, comm_config::BUFFER_SIZE), field(config, size, comm_config::DETERMINISTIC)) };
    let not_set_ok = v.has_config_not_set();
    if let Some(b) = buffer {
        // `CommConfig::SetConfigBufferSize`: below HCCL_CCL_COMM_BUFFER_MIN (1 MB)
        // is HCCL_E_PARA; version 6 on, 0xffffffff means "use HCCL_BUFFSIZE".
        if b < BUFFER_MIN_MB {
            return fail(HCCL_E_PARA, format!("hcclBufferSize {b} MB: should be equal to or greater than 1 (MB)"));
        }
        // Before version 6 there is no "not set": HCCL takes 0xffffffff MB
        // literally and cannot allocate the communication buffer.
        if b == NOT_SET && !not_set_ok {
            return fail(
                HCCL_E_MEMORY,
                format!(
                    "hcclBufferSize 0xffffffff MB cannot be allocated: CANN {} has no \"not set\" value \
                     (its HcclCommConfigInit writes 200)",
                    v.name()
                ),
            );
        }
    }
    if let Some(d) = deterministic {
        // `CommConfig::SetConfigDeterministic`: "should be 0(disable) or
        // 1(enable)" (8.1, 8.3), "0(disable), 1(enable) or 2(strict)" (8.5);
        // 0xffffffff is "not set" from config version 6 on.
        if !(d == NOT_SET && not_set_ok) && d > v.max_deterministic() {
            return fail(
                HCCL_E_PARA,
                format!(
                    "hcclDeterministic {d:#x} is invalid on CANN {}: it should be at most {}{}",
                    v.name(),
                    v.max_deterministic(),
                    if not_set_ok { " or 0xffffffff (not set)" } else { " (its HcclCommConfigInit writes 0)" }
                ),
            );
        }
    }
    // `CommConfig::SetConfigByVersion` (hicann/hcomm
    // `src/framework/common/src/config/comm_config.cc`): from config version 7,
    // an `aclGraphZeroCopyEnable` other than 0 or 1 is EI0003, HCCL_E_PARA.
    if version >= 7 && comm_config::ZERO_COPY < size {
        // SAFETY: inside the `size` bytes the header declares.
        let z = unsafe { (config as *const u8).add(comm_config::ZERO_COPY).read() };
        if z > 1 {
            return fail(HCCL_E_PARA, format!("EI0003: aclGraphZeroCopyEnable {z} is invalid (expected 0 or 1)"));
        }
    }
    Ok(())
}

/// What an `HcclCreateSubCommConfig` call is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubCommCall {
    /// A member of the new group: create it.
    Member,
    /// A rank outside the new group (`rankIds == NULL`, `subCommId ==
    /// 0xFFFFFFFF`): nothing to create, success.
    NotMember,
}

/// Communicators created by `HcclCreateSubCommConfig` (handles are never
/// reused, so entries never go stale).
static SUB_COMMS: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// `(global communicator, subCommId)` pairs already used.
static USED_IDS: Mutex<Option<HashSet<(usize, u64)>>> = Mutex::new(None);

/// `subCommId` a rank outside the new group passes.
pub const NOT_MEMBER_ID: u64 = 0xFFFF_FFFF;

/// The parent's rank and size, as `HcclGetRankId` / `HcclGetRankSize`
/// report them; a handle that is not a live communicator fails with their
/// code.
fn parent_rank_and_size(parent: HcclComm) -> SimResult<(u32, u32)> {
    let c =
        comms::comm(parent).map_err(|e| SimError::new(e.code, format!("comm {parent:p} is not a live HcclComm")))?;
    Ok((c.rank, c.size))
}

/// The rules of `HcclCreateSubCommConfig` (HCCL API reference, hcclcpp_07_0019,
/// CANN 8.0 to 8.5 and hcomm's `HcclCreateSubCommConfig.md`).
pub unsafe fn create_sub_comm(
    comm: *mut HcclComm,
    rank_num: u32,
    rank_ids: *const u32,
    sub_comm_id: u64,
    sub_comm_rank_id: u32,
    config: *const c_void,
    sub_comm: *mut HcclComm,
) -> SimResult<SubCommCall> {
    if comm.is_null() || sub_comm.is_null() {
        return fail(HCCL_E_PTR, "comm or subComm is NULL");
    }
    // SAFETY: `comm` points to the parent handle (C contract).
    let parent = unsafe { *comm };
    // "Only splitting from the global communicator is supported; nested
    // splitting is not."
    if SUB_COMMS.lock().unwrap_or_else(|e| e.into_inner()).contains(&(parent as usize)) {
        return fail(
            HCCL_E_NOT_SUPPORT,
            format!("comm {parent:p} is a sub-communicator: only the global communicator can be split (no nesting)"),
        );
    }
    // "Ranks that do not need a sub-communicator pass rankIds == nullptr and
    // subCommId = 0xFFFFFFFF." Both or neither: one without the other is
    // HCCL_E_PARA (hicann/hcomm v8.5.0 `src/framework/op_base/src/op_base.cc:811-818`).
    if rank_ids.is_null() && sub_comm_id == NOT_MEMBER_ID {
        parent_rank_and_size(parent)?;
        return Ok(SubCommCall::NotMember);
    }
    if rank_ids.is_null() || sub_comm_id == NOT_MEMBER_ID {
        return fail(
            HCCL_E_PARA,
            format!(
                "rankIds is {} with subCommId {sub_comm_id:#x}: a rank outside the group passes NULL with \
                 subCommId 0xFFFFFFFF, a member both valid",
                if rank_ids.is_null() { "NULL" } else { "given" }
            ),
        );
    }
    // hcomm's HcclCreateSubCommConfig test "When_RankNumIsZero_Expect_ReturnIsHCCL_E_PARA".
    if rank_num == 0 {
        return fail(HCCL_E_PARA, "rankNum is 0");
    }
    let (my_rank, size) = parent_rank_and_size(parent)?;
    // SAFETY: rankIds holds rankNum entries (C contract).
    let ids = unsafe { std::slice::from_raw_parts(rank_ids, rank_num as usize) };
    // "rankIds: the ranks' ids in the global communicator. The array should be
    // ordered; the index of each rank in it becomes its rank in the
    // sub-communicator."
    if let Some(w) = ids.windows(2).find(|w| w[0] >= w[1]) {
        return fail(
            HCCL_E_PARA,
            format!("rankIds {ids:?} must be in ascending order without repeats ({} then {})", w[0], w[1]),
        );
    }
    if let Some(&bad) = ids.iter().find(|&&r| r >= size) {
        return fail(HCCL_E_PARA, format!("rankIds {ids:?}: rank {bad} is outside the global communicator of {size}"));
    }
    // "subCommRankId: set it to the index of the current rank in rankIds."
    let Some(pos) = ids.iter().position(|&r| r == my_rank) else {
        return fail(
            HCCL_E_PARA,
            format!(
                "rank {my_rank} is not in rankIds {ids:?}: a rank outside the group passes rankIds = NULL and \
                 subCommId = 0xFFFFFFFF"
            ),
        );
    };
    if pos as u32 != sub_comm_rank_id {
        return fail(
            HCCL_E_PARA,
            format!("subCommRankId {sub_comm_rank_id}, but rank {my_rank} is at index {pos} of rankIds {ids:?}"),
        );
    }
    // "A subCommId must not be reused within one global communicator" (8.5:
    // unless the config names the sub-communicator).
    let named = CannVersion::current() >= CannVersion::V8_5 && unsafe { config_has_name(config) };
    if !named
        && USED_IDS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(|s| s.contains(&(parent as usize, sub_comm_id)))
    {
        return fail(HCCL_E_PARA, format!("subCommId {sub_comm_id:#x} was already used with this global communicator"));
    }
    Ok(SubCommCall::Member)
}

unsafe fn config_has_name(config: *const c_void) -> bool {
    if config.is_null() {
        return false;
    }
    // SAFETY: the header is checked by `comm_config` before; the name is read
    // only when the declared size covers it.
    unsafe {
        let size = (config as *const usize).read_unaligned();
        size > comm_config::COMM_NAME && *(config as *const u8).add(comm_config::COMM_NAME) != 0
    }
}

/// Records a sub-communicator `HcclCreateSubCommConfig` created from `*comm`
/// with `sub_comm_id`, for the nesting and id-reuse rules.
pub unsafe fn sub_comm_created(comm: *mut HcclComm, sub_comm_id: u64, sub_comm: *mut HcclComm) {
    if comm.is_null() || sub_comm.is_null() {
        return;
    }
    // SAFETY: both point to handles (checked non-NULL; C contract).
    let (parent, sub) = unsafe { (*comm as usize, *sub_comm as usize) };
    SUB_COMMS.lock().unwrap_or_else(|e| e.into_inner()).push(sub);
    USED_IDS.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(HashSet::new).insert((parent, sub_comm_id));
}

/// `HcclCommDestroy`'s checks before it looks at the communicator: the
/// calling thread needs a current device (any device: HCCL then finds the
/// communicator by the device it was made on), or the call fails with
/// HCCL_E_RUNTIME; a NULL communicator is then a success that does nothing.
/// Returns whether there is a communicator to destroy.
///
/// hicann/hcomm v8.5.0 `src/framework/op_base/src/op_base.cc:2358-2360`:
/// `HcclDeviceRefresh` first, then "An empty comm given, skip destroy"
/// (HCCL_SUCCESS); `HcclDeviceRefresh` (`:3514-3522`) fails when
/// `hrtGetDeviceRefresh` does, and that returns HCCL_E_RUNTIME when
/// `aclrtGetDevice` fails ("please make sure that device is set",
/// `src/platform/common/adapter/adapter_rts.cc:184-202`). The same at
/// v9.1.0-beta.1 (`op_base.cc:3281-3283`).
pub fn comm_destroy(comm: HcclComm) -> SimResult<bool> {
    context::current()
        .map_err(|e| SimError::new(HCCL_E_RUNTIME, format!("{}: HcclCommDestroy needs a current device", e.msg)))?;
    Ok(!comm.is_null())
}

/// `HcclAlltoAllV` on a one-rank communicator: both displacements 0.
/// Stricter than HCCL, which accepts any: its one-rank all-to-all copies
/// `sendCounts[0]` elements from the start of `sendBuf` to the start of
/// `recvBuf` and never reads `sdispls` or `rdispls` (hicann/hcomm v8.5.0
/// `src/algorithm/impl/operator/alltoall_operator.cc:254-256` selects
/// `RunAlltoAllSingleExecutor` when the communicator has one rank;
/// `src/algorithm/impl/coll_executor/coll_all_to_all/coll_all_to_all_single_rank_executor.cc:20-30`
/// takes the two buffer addresses as they are, `:50-76` copies; the buffers
/// are the caller's, `src/framework/communicator/impl/hccl_communicator_host.cc:2871-2880`).
/// With a displacement other than 0 a device would move other bytes than the
/// simulator, which honours the displacements, so the call is refused.
pub fn one_rank_all_to_all_displacements(size: u32, sdispls: &[usize], rdispls: &[usize]) -> SimResult<()> {
    if size == 1 && (sdispls[0] != 0 || rdispls[0] != 0) {
        return fail(
            HCCL_E_PARA,
            format!(
                "HcclAlltoAllV on a one-rank communicator with sdispls[0] = {}, rdispls[0] = {}: HCCL's one-rank \
                 all-to-all copies sendCounts[0] elements from the start of sendBuf to the start of recvBuf and \
                 ignores the displacements (pass buffers that start at the block, with displacements 0)",
                sdispls[0], rdispls[0]
            ),
        );
    }
    Ok(())
}

/// The operand rules of a collective: every buffer non-NULL whatever its
/// count, every buffer device memory, and the stream non-NULL.
///
/// HCCL's collective entry points refuse a NULL buffer or stream with
/// HCCL_E_PTR (`CHK_PTR_NULL(sendBuf)`, `CHK_PTR_NULL(recvBuf)`,
/// `CHK_PTR_NULL(stream)`; hicann/hcomm v8.5.0
/// `src/framework/op_base/src/op_base.cc:1619-1625`). Refusing NULL also for
/// a count of 0 is stricter than CANN 8.5.0, whose collectives return success
/// for count 0 before the pointer checks (`:1615`) and whose V collectives
/// take NULL on a side without elements (`:1717`, `:2044`). HCCL moves the
/// data with the device's DMA engines, which cannot reach host memory: a host
/// pointer is refused too.
pub fn operands(bufs: &[(&str, *const c_void)], stream: AclrtStream) -> SimResult<()> {
    for &(what, p) in bufs {
        if p.is_null() {
            return fail(HCCL_E_PTR, format!("{what} is NULL (HCCL checks every buffer, even with count 0)"));
        }
        // One byte: the buffer must at least start inside a live device allocation.
        if let Err(e) = arena::resolve(p as usize, 1, what) {
            return fail(HCCL_E_PTR, format!("{what} must be device memory: {}", e.msg));
        }
    }
    if stream.is_null() {
        return fail(HCCL_E_PTR, "stream is NULL (HCCL collectives need an explicit stream)");
    }
    Ok(())
}

/// The reductions' buffer alignment: "the input and output addresses
/// (sendBuf and recvBuf) must be aligned by data type: int8 to 1 byte;
/// int16, float16, bfp16 to 2 bytes; int32, float32 to 4 bytes; int64,
/// uint64, float64 to 8 bytes" (HCCL API reference, hicann/hccl v9.1.0
/// `docs/zh/api_ref/comm_op_interface/HcclAllReduce.md:69-73`,
/// `HcclReduceScatter.md:70-74`, `HcclReduceScatterV.md:71-75`; the gathers,
/// the broadcast and the all-to-all state none). HCCL names no code for it:
/// a parameter error.
pub fn reduce_aligned(bufs: &[(&str, *const c_void)], elem: usize) -> SimResult<()> {
    for &(what, p) in bufs {
        if elem > 1 && p as usize % elem != 0 {
            return fail(
                HCCL_E_PARA,
                format!("{what} {p:p} is not aligned to its {elem}-byte elements, which HCCL reductions need"),
            );
        }
    }
    Ok(())
}

/// `SYS_MAX_COUNT`, the largest element count HCCL takes (hicann/hccl
/// v8.5.0 and v9.1.0 `src/common/hccl_common.h:42`).
pub const SYS_MAX_COUNT: u64 = 0x7_FFFF_FFFF;

/// A collective's element count is at most [`SYS_MAX_COUNT`], else
/// HCCL_E_PARA: `HcomCheckCount` (hicann/hccl v8.5.0
/// `src/common/param_check.cc:91-99`) and `CheckCount` (v9.1.0
/// `src/ops/op_common/op_common.cc:1940`), checked after the pointers and
/// before the dtype on `count` of all-reduce and broadcast, `recvCount` of the
/// reduce-scatters, `sendCount` of the all-gathers, and the largest entry of
/// `sendCounts` and `recvCounts` of all-to-all-v (v9.1.0
/// `src/ops/all_reduce/all_reduce_op.cc:125`, `broadcast/broadcast_op.cc:118`,
/// `reduce_scatter/reduce_scatter_op.cc:52`, `reduce_scatter_v/reduce_scatter_v_op.cc:64`,
/// `all_gather/all_gather_op.cc:117`, `all_gather_v/all_gather_v_op.cc:56`,
/// `all_to_all_v/all_to_all_v_op.cc:118-125`).
pub fn count_in_range(call: &str, what: &str, count: u64) -> SimResult<()> {
    if count > SYS_MAX_COUNT {
        return fail(HCCL_E_PARA, format!("{call}: {what} {count} is above HCCL's largest count {SYS_MAX_COUNT:#x}"));
    }
    Ok(())
}

/// Every entry of the counts array of a V collective (`what`: `sendCounts`
/// of a reduce-scatter-v, `recvCounts` of an all-gather-v), not only this
/// rank's: CANN 8.5.0's `HcclReduceScatterVInner` and `HcclAllGatherVInner`
/// refuse any above `SYS_MAX_COUNT` with HCCL_E_PARA on every rank (hicann/hcomm
/// v8.5.0 `src/framework/op_base/src/op_base.cc:1745-1749`, `:2066-2070`), so a
/// peer's huge count fails this rank at once instead of leaving it waiting.
pub fn counts_in_range(call: &str, what: &str, counts: &[usize]) -> SimResult<()> {
    counts.iter().enumerate().try_for_each(|(i, &c)| count_in_range(call, &format!("{what}[{i}]"), c as u64))
}

/// This rank's own count of a V collective equals its entry in the counts
/// array: `recvCount == sendCounts[rank]` (reduce-scatter-v) and `sendCount
/// == recvCounts[rank]` (all-gather-v), else HCCL_E_PARA (hicann/hcomm v8.5.0
/// `src/framework/op_base/src/op_base.cc:1784-1788`, `:2105-2109`).
pub fn own_count(own: (&str, u64), counts: (&str, &[usize]), rank: u32) -> SimResult<()> {
    let entry = counts.1[rank as usize];
    if entry as u64 != own.1 {
        return fail(HCCL_E_PARA, format!("{} {} but {}[{rank}] = {entry}", own.0, own.1, counts.0));
    }
    Ok(())
}

/// `HcclAllGatherV`, `HcclReduceScatterV` and `HcclAlltoAllV` (HCCL API
/// reference, hicann/hccl v9.1.0 `docs/zh/api_ref/comm_op_interface/`
/// `HcclAllGatherV.md:44`, `HcclReduceScatterV.md:40`, `HcclAlltoAllV.md:41`):
/// "The addresses configured for recvBuf and sendBuf cannot be the same".
/// The code of the same release refuses it for AlltoAllV whatever the
/// counts (`src/ops/all_to_all_v/all_to_all_v_op.cc:487-489`,
/// `CheckAlltoAllVInputPara`: "AlltoAllV does not support in-place operation").
pub fn distinct_buffers(send: *const c_void, recv: *const c_void) -> SimResult<()> {
    if send == recv {
        return fail(HCCL_E_PARA, format!("sendBuf and recvBuf are the same address {send:p}"));
    }
    Ok(())
}

/// `HcclBarrier` on a capturing stream: HCCL's list of operators supported on
/// Atlas A2 names no barrier in any mode, aclgraph capture included, and
/// "operators and modes not listed are not supported" (hicann/hccl v9.1.0
/// `docs/zh/user_guide/comm_ops_support_list/comm_ops_support_a2.md:13`).
// The stream is a handle the capture table resolves, never dereferenced.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn not_under_capture(call: &str, stream: AclrtStream) -> SimResult<()> {
    let (mut capture_status, mut model) = (0i32, std::ptr::null_mut());
    // Asked as the ACL call `aclmdlRICaptureGetInfo`, its boundary included:
    // a failed query is the thread's last ACL error (`aclrtGetLastError`).
    // SAFETY: the query writes through the two valid out-pointers.
    let rc = status::acl("aclmdlRICaptureGetInfo", || unsafe { capture_info(stream, &mut capture_status, &mut model) });
    if rc == 0 && capture_status != ACL_MODEL_RI_CAPTURE_STATUS_NONE {
        return fail(
            HCCL_E_NOT_SUPPORT,
            format!("{call} on a capturing stream: HCCL supports no barrier under graph capture (aclgraph)"),
        );
    }
    Ok(())
}

/// HcclDataType codes the tables below name (`hccl_types.h`).
const INT16: i32 = 1;
const UINT64: i32 = 6;
const UINT16: i32 = 8;
const UINT32: i32 = 9;
const FP64: i32 = 10;

/// What a collective of ours takes on Atlas A2, per the HCCL API reference
/// (hicann/hccl v9.1.0 `docs/zh/api_ref/comm_op_interface/`): the dtypes, and
/// for reductions the ops. A dtype outside the list is HCCL_E_NOT_SUPPORT, the
/// code of HCCL's own dtype check (`HcomCheckDataType`, v8.5.0
/// `src/common/param_check.cc:101-109`); an op outside it HCCL_E_NOT_SUPPORT too.
pub fn a2_dtype(call: &str, dtype: i32, op: Option<i32>) -> SimResult<()> {
    const REDUCE: &[i32] = &[
        HCCL_DATA_TYPE_INT8,
        INT16,
        HCCL_DATA_TYPE_INT32,
        HCCL_DATA_TYPE_INT64,
        HCCL_DATA_TYPE_FP16,
        HCCL_DATA_TYPE_FP32,
        HCCL_DATA_TYPE_BFP16,
    ];
    const REDUCE_V: &[i32] = &[
        HCCL_DATA_TYPE_INT8,
        INT16,
        HCCL_DATA_TYPE_INT32,
        HCCL_DATA_TYPE_FP16,
        HCCL_DATA_TYPE_FP32,
        HCCL_DATA_TYPE_BFP16,
    ];
    const MOVE: &[i32] = &[
        HCCL_DATA_TYPE_INT8,
        HCCL_DATA_TYPE_UINT8,
        INT16,
        UINT16,
        HCCL_DATA_TYPE_INT32,
        UINT32,
        HCCL_DATA_TYPE_INT64,
        UINT64,
        HCCL_DATA_TYPE_FP16,
        HCCL_DATA_TYPE_FP32,
        FP64,
        HCCL_DATA_TYPE_BFP16,
    ];
    const ALL_OPS: &[i32] = &[HCCL_REDUCE_SUM, HCCL_REDUCE_PROD, HCCL_REDUCE_MAX, HCCL_REDUCE_MIN];
    const NO_PROD: &[i32] = &[HCCL_REDUCE_SUM, HCCL_REDUCE_MAX, HCCL_REDUCE_MIN];
    let (dtypes, ops, doc): (&[i32], &[i32], &str) = match call {
        // HcclAllReduce.md:49,57; HcclReduceScatter.md:49,57.
        "HcclAllReduce" | "HcclReduceScatter" => (REDUCE, ALL_OPS, "int8, int16, int32, int64, fp16, fp32, bfp16"),
        // HcclReduceScatterV.md:51,58: no int64, no prod.
        "HcclReduceScatterV" => (REDUCE_V, NO_PROD, "int8, int16, int32, fp16, fp32, bfp16"),
        // HcclAllGather.md:51, HcclAllGatherV.md:55, HcclAlltoAllV.md:52, HcclBroadcast.md:48.
        _ => (MOVE, &[], "the 1-, 2-, 4- and 8-byte integers, fp16, fp32, fp64, bfp16"),
    };
    if !dtypes.contains(&dtype) {
        return fail(
            HCCL_E_NOT_SUPPORT,
            format!("{call} does not take HcclDataType {dtype} on Atlas A2 (it takes {doc})"),
        );
    }
    if let Some(op) = op {
        if !ops.contains(&op) {
            return fail(HCCL_E_NOT_SUPPORT, format!("{call} does not take HcclReduceOp {op} on Atlas A2"));
        }
        // "prod does not support int16 and bfp16" (HcclAllReduce.md:57).
        if op == HCCL_REDUCE_PROD && (dtype == INT16 || dtype == HCCL_DATA_TYPE_BFP16) {
            return fail(HCCL_E_NOT_SUPPORT, format!("{call}: prod does not take HcclDataType {dtype} on Atlas A2"));
        }
    }
    Ok(())
}
