//! C ABI conventions (last error, buffer sizes, per-thread messages) and the
//! token prepare / finalize exports across 4 threads, through the same
//! `extern "C"` functions a C or Python caller uses.

mod capi_common;

use std::ffi::{c_char, CString};
use std::ptr::{null, null_mut};

use ascend_moe::capi::*;
use capi_common::{host, last_error};

#[test]
fn last_error_is_per_thread_truncates_on_char_boundaries_and_is_not_cleared_by_reading() {
    let name = CString::new("grüße-ñ-world").expect("no NUL");
    let mut out: *mut amoe_comm = null_mut();
    // SAFETY: valid name and out-pointer; world size 0 is an error.
    let st = unsafe { amoe_comm_cpu_new(name.as_ptr(), 0, 0, 1.0, &mut out) };
    assert_eq!(st, amoe_status::CommSetup);
    assert!(out.is_null(), "no handle on failure");
    let full = last_error();
    assert!(full.contains("grüße-ñ-world") && full.contains("world size 0"), "{full}");
    assert_eq!(amoe_last_error_length(), full.len() + 1);

    // Cut inside the 2-byte 'ü': only whole characters are written, NUL-terminated.
    let cut = full.find('ü').expect("ü in message") + 1;
    let mut buf = vec![0xAAu8; cut + 1];
    let mut n = 99usize;
    // SAFETY: `buf` is writable for its length.
    let st = unsafe { amoe_last_error_message(buf.as_mut_ptr() as *mut c_char, buf.len(), &mut n) };
    assert_eq!(st, amoe_status::BufferTooSmall);
    assert_eq!(n, cut - 1);
    assert_eq!(&buf[..n], &full.as_bytes()[..n]);
    assert_eq!(buf[n], 0);
    // SAFETY: len 0 writes nothing; NULL buffer is fine then.
    let st = unsafe { amoe_last_error_message(null_mut(), 0, &mut n) };
    assert_eq!((st, n), (amoe_status::BufferTooSmall, 0));
    assert_eq!(last_error(), full, "reading does not clear the message");

    let other = std::thread::spawn(|| (amoe_last_error_length(), last_error())).join().expect("thread");
    assert_eq!(other, (1, String::new()), "another thread has its own (empty) message");
}

/// `timeout_s` reads as every timeout does (`CommOptions::timeout_from_secs`):
/// 0, negative and NaN the default, infinity no limit, under 1 ns refused.
#[test]
fn a_timeout_reads_by_the_one_rule() {
    let make = |tag: &str, timeout_s: f64| {
        let name = CString::new(format!("capi-abi-timeout-{tag}-{}", std::process::id())).expect("no NUL");
        let mut out: *mut amoe_comm = null_mut();
        // SAFETY: valid name and out-pointer.
        let st = unsafe { amoe_comm_cpu_new(name.as_ptr(), 1, 0, timeout_s, &mut out) };
        assert_eq!(st == amoe_status::Ok, !out.is_null(), "{tag}: a handle exactly on success");
        // SAFETY: NULL or the handle just made.
        unsafe { amoe_comm_free(out) };
        (st, last_error())
    };
    for (tag, t) in [
        ("zero", 0.0),
        ("minus-zero", -0.0),
        ("negative", -1.0),
        ("minus-inf", f64::NEG_INFINITY),
        ("nan", f64::NAN),
        ("inf", f64::INFINITY),
        ("huge", 1e300),
        ("ns", 1e-9),
    ] {
        let (st, e) = make(tag, t);
        assert_eq!(st, amoe_status::Ok, "{tag}: {e}");
    }
    for (tag, t, why) in [("sub-ns", 1e-12, "least timeout, 1 ns"), ("tiny", 1e-300, "least timeout, 1 ns")] {
        let (st, e) = make(tag, t);
        assert_eq!(st, amoe_status::InvalidArgument, "{tag} was accepted");
        assert!(e.contains("amoe_comm_cpu_new: invalid argument `timeout_s`") && e.contains(why), "{tag}: {e}");
    }
}

#[test]
fn a_handle_of_another_type_is_refused_naming_the_argument() {
    let name = CString::new(format!("capi-abi-cast-{}", std::process::id())).expect("no NUL");
    let mut comm: *mut amoe_comm = null_mut();
    // SAFETY: valid name and out-pointer.
    assert_eq!(unsafe { amoe_comm_cpu_new(name.as_ptr(), 1, 0, 5.0, &mut comm) }, amoe_status::Ok, "{}", last_error());
    let (mut data, mut block): (*mut std::ffi::c_void, *mut amoe_host_block) = (null_mut(), null_mut());
    // SAFETY: valid out-pointers.
    assert_eq!(unsafe { amoe_host_block_new(64, &mut data, &mut block) }, amoe_status::Ok, "{}", last_error());

    // SAFETY: live handles, each passed where another type is expected (the case under test).
    let st = unsafe { amoe_stream_check(comm.cast::<amoe_stream>()) };
    assert_eq!(st, amoe_status::InvalidArgument, "a communicator taken for a stream");
    assert_eq!(
        last_error(),
        "amoe_stream_check: `stream` is not a live amoe_stream handle (a released handle, one of another type, or no handle)"
    );
    let mut r = 7usize;
    // SAFETY: as above.
    let st = unsafe { amoe_comm_rank(block.cast::<amoe_comm>(), &mut r) };
    assert_eq!((st, r), (amoe_status::InvalidArgument, 7), "a host block taken for a communicator");
    assert!(last_error().contains("`comm` is not a live amoe_comm handle"), "{}", last_error());
    let (mut cap, mut used) = (0usize, 0usize);
    // SAFETY: as above.
    let st = unsafe { amoe_live_context_guards(comm.cast::<amoe_live_context>(), &mut cap, &mut used) };
    assert_eq!(st, amoe_status::InvalidArgument, "a communicator taken for a live context");
    let mut g: *mut amoe_moe_groups = null_mut();
    // SAFETY: as above.
    let st = unsafe { amoe_moe_groups_new(block.cast::<amoe_comm>(), 1, 1, &mut g) };
    assert_eq!(st, amoe_status::InvalidArgument, "a host block taken for a world");
    assert!(g.is_null());
    // Releasing a handle through another type's function leaves it alone: it
    // still works, and is released by its own.
    // SAFETY: as above.
    unsafe { amoe_comm_free(block.cast::<amoe_comm>()) };
    // SAFETY: as above.
    unsafe { amoe_host_block_free(comm.cast::<amoe_host_block>()) };
    // SAFETY: live handle and out-pointer.
    assert_eq!(unsafe { amoe_comm_rank(comm, &mut r) }, amoe_status::Ok, "{}", last_error());
    assert_eq!(r, 0);
    // SAFETY: the handles made above, each released once by its own function.
    unsafe {
        amoe_host_block_free(block);
        amoe_comm_free(comm);
    }
}

