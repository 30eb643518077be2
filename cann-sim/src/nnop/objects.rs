//! The nnopbase objects: what an `aclTensor` and an `aclScalar` describe,
//! the ACL data types they carry, and the tables of live ones.
//!
//! A leaf: the nnopbase exports fill the tables, the aclnn ops read them and
//! so does the leak report, none of them through another.

use crate::ffi::*;
use crate::handles::Table;

/// Live tensors.
pub static TENSORS: Table<TensorDesc> = Table::new("aclTensor", 0x5a3);
/// Live scalars.
pub static SCALARS: Table<Scalar> = Table::new("aclScalar", 0x5a4);

/// Bytes per element of an ACL data type the simulator computes with.
pub fn dtype_size(dt: i32) -> Option<usize> {
    Some(match dt {
        ACL_FLOAT | ACL_INT32 | ACL_UINT32 => 4,
        ACL_FLOAT16 | ACL_BF16 | ACL_INT16 | ACL_UINT16 => 2,
        ACL_INT8 | ACL_UINT8 | ACL_BOOL => 1,
        ACL_INT64 | ACL_UINT64 | ACL_DOUBLE => 8,
        _ => return None,
    })
}

/// Name of an ACL data type.
pub fn dtype_name(dt: i32) -> String {
    match dt {
        ACL_FLOAT => "ACL_FLOAT".into(),
        ACL_FLOAT16 => "ACL_FLOAT16".into(),
        ACL_BF16 => "ACL_BF16".into(),
        ACL_INT32 => "ACL_INT32".into(),
        ACL_INT64 => "ACL_INT64".into(),
        ACL_DOUBLE => "ACL_DOUBLE".into(),
        other => format!("aclDataType {other}"),
    }
}

/// What an `aclTensor` describes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorDesc {
    /// View shape.
    pub dims: Vec<i64>,
    /// aclDataType.
    pub dtype: i32,
    /// View strides in elements.
    pub strides: Vec<i64>,
    /// View offset in elements.
    pub offset: i64,
    /// aclFormat.
    pub format: i32,
    /// Storage shape.
    pub storage: Vec<i64>,
    /// Device address of the storage.
    pub data: usize,
}

impl TensorDesc {
    /// Number of elements of the view.
    pub fn numel(&self) -> usize {
        self.dims.iter().map(|&d| d as usize).product()
    }

    /// Element size (the dtype was validated at creation).
    pub fn elem(&self) -> usize {
        dtype_size(self.dtype).unwrap_or(1)
    }

    /// True when the view is row-major contiguous.
    pub fn is_contiguous(&self) -> bool {
        let mut want = 1i64;
        for (&d, &s) in self.dims.iter().zip(&self.strides).rev() {
            if d != 1 && s != want {
                return false;
            }
            want *= d;
        }
        true
    }

    /// Device address of the first element of the view.
    pub fn addr(&self) -> usize {
        self.data + self.offset as usize * self.elem()
    }

    /// Bytes spanned by the (contiguous) view.
    pub fn bytes(&self) -> usize {
        self.numel() * self.elem()
    }
}

/// A host scalar.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scalar {
    /// aclDataType it was created with.
    pub dtype: i32,
    /// Its value as f64.
    pub value: f64,
    /// Its value as i64 (integers and bools; floats truncated).
    pub int: i64,
}
