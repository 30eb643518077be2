//! Memory freed while work queued on a stream still uses it: `aclrtFree` and
//! `aclrtFreeHost` do not wait, so the queued task would run against memory
//! that is gone or that a newer allocation at the same address owns. The task
//! is not run and the stream fails with `ACL_ERROR_RT_DEVICE_MEM_ERROR`
//! (507053) at its synchronisation; the newer allocation keeps its bytes.
//!
//! The tests check that a new allocation of the same size gets the freed
//! address, so they take [`serial`]: no other test of this binary allocates
//! in between.

mod common;

use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard};

use common::*;

const DEVICE_MEM_ERROR: i32 = 507053;

/// Whether streams run their tasks only when waited for (the default): in
/// `CANNSIM_STREAM_MODE=eager` a task may run as it is queued, before the
/// free, and there is nothing to catch.
fn lazy() -> bool {
    std::env::var("CANNSIM_STREAM_MODE").as_deref() != Ok("eager")
}

fn serial() -> MutexGuard<'static, ()> {
    static M: Mutex<()> = Mutex::new(());
    M.lock().unwrap_or_else(|e| e.into_inner())
}

fn malloc_host(size: usize) -> Ptr {
    let mut p = std::ptr::null_mut();
    assert_eq!(unsafe { (sim().aclrtMallocHost)(&mut p, size) }, 0, "aclrtMallocHost: {}", err_msg());
    p
}

fn free_host(p: Ptr) {
    assert_eq!(unsafe { (sim().aclrtFreeHost)(p) }, 0, "aclrtFreeHost: {}", err_msg());
}

/// Fills `n` bytes of device memory at `p` with `byte`, synchronously.
fn fill(p: Ptr, byte: u8, n: usize) {
    let v = vec![byte; n];
    let r = unsafe { (sim().aclrtMemcpy)(p, n, v.as_ptr() as *const c_void, n, H2D) };
    assert_eq!(r, 0, "aclrtMemcpy: {}", err_msg());
}

/// Synchronises `st`, expects the use-after-free error and returns its text.
fn sync_fails(st: Ptr) -> String {
    let r = unsafe { (sim().aclrtSynchronizeStream)(st) };
    let msg = err_msg();
    assert_eq!(r, DEVICE_MEM_ERROR, "{msg}");
    msg
}

#[test]
fn a_copy_into_a_buffer_freed_and_allocated_again_fails_the_sync_and_spares_the_new_owner() {
    let _one = serial();
    if !lazy() {
        return;
    }
    let s = use_device(0);
    let st = stream();
    let old = malloc(256);
    let src = [1u8; 256];
    unsafe { assert_eq!((s.aclrtMemcpyAsync)(old, 256, src.as_ptr() as *const c_void, 256, H2D, st), 0) };
    free(old);
    let new = malloc(256);
    assert_eq!(new, old, "a same-size allocation takes the freed address");
    fill(new, 0x22, 256);
    let msg = sync_fails(st);
    assert!(msg.contains("aclrtMemcpyAsync"), "names the call that queued the task: {msg}");
    assert!(msg.contains(&format!("{:#x}", old as usize)), "names the address: {msg}");
    assert!(msg.contains("freed") && msg.contains("pending"), "says the memory was freed under the task: {msg}");
    assert!(msg.contains("newer allocation"), "{msg}");
    assert_eq!(download::<u8>(new, 256), vec![0x22; 256], "the new owner's bytes are untouched");
    assert_eq!(unsafe { (s.aclrtSynchronizeStream)(st) }, DEVICE_MEM_ERROR, "the error is sticky");
    free(new);
    destroy_stream(st);
}

#[test]
fn a_device_to_device_copy_from_a_source_freed_and_allocated_again_fails_and_writes_nothing() {
    let _one = serial();
    if !lazy() {
        return;
    }
    let s = use_device(0);
    let st = stream();
    let (dst, src) = (malloc(128), malloc(128));
    fill(dst, 0x33, 128);
    unsafe { assert_eq!((s.aclrtMemcpyAsync)(dst, 128, src, 128, D2D, st), 0) };
    free(src);
    let new = malloc(128);
    assert_eq!(new, src, "a same-size allocation takes the freed address");
    fill(new, 0x99, 128);
    let msg = sync_fails(st);
    assert!(msg.contains(&format!("src {:#x}", src as usize)) && msg.contains("pending"), "{msg}");
    assert_eq!(download::<u8>(dst, 128), vec![0x33; 128], "the copy did not run");
    free(new);
    free(dst);
    destroy_stream(st);
}

#[test]
fn a_memset_of_a_buffer_freed_and_allocated_again_fails_the_sync_and_spares_the_new_owner() {
    let _one = serial();
    if !lazy() {
        return;
    }
    let s = use_device(1);
    let st = stream();
    let old = malloc(512);
    unsafe { assert_eq!((s.aclrtMemsetAsync)(old, 512, 0, 512, st), 0) };
    free(old);
    let new = malloc(512);
    assert_eq!(new, old, "a same-size allocation takes the freed address");
    fill(new, 0x44, 512);
    let msg = sync_fails(st);
    assert!(msg.contains("aclrtMemsetAsync") && msg.contains(&format!("{:#x}", old as usize)), "{msg}");
    assert_eq!(download::<u8>(new, 512), vec![0x44; 512], "the new owner's bytes are untouched");
    free(new);
    destroy_stream(st);
}