#[test]
fn released_handles_and_stray_pointers_are_refused_without_being_read() {
    let name = CString::new(format!("capi-abi-stray-{}", std::process::id())).expect("no NUL");
    let mut comm: *mut amoe_comm = null_mut();
    // SAFETY: valid name and out-pointer.
    assert_eq!(unsafe { amoe_comm_cpu_new(name.as_ptr(), 1, 0, 5.0, &mut comm) }, amoe_status::Ok, "{}", last_error());
    // A forgery: memory that begins with the bytes a communicator handle
    // begins with ("amoeCOMM"), then nothing a communicator holds.
    let mut forged = [0u64; 16];
    forged[0] = u64::from_le_bytes(*b"amoeCOMM");
    let stray = forged.as_mut_ptr().cast::<amoe_comm>();
    let mut r = 7usize;
    // SAFETY: `stray` is the pointer under test; `r` is writable.
    let st = unsafe { amoe_comm_rank(stray, &mut r) };
    assert_eq!((st, r), (amoe_status::InvalidArgument, 7), "a forged communicator was used");
    assert!(last_error().contains("`comm` is not a live amoe_comm handle"), "{}", last_error());
    // SAFETY: as above; a release of what is not a live handle does nothing.
    unsafe { amoe_comm_free(stray) };
    assert_eq!(forged[0], u64::from_le_bytes(*b"amoeCOMM"), "the forgery was not written to");

    // SAFETY: the handle made above, released once here ...
    unsafe { amoe_comm_free(comm) };
    // ... and refused after, by every use and by a second release.
    // SAFETY: a released handle, the case under test; `r` is writable.
    let st = unsafe { amoe_comm_rank(comm, &mut r) };
    assert_eq!((st, r), (amoe_status::InvalidArgument, 7), "a released communicator was used");
    assert!(last_error().contains("a released handle"), "{}", last_error());
    // SAFETY: as above.
    unsafe { amoe_comm_free(comm) };
}

/// A released handle stays refused after new handles of its type are made,
/// though the allocator hands their values the memory a released one had:
/// no handle value is given twice.
#[test]
fn a_released_handle_is_not_taken_for_a_later_handle_of_its_type() {
    let mut r = 7usize;
    // Made and released in turn: the allocator reuses the same memory.
    let released: Vec<*mut amoe_comm> = (0..32)
        .map(|i| {
            let name = CString::new(format!("capi-abi-aba-{}-{i}", std::process::id())).expect("no NUL");
            let mut c: *mut amoe_comm = null_mut();
            // SAFETY: valid name and out-pointer.
            let st = unsafe { amoe_comm_cpu_new(name.as_ptr(), 1, 0, 5.0, &mut c) };
            assert_eq!(st, amoe_status::Ok, "{}", last_error());
            // SAFETY: the live handle just made; `r` is writable. Then released once.
            assert_eq!(unsafe { amoe_comm_rank(c, &mut r) }, amoe_status::Ok, "{}", last_error());
            unsafe { amoe_comm_free(c) };
            c
        })
        .collect();
    let distinct: std::collections::HashSet<_> = released.iter().collect();
    assert_eq!(distinct.len(), released.len(), "a handle value was given twice: {released:?}");
    let mut r = 7usize;
    for c in released {
        // SAFETY: a released handle, the case under test; `r` is writable.
        let st = unsafe { amoe_comm_rank(c, &mut r) };
        assert_eq!((st, r), (amoe_status::InvalidArgument, 7), "a released handle was used");
    }
}

#[test]
fn a_null_layout_with_entries_is_refused_not_taken_for_no_layout() {
    let mut v = vec![0f32; 6];
    let xs = [6usize, 1];
    let x = host(&mut v, &xs);
    let (mut shape, mut ndim) = ([0usize; AMOE_MAX_NDIM], 0usize);
    // SAFETY: valid descriptor and out-pointers; `local_sizes` is NULL with
    // 2 entries, the case under test.
    let st = unsafe {
        amoe_maybe_pad_and_reduce_output_shape(&x, null(), 2, 0, 2, shape.as_mut_ptr(), AMOE_MAX_NDIM, &mut ndim)
    };
    assert_eq!(st, amoe_status::NullArgument, "a NULL layout of 2 entries was taken for none");
    assert!(last_error().contains("`local_sizes` is NULL") && last_error().contains("n = 2"), "{}", last_error());
    // SAFETY: as above, with n = 0: no layout.
    let st = unsafe {
        amoe_maybe_all_gather_and_maybe_unpad_output_shape(
            &x,
            null(),
            0,
            0,
            2,
            shape.as_mut_ptr(),
            AMOE_MAX_NDIM,
            &mut ndim,
        )
    };
    assert_eq!((st, &shape[..ndim]), (amoe_status::Ok, &[12usize, 1][..]), "{}", last_error());
    // An empty list whose pointer is not NULL (a C++ `std::vector{}.data()`
    // may be either) is no layout too: `n` alone decides.
    let empty: Vec<usize> = Vec::new();
    for sizes in [null(), empty.as_ptr()] {
        // SAFETY: valid descriptor and out-pointers; nothing is read with n = 0.
        let st = unsafe {
            amoe_maybe_pad_and_reduce_output_shape(&x, sizes, 0, 0, 2, shape.as_mut_ptr(), AMOE_MAX_NDIM, &mut ndim)
        };
        assert_eq!((st, &shape[..ndim]), (amoe_status::Ok, &[3usize, 1][..]), "{sizes:?}: {}", last_error());
        // SAFETY: as above.
        let st = unsafe {
            amoe_maybe_all_gather_and_maybe_unpad_output_shape(
                &x,
                sizes,
                0,
                0,
                2,
                shape.as_mut_ptr(),
                AMOE_MAX_NDIM,
                &mut ndim,
            )
        };
        assert_eq!((st, &shape[..ndim]), (amoe_status::Ok, &[12usize, 1][..]), "{sizes:?}: {}", last_error());
    }
}

