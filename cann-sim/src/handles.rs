//! Handle tables. Every handle given to C (stream, event, tensor, scalar,
//! executor, communicator) is an opaque value that encodes its kind and a
//! never-reused id, so a destroyed, foreign or wrong-kind handle is reported
//! instead of dereferenced. The values point into unmapped address space, so a
//! caller that dereferences one faults.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// A table of live objects of one kind (`T` may be a trait object).
#[derive(Debug)]
pub struct Table<T: ?Sized> {
    kind: &'static str,
    tag: usize,
    next: AtomicUsize,
    map: Mutex<BTreeMap<usize, Arc<T>>>,
}

impl<T: ?Sized> Table<T> {
    /// A table whose handles carry `tag` (distinct per kind).
    pub const fn new(kind: &'static str, tag: usize) -> Self {
        Table { kind, tag, next: AtomicUsize::new(1), map: Mutex::new(BTreeMap::new()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, Arc<T>>> {
        // Poisoning only follows a panic in another thread; the map itself is
        // always consistent (single insert/remove per critical section).
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What the table holds ("stream", ...).
    pub fn kind(&self) -> &'static str {
        self.kind
    }

    /// Registers `v`; returns its handle.
    pub fn insert(&self, v: Arc<T>) -> usize {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let h = (self.tag << 40) | (id << 4);
        self.lock().insert(h, v);
        h
    }

    /// The object of handle `h`.
    pub fn get(&self, h: usize) -> Option<Arc<T>> {
        self.lock().get(&h).cloned()
    }

    /// Removes and returns the object of handle `h`.
    pub fn remove(&self, h: usize) -> Option<Arc<T>> {
        self.lock().remove(&h)
    }

    /// Every live object with its handle.
    pub fn all(&self) -> Vec<(usize, Arc<T>)> {
        self.lock().iter().map(|(h, v)| (*h, v.clone())).collect()
    }
}