#[test]
fn a_pinned_host_source_freed_under_a_queued_copy_fails_the_sync_and_the_copy_does_not_run() {
    let _one = serial();
    if !lazy() {
        return;
    }
    let s = use_device(2);
    let st = stream();
    let dev = malloc(256);
    fill(dev, 0x55, 256);
    let host = malloc_host(256);
    unsafe {
        std::ptr::write_bytes(host as *mut u8, 7, 256);
        assert_eq!((s.aclrtMemcpyAsync)(dev, 256, host, 256, H2D, st), 0);
    }
    free_host(host);
    // Pinned memory allocated again, possibly at the same address, with other bytes.
    let again = malloc_host(256);
    unsafe { std::ptr::write_bytes(again as *mut u8, 9, 256) };
    let msg = sync_fails(st);
    assert!(msg.contains("aclrtMemcpyAsync") && msg.contains("aclrtFreeHost"), "{msg}");
    assert!(msg.contains(&format!("src {:#x}", host as usize)), "names the host address: {msg}");
    assert_eq!(download::<u8>(dev, 256), vec![0x55; 256], "the copy did not run");
    free_host(again);
    free(dev);
    destroy_stream(st);
}

#[test]
fn a_pinned_host_destination_freed_under_a_queued_copy_fails_the_sync() {
    let _one = serial();
    if !lazy() {
        return;
    }
    let s = use_device(2);
    let st = stream();
    let dev = malloc(64);
    fill(dev, 0x66, 64);
    let host = malloc_host(64);
    unsafe { assert_eq!((s.aclrtMemcpyAsync)(host, 64, dev, 64, D2H, st), 0) };
    free_host(host);
    let msg = sync_fails(st);
    assert!(msg.contains(&format!("dst {:#x}", host as usize)) && msg.contains("aclrtFreeHost"), "{msg}");
    free(dev);
    destroy_stream(st);
}

#[test]
fn a_collective_whose_receive_buffer_was_freed_fails_its_stream() {
    let _one = serial();
    if !lazy() {
        return;
    }
    let s = use_device(3);
    let mut root = vec![0u8; 4108];
    let mut comm = std::ptr::null_mut();
    unsafe {
        assert_eq!((s.HcclGetRootInfo)(root.as_mut_ptr()), 0, "{}", err_msg());
        assert_eq!((s.HcclCommInitRootInfo)(1, root.as_ptr(), 0, &mut comm), 0, "{}", err_msg());
    }
    let st = stream();
    let send = upload(&[1.0f32; 16]);
    let recv = malloc(64);
    unsafe { assert_eq!((s.HcclAllReduce)(send, recv, 16, HCCL_FP32, HCCL_SUM, comm, st), 0, "{}", err_msg()) };
    free(recv);
    let new = malloc(64);
    assert_eq!(new, recv, "a same-size allocation takes the freed address");
    fill(new, 0x77, 64);
    let msg = sync_fails(st);
    assert!(msg.contains("HcclAllReduce") && msg.contains(&format!("recvBuf {:#x}", recv as usize)), "{msg}");
    assert_eq!(download::<u8>(new, 64), vec![0x77; 64], "the new owner's bytes are untouched");
    free(new);
    free(send);
    destroy_stream(st);
    unsafe { assert_eq!((s.HcclCommDestroy)(comm), 0, "{}", err_msg()) };
}

#[test]
fn memory_freed_after_the_sync_and_allocated_again_is_normal_use() {
    let _one = serial();
    let s = use_device(3);
    let st = stream();
    let host = malloc_host(256);
    for round in 0..3u8 {
        let dev = malloc(256);
        unsafe {
            std::ptr::write_bytes(host as *mut u8, round, 256);
            assert_eq!((s.aclrtMemsetAsync)(dev, 256, 0, 256, st), 0);
            assert_eq!((s.aclrtMemcpyAsync)(dev, 256, host, 256, H2D, st), 0);
            assert_eq!((s.aclrtMemcpyAsync)(host, 256, dev, 256, D2H, st), 0);
        }
        sync(st);
        assert_eq!(download::<u8>(dev, 256), vec![round; 256]);
        free(dev);
    }
    // Pageable host memory has no allocation to check: a copy from it runs.
    let dev = malloc(64);
    let pageable = [5u8; 64];
    unsafe { assert_eq!((s.aclrtMemcpyAsync)(dev, 64, pageable.as_ptr() as *const c_void, 64, H2D, st), 0) };
    sync(st);
    assert_eq!(download::<u8>(dev, 64), vec![5; 64]);
    free(dev);
    free_host(host);
    destroy_stream(st);
}
