//! One rank's bad argument to a C ABI export that communicates (a NULL
//! descriptor or list, an unknown reduce op, an output of the wrong shape)
//! is found by the export before any collective, on that rank alone, while
//! its peers already wait in theirs. Each case runs two CPU ranks that keep
//! their communicators, as an engine does, with rank 1 passing the bad
//! argument: rank 1 fails naming it, and rank 0 fails at once with a
//! mismatch naming rank 1 and the argument (a rank 0 that waited out the
//! timeout would report a timeout naming neither).

mod capi_common;

use std::ffi::CString;
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Barrier;

use ascend_moe::capi::*;
use capi_common::{finalize_args, host, last_error};

/// The rank whose argument is bad.
const BAD: usize = 1;

/// Runs `op(rank, world)` on two ranks of a fresh CPU world and checks: rank
/// [`BAD`] fails with `bad_status`, naming `arg` (or returns OK, when it
/// reports its refusal with `amoe_*_refuse`); rank 0 fails with
/// COMM_MISMATCH naming rank [`BAD`] and `arg`.
fn one_bad_rank(
    case: &str,
    arg: &str,
    bad_status: amoe_status,
    op: impl Fn(usize, *mut amoe_comm) -> amoe_status + Sync,
) {
    one_bad_rank_seen_as(case, arg, bad_status, arg, op)
}

/// [`one_bad_rank`], rank 0's error naming `seen` for the bad argument.
fn one_bad_rank_seen_as(
    case: &str,
    arg: &str,
    bad_status: amoe_status,
    seen: &str,
    op: impl Fn(usize, *mut amoe_comm) -> amoe_status + Sync,
) {
    static WORLDS: AtomicUsize = AtomicUsize::new(0);
    let name = format!("capi-refusal-{}-{}", std::process::id(), WORLDS.fetch_add(1, Ordering::Relaxed));
    let name = CString::new(name).expect("no NUL");
    let held = Barrier::new(2);
    let res: Vec<(amoe_status, String)> = std::thread::scope(|s| {
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let (name, held, op) = (&name, &held, &op);
                s.spawn(move || {
                    let mut world: *mut amoe_comm = null_mut();
                    // SAFETY: a valid name and out-pointer.
                    let st = unsafe { amoe_comm_cpu_new(name.as_ptr(), 2, rank, 30.0, &mut world) };
                    assert_eq!(st, amoe_status::Ok, "{case}: rank {rank}: {}", last_error());
                    let st = op(rank, world);
                    let msg = if st == amoe_status::Ok { String::new() } else { last_error() };
                    // The communicator outlives the failed call on every rank.
                    held.wait();
                    // SAFETY: the handle from amoe_comm_cpu_new, freed once.
                    unsafe { amoe_comm_free(world) };
                    (st, msg)
                })
            })
            .collect();
        ranks.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    let (st, msg) = &res[BAD];
    assert_eq!(*st, bad_status, "{case}: rank {BAD}: {msg}");
    // A rank that reports its refusal itself (amoe_*_refuse) succeeds in that.
    assert!(*st == amoe_status::Ok || msg.contains(arg), "{case}: rank {BAD}'s error does not name `{arg}`: {msg}");
    let (st, msg) = &res[0];
    assert_eq!(*st, amoe_status::CommMismatch, "{case}: rank 0 did not learn rank {BAD}'s refusal: {msg}");
    assert!(msg.contains(&format!("rank {BAD}")) && msg.contains(seen), "{case}: rank 0: {msg}");
}