/// A layout past `AMOE_MAX_EP_RANKS` entries is refused naming `tp_size`,
/// before the caller is told a size to allocate for it; one within the
/// bound asks for its size first.
#[test]
fn a_layout_past_the_ep_bound_is_refused_before_its_size_is_asked_for() {
    let dp = [3usize, 4];
    let mut len = 7usize;
    for tp in [AMOE_MAX_EP_RANKS / 2 + 1, 1 << 40, usize::MAX] {
        // SAFETY: `dp` readable for 2 entries; no `out` (cap 0); `len` writable.
        let st = unsafe { amoe_sp_layout_from_dp_tokens(dp.as_ptr(), 2, tp, null_mut(), 0, &mut len) };
        assert_eq!((st, len), (amoe_status::InvalidArgument, 7), "tp {tp}: {}", last_error());
        let want =
            format!("invalid argument `tp_size`: dp_size 2 x tp_size {tp} exceeds the maximum of 1048576 EP ranks");
        assert!(last_error().contains(&want), "{}", last_error());
    }
    // SAFETY: as above.
    let st = unsafe { amoe_sp_layout_from_dp_tokens(dp.as_ptr(), 2, AMOE_MAX_EP_RANKS / 2, null_mut(), 0, &mut len) };
    assert_eq!((st, len), (amoe_status::BufferTooSmall, AMOE_MAX_EP_RANKS), "{}", last_error());
}

/// The size a caller asks for (cap 0) is that of the layout the call then
/// makes: a layout the Rust API refuses (rows that overflow when summed) is
/// refused when its size is asked for, not after the caller allocated it.
#[test]
fn a_layout_size_is_asked_of_the_layout_the_call_makes() {
    let dp = [usize::MAX, usize::MAX];
    for cap in [0usize, 2] {
        let (mut out, mut len) = ([0usize; 2], 7usize);
        // SAFETY: `dp` readable for 2 entries, `out` writable for 2, `len` writable.
        let st = unsafe { amoe_sp_layout_from_dp_tokens(dp.as_ptr(), 2, 1, out.as_mut_ptr(), cap, &mut len) };
        assert_eq!((st, len), (amoe_status::InvalidArgument, 7), "cap {cap}: {}", last_error());
        assert!(last_error().contains("total rows overflow"), "{}", last_error());
        // SAFETY: as above.
        let st = unsafe { amoe_sp_layout_from_dp_tokens_pcp(dp.as_ptr(), 2, 1, 1, out.as_mut_ptr(), cap, &mut len) };
        assert_eq!((st, len), (amoe_status::InvalidArgument, 7), "cap {cap}: {}", last_error());
    }
}

/// The PCP layout expands every DP rank's `ceil(T_d / TP)` over its PCP x
/// TP ranks (SPEC section 2's example); PCP 1 is the plain layout, and a
/// zero, a product past the bound and a short buffer are refused by name.
#[test]
fn the_pcp_layout_repeats_each_dp_ranks_rows_over_its_pcp_and_tp_ranks() {
    let (mut out, mut len) = ([0usize; 8], 0usize);
    // SAFETY: `dp` readable for its entries, `out` writable for 8, `len` writable (every call below).
    let st = unsafe { amoe_sp_layout_from_dp_tokens_pcp([1usize, 9].as_ptr(), 2, 2, 2, out.as_mut_ptr(), 8, &mut len) };
    assert_eq!((st, len, out), (amoe_status::Ok, 8, [1, 1, 1, 1, 5, 5, 5, 5]), "{}", last_error());
    let mut plain = [0usize; 6];
    let dp = [5usize, 0, 3];
    let st = unsafe { amoe_sp_layout_from_dp_tokens_pcp(dp.as_ptr(), 3, 1, 2, out.as_mut_ptr(), 8, &mut len) };
    assert_eq!((st, len), (amoe_status::Ok, 6), "{}", last_error());
    let st = unsafe { amoe_sp_layout_from_dp_tokens(dp.as_ptr(), 3, 2, plain.as_mut_ptr(), 6, &mut len) };
    assert_eq!((st, &out[..6]), (amoe_status::Ok, &plain[..]), "{}", last_error());
    assert_eq!(plain, [3, 3, 0, 0, 2, 2]);
    for (pcp, tp, arg) in [(0, 2, "pcp_size"), (2, 0, "tp_size")] {
        let st = unsafe { amoe_sp_layout_from_dp_tokens_pcp(dp.as_ptr(), 3, pcp, tp, out.as_mut_ptr(), 8, &mut len) };
        assert_eq!(st, amoe_status::InvalidArgument, "{}", last_error());
        assert!(last_error().contains(&format!("`{arg}`: expected >= 1, got 0")), "{}", last_error());
    }
    len = 7;
    let st = unsafe { amoe_sp_layout_from_dp_tokens_pcp(dp.as_ptr(), 3, 1 << 19, 2, null_mut(), 0, &mut len) };
    assert_eq!((st, len), (amoe_status::InvalidArgument, 7), "{}", last_error());
    let want = "`pcp_size`: dp_size 3 x pcp_size 524288 x tp_size 2 exceeds the maximum of 1048576 EP ranks";
    assert!(last_error().contains(want), "{}", last_error());
    let st = unsafe { amoe_sp_layout_from_dp_tokens_pcp(dp.as_ptr(), 3, 2, 2, out.as_mut_ptr(), 8, &mut len) };
    assert_eq!((st, len), (amoe_status::BufferTooSmall, 12), "{}", last_error());
    assert!(last_error().contains("amoe_sp_layout_from_dp_tokens_pcp: `out` holds 8 entries, the layout has 12"));
}

