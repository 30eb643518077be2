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
//! A handle is a number of this process, never a pointer to what it stands
//! for: each new handle gets the next one (never 0, never given twice), and
//! a table of the live handles maps it to its type's tag and to the boxed
//! value (for an `Arc` handle, the caller's `Arc`). Only the table is read to
//! check a handle on every use, so a handle of another type, a released one
//! (even after a new handle of its type took the memory it stood for) or any
//! other pointer passed in its place is refused
//! (`AMOE_STATUS_INVALID_ARGUMENT`, naming the argument) and the memory it
//! points to is never read. A release takes the handle out of the table
//! first, so a second release of it, or one through another type's function,
//! does nothing.
//!
//! The functions here take the handle arguments of exports, which each
//! export's contract makes NULL or a live handle: these are the only places
//! a handle leads to its value.

use std::collections::{hash_map, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, RwLock};

use super::failure::{write_out, Failure};
use super::types::{amoe_comm, amoe_host_block, amoe_live_context, amoe_moe_groups, amoe_status, amoe_stream};
use crate::backend::cpu::host_pool::Block;
use crate::backend::npu::live_context::LiveContext;
use crate::moe::prepare_finalize::MoeGroups;
use crate::moe::LiveStream;
use crate::Comm;

/// The handle is a `Box` of its Rust value.
pub(crate) enum OwnedBox {}
/// The handle is an `Arc` of its Rust value: the caller holds one reference.
pub(crate) enum OwnedArc {}

/// How a handle holds its Rust value `T`.
pub(crate) trait Holds<T> {
    /// What the handle's allocation holds.
    type Held: 'static;
    /// The value behind what is held.
    fn get(held: &Self::Held) -> &T;
}

impl<T: 'static> Holds<T> for OwnedBox {
    type Held = T;
    fn get(held: &T) -> &T {
        held
    }
}

impl<T: 'static> Holds<T> for OwnedArc {
    type Held = Arc<T>;
    fn get(held: &Arc<T>) -> &T {
        held
    }
}

/// A C handle type: the Rust value behind it, how it is held, and the tag
/// its live handles have in the table.
pub(crate) trait Castable {
    /// [`OwnedBox`] or [`OwnedArc`].
    type Ownership: Holds<Self::RustType>;
    /// The value a handle stands for.
    type RustType: 'static;
    /// The tag of this type's handles (distinct per type, never 0).
    const TAG: u64;
    /// The C type name, for errors.
    const NAME: &'static str;
}

/// What the handle's allocation holds.
type Held<C> = <<C as Castable>::Ownership as Holds<<C as Castable>::RustType>>::Held;

/// A tag from an 8-byte name.
const fn tag(name: &[u8; 8]) -> u64 {
    u64::from_le_bytes(*name)
}

impl Castable for amoe_comm {
    type Ownership = OwnedBox;
    type RustType = Comm;
    const TAG: u64 = tag(b"amoeCOMM");
    const NAME: &'static str = "amoe_comm";
}

impl Castable for amoe_stream {
    type Ownership = OwnedBox;
    type RustType = LiveStream;
    const TAG: u64 = tag(b"amoeSTRM");
    const NAME: &'static str = "amoe_stream";
}

impl Castable for amoe_moe_groups {
    type Ownership = OwnedBox;
    type RustType = MoeGroups;
    const TAG: u64 = tag(b"amoeGRPS");
    const NAME: &'static str = "amoe_moe_groups";
}

impl Castable for amoe_live_context {
    type Ownership = OwnedArc;
    type RustType = LiveContext;
    const TAG: u64 = tag(b"amoeLIVE");
    const NAME: &'static str = "amoe_live_context";
}

impl Castable for amoe_host_block {
    type Ownership = OwnedBox;
    type RustType = Block;
    const TAG: u64 = tag(b"amoeHBLK");
    const NAME: &'static str = "amoe_host_block";
}

/// A live handle: its type's tag and the address of its boxed value.
#[derive(Clone, Copy)]
struct Entry {
    tag: u64,
    held: usize,
}

/// The live handles, by handle number.
fn live() -> &'static RwLock<HashMap<usize, Entry>> {
    static LIVE: OnceLock<RwLock<HashMap<usize, Entry>>> = OnceLock::new();
    let live = LIVE.get_or_init(RwLock::default);
    crate::fork::watch(crate::fork::HANDLES, lock_for_fork);
    live
}

/// The handle table's guard, held by the thread that forks ([`crate::fork`]).
pub(crate) fn lock_for_fork() -> Box<dyn std::any::Any> {
    Box::new(live().write().unwrap_or_else(|e| e.into_inner()))
}