#[test]
fn a_collective_with_a_bad_argument_on_one_rank_fails_every_rank_at_once() {
    let bad = |rank: usize| rank == BAD;
    one_bad_rank("all_reduce src", "src", amoe_status::NullArgument, |rank, c| {
        let (mut a, mut b) = (vec![1f32; 8], vec![0f32; 8]);
        let (s, d) = (host(&mut a, &[8]), host(&mut b, &[8]));
        // SAFETY: live handle; descriptors over live buffers (or NULL).
        unsafe { amoe_all_reduce(c, if bad(rank) { null() } else { &s }, &d, 0, null()) }
    });
    one_bad_rank("all_reduce op", "op", amoe_status::InvalidArgument, |rank, c| {
        let (mut a, mut b) = (vec![1f32; 8], vec![0f32; 8]);
        let (s, d) = (host(&mut a, &[8]), host(&mut b, &[8]));
        // SAFETY: as above.
        unsafe { amoe_all_reduce(c, &s, &d, if bad(rank) { 7 } else { 0 }, null()) }
    });
    one_bad_rank("all_to_all_v", "recv_counts", amoe_status::NullArgument, |rank, c| {
        let (mut a, mut b) = (vec![1f32; 4], vec![0f32; 4]);
        let (s, d) = (host(&mut a, &[4]), host(&mut b, &[4]));
        let counts = [2usize, 2];
        let recv = if bad(rank) { null() } else { counts.as_ptr() };
        // SAFETY: as above; the count lists hold 2 entries (or NULL).
        unsafe { amoe_all_to_all_v(c, &s, counts.as_ptr(), 2, &d, recv, 2, null()) }
    });
    one_bad_rank("broadcast", "buf", amoe_status::NullArgument, |rank, c| {
        let mut a = vec![1f32; 4];
        let b = host(&mut a, &[4]);
        // SAFETY: as above.
        unsafe { amoe_broadcast(c, if bad(rank) { null() } else { &b }, 0, null()) }
    });
}

#[test]
fn an_sp_op_with_a_bad_argument_on_one_rank_fails_every_rank_at_once() {
    // Layout [2, 1]: 3 rows in all; rank r keeps local_sizes[r].
    let sizes = [2usize, 1];
    one_bad_rank("pad_and_reduce out", "out", amoe_status::Shape, |rank, c| {
        let mut x = vec![1f32; 3 * 4];
        let mut o = vec![0f32; 3 * 4];
        let rows = sizes[rank] + usize::from(rank == BAD);
        let (xs, os) = ([3usize, 4], [rows, 4]);
        let (xd, od) = (host(&mut x, &xs), host(&mut o, &os));
        // SAFETY: live handle; descriptors over live buffers of their shapes.
        unsafe { amoe_maybe_pad_and_reduce(&xd, sizes.as_ptr(), 2, c, &od, null()) }
    });
    one_bad_rank("gather_and_unpad local_sizes", "local_sizes", amoe_status::InvalidArgument, |rank, c| {
        let mut x = vec![1f32; 2 * 4];
        let mut o = vec![0f32; 3 * 4];
        let (xs, os) = ([sizes[rank], 4], [3usize, 4]);
        let (xd, od) = (host(&mut x, &xs), host(&mut o, &os));
        // The bad rank's layout has rows that overflow when summed (an empty
        // list is no layout, not a bad one).
        let overflowing = [usize::MAX; 2];
        let l = if rank == BAD { overflowing.as_ptr() } else { sizes.as_ptr() };
        // SAFETY: as above.
        unsafe { amoe_maybe_all_gather_and_maybe_unpad(&xd, l, 2, c, &od, null()) }
    });
    one_bad_rank("finalize_and_reduce args", "args", amoe_status::NullArgument, |rank, c| {
        let (mut x, mut idx, mut o) = (vec![1f32; 3 * 4], vec![0i32, 1, 2], vec![0f32; sizes[rank] * 4]);
        let (xs, is, os) = ([3usize, 4], [3usize], [sizes[rank], 4]);
        let xd = host(&mut x, &xs);
        let id = amoe_tensor { data: idx.as_mut_ptr().cast(), dtype: amoe_dtype::I32 as u32, ..host(&mut [], &is) };
        let od = host(&mut o, &os);
        let args = finalize_args(&xd, &id, amoe_drop_pad_mode::DropLessRow as u32);
        let a = if rank == BAD { null() } else { &args as *const _ };
        // SAFETY: as above.
        unsafe { amoe_finalize_and_reduce(a, sizes.as_ptr(), 2, c, &od, null()) }
    });
}