#[test]
fn a_moe_context_is_initialised_with_its_size_and_defaults_and_a_foreign_size_is_refused() {
    // SAFETY: every pointer is NULL (the case under test) or writable / valid.
    unsafe {
        assert_eq!(amoe_moe_context_init(null_mut()), amoe_status::NullArgument);
        let mut c = std::mem::MaybeUninit::<amoe_moe_context>::uninit();
        assert_eq!(amoe_moe_context_init(c.as_mut_ptr()), amoe_status::Ok);
        let mut c = c.assume_init();
        assert_eq!(c.struct_size, std::mem::size_of::<amoe_moe_context>());
        assert_eq!((c.dp_size, c.tp_size, c.dp_rank, c.tp_rank, c.sp), (0, 1, 0, 0, 0));
        assert_eq!((c.num_actual_tokens, c.pcp_size, c.pcp_rank), (usize::MAX, 1, 0));
        let tokens = [3usize];
        c.dp_tokens = tokens.as_ptr();
        c.dp_size = 1;
        let (mut x, xs) = (vec![0f32; 6], [3usize, 2]);
        let xt = host(&mut x, &xs);
        let (mut shape, mut nd) = ([0usize; AMOE_MAX_NDIM], 0usize);
        let st = amoe_token_prepare_output_shape(&xt, 0, &c, shape.as_mut_ptr(), AMOE_MAX_NDIM, &mut nd);
        assert_eq!(st, amoe_status::Ok, "{}", last_error());
        assert_eq!(&shape[..nd], &[3, 2]);
        // A context of another layout (an older or newer header) is refused by name.
        c.struct_size -= 8;
        let st = amoe_token_prepare_output_shape(&xt, 0, &c, shape.as_mut_ptr(), AMOE_MAX_NDIM, &mut nd);
        assert_eq!(st, amoe_status::InvalidArgument);
        let e = last_error();
        assert!(e.contains("ctx.struct_size") && e.contains("amoe_moe_context_init"), "{e}");
        c.struct_size += 8;
        // `pcp_size` 0 is no PCP, as 1 is: rank 0 only, and an error names
        // the size passed, not one the caller never gave.
        c.pcp_size = 0;
        let st = amoe_token_prepare_output_shape(&xt, 0, &c, shape.as_mut_ptr(), AMOE_MAX_NDIM, &mut nd);
        assert_eq!((st, &shape[..nd]), (amoe_status::Ok, &[3usize, 2][..]), "{}", last_error());
        c.pcp_rank = 1;
        let st = amoe_token_prepare_output_shape(&xt, 0, &c, shape.as_mut_ptr(), AMOE_MAX_NDIM, &mut nd);
        assert_eq!(st, amoe_status::InvalidArgument);
        let e = last_error();
        assert!(e.contains("`pcp_rank`: 1 with pcp_size 0") && !e.contains("PCP size 1"), "{e}");
    }
}

#[test]
fn a_shape_function_refuses_an_output_whose_bytes_no_descriptor_can_carry() {
    // SAFETY: every pointer is valid / writable.
    unsafe {
        let mut c = std::mem::MaybeUninit::<amoe_moe_context>::uninit();
        assert_eq!(amoe_moe_context_init(c.as_mut_ptr()), amoe_status::Ok);
        let mut c = c.assume_init();
        let tokens = [2usize, 3];
        c.dp_tokens = tokens.as_ptr();
        c.dp_size = 2;
        // 2^61 padded rows of one f32: 2^63 bytes, one past isize::MAX.
        c.padded_num_tokens = 1 << 61;
        let (mut x, xs) = (vec![0f32; 2], [2usize, 1]);
        let xt = host(&mut x, &xs);
        let (mut shape, mut nd) = ([0usize; AMOE_MAX_NDIM], 0usize);
        let st = amoe_token_prepare_output_shape(&xt, 1, &c, shape.as_mut_ptr(), AMOE_MAX_NDIM, &mut nd);
        assert_eq!(st, amoe_status::Shape, "{}", last_error());
        let e = last_error();
        assert!(
            e.starts_with("amoe_token_prepare_output_shape: `out`") && e.contains("[2305843009213693952, 1]"),
            "{e}"
        );
        // Half of it fits: 2^62 bytes.
        c.padded_num_tokens = 1 << 60;
        let st = amoe_token_prepare_output_shape(&xt, 1, &c, shape.as_mut_ptr(), AMOE_MAX_NDIM, &mut nd);
        assert_eq!(st, amoe_status::Ok, "{}", last_error());
        assert_eq!(&shape[..nd], &[1 << 60, 1]);
        // An EP gather of 2^60 rows of one f32 (shape functions never read
        // data) from 4 ranks: 2^64 bytes.
        let (mut y, ys) = (vec![0f32; 0], [1usize << 60, 1]);
        let yt = host(&mut y, &ys);
        let st = amoe_maybe_all_gather_and_maybe_unpad_output_shape(
            &yt,
            null(),
            0,
            0,
            4,
            shape.as_mut_ptr(),
            AMOE_MAX_NDIM,
            &mut nd,
        );
        assert_eq!(st, amoe_status::Shape, "{}", last_error());
        assert!(last_error().contains("fits in isize"), "{}", last_error());
    }
}

#[test]
fn host_blocks_check_their_arguments_and_are_reused_once_freed() {
    let (mut data, mut block) = (null_mut(), null_mut());
    // SAFETY: the out-pointers are writable or NULL (the cases under test).
    unsafe {
        assert_eq!(amoe_host_block_new(0, &mut data, &mut block), amoe_status::InvalidArgument);
        assert!(last_error().contains("`len`"), "{}", last_error());
        assert_eq!(amoe_host_block_new(64, null_mut(), &mut block), amoe_status::NullArgument);
        assert_eq!(amoe_host_block_new(64, &mut data, null_mut()), amoe_status::NullArgument);
        // More than any address space (2^62 bytes), and a size whose rounding
        // up to the mapping's granule overflows.
        for len in [1usize << 62, usize::MAX - 1] {
            assert_eq!(amoe_host_block_new(len, &mut data, &mut block), amoe_status::HostMemory, "{len}");
            let want = format!("amoe_host_block_new: {len} bytes of host memory could not be allocated");
            assert_eq!(last_error(), want);
        }
    }
    let len = amoe_host_block_min_len() * 3 + 5;
    // SAFETY: both out-pointers writable; each block is freed once, after its
    // memory was last used.
    unsafe {
        assert_eq!(amoe_host_block_new(len, &mut data, &mut block), amoe_status::Ok);
        assert_eq!(data as usize % (2 << 20), 0);
        std::ptr::write_bytes(data.cast::<u8>(), 1, len);
        let (mut d2, mut b2) = (null_mut(), null_mut());
        assert_eq!(amoe_host_block_new(len, &mut d2, &mut b2), amoe_status::Ok);
        assert_ne!(d2, data, "two live blocks share memory");
        let first = data;
        amoe_host_block_free(block);
        assert_eq!(amoe_host_block_new(len, &mut data, &mut block), amoe_status::Ok);
        assert_eq!(data, first, "a freed block was not reused");
        amoe_host_block_free(block);
        amoe_host_block_free(b2);
    }
}