/// The handle numbers: multiples of 16 (they look like aligned pointers to
/// C), from 16 up, each given once. The first 4095 lie below the lowest
/// address Linux maps by default (`vm.mmap_min_addr`, 64 KiB), so a caller
/// that dereferences one faults at once.
fn next_number() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    // 2^60 handles are not made in the life of a process.
    assert!(n < usize::MAX >> 4, "ascend-moe: C handle numbers exhausted");
    n << 4
}

/// The address of the boxed value of the live `C` handle `p`; `None` when
/// `p` is no live handle of `C`. Reads the table only, never `*p`.
fn held_of<C: Castable>(p: *const C) -> Option<*const Held<C>> {
    let live = live().read().unwrap_or_else(|e| e.into_inner());
    let e = live.get(&(p as usize))?;
    (e.tag == C::TAG).then_some(e.held as *const Held<C>)
}

/// What the live `C` handle `p` (the argument `arg` of export `f`) holds,
/// borrowed for the call; `None` for NULL. A pointer that is no live handle
/// of `C` is INVALID_ARGUMENT naming `arg`.
fn opt_held<'a, C: Castable>(f: &str, arg: &str, p: *const C) -> Result<Option<&'a Held<C>>, Failure> {
    if p.is_null() {
        return Ok(None);
    }
    let Some(held) = held_of(p) else {
        return Err(Failure::new(
            amoe_status::InvalidArgument,
            format!(
                "{f}: `{arg}` is not a live {} handle (a released handle, one of another type, or no handle)",
                C::NAME
            ),
        ));
    };
    // SAFETY: `p` is a live handle of `C`, so `held` is the value `handle_out`
    // boxed for it, which by the export's contract is not released before
    // the call ends.
    Ok(Some(unsafe { &*held }))
}

/// The value behind `p` (the argument `arg` of export `f`), borrowed for the
/// call; `None` for NULL. A pointer that is no live handle of `C` is
/// INVALID_ARGUMENT naming `arg`.
pub(crate) fn opt_ref<'a, C: Castable>(f: &str, arg: &str, p: *const C) -> Result<Option<&'a C::RustType>, Failure> {
    Ok(opt_held(f, arg, p)?.map(<C::Ownership as Holds<C::RustType>>::get))
}

/// The value behind `p`; NULL is NULL_ARGUMENT naming `arg`.
pub(crate) fn try_handle<'a, C: Castable>(f: &str, arg: &str, p: *const C) -> Result<&'a C::RustType, Failure> {
    opt_ref(f, arg, p)?.ok_or_else(|| Failure::null(f, arg))
}

/// Moves `held` into a new handle of `C` written to `*out` (checked non-null).
fn handle_out<C: Castable>(out: *mut *mut C, held: Held<C>) {
    let held = Box::into_raw(Box::new(held)) as usize;
    let number = next_number();
    live().write().unwrap_or_else(|e| e.into_inner()).insert(number, Entry { tag: C::TAG, held });
    write_out(out, number as *mut C);
}

/// Moves `v` into a new `Box` handle written to `*out` (checked non-null).
pub(crate) fn box_out<C: Castable<Ownership = OwnedBox>>(out: *mut *mut C, v: C::RustType) {
    handle_out::<C>(out, v);
}

/// Writes a new `Arc` handle of `v` to `*out` (checked non-null).
pub(crate) fn arc_out<C: Castable<Ownership = OwnedArc>>(out: *mut *mut C, v: Arc<C::RustType>) {
    handle_out::<C>(out, v);
}

/// One more reference to the value of an `Arc` handle; NULL is NULL_ARGUMENT.
pub(crate) fn clone_arc<C: Castable<Ownership = OwnedArc>>(
    f: &str,
    arg: &str,
    p: *const C,
) -> Result<Arc<C::RustType>, Failure> {
    let held: &Arc<C::RustType> = opt_held(f, arg, p)?.ok_or_else(|| Failure::null(f, arg))?;
    Ok(Arc::clone(held))
}

/// Releases a handle (for an `Arc` handle, the caller's reference); NULL, and
/// a pointer that is not a live handle of `C`, are left alone. A panic in the
/// value's `Drop` is contained.
pub(crate) fn release<C: Castable>(p: *mut C) {
    if p.is_null() {
        return;
    }
    let held = match live().write().unwrap_or_else(|e| e.into_inner()).entry(p as usize) {
        hash_map::Entry::Occupied(e) if e.get().tag == C::TAG => e.remove().held,
        _ => return,
    };
    // A drop binds the value's device; the caller's is current again after.
    let _device = crate::backend::npu::runtime::ThreadDevice::kept();
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: the boxed value of a live handle of `C` (taken out of the
        // table above, so released once), made by `handle_out`, not used
        // again by the release export's contract.
        drop(unsafe { Box::from_raw(held as *mut Held<C>) });
    }));
}