#[test]
fn a_shared_expert_op_or_reduction_point_with_a_bad_argument_on_one_rank_fails_every_rank_at_once() {
    one_bad_rank("shared_gather_unpad x", "x", amoe_status::NullArgument, |rank, c| {
        // 4 tokens over TP 2: shards of 2 rows.
        let (mut x, mut o) = (vec![1f32; 2 * 4], vec![0f32; 4 * 4]);
        let (xs, os) = ([2usize, 4], [4usize, 4]);
        let (xd, od) = (host(&mut x, &xs), host(&mut o, &os));
        // SAFETY: as above.
        unsafe { amoe_shared_gather_unpad(if rank == BAD { null() } else { &xd }, 4, c, &od, null()) }
    });
    // TP 2, no shared expert, no SP: the final point reduces.
    let policy = amoe_reduce_policy { shared_mode: 0, has_routed_transform: 0, sp: 0, tp_size: 2, ep_size: 2 };
    one_bad_rank("reduce_final out", "out", amoe_status::Shape, |rank, c| {
        let (mut x, mut o) = (vec![1f32; 3 * 4], vec![0f32; 4 * 4]);
        let (xs, os) = ([3usize, 4], [3 + usize::from(rank == BAD), 4]);
        let (xd, od) = (host(&mut x, &xs), host(&mut o, &os));
        // SAFETY: as above; a valid policy.
        unsafe { amoe_reduce_final(&policy, &xd, amoe_comm_type::AllGather as u32, c, &od, null()) }
    });
}

/// Runs `op(ctx, groups)` on rank `rank` of DP 2 x TP 1 under ALLGATHER (2
/// tokens per DP rank, 4 gathered rows), with the groups of world `c`.
fn with_groups(
    rank: usize,
    c: *mut amoe_comm,
    op: &dyn Fn(&amoe_moe_context, *mut amoe_moe_groups) -> amoe_status,
) -> amoe_status {
    let dp_tokens = [2usize, 2];
    let mut groups: *mut amoe_moe_groups = null_mut();
    // SAFETY: live world handle and out-pointer.
    assert_eq!(unsafe { amoe_moe_groups_new(c, 1, 1, &mut groups) }, amoe_status::Ok, "{}", last_error());
    let ctx =
        amoe_moe_context { dp_tokens: dp_tokens.as_ptr(), dp_size: 2, tp_size: 1, dp_rank: rank, ..Default::default() };
    let st = op(&ctx, groups);
    // SAFETY: the handle from amoe_moe_groups_new, freed once.
    unsafe { amoe_moe_groups_free(groups) };
    st
}

#[test]
fn token_prepare_or_finalize_with_a_bad_argument_on_one_rank_fails_every_rank_at_once() {
    let ag = amoe_comm_type::AllGather as u32;
    one_bad_rank("prepare out", "out", amoe_status::Shape, |rank, c| {
        with_groups(rank, c, &|ctx, g| {
            let (mut x, mut o) = (vec![1f32; 2 * 4], vec![0f32; 5 * 4]);
            let (xs, os) = ([2usize, 4], [4 + usize::from(rank == BAD), 4]);
            let (xd, od) = (host(&mut x, &xs), host(&mut o, &os));
            // SAFETY: live handles; descriptors over live buffers.
            unsafe { amoe_token_prepare(&xd, ag, ctx, g, &od, null(), null()) }
        })
    });
    // Without a comm type or a context the bad rank has no plan; its peers
    // wait in the comm-type agreement, on by default on a CPU group.
    one_bad_rank("prepare comm_type", "comm_type", amoe_status::InvalidArgument, |rank, c| {
        with_groups(rank, c, &|ctx, g| {
            let (mut x, mut o) = (vec![1f32; 2 * 4], vec![0f32; 4 * 4]);
            let (xd, od) = (host(&mut x, &[2, 4]), host(&mut o, &[4, 4]));
            let ct = if rank == BAD { 99 } else { ag };
            // SAFETY: live handles; descriptors over live buffers.
            unsafe { amoe_token_prepare(&xd, ct, ctx, g, &od, null(), null()) }
        })
    });
    one_bad_rank("prepare ctx", "ctx", amoe_status::NullArgument, |rank, c| {
        with_groups(rank, c, &|ctx, g| {
            let (mut x, mut o) = (vec![1f32; 2 * 4], vec![0f32; 4 * 4]);
            let (xd, od) = (host(&mut x, &[2, 4]), host(&mut o, &[4, 4]));
            let ctx: *const amoe_moe_context = if rank == BAD { null() } else { ctx };
            // SAFETY: live handles; descriptors over live buffers; ctx valid or NULL.
            unsafe { amoe_token_prepare(&xd, ag, ctx, g, &od, null(), null()) }
        })
    });
    one_bad_rank("finalize y", "y", amoe_status::NullArgument, |rank, c| {
        with_groups(rank, c, &|ctx, g| {
            let (mut y, mut o) = (vec![1f32; 4 * 4], vec![0f32; 2 * 4]);
            let (ys, os) = ([4usize, 4], [2usize, 4]);
            let (yd, od) = (host(&mut y, &ys), host(&mut o, &os));
            // SAFETY: as above.
            unsafe { amoe_token_finalize(if rank == BAD { null() } else { &yd }, ag, ctx, g, &od, null()) }
        })
    });
}