#[test]
fn null_arguments_and_small_shape_buffers_are_reported() {
    let mut r = 0usize;
    // SAFETY: NULL comm is the case under test; `r` is writable.
    assert_eq!(unsafe { amoe_comm_rank(null(), &mut r) }, amoe_status::NullArgument);
    assert_eq!(last_error(), "amoe_comm_rank: `comm` is NULL");
    // A NULL communicator is named as the caller's parameter.
    let mut v = vec![1f32; 4];
    let shape = [4usize];
    let x = host(&mut v, &shape);
    let policy = amoe_reduce_policy { shared_mode: 1, has_routed_transform: 0, sp: 0, tp_size: 2, ep_size: 2 };
    // SAFETY: valid policy and descriptors; the NULL communicator is the case under test.
    let st = unsafe { amoe_reduce_final(&policy, &x, 0, null(), &x, null()) };
    assert_eq!(st, amoe_status::NullArgument);
    assert_eq!(last_error(), "amoe_reduce_final: `tp_comm` is NULL");
    // SAFETY: NULL handles are accepted by the free functions.
    unsafe {
        amoe_comm_free(null_mut());
        amoe_stream_free(null_mut());
        amoe_moe_groups_free(null_mut());
        amoe_host_block_free(null_mut());
    }

    let (mut p, mut i) = (vec![0f32; 12], [0i32, 1, 2]);
    let (ps, is) = ([3usize, 4], [3usize]);
    let pt = host(&mut p, &ps);
    let mut it = host(&mut [], &is);
    it.data = i.as_mut_ptr().cast();
    it.dtype = amoe_dtype::I32 as u32;
    let mut shape = [0usize; 1];
    let mut ndim = 0usize;
    // SAFETY: valid descriptors; `shape` holds 1 entry, as `cap` says.
    let st = unsafe { amoe_moe_token_unpermute_output_shape(&pt, &it, null(), shape.as_mut_ptr(), 1, &mut ndim) };
    assert_eq!((st, ndim), (amoe_status::BufferTooSmall, 2), "{}", last_error());
    let mut shape = [0usize; AMOE_MAX_NDIM];
    // SAFETY: as above with a large enough buffer.
    let st = unsafe {
        amoe_moe_token_unpermute_output_shape(&pt, &it, null(), shape.as_mut_ptr(), AMOE_MAX_NDIM, &mut ndim)
    };
    assert_eq!((st, ndim, &shape[..2]), (amoe_status::Ok, 2, &[3usize, 4][..]));

    // A wrong output shape is rejected before the op runs, naming both shapes.
    let mut o = vec![0f32; 8];
    let os = [2usize, 4];
    let ot = host(&mut o, &os);
    // SAFETY: valid descriptors.
    let st = unsafe { amoe_moe_token_unpermute(&pt, &it, null(), &ot, null()) };
    assert_eq!(st, amoe_status::Shape);
    assert!(last_error().contains("[2, 4], expected [3, 4]"), "{}", last_error());
}

/// Every failure's message starts with the export's name, also where a layer
/// below refused the argument under its own name (these read
/// `SpLayout::from_dp_tokens: ...`, `CommType: ...` and
/// `moe_finalize_routing: ...`, so a C caller could not tell which call
/// failed).
#[test]
fn every_failure_is_named_by_its_export() {
    let named = |f: &str, st: amoe_status| {
        let msg = last_error();
        assert_eq!(st, amoe_status::InvalidArgument, "{f}: {msg}");
        assert!(msg.starts_with(&format!("{f}: ")), "{f}: {msg}");
        msg
    };
    let (dp, mut out, mut len) = ([0usize; 0], [0usize; 4], 0usize);
    // SAFETY: `dp` is readable for its 0 entries, `out` writable for 4, `len` writable.
    let st = unsafe { amoe_sp_layout_from_dp_tokens(dp.as_ptr(), 0, 2, out.as_mut_ptr(), 4, &mut len) };
    let msg = named("amoe_sp_layout_from_dp_tokens", st);
    assert!(msg.contains("SpLayout::from_dp_tokens: invalid argument `dp_tokens`"), "{msg}");
    let mut flag = 0u8;
    // SAFETY: `flag` is writable.
    let st = unsafe { amoe_routed_is_reduced(7, 0, &mut flag) };
    assert!(named("amoe_routed_is_reduced", st).contains("CommType"));
    let mut name: *const c_char = null();
    // SAFETY: `name` is writable.
    let st = unsafe { amoe_comm_type_name(4, &mut name) };
    named("amoe_comm_type_name", st);
    // A name is not doubled where the export already wrote it.
    let (mut x, mut i) = (vec![0f32; 8], [0i32, 1]);
    let (xs, is) = ([2usize, 4], [2usize]);
    let xt = host(&mut x, &xs);
    let mut it = host(&mut [], &is);
    it.data = i.as_mut_ptr().cast();
    it.dtype = amoe_dtype::I32 as u32;
    let (mut shape, mut ndim) = ([0usize; AMOE_MAX_NDIM], 0usize);
    let args = capi_common::finalize_args(&xt, &it, 9);
    // SAFETY: valid descriptors; `shape` holds AMOE_MAX_NDIM entries.
    let st = unsafe { amoe_moe_finalize_routing_output_shape(&args, shape.as_mut_ptr(), AMOE_MAX_NDIM, &mut ndim) };
    let msg = named("amoe_moe_finalize_routing_output_shape", st);
    assert!(!msg["amoe_moe_finalize_routing_output_shape: ".len()..].starts_with("amoe_"), "{msg}");
    assert!(msg.contains("drop_pad_mode"), "{msg}");
}

