//! The aclnn side of CANN: opaque tensor / scalar handles and their
//! constructors (`libnnopbase`), and the two-phase operator entry points the
//! MoE layer calls (`libopapi`, or an aclnn feature library next to it).
//!
//! The aclnn headers are C++ only and are not part of the header set the
//! bindings are regenerated from, so these few declarations are written by
//! hand from CANN's `aclnn/acl_meta.h` and `aclnnop/aclnn_*.h` prototypes.
//! Every operator is optional: it is usable iff both its phases resolve.

#![allow(non_camel_case_types, non_snake_case)]

use std::ffi::c_void;
use std::marker::{PhantomData, PhantomPinned};
use std::sync::OnceLock;

use libloading::Library;

use crate::loader::{self, Candidate, LibSpec, LoadError};
use crate::{aclDataType, aclFormat, aclrtStream};

/// Status returned by aclnn functions (`0` = success).
pub type aclnnStatus = i32;

/// `ACLNN_SUCCESS`.
pub const ACLNN_SUCCESS: aclnnStatus = 0;
/// `ACLNN_ERR_PARAM_NULLPTR`.
pub const ACLNN_ERR_PARAM_NULLPTR: aclnnStatus = 161001;
/// `ACLNN_ERR_PARAM_INVALID`.
pub const ACLNN_ERR_PARAM_INVALID: aclnnStatus = 161002;
/// `ACLNN_ERR_RUNTIME_ERROR`.
pub const ACLNN_ERR_RUNTIME_ERROR: aclnnStatus = 361001;
/// `ACLNN_ERR_INNER`.
pub const ACLNN_ERR_INNER: aclnnStatus = 561000;