/// A `stream` that is no live stream handle (here the rank's communicator,
/// a handle of another type) is refused through the communicator the peers
/// wait on, like any other bad argument.
#[test]
fn a_bad_stream_handle_on_one_rank_fails_every_rank_at_once() {
    let stream = |rank: usize, c: *mut amoe_comm| if rank == BAD { c as *const amoe_stream } else { null() };
    let inv = amoe_status::InvalidArgument;
    one_bad_rank("all_reduce stream", "stream", inv, |rank, c| {
        let (mut a, mut b) = (vec![1f32; 8], vec![0f32; 8]);
        let (s, d) = (host(&mut a, &[8]), host(&mut b, &[8]));
        // SAFETY: live handle; descriptors over live buffers; the stream
        // argument is NULL or a live handle (of another type).
        unsafe { amoe_all_reduce(c, &s, &d, 0, stream(rank, c)) }
    });
    // SAFETY: as above.
    one_bad_rank("barrier stream", "stream", inv, |rank, c| unsafe { amoe_barrier(c, stream(rank, c)) });
    let sizes = [2usize, 1];
    one_bad_rank("pad_and_reduce stream", "stream", inv, |rank, c| {
        let (mut x, mut o) = (vec![1f32; 3 * 4], vec![0f32; 2 * 4]);
        // The descriptor points at its shape: the shape outlives the call.
        let os = [sizes[rank], 4];
        let (xd, od) = (host(&mut x, &[3, 4]), host(&mut o, &os));
        // SAFETY: as above.
        unsafe { amoe_maybe_pad_and_reduce(&xd, sizes.as_ptr(), 2, c, &od, stream(rank, c)) }
    });
    one_bad_rank("shared_gather_unpad stream", "stream", inv, |rank, c| {
        let (mut x, mut o) = (vec![1f32; 2 * 4], vec![0f32; 4 * 4]);
        let (xd, od) = (host(&mut x, &[2, 4]), host(&mut o, &[4, 4]));
        // SAFETY: as above.
        unsafe { amoe_shared_gather_unpad(&xd, 4, c, &od, stream(rank, c)) }
    });
    let policy = amoe_reduce_policy { shared_mode: 0, has_routed_transform: 0, sp: 0, tp_size: 2, ep_size: 2 };
    one_bad_rank("reduce_final stream", "stream", inv, |rank, c| {
        let (mut x, mut o) = (vec![1f32; 3 * 4], vec![0f32; 3 * 4]);
        let (xd, od) = (host(&mut x, &[3, 4]), host(&mut o, &[3, 4]));
        let ag = amoe_comm_type::AllGather as u32;
        // SAFETY: as above; a valid policy.
        unsafe { amoe_reduce_final(&policy, &xd, ag, c, &od, stream(rank, c)) }
    });
    one_bad_rank("prepare stream", "stream", inv, |rank, c| {
        with_groups(rank, c, &|ctx, g| {
            let (mut x, mut o) = (vec![1f32; 2 * 4], vec![0f32; 4 * 4]);
            let (xd, od) = (host(&mut x, &[2, 4]), host(&mut o, &[4, 4]));
            let ag = amoe_comm_type::AllGather as u32;
            // SAFETY: as above.
            unsafe { amoe_token_prepare(&xd, ag, ctx, g, &od, null(), stream(rank, c)) }
        })
    });
}