/// An unknown drop-pad mode is named by the export the caller called, not
/// by another finalize export or the Rust function behind it.
#[test]
fn an_unknown_drop_pad_mode_is_named_by_the_export_called() {
    let name = CString::new(format!("capi-abi-mode-{}", std::process::id())).expect("no NUL");
    let mut comm: *mut amoe_comm = null_mut();
    // SAFETY: valid name and out-pointer.
    assert_eq!(unsafe { amoe_comm_cpu_new(name.as_ptr(), 1, 0, 5.0, &mut comm) }, amoe_status::Ok, "{}", last_error());
    let (mut x, mut i, mut o) = (vec![0f32; 8], [0i32, 1], vec![0f32; 8]);
    let (xs, is) = ([2usize, 4], [2usize]);
    let (xt, ot) = (host(&mut x, &xs), host(&mut o, &xs));
    let mut it = host(&mut [], &is);
    it.data = i.as_mut_ptr().cast();
    it.dtype = amoe_dtype::I32 as u32;
    let args = capi_common::finalize_args(&xt, &it, 9);
    let want = |f: &str| format!("{f}: invalid argument `drop_pad_mode`: unknown drop-pad mode 9");
    // SAFETY: valid descriptors and a live world of one rank; no layout (n 0).
    let st = unsafe { amoe_finalize_and_reduce(&args, null(), 0, comm, &ot, null()) };
    let msg = last_error();
    assert_eq!(st, amoe_status::InvalidArgument, "{msg}");
    assert!(msg.starts_with(&want("amoe_finalize_and_reduce")) && !msg.contains("moe_finalize_routing"), "{msg}");
    // SAFETY: valid descriptors.
    let st = unsafe { amoe_moe_finalize_routing(&args, &ot, null()) };
    let msg = last_error();
    assert_eq!(st, amoe_status::InvalidArgument, "{msg}");
    assert!(msg.starts_with(&want("amoe_moe_finalize_routing")), "{msg}");
    // SAFETY: the handle made above, freed once.
    unsafe { amoe_comm_free(comm) };
}

/// Rank body: prepare then finalize the rank's tokens (identity experts) under
/// every comm type, against the SPEC section 6 round trip: ALLGATHER without
/// SP returns `DP * x` (the DP reduce-scatter sums the DP copies of each
/// gathered token), the TP-split paths return `x`.
fn prepare_finalize_rank(name: &CString, rank: usize) -> Result<usize, String> {
    let (dp_size, tp) = (2usize, 2usize);
    let dp_tokens = [3usize, 1];
    let (d, t) = (rank / tp, rank % tp);
    let h = 4usize;
    let mut world: *mut amoe_comm = null_mut();
    let mut groups: *mut amoe_moe_groups = null_mut();
    let mut checks = 0;
    // SAFETY: valid name, out-pointers and descriptors throughout; handles are
    // freed once at the end.
    unsafe {
        let st = amoe_comm_cpu_new(name.as_ptr(), dp_size * tp, rank, 20.0, &mut world);
        if st != amoe_status::Ok {
            return Err(last_error());
        }
        if amoe_moe_groups_new(world, 1, tp, &mut groups) != amoe_status::Ok {
            return Err(last_error());
        }
        let ctx = amoe_moe_context {
            dp_tokens: dp_tokens.as_ptr(),
            dp_size,
            tp_size: tp,
            dp_rank: d,
            tp_rank: t,
            ..Default::default()
        };
        // Tokens of DP rank d (the same on its TP ranks): row j = d*10 + j.
        let mut x: Vec<f32> = (0..dp_tokens[d] * h).map(|e| (d * 10 + e / h) as f32 + 0.25 * (e % h) as f32).collect();
        let xs = [dp_tokens[d], h];
        let xt = host(&mut x, &xs);
        for ct in 0..4u32 {
            let mut shape = [0usize; AMOE_MAX_NDIM];
            let mut nd = 0;
            let st = amoe_token_prepare_output_shape(&xt, ct, &ctx, shape.as_mut_ptr(), AMOE_MAX_NDIM, &mut nd);
            if st != amoe_status::Ok {
                return Err(format!("prepare shape {ct}: {}", last_error()));
            }
            let ps = shape[..nd].to_vec();
            let mut prepared = vec![f32::NAN; ps.iter().product()];
            let pt = host(&mut prepared, &ps);
            // The mask descriptor: one byte per prepared row (the MC2 length).
            let mask_rows = [ps[0]];
            let mut mask = vec![7u8; ps[0]];
            let mt = amoe_tensor {
                data: mask.as_mut_ptr().cast(),
                dtype: amoe_dtype::U8 as u32,
                ndim: 1,
                shape: mask_rows.as_ptr(),
                ..xt
            };
            let st = amoe_token_prepare(&xt, ct, &ctx, groups, &pt, &mt, null());
            if st != amoe_status::Ok {
                return Err(format!("prepare {ct}: {}", last_error()));
            }
            if ct == 1 || ct == 3 {
                // MC2: rows [t*chunk, (t+1)*chunk) of the batch padded to ceil_to(max T, TP).
                let chunk = 3usize.div_ceil(tp);
                let want: Vec<u8> = (0..chunk).map(|i| (t * chunk + i < dp_tokens[d]) as u8).collect();
                if mask != want {
                    return Err(format!("mc2 mask {mask:?}, want {want:?}"));
                }
                checks += 1;
            } else if mask.iter().any(|&b| b != 7) {
                return Err(format!("comm type {ct} wrote the mask {mask:?}"));
            }
            let st = amoe_token_finalize_output_shape(&pt, ct, &ctx, shape.as_mut_ptr(), AMOE_MAX_NDIM, &mut nd);
            if st != amoe_status::Ok || shape[..nd] != xs {
                return Err(format!("finalize shape {ct}: {:?} {}", &shape[..nd], last_error()));
            }
            // ALLGATHER sums the rows over DP: a one-byte `y` is refused by
            // the shape function as by the op; the TP-split paths move it.
            let y8 = amoe_tensor { dtype: amoe_dtype::I8 as u32, ..pt };
            let st = amoe_token_finalize_output_shape(&y8, ct, &ctx, shape.as_mut_ptr(), AMOE_MAX_NDIM, &mut nd);
            let want = if ct == 0 { amoe_status::Dtype } else { amoe_status::Ok };
            if st != want || (ct == 0 && !last_error().contains("`y`")) {
                return Err(format!("finalize shape of an i8 `y` under {ct}: {st:?} {}", last_error()));
            }
            let mut back = vec![f32::NAN; x.len()];
            let bt = host(&mut back, &xs);
            // The op names the i8 `y` too, before it looks at the f32 `out`
            // (every rank refuses; the round trip below still runs).
            if ct == 0 {
                let st = amoe_token_finalize(&y8, ct, &ctx, groups, &bt, null());
                if st != amoe_status::Dtype
                    || !last_error().starts_with("amoe_token_finalize: moe_finalize: `y` has dtype i8")
                {
                    return Err(format!("finalize of an i8 `y` into an f32 `out`: {st:?} {}", last_error()));
                }
            }
            if amoe_token_finalize(&pt, ct, &ctx, groups, &bt, null()) != amoe_status::Ok {
                return Err(format!("finalize {ct}: {}", last_error()));
            }
            let factor = if ct == 0 { dp_size as f32 } else { 1.0 };
            let want: Vec<f32> = x.iter().map(|v| v * factor).collect();
            if back != want {
                return Err(format!("comm type {ct}: round trip {back:?}, want {want:?}"));
            }
            checks += 1;
        }
        amoe_moe_groups_free(groups);
        amoe_comm_free(world);
    }
    Ok(checks)
}

