//! [`View`] and [`ViewMut`]: one operand of a backend op, a shape and dtype
//! over a buffer of that backend, borrowed for the duration of the call.
//!
//! The backends take these, never a `Tensor`: a `Tensor` (one layer up) lends
//! its storage as the view of the backend that owns it, and the C ABI lends
//! the caller's memory the same way, so an op reads its inputs and writes its
//! output where they already are.

use crate::types::TensorMeta;
use crate::{DType, Error, Result};

/// Memory of one backend, holding a whole number of bytes.
pub trait Buffer {
    /// Its length in bytes.
    fn len_bytes(&self) -> usize;
}

/// A read-only operand: `meta` over `buf`, which holds exactly the bytes
/// `meta` describes.
#[derive(Debug)]
pub struct View<'a, B: ?Sized> {
    meta: TensorMeta<'a>,
    buf: &'a B,
}

impl<B: ?Sized> Clone for View<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: ?Sized> Copy for View<'_, B> {}

/// A written operand: `meta` over `buf`, lent to the op alone.
#[derive(Debug)]
pub struct ViewMut<'a, B: ?Sized> {
    meta: TensorMeta<'a>,
    buf: &'a mut B,
}

fn check_len(op: &'static str, arg: &'static str, meta: TensorMeta<'_>, have: usize) -> Result<()> {
    let need = super::args::checked_bytes(op, arg, meta.shape, meta.dtype)?;
    if need != have {
        return Err(Error::invalid(
            op,
            arg,
            format!("shape {:?} of {} needs {need} bytes, the buffer holds {have}", meta.shape, meta.dtype),
        ));
    }
    Ok(())
}

macro_rules! meta_accessors {
    () => {
        /// Shape and dtype.
        pub fn meta(&self) -> TensorMeta<'a> {
            self.meta
        }
        /// Shape.
        pub fn shape(&self) -> &'a [usize] {
            self.meta.shape
        }
        /// Element type.
        pub fn dtype(&self) -> DType {
            self.meta.dtype
        }
        /// Number of elements.
        pub fn numel(&self) -> usize {
            self.meta.numel()
        }
        /// Bytes of the elements.
        pub fn len_bytes(&self) -> usize {
            self.meta.numel() * self.meta.dtype.size()
        }
        /// Rows (dim 0); a 0-d operand has one row.
        pub fn rows(&self) -> usize {
            self.meta.rows()
        }
        /// Elements per row.
        pub fn row_len(&self) -> usize {
            self.meta.row_len()
        }
    };
}

impl<'a, B: Buffer + ?Sized> View<'a, B> {
    /// `meta` over `buf`; an error naming `op` and `arg` when `buf` does not
    /// hold exactly the bytes of `meta`.
    pub fn new(op: &'static str, arg: &'static str, meta: TensorMeta<'a>, buf: &'a B) -> Result<Self> {
        check_len(op, arg, meta, buf.len_bytes())?;
        Ok(View { meta, buf })
    }
}

impl<'a, B: ?Sized> View<'a, B> {
    meta_accessors!();

    /// The buffer.
    pub fn buf(&self) -> &'a B {
        self.buf
    }
}

impl<'a, B: Buffer + ?Sized> ViewMut<'a, B> {
    /// `meta` over `buf`; an error naming `op` and `arg` when `buf` does not
    /// hold exactly the bytes of `meta`.
    pub fn new(op: &'static str, arg: &'static str, meta: TensorMeta<'a>, buf: &'a mut B) -> Result<Self> {
        check_len(op, arg, meta, buf.len_bytes())?;
        Ok(ViewMut { meta, buf })
    }
}

impl<'a, B: ?Sized> ViewMut<'a, B> {
    meta_accessors!();

    /// The buffer, for reading.
    pub fn buf(&self) -> &B {
        self.buf
    }

    /// The buffer, for writing.
    pub fn buf_mut(&mut self) -> &mut B {
        self.buf
    }

    /// The same operand, read-only, for as long as this borrow.
    pub fn as_view(&self) -> View<'_, B> {
        View { meta: self.meta, buf: self.buf }
    }

    /// The same operand, lent on for a shorter call.
    pub fn reborrow(&mut self) -> ViewMut<'_, B> {
        ViewMut { meta: self.meta, buf: self.buf }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Bytes(usize);
    impl Buffer for Bytes {
        fn len_bytes(&self) -> usize {
            self.0
        }
    }

    #[test]
    fn a_view_holds_exactly_the_bytes_of_its_meta() {
        let meta = TensorMeta { shape: &[3, 2], dtype: DType::BF16 };
        let v = View::new("op", "x", meta, &Bytes(12)).unwrap();
        assert_eq!((v.rows(), v.row_len(), v.numel(), v.len_bytes()), (3, 2, 6, 12));
        for len in [0, 11, 13, 24] {
            let e = View::new("op", "x", meta, &Bytes(len)).unwrap_err().to_string();
            assert!(
                e.contains("op") && e.contains('x') && e.contains("12 bytes") && e.contains(&len.to_string()),
                "{e}"
            );
            assert!(ViewMut::new("op", "x", meta, &mut Bytes(len)).is_err());
        }
        let mut b = Bytes(12);
        let mut w = ViewMut::new("op", "out", meta, &mut b).unwrap();
        assert_eq!(w.reborrow().as_view().shape(), &[3, 2]);
    }
}
