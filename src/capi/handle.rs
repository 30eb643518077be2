//! Typed ownership of the opaque handles: each handle type says once which
//! Rust value it stands for and whether the caller holds it as a `Box` (one
//! owner, freed once) or an `Arc` (shared), so no export casts a pointer
//! itself and a `Box` handle cannot be released as an `Arc`.
//!
//! | handle | Rust value | held as |
//! |---|---|---|
//! | `amoe_comm` | [`Comm`] | `Box` |
//! | `amoe_stream` | [`LiveStream`] | `Box` |
//! | `amoe_moe_groups` | [`MoeGroups`] | `Box` |
//! | `amoe_live_context` | [`LiveContext`] | `Arc` |
//! | `amoe_host_block` | [`Block`] | `Box` |
//!
//! The functions here take the handle arguments of exports, which each
//! export's contract makes NULL or a live handle of their type: these are
//! the only places such a pointer becomes a reference.

use std::sync::Arc;

use super::failure::{write_out, Failure};
use super::types::{amoe_comm, amoe_host_block, amoe_live_context, amoe_moe_groups, amoe_stream};
use crate::backend::cpu::host_pool::Block;
use crate::backend::npu::live_context::LiveContext;
use crate::moe::prepare_finalize::MoeGroups;
use crate::moe::LiveStream;
use crate::Comm;

/// The handle is a `Box` of its Rust value.
pub(crate) enum OwnedBox {}
/// The handle is an `Arc` of its Rust value (`Arc::into_raw`).
pub(crate) enum OwnedArc {}

/// A C handle type: the Rust value behind it and how it is held.
pub(crate) trait Castable {
    /// [`OwnedBox`] or [`OwnedArc`].
    type Ownership;
    /// The value a handle points to.
    type RustType;
}

impl Castable for amoe_comm {
    type Ownership = OwnedBox;
    type RustType = Comm;
}

impl Castable for amoe_stream {
    type Ownership = OwnedBox;
    type RustType = LiveStream;
}

impl Castable for amoe_moe_groups {
    type Ownership = OwnedBox;
    type RustType = MoeGroups;
}

impl Castable for amoe_live_context {
    type Ownership = OwnedArc;
    type RustType = LiveContext;
}

impl Castable for amoe_host_block {
    type Ownership = OwnedBox;
    type RustType = Block;
}

/// The value behind `p`, borrowed for the call; `None` for NULL.
pub(crate) fn opt_ref<'a, C: Castable>(p: *const C) -> Option<&'a C::RustType> {
    // SAFETY: `p` is a handle argument of an export, NULL or a live handle of
    // type `C` by the export's contract: a pointer made by `box_out` /
    // `arc_out` from a `C::RustType` that is not freed before the call ends.
    unsafe { p.cast::<C::RustType>().as_ref() }
}

/// The value behind `p`; NULL is NULL_ARGUMENT naming `arg`.
pub(crate) fn try_handle<'a, C: Castable>(f: &str, arg: &str, p: *const C) -> Result<&'a C::RustType, Failure> {
    opt_ref(p).ok_or_else(|| Failure::null(f, arg))
}

/// Moves `v` into a new `Box` handle written to `*out` (checked non-null).
pub(crate) fn box_out<C: Castable<Ownership = OwnedBox>>(out: *mut *mut C, v: C::RustType) {
    write_out(out, Box::into_raw(Box::new(v)).cast::<C>());
}

/// Releases a `Box` handle; NULL is a no-op, and a panic in the value's
/// `Drop` is contained.
pub(crate) fn free_box<C: Castable<Ownership = OwnedBox>>(p: *mut C) {
    if p.is_null() {
        return;
    }
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: a live `Box` handle (made by `box_out`), not used again, by
        // the free export's contract.
        drop(unsafe { Box::from_raw(p.cast::<C::RustType>()) });
    }));
}

/// Writes a new `Arc` handle of `v` to `*out` (checked non-null).
pub(crate) fn arc_out<C: Castable<Ownership = OwnedArc>>(out: *mut *mut C, v: Arc<C::RustType>) {
    write_out(out, Arc::into_raw(v).cast_mut().cast::<C>());
}

/// One more reference to the value of an `Arc` handle; NULL is NULL_ARGUMENT.
pub(crate) fn clone_arc<C: Castable<Ownership = OwnedArc>>(
    f: &str,
    arg: &str,
    p: *const C,
) -> Result<Arc<C::RustType>, Failure> {
    if p.is_null() {
        return Err(Failure::null(f, arg));
    }
    let p = p.cast::<C::RustType>();
    // SAFETY: a live `Arc` handle (made by `arc_out`) by the export's
    // contract; the count is raised before the new `Arc` takes it over.
    unsafe {
        Arc::increment_strong_count(p);
        Ok(Arc::from_raw(p))
    }
}

/// Releases an `Arc` handle (the caller's reference); NULL is a no-op.
pub(crate) fn free_arc<C: Castable<Ownership = OwnedArc>>(p: *const C) {
    if p.is_null() {
        return;
    }
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: a live `Arc` handle (made by `arc_out`), not used again, by
        // the free export's contract.
        drop(unsafe { Arc::from_raw(p.cast::<C::RustType>()) });
    }));
}