#[test]
fn token_prepare_and_finalize_round_trip_on_4_threads() {
    let name = CString::new(format!("capi-prepare-{}", std::process::id())).expect("no NUL");
    let results: Vec<Result<usize, String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|r| {
                s.spawn({
                    let name = &name;
                    move || prepare_finalize_rank(name, r)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("rank panicked".into()))).collect()
    });
    for (r, res) in results.iter().enumerate() {
        assert!(matches!(res, Ok(n) if *n == 6), "rank {r}: {res:?}");
    }
}

/// An MC2 prepare of 2^44 zero-width rows (no bytes: `data` may be NULL) and
/// no mask: nothing is held per row, so the call returns instead of
/// allocating one mask entry per row (which aborts the process).
#[test]
fn an_mc2_prepare_holds_nothing_per_row() {
    let name = CString::new(format!("capi-mc2-rows-{}", std::process::id())).expect("no NUL");
    let rows = 1usize << 44;
    let (dp, xs) = ([rows], [rows, 0usize]);
    let x = amoe_tensor { data: null_mut(), ..host(&mut [], &xs) };
    let ctx = amoe_moe_context { dp_tokens: dp.as_ptr(), dp_size: 1, tp_size: 1, ..Default::default() };
    let (mut world, mut groups): (*mut amoe_comm, *mut amoe_moe_groups) = (null_mut(), null_mut());
    // SAFETY: valid name, out-pointers and descriptors; handles freed at the end.
    unsafe {
        assert_eq!(amoe_comm_cpu_new(name.as_ptr(), 1, 0, 20.0, &mut world), amoe_status::Ok, "{}", last_error());
        assert_eq!(amoe_moe_groups_new(world, 1, 1, &mut groups), amoe_status::Ok, "{}", last_error());
        for ct in [1u32, 3] {
            let st = amoe_token_prepare(&x, ct, &ctx, groups, &x, null(), null());
            assert_eq!(st, amoe_status::Ok, "comm type {ct}: {}", last_error());
        }
        amoe_moe_groups_free(groups);
        amoe_comm_free(world);
    }
}

/// An MC2 mask written into bytes of `out` would overwrite prepared rows (or
/// be overwritten by them): refused before any work, naming both; a mask
/// right after `out` in the same allocation is apart from it and written.
#[test]
fn an_mc2_mask_overlapping_out_is_refused() {
    let name = CString::new(format!("capi-mask-overlap-{}", std::process::id())).expect("no NUL");
    let (rows, h) = (4usize, 2usize);
    let (dp, xs, mask_rows) = ([rows], [rows, h], [rows]);
    let mut x: Vec<f32> = (0..rows * h).map(|e| e as f32).collect();
    let xt = host(&mut x, &xs);
    let ctx =
        amoe_moe_context { dp_tokens: dp.as_ptr(), dp_size: 1, tp_size: 1, num_actual_tokens: 3, ..Default::default() };
    // `out`'s rows, then one more f32 per row of room for the mask bytes.
    let mut buf = vec![-1f32; rows * h + rows];
    let (mut world, mut groups): (*mut amoe_comm, *mut amoe_moe_groups) = (null_mut(), null_mut());
    // SAFETY: valid name, out-pointers and descriptors (every mask offset
    // stays inside `buf`); handles freed at the end.
    unsafe {
        assert_eq!(amoe_comm_cpu_new(name.as_ptr(), 1, 0, 20.0, &mut world), amoe_status::Ok, "{}", last_error());
        assert_eq!(amoe_moe_groups_new(world, 1, 1, &mut groups), amoe_status::Ok, "{}", last_error());
        let base: *mut u8 = buf.as_mut_ptr().cast();
        let out = host(&mut buf, &xs);
        let out_bytes = rows * h * 4;
        let mask_at = |offset: usize| amoe_tensor {
            data: base.add(offset).cast(),
            dtype: amoe_dtype::U8 as u32,
            ndim: 1,
            shape: mask_rows.as_ptr(),
            ..xt
        };
        for (offset, what) in [(0, "its start"), (8, "its middle"), (out_bytes - 1, "its last byte")] {
            for ct in [1u32, 3] {
                let m = mask_at(offset);
                let st = amoe_token_prepare(&xt, ct, &ctx, groups, &out, &m, null());
                let e = last_error();
                assert_eq!(st, amoe_status::InvalidArgument, "mask at {what} of `out`, comm type {ct}: {e}");
                assert!(e.contains("`mc2_mask`") && e.contains("`out`") && e.contains("overlap"), "{e}");
            }
        }
        assert!(buf.iter().all(|&v| v == -1.0), "nothing was written: {buf:?}");
        let m = mask_at(out_bytes);
        assert_eq!(amoe_token_prepare(&xt, 1, &ctx, groups, &out, &m, null()), amoe_status::Ok, "{}", last_error());
        assert_eq!(&buf[..rows * h], &x[..], "the prepared rows");
        let mask: Vec<u8> = std::slice::from_raw_parts(base.add(out_bytes), rows).to_vec();
        assert_eq!(mask, [1, 1, 1, 0], "the mask after `out`");
        amoe_moe_groups_free(groups);
        amoe_comm_free(world);
    }
}