/// The groups' creation is a collective (the ranks agree on the sizes): a
/// rank without a place to put its handle refuses through that agreement.
#[test]
fn moe_groups_without_an_out_pointer_on_one_rank_fail_every_rank_at_once() {
    one_bad_rank("moe_groups_new out", "out", amoe_status::NullArgument, |rank, c| {
        let mut groups: *mut amoe_moe_groups = null_mut();
        let out: *mut *mut amoe_moe_groups = if rank == BAD { null_mut() } else { &mut groups };
        // SAFETY: live world handle; out writable or NULL.
        let st = unsafe { amoe_moe_groups_new(c, 1, 1, out) };
        // SAFETY: NULL or the new handle, freed once.
        unsafe { amoe_moe_groups_free(groups) };
        st
    });
}

/// A refusal whose own message cannot be read (NULL, not UTF-8) still
/// releases the peers waiting in the call, with what can be made of it; the
/// refusing rank gets the message's error.
#[test]
fn a_refusal_with_an_unreadable_message_still_reaches_the_peers() {
    let not_utf8 = CString::new(b"binding: `x` \xff is bad".to_vec()).expect("no NUL");
    for (case, message, status, seen) in [
        ("comm_refuse NULL", None, amoe_status::NullArgument, "NULL message"),
        ("comm_refuse not UTF-8", Some(&not_utf8), amoe_status::InvalidArgument, "binding: `x`"),
    ] {
        one_bad_rank_seen_as(case, "message", status, seen, |rank, c| {
            let (mut a, mut b) = (vec![1f32; 8], vec![0f32; 8]);
            let (s, d) = (host(&mut a, &[8]), host(&mut b, &[8]));
            // SAFETY: live handle; descriptors over live buffers; the message
            // is NULL or a C string.
            unsafe {
                if rank == BAD {
                    amoe_comm_refuse(c, message.map_or(null(), |m| m.as_ptr()))
                } else {
                    amoe_all_reduce(c, &s, &d, 0, null())
                }
            }
        });
    }
    let policy = amoe_reduce_policy { shared_mode: 0, has_routed_transform: 0, sp: 0, tp_size: 2, ep_size: 2 };
    one_bad_rank_seen_as("reduce_refuse NULL", "message", amoe_status::NullArgument, "NULL message", |rank, c| {
        let (mut x, mut o) = (vec![1f32; 3 * 4], vec![0f32; 3 * 4]);
        let (xd, od) = (host(&mut x, &[3, 4]), host(&mut o, &[3, 4]));
        // SAFETY: as above; a valid policy.
        unsafe {
            if rank == BAD {
                amoe_reduce_refuse(c, 1, null())
            } else {
                amoe_reduce_final(&policy, &xd, amoe_comm_type::AllGather as u32, c, &od, null())
            }
        }
    });
}

