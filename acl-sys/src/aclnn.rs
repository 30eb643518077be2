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
    /// Feature libraries that were also searched (opened ones only).
    pub feature_libraries: Vec<String>,
    _libraries: Vec<Library>,
}

/// aclnn feature libraries searched (by soname) for an op `libopapi` lacks.
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

/// Looks `name` and `name + "GetWorkspaceSize"` up in the first library having both.
fn find_op<W: Copy>(libs: &[Library], name: &str) -> Option<Op<W>> {
    let ws_name = format!("{name}GetWorkspaceSize\0");
    let run_name = format!("{name}\0");
    libs.iter().find_map(|lib| {
        // SAFETY: `W` is the documented prototype of `name`'s phase one, and
        // phase two of every aclnn op has the `aclnnRun_fn` prototype.
        unsafe {
            let ws = *lib.get::<W>(ws_name.as_bytes()).ok()?;
            let run = *lib.get::<aclnnRun_fn>(run_name.as_bytes()).ok()?;
            Some(Op { get_workspace_size: ws, run })
        }
    })
}

/// Loads `libopapi` (once per process) and resolves the MoE operators,
/// falling back to the aclnn feature libraries for ops it lacks.
pub fn opapi() -> Result<&'static OpApi, LoadError> {
    static LIB: OnceLock<Result<OpApi, LoadError>> = OnceLock::new();
    LIB.get_or_init(|| {
        let opened = loader::open(&loader::OPAPI, &[])?;
        let mut libs = vec![opened.library];
        let mut feature_libraries = Vec::new();
        let overridden = std::env::var_os(loader::OPAPI.env).is_some_and(|v| !v.is_empty());
        if !overridden {
            for soname in FEATURE_LIBRARIES {
                let spec = LibSpec { soname, env: loader::OPAPI.env, subdirs: &["lib64"] };
                if let Ok(o) = loader::open(&spec, &[]) {
                    feature_libraries.push(o.candidate.path.to_string_lossy().into_owned());
                    libs.push(o.library);
                }
            }
        }
        Ok(OpApi {
            moe_finalize_routing_v2: find_op(&libs, "aclnnMoeFinalizeRoutingV2"),
            moe_token_unpermute: find_op(&libs, "aclnnMoeTokenUnpermute"),
            add: find_op(&libs, "aclnnAdd"),
            origin: opened.candidate,
            feature_libraries,
            _libraries: libs,
        })
    })
    .as_ref()
    .map_err(Clone::clone)
}