/// A mask of another dtype or length is refused by the Rust API's own check,
/// so the C caller reads the words a Rust caller does (after the export's
/// name), and nothing is written.
#[test]
fn an_mc2_mask_of_another_dtype_or_length_is_refused_in_the_rust_apis_words() {
    use ascend_moe::moe::prepare_finalize::{mc2_mask_into, MoeContext};
    use ascend_moe::{CommType, Tensor};
    let name = CString::new(format!("capi-mask-words-{}", std::process::id())).expect("no NUL");
    let (rows, h) = (4usize, 2usize);
    let (dp, xs) = ([rows], [rows, h]);
    let mut x: Vec<f32> = (0..rows * h).map(|e| e as f32).collect();
    let xt = host(&mut x, &xs);
    let ctx =
        amoe_moe_context { dp_tokens: dp.as_ptr(), dp_size: 1, tp_size: 1, num_actual_tokens: 3, ..Default::default() };
    let rust_ctx = MoeContext::new(&dp, 1, 0, 0, false).and_then(|c| c.with_num_actual_tokens(3)).expect("context");
    let mut buf = vec![-1f32; rows * h];
    let mut mask_buf = vec![7u8; 4 * (rows + 1)];
    let (mut world, mut groups): (*mut amoe_comm, *mut amoe_moe_groups) = (null_mut(), null_mut());
    // SAFETY: valid name, out-pointers and descriptors (each mask fits
    // `mask_buf`); handles freed at the end.
    unsafe {
        assert_eq!(amoe_comm_cpu_new(name.as_ptr(), 1, 0, 20.0, &mut world), amoe_status::Ok, "{}", last_error());
        assert_eq!(amoe_moe_groups_new(world, 1, 1, &mut groups), amoe_status::Ok, "{}", last_error());
        let out = host(&mut buf, &xs);
        for (dtype, len, status) in [
            (amoe_dtype::F32, rows, amoe_status::Dtype),
            (amoe_dtype::U8, rows + 1, amoe_status::Shape),
            (amoe_dtype::Bool, rows - 1, amoe_status::Shape),
        ] {
            let shape = [len];
            let m = amoe_tensor {
                data: mask_buf.as_mut_ptr().cast(),
                dtype: dtype as u32,
                ndim: 1,
                shape: shape.as_ptr(),
                ..xt
            };
            for ct in [CommType::Mc2, CommType::FusedMc2] {
                let st = amoe_token_prepare(&xt, ct as u32, &ctx, groups, &out, &m, null());
                let e = last_error();
                let mut t = Tensor::try_zeros_cpu(&[len], dtype).expect("a mask");
                let want = mc2_mask_into(ct, &rust_ctx, &mut t).expect_err("a bad mask").to_string();
                assert_eq!((st, e), (status, format!("amoe_token_prepare: {want}")), "{dtype:?} [{len}], {ct:?}");
            }
        }
        assert!(buf.iter().all(|&v| v == -1.0) && mask_buf.iter().all(|&b| b == 7), "nothing was written");
        amoe_moe_groups_free(groups);
        amoe_comm_free(world);
    }
}

/// A tensor without elements is contiguous whatever strides it carries:
/// torch gives shape [2, 0, 3] the strides (3, 3, 1), numpy (0, 0, 0). A
/// tensor with elements still needs contiguous strides.
#[test]
fn empty_tensors_take_any_strides() {
    let name = CString::new(format!("capi-empty-strides-{}", std::process::id())).expect("no NUL");
    let mut world: *mut amoe_comm = null_mut();
    let shape = [2usize, 0, 3];
    // SAFETY: valid name, out-pointers and descriptors; the handle is freed at the end.
    unsafe {
        assert_eq!(amoe_comm_cpu_new(name.as_ptr(), 1, 0, 20.0, &mut world), amoe_status::Ok, "{}", last_error());
        for strides in [[3isize, 3, 1], [0, 0, 0]] {
            let t = amoe_tensor { strides: strides.as_ptr(), ..host(&mut [], &shape) };
            assert_eq!(amoe_all_reduce(world, &t, &t, 0, null()), amoe_status::Ok, "{strides:?}: {}", last_error());
        }
        let mut v = vec![0f32; 6];
        let (full, transposed) = ([2usize, 3], [1isize, 2]);
        let t = amoe_tensor { strides: transposed.as_ptr(), ..host(&mut v, &full) };
        assert_eq!(amoe_all_reduce(world, &t, &t, 0, null()), amoe_status::InvalidArgument);
        assert!(last_error().contains("not contiguous"), "{}", last_error());
        amoe_comm_free(world);
    }
}

/// An output in other memory than the op's inputs is refused as the Rust
/// ops refuse it, before any work and whether or not an NPU runtime is
/// there: DEVICE naming the output and both memories, also when its dtype
/// is wrong too (the memory is checked first, then the dtype, then the
/// shape). The NPU output's memory is never touched.
#[test]
fn an_npu_output_of_host_inputs_is_refused_first_as_device() {
    let (xs, is) = ([4usize, 2], [4usize]);
    let mut x = [1.0f32; 8];
    let mut idx = [0i32, 1, 2, 3];
    let xd = host(&mut x, &xs);
    let id = capi_common::desc(idx.as_mut_ptr().cast(), amoe_dtype::I32, &is, amoe_device_kind::Cpu, 0);
    let args = capi_common::finalize_args(&xd, &id, amoe_drop_pad_mode::DropLessColumn as u32);
    for dtype in [amoe_dtype::F32, amoe_dtype::F16] {
        let npu = capi_common::desc(0x1000 as *mut _, dtype, &xs, amoe_device_kind::Npu, 0);
        // SAFETY: host descriptors over live memory; the NPU one is refused
        // before its (fake) pointer is used.
        let st = unsafe { amoe_moe_finalize_routing(&args, &npu, null()) };
        let msg = last_error();
        assert_eq!(st, amoe_status::Device, "{dtype:?}: {msg}");
        let want = "amoe_moe_finalize_routing: `out` is on npu:0, expected cpu like the op's input";
        assert!(msg.contains(want), "{dtype:?}: {msg}");
    }
    assert_eq!(x, [1.0f32; 8], "the input is left alone");
}