/// With the comm-type agreement off (`ASCEND_MOE_CHECK_COMM_TYPE=0`, read by
/// every call, so the cases run in a child process of this test binary with
/// the variable set), a bad argument found before the agreement would have
/// been sent through it went nowhere: a bad stream at a token prepare or
/// finalize or at a reduction point, and a policy whose tp_size is not the
/// group's. Each is now refused through the call the peers make first (the
/// DP all-gather or reduce-scatter, the TP all-reduce).
#[test]
fn with_the_comm_type_check_off_a_bad_argument_still_reaches_the_peers() {
    const CHILD: &str = "AMOE_TEST_CHECK_OFF_CHILD";
    const NAME: &str = "with_the_comm_type_check_off_a_bad_argument_still_reaches_the_peers";
    if std::env::var_os(CHILD).is_none() {
        let exe = std::env::current_exe().expect("this test binary");
        let out = std::process::Command::new(exe)
            .args(["--exact", NAME, "--test-threads=1", "--nocapture"])
            .env(CHILD, "1")
            .env("ASCEND_MOE_CHECK_COMM_TYPE", "0")
            .output()
            .expect("the test binary runs");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && text.contains("1 passed"), "the cases with the check off:\n{text}");
        return;
    }
    assert_eq!(std::env::var("ASCEND_MOE_CHECK_COMM_TYPE").as_deref(), Ok("0"));
    let stream = |rank: usize, c: *mut amoe_comm| if rank == BAD { c as *const amoe_stream } else { null() };
    let (inv, ag) = (amoe_status::InvalidArgument, amoe_comm_type::AllGather as u32);
    one_bad_rank("prepare stream, check off", "stream", inv, |rank, c| {
        with_groups(rank, c, &|ctx, g| {
            let (mut x, mut o) = (vec![1f32; 2 * 4], vec![0f32; 4 * 4]);
            let (xd, od) = (host(&mut x, &[2, 4]), host(&mut o, &[4, 4]));
            // SAFETY: live handles; descriptors over live buffers; the stream
            // argument is NULL or a live handle (of another type).
            unsafe { amoe_token_prepare(&xd, ag, ctx, g, &od, null(), stream(rank, c)) }
        })
    });
    one_bad_rank("finalize stream, check off", "stream", inv, |rank, c| {
        with_groups(rank, c, &|ctx, g| {
            let (mut y, mut o) = (vec![1f32; 4 * 4], vec![0f32; 2 * 4]);
            let (yd, od) = (host(&mut y, &[4, 4]), host(&mut o, &[2, 4]));
            // SAFETY: as above.
            unsafe { amoe_token_finalize(&yd, ag, ctx, g, &od, stream(rank, c)) }
        })
    });
    // TP 2, no shared expert, no SP: the final point all-reduces.
    let policy = amoe_reduce_policy { shared_mode: 0, has_routed_transform: 0, sp: 0, tp_size: 2, ep_size: 2 };
    one_bad_rank("reduce_final stream, check off", "stream", inv, |rank, c| {
        let (mut x, mut o) = (vec![1f32; 3 * 4], vec![0f32; 3 * 4]);
        let (xd, od) = (host(&mut x, &[3, 4]), host(&mut o, &[3, 4]));
        // SAFETY: as above; a valid policy.
        unsafe { amoe_reduce_final(&policy, &xd, ag, c, &od, stream(rank, c)) }
    });
    let one = amoe_reduce_policy { tp_size: 1, ep_size: 1, ..policy };
    one_bad_rank("reduce_final tp_size, check off", "tp", inv, |rank, c| {
        let (mut x, mut o) = (vec![1f32; 3 * 4], vec![0f32; 3 * 4]);
        let (xd, od) = (host(&mut x, &[3, 4]), host(&mut o, &[3, 4]));
        let p = if rank == BAD { &one } else { &policy };
        // SAFETY: as above; valid policies.
        unsafe { amoe_reduce_final(p, &xd, ag, c, &od, null()) }
    });
}

#[test]
fn a_split_with_a_null_list_on_one_rank_fails_every_rank_at_once() {
    // The peers learn that the member passed no list.
    one_bad_rank_seen_as("split", "ranks", amoe_status::NullArgument, "no rank list", |rank, c| {
        let ranks = [0usize, 1];
        let mut sub: *mut amoe_comm = null_mut();
        let list = if rank == BAD { null() } else { ranks.as_ptr() };
        // SAFETY: live handle; the list holds 2 entries (or NULL); out writable.
        let st = unsafe { amoe_comm_split(c, list, 2, &mut sub) };
        // SAFETY: NULL or the new handle, freed once.
        unsafe { amoe_comm_free(sub) };
        st
    });
}