macro_rules! opaque {
    ($($(#[$m:meta])* $name:ident;)*) => {$(
        $(#[$m])*
        #[repr(C)]
        pub struct $name {
            _data: [u8; 0],
            _marker: PhantomData<(*mut u8, PhantomPinned)>,
        }
    )*};
}

opaque! {
    /// An aclnn tensor descriptor (shape, strides, dtype, device address).
    aclTensor;
    /// An aclnn scalar.
    aclScalar;
    /// An aclnn int64 array.
    aclIntArray;
    /// The executor produced by phase one of an aclnn call and consumed by phase two.
    aclOpExecutor;
}

/// `aclCreateTensor(viewDims, viewDimsNum, dataType, stride, offset, format, storageDims, storageDimsNum, tensorData)`.
pub type aclCreateTensor_fn = unsafe extern "C" fn(
    view_dims: *const i64,
    view_dims_num: u64,
    data_type: aclDataType,
    stride: *const i64,
    offset: i64,
    format: aclFormat,
    storage_dims: *const i64,
    storage_dims_num: u64,
    tensor_data: *mut c_void,
) -> *mut aclTensor;
/// `aclDestroyTensor(tensor)`.
pub type aclDestroyTensor_fn = unsafe extern "C" fn(tensor: *const aclTensor) -> aclnnStatus;
/// `aclCreateScalar(value, dataType)`.
pub type aclCreateScalar_fn = unsafe extern "C" fn(value: *mut c_void, data_type: aclDataType) -> *mut aclScalar;
/// `aclDestroyScalar(scalar)`.
pub type aclDestroyScalar_fn = unsafe extern "C" fn(scalar: *const aclScalar) -> aclnnStatus;

/// Phase two of every aclnn op: `aclnnXxx(workspace, workspaceSize, executor, stream)`.
pub type aclnnRun_fn = unsafe extern "C" fn(
    workspace: *mut c_void,
    workspace_size: u64,
    executor: *mut aclOpExecutor,
    stream: aclrtStream,
) -> aclnnStatus;

/// `aclnnMoeFinalizeRoutingV2GetWorkspaceSize(expandedX, expandedRowIdx, x1Optional,
/// x2Optional, biasOptional, scalesOptional, expertIdxOptional, dropPadMode, out,
/// workspaceSize, executor)`.
pub type aclnnMoeFinalizeRoutingV2GetWorkspaceSize_fn = unsafe extern "C" fn(
    expanded_x: *const aclTensor,
    expanded_row_idx: *const aclTensor,
    x1: *const aclTensor,
    x2: *const aclTensor,
    bias: *const aclTensor,
    scales: *const aclTensor,
    expert_idx: *const aclTensor,
    drop_pad_mode: i64,
    out: *const aclTensor,
    workspace_size: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus;

/// `aclnnMoeTokenUnpermuteGetWorkspaceSize(permutedTokens, sortedIndices, probsOptional,
/// paddedMode, restoreShapeOptional, out, workspaceSize, executor)`.
pub type aclnnMoeTokenUnpermuteGetWorkspaceSize_fn = unsafe extern "C" fn(
    permuted_tokens: *const aclTensor,
    sorted_indices: *const aclTensor,
    probs: *const aclTensor,
    padded_mode: bool,
    restore_shape: *const aclIntArray,
    out: *const aclTensor,
    workspace_size: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus;

/// `aclnnAddGetWorkspaceSize(self, other, alpha, out, workspaceSize, executor)`:
/// `out = self + alpha * other`.
pub type aclnnAddGetWorkspaceSize_fn = unsafe extern "C" fn(
    self_: *const aclTensor,
    other: *const aclTensor,
    alpha: *const aclScalar,
    out: *mut aclTensor,
    workspace_size: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus;

/// The tensor / scalar constructors of `libnnopbase`.
#[derive(Debug)]
pub struct Nnopbase {
    /// `aclCreateTensor`.
    pub aclCreateTensor: aclCreateTensor_fn,
    /// `aclDestroyTensor`.
    pub aclDestroyTensor: aclDestroyTensor_fn,
    /// `aclCreateScalar`.
    pub aclCreateScalar: aclCreateScalar_fn,
    /// `aclDestroyScalar`.
    pub aclDestroyScalar: aclDestroyScalar_fn,
    /// Where the library was opened from.
    pub origin: Candidate,
    _library: Library,
}

/// Symbols `libnnopbase` must export.
pub const NNOPBASE_REQUIRED: &[&str] = &["aclCreateTensor", "aclDestroyTensor", "aclCreateScalar", "aclDestroyScalar"];

/// One two-phase aclnn operator.
#[derive(Debug, Clone, Copy)]
pub struct Op<W> {
    /// Phase one: validate, size the workspace, build the executor.
    pub get_workspace_size: W,
    /// Phase two: run on a stream.
    pub run: aclnnRun_fn,
}

/// The aclnn operators the MoE layer uses; each is `None` when this CANN
/// release does not ship it.
#[derive(Debug)]
pub struct OpApi {
    /// `aclnnMoeFinalizeRoutingV2`.
    pub moe_finalize_routing_v2: Option<Op<aclnnMoeFinalizeRoutingV2GetWorkspaceSize_fn>>,
    /// `aclnnMoeTokenUnpermute`.
    pub moe_token_unpermute: Option<Op<aclnnMoeTokenUnpermuteGetWorkspaceSize_fn>>,
    /// `aclnnAdd`.
    pub add: Option<Op<aclnnAddGetWorkspaceSize_fn>>,
    /// Where `libopapi` was opened from.
    pub origin: Candidate,
    /// Every library opened and searched, in search order.
    pub searched: Vec<String>,
    /// For each operator found, the library file it was resolved from.
    pub op_sources: Vec<(&'static str, String)>,
    _libraries: Vec<Library>,
}

impl OpApi {
    /// The library file `op` (e.g. `"aclnnAdd"`) was resolved from.
    pub fn source_of(&self, op: &str) -> Option<&str> {
        self.op_sources.iter().find(|(n, _)| *n == op).map(|(_, p)| p.as_str())
    }
}

/// The per-domain operator libraries of CANN 8.5 and later, searched before
/// `libopapi.so`: the MoE ops ship in `libopapi_transformer.so` and `aclnnAdd`
/// in `libopapi_math.so` (torch_npu's `GetTransformerOpApiLibName`; op-plugin's
/// `GetOpApiFuncAddr` opens every `lib64/libopapi_*.so`; ops-transformer's
/// `fallback.h` looks in `libopapi_transformer.so` before `libopapi.so`).
pub const SPLIT_LIBRARIES: &[&str] = &["libopapi_transformer.so", "libopapi_math.so"];

/// aclnn feature libraries searched (by soname) for an op `libopapi` lacks
/// (op-plugin's fallback list after `libopapi.so`).
pub const FEATURE_LIBRARIES: &[&str] = &["libaclnn_ops_infer.so", "libaclnn_math.so"];

/// Loads `libnnopbase` (once per process).
pub fn nnopbase() -> Result<&'static Nnopbase, LoadError> {
    static LIB: OnceLock<Result<Nnopbase, LoadError>> = OnceLock::new();
    LIB.get_or_init(|| {
        let opened = loader::open(&loader::NNOPBASE, NNOPBASE_REQUIRED)?;
        let lib = opened.library;
        // SAFETY: `open` checked that every symbol exists; the types are the
        // documented C prototypes of CANN's acl_meta.h.
        unsafe {
            Ok(Nnopbase {
                aclCreateTensor: *lib.get::<aclCreateTensor_fn>(b"aclCreateTensor\0").map_err(|e| sym_err(&e))?,
                aclDestroyTensor: *lib.get::<aclDestroyTensor_fn>(b"aclDestroyTensor\0").map_err(|e| sym_err(&e))?,
                aclCreateScalar: *lib.get::<aclCreateScalar_fn>(b"aclCreateScalar\0").map_err(|e| sym_err(&e))?,
                aclDestroyScalar: *lib.get::<aclDestroyScalar_fn>(b"aclDestroyScalar\0").map_err(|e| sym_err(&e))?,
                origin: opened.candidate,
                _library: lib,
            })
        }
    })
    .as_ref()
    .map_err(Clone::clone)
}

fn sym_err(e: &libloading::Error) -> LoadError {
    LoadError {
        library: loader::NNOPBASE.soname,
        env: loader::NNOPBASE.env,
        attempts: vec![loader::Attempt {
            candidate: Candidate { path: loader::NNOPBASE.soname.into(), source: "symbol lookup".into() },
            reason: e.to_string(),
        }],
    }
}

/// Looks `name` and `name + "GetWorkspaceSize"` up in the first library
/// having both, `home` (the per-domain library that ships the op from CANN
/// 8.5 on) first, recording which file that was in `sources`.
fn find_op<W: Copy>(
    libs: &[(String, Library)],
    name: &'static str,
    home: &str,
    sources: &mut Vec<(&'static str, String)>,
) -> Option<Op<W>> {
    let ws_name = format!("{name}GetWorkspaceSize\0");
    let run_name = format!("{name}\0");
    let (first, rest): (Vec<_>, Vec<_>) = libs.iter().partition(|(path, _)| path.ends_with(home));
    first.into_iter().chain(rest).find_map(|(path, lib)| {
        // SAFETY: `W` is the documented prototype of `name`'s phase one, and
        // phase two of every aclnn op has the `aclnnRun_fn` prototype.
        let op = unsafe {
            let ws = *lib.get::<W>(ws_name.as_bytes()).ok()?;
            let run = *lib.get::<aclnnRun_fn>(run_name.as_bytes()).ok()?;
            Op { get_workspace_size: ws, run }
        };
        sources.push((name, path.clone()));
        Some(op)
    })
}

/// Opens `soname` the way the search order says: next to the
/// `ASCEND_MOE_OPAPI_LIB` file when that override is set (so one directory of
/// libraries, such as the simulator's, stands for a CANN `lib64`), else from
/// the CANN roots. `None` when absent.
fn open_beside(soname: &'static str, overridden: Option<&std::path::Path>) -> Option<(String, Library)> {
    match overridden {
        Some(file) => {
            let path = file.parent()?.join(soname);
            if !path.is_file() {
                return None;
            }
            // SAFETY: a CANN operator library; its initialisers only register ops.
            let lib = unsafe { Library::new(&path) }.ok()?;
            Some((path.to_string_lossy().into_owned(), lib))
        }
        None => {
            let spec = LibSpec { soname, env: loader::OPAPI.env, subdirs: &["lib64"] };
            loader::open(&spec, &[]).ok().map(|o| (o.candidate.path.to_string_lossy().into_owned(), o.library))
        }
    }
}

/// Loads the operator libraries (once per process) and resolves the MoE
/// operators. Search order: the per-domain libraries of CANN 8.5+
/// ([`SPLIT_LIBRARIES`]), then `libopapi.so`, then the aclnn feature libraries
/// ([`FEATURE_LIBRARIES`], only without an override); each op is taken from the
/// first library exporting both of its phases.
pub fn opapi() -> Result<&'static OpApi, LoadError> {
    static LIB: OnceLock<Result<OpApi, LoadError>> = OnceLock::new();
    LIB.get_or_init(|| {
        let override_path = std::env::var_os(loader::OPAPI.env).filter(|v| !v.is_empty()).map(std::path::PathBuf::from);
        let mut named: Vec<(String, Library)> =
            SPLIT_LIBRARIES.iter().filter_map(|s| open_beside(s, override_path.as_deref())).collect();
        let (origin, umbrella) = match loader::open(&loader::OPAPI, &[]) {
            Ok(o) => (o.candidate, Some(o.library)),
            // CANN 8.5 may ship only the per-domain libraries.
            Err(_) if !named.is_empty() => {
                (Candidate { path: named[0].0.clone().into(), source: "libopapi_* library".into() }, None)
            }
            Err(e) => return Err(e),
        };
        if let Some(lib) = umbrella {
            named.push((origin.path.to_string_lossy().into_owned(), lib));
        }
        if override_path.is_none() {
            named.extend(FEATURE_LIBRARIES.iter().filter_map(|s| open_beside(s, None)));
        }
        let mut op_sources = Vec::new();
        let transformer = SPLIT_LIBRARIES[0];
        let moe_finalize_routing_v2 = find_op(&named, "aclnnMoeFinalizeRoutingV2", transformer, &mut op_sources);
        let moe_token_unpermute = find_op(&named, "aclnnMoeTokenUnpermute", transformer, &mut op_sources);
        let add = find_op(&named, "aclnnAdd", SPLIT_LIBRARIES[1], &mut op_sources);
        let searched = named.iter().map(|(p, _)| p.clone()).collect();
        Ok(OpApi {
            moe_finalize_routing_v2,
            moe_token_unpermute,
            add,
            origin,
            searched,
            op_sources,
            _libraries: named.into_iter().map(|(_, l)| l).collect(),
        })
    })
    .as_ref()
    .map_err(Clone::clone)
}
