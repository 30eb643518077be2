//! A child made by `fork` while another thread holds the library's
//! process-wide locks (an engine forking workers while a thread makes
//! results) can still use the library: the forking thread takes the locks
//! around `fork`, so the child never inherits one held by a thread it does
//! not have. Its own test binary: the child of a multi-threaded test harness
//! runs only the few calls below.

use std::ptr::null_mut;
use std::time::{Duration, Instant};

use ascend_moe::capi::{amoe_host_block_free, amoe_host_block_new, amoe_status};
use ascend_moe::testing::with_fork_locks_held;

#[test]
fn a_child_forked_while_another_thread_holds_the_librarys_locks_makes_a_pooled_block() {
    let (held, release) = (std::sync::mpsc::channel(), std::sync::mpsc::channel::<()>());
    let holder = std::thread::spawn(move || {
        with_fork_locks_held(|| {
            held.0.send(()).expect("the test waits");
            // Held until the fork began (or a bound passed): the fork then
            // waits for this thread to let go.
            let _ = release.1.recv_timeout(Duration::from_millis(300));
        })
    });
    held.1.recv().expect("the holder runs");
    // SAFETY: the child makes and frees one pooled block (a 2 MiB result of
    // the C ABI: the handle table and the free list), then leaves at once.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let (mut data, mut block) = (null_mut(), null_mut());
        // SAFETY: writable out-pointers; the block is freed once.
        let code = unsafe {
            let ok = amoe_host_block_new(2 << 20, &mut data, &mut block) == amoe_status::Ok;
            amoe_host_block_free(block);
            i32::from(!ok)
        };
        // SAFETY: ends the child without running the harness's exit handlers.
        unsafe { libc::_exit(code) };
    }
    assert!(pid > 0, "fork failed");
    let _ = release.0.send(());
    holder.join().expect("the holder returns");
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut status = 0;
    loop {
        // SAFETY: our own child; `status` is writable.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            break;
        }
        if Instant::now() > deadline {
            // SAFETY: our own child, still running.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            panic!("the child hung on a lock another thread of its parent held at the fork");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child status {status:#x}");
}