/// Rank 1 splits where rank 0 all-reduces: rank 0 fails at once naming the
/// split (rank 1 took part in its all-reduce to fail it), and rank 1 with a
/// mismatch naming the all-reduce, not after the 30 s timeout.
#[test]
fn a_split_where_a_peer_calls_a_collective_fails_both_at_once() {
    one_bad_rank_seen_as("split vs all_reduce", "all_reduce", amoe_status::CommMismatch, "split([0, 1])", |rank, c| {
        if rank != BAD {
            let (mut a, mut b) = (vec![1f32; 8], vec![0f32; 8]);
            let (s, d) = (host(&mut a, &[8]), host(&mut b, &[8]));
            // SAFETY: live handle; descriptors over live buffers.
            return unsafe { amoe_all_reduce(c, &s, &d, 0, null()) };
        }
        let ranks = [0usize, 1];
        let mut sub: *mut amoe_comm = null_mut();
        // SAFETY: live handle; the list holds 2 entries; out writable.
        let st = unsafe { amoe_comm_split(c, ranks.as_ptr(), 2, &mut sub) };
        // SAFETY: NULL or the new handle, freed once.
        unsafe { amoe_comm_free(sub) };
        st
    });
}

/// A binding that refuses its own arguments before it calls the library
/// tells the peers through `amoe_comm_refuse`, `amoe_reduce_refuse` or
/// `amoe_token_refuse`: they fail at once quoting its message.
#[test]
fn a_binding_reports_its_own_refusal_to_the_peers_waiting_in_the_call() {
    let message = CString::new("binding: `x` is float64, which the library does not take").expect("no NUL");
    one_bad_rank("comm_refuse", "float64", amoe_status::Ok, |rank, c| {
        let (mut a, mut b) = (vec![1f32; 3 * 4], vec![0f32; 2 * 4]);
        let (xd, od) = (host(&mut a, &[3, 4]), host(&mut b, &[2, 4]));
        let sizes = [2usize, 1];
        // SAFETY: live handle; descriptors over live buffers; a C string.
        unsafe {
            if rank == BAD {
                amoe_comm_refuse(c, message.as_ptr())
            } else {
                amoe_maybe_pad_and_reduce(&xd, sizes.as_ptr(), 2, c, &od, null())
            }
        }
    });
    let policy = amoe_reduce_policy { shared_mode: 0, has_routed_transform: 0, sp: 0, tp_size: 2, ep_size: 2 };
    one_bad_rank("reduce_refuse", "float64", amoe_status::Ok, |rank, c| {
        let (mut x, mut o) = (vec![1f32; 3 * 4], vec![0f32; 3 * 4]);
        let (xd, od) = (host(&mut x, &[3, 4]), host(&mut o, &[3, 4]));
        // SAFETY: as above; a valid policy.
        unsafe {
            if rank == BAD {
                amoe_reduce_refuse(c, 1, message.as_ptr())
            } else {
                amoe_reduce_final(&policy, &xd, amoe_comm_type::AllGather as u32, c, &od, null())
            }
        }
    });
    one_bad_rank("token_refuse", "float64", amoe_status::Ok, |rank, c| {
        with_groups(rank, c, &|ctx, g| {
            let (mut y, mut o) = (vec![1f32; 4 * 4], vec![0f32; 2 * 4]);
            let (yd, od) = (host(&mut y, &[4, 4]), host(&mut o, &[2, 4]));
            let ag = amoe_comm_type::AllGather as u32;
            // SAFETY: live handles; descriptors over live buffers; a C string.
            unsafe {
                if rank == BAD {
                    amoe_token_refuse(ag, ctx, g, 1, message.as_ptr())
                } else {
                    amoe_token_finalize(&yd, ag, ctx, g, &od, null())
                }
            }
        })
    });
    // A binding that could not read its comm type or context: a prepare's
    // peers still wait in the comm-type agreement.
    one_bad_rank("token_refuse unread", "float64", amoe_status::Ok, |rank, c| {
        with_groups(rank, c, &|ctx, g| {
            let (mut x, mut o) = (vec![1f32; 2 * 4], vec![0f32; 4 * 4]);
            let (xd, od) = (host(&mut x, &[2, 4]), host(&mut o, &[4, 4]));
            let ag = amoe_comm_type::AllGather as u32;
            // SAFETY: live handles; descriptors over live buffers; a C string.
            unsafe {
                if rank == BAD {
                    amoe_token_refuse(u32::MAX, null(), g, 0, message.as_ptr())
                } else {
                    amoe_token_prepare(&xd, ag, ctx, g, &od, null(), null())
                }
            }
        })
    });
}
