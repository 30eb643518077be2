//! 4 thread ranks: byte moves of every element type, reductions refused on
//! the types they do not take, and the caller's context tag in the
//! collective descriptor (ranks that disagree on it, call different
//! collectives, or stop calling all fail together, and the error names who
//! did what).

use std::time::Duration;

use shm_comm::{Config, DataType, Error, ErrorKind, ReduceOp, Shape, ShmComm};

const WORLD: usize = 4;

/// Runs `f(rank, comm)` on WORLD threads of a fresh group.
fn ranks<R: Send>(tag: &str, f: impl Fn(usize, ShmComm) -> R + Sync) -> Vec<R> {
    let name = format!("ctx-{tag}-{}", std::process::id());
    let f = &f;
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..WORLD)
            .map(|r| {
                let name = &name;
                s.spawn(move || {
                    let c = ShmComm::rendezvous(name, WORLD, r, Duration::from_secs(20), &Config::default())
                        .expect("rendezvous");
                    f(r, c)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank panicked")).collect()
    })
}

fn all_reduce_ones(c: &ShmComm) -> Result<Vec<u8>, Error> {
    let src: Vec<u8> = (0..8).flat_map(|_| 1f32.to_le_bytes()).collect();
    let mut dst = vec![0u8; src.len()];
    c.all_reduce(DataType::F32, ReduceOp::Sum, &src, &mut dst, Ok::<(), Error>(()))?;
    Ok(dst)
}

#[test]
fn ranks_that_disagree_on_the_tag_all_fail_naming_who_chose_what() {
    let out = ranks("disagree", |r, c| {
        c.set_context_tag(Some((r / 2) as u64));
        assert_eq!(c.context_tag(), Some((r / 2) as u64));
        let e = all_reduce_ones(&c).expect_err("tags differ");
        // The group stays usable once the ranks agree again.
        c.set_context_tag(Some(1));
        let again = all_reduce_ones(&c).expect("tags agree");
        (e, again)
    });
    let four: Vec<u8> = (0..8).flat_map(|_| 4f32.to_le_bytes()).collect();
    for (r, (e, again)) in out.iter().enumerate() {
        let s = e.to_string();
        assert_eq!(e.kind(), Some(ErrorKind::Mismatch), "rank {r}: {s}");
        assert!(s.contains("ranks [0, 1] chose 0, ranks [2, 3] chose 1"), "rank {r}: {s}");
        assert!(s.contains("all_reduce") && s.contains("tag 0") && s.contains("tag 1"), "rank {r}: {s}");
        assert_eq!(again, &four, "rank {r}");
    }
}

#[test]
fn ranks_whose_shapes_differ_with_equal_counts_all_fail_naming_each_shape() {
    // 16 elements everywhere; ranks 2 and 3 see them as [8, 2], the others
    // as [4, 4]. A 9-dimensional shape differs only past its 7th dimension.
    let out = ranks("shape", |r, c| {
        let dims: &[usize] = if r < 2 { &[4, 4] } else { &[8, 2] };
        let src: Vec<u8> = (0..16).flat_map(|_| 1f32.to_le_bytes()).collect();
        let mut dst = vec![0u8; src.len() * WORLD];
        let e = c
            .agreeing(Shape { label: "src", dims })
            .all_gather(DataType::F32, &src, &mut dst, Ok::<(), Error>(()))
            .expect_err("shapes differ");
        let long: &[usize] = if r == 0 { &[1, 1, 1, 1, 1, 1, 1, 2, 8] } else { &[1, 1, 1, 1, 1, 1, 1, 8, 2] };
        let long = c
            .agreeing(Shape { label: "buf", dims: long })
            .all_reduce(DataType::F32, ReduceOp::Sum, &src, &mut dst[..src.len()], Ok::<(), Error>(()))
            .expect_err("long shapes differ");
        // The same shape everywhere passes, and a call without a shape
        // against ranks that post one fails.
        c.agreeing(Shape { label: "src", dims: &[16] })
            .all_gather(DataType::F32, &src, &mut dst, Ok::<(), Error>(()))
            .expect("shapes agree");
        let none = if r == 0 {
            c.all_gather(DataType::F32, &src, &mut dst, Ok::<(), Error>(()))
        } else {
            c.agreeing(Shape { label: "src", dims: &[16] }).all_gather(
                DataType::F32,
                &src,
                &mut dst,
                Ok::<(), Error>(()),
            )
        };
        (e, long, none.expect_err("rank 0 posts no shape"))
    });
    for (r, (e, long, none)) in out.iter().enumerate() {
        let s = e.to_string();
        assert_eq!(e.kind(), Some(ErrorKind::Mismatch), "rank {r}: {s}");
        assert!(s.contains("ranks [0, 1] called all_gather dtype f32 count 16 src shape [4, 4]"), "rank {r}: {s}");
        assert!(s.contains("ranks [2, 3] called all_gather dtype f32 count 16 src shape [8, 2]"), "rank {r}: {s}");
        let l = long.to_string();
        assert_eq!(long.kind(), Some(ErrorKind::Mismatch), "rank {r}: {l}");
        assert!(l.contains("ranks [0] called") && l.contains("ranks [1, 2, 3] called"), "rank {r}: {l}");
        assert!(l.contains("buf shape [1, 1, 1, 1, 1, 1, 1, ... (9 dims"), "rank {r}: {l}");
        assert_eq!(none.kind(), Some(ErrorKind::Mismatch), "rank {r}: {none}");
    }
}

#[test]
fn ranks_reducing_in_place_and_out_of_place_agree_on_equal_dims() {
    // Ranks 0 and 2 post their shape as "buf" (in place), ranks 1 and 3 as
    // "src": the label only names the shape, so the dims [4, 4] agree and
    // every rank gets the sum of the ranks' values (1 + 2 + 3 + 4).
    let out = ranks("inplace", |r, c| {
        let dims: &[usize] = &[4, 4];
        let mine: Vec<u8> = (0..16).flat_map(|i| ((r + 1) as f32 * (i + 1) as f32).to_le_bytes()).collect();
        if r % 2 == 0 {
            let mut buf = mine;
            c.agreeing(Shape { label: "buf", dims })
                .all_reduce_in_place(DataType::F32, ReduceOp::Sum, &mut buf, Ok::<(), Error>(()))
                .map(|()| buf)
        } else {
            let mut dst = vec![0u8; mine.len()];
            c.agreeing(Shape { label: "src", dims })
                .all_reduce(DataType::F32, ReduceOp::Sum, &mine, &mut dst, Ok::<(), Error>(()))
                .map(|()| dst)
        }
    });
    let want: Vec<u8> = (0..16).flat_map(|i| (10.0 * (i + 1) as f32).to_le_bytes()).collect();
    for (r, got) in out.iter().enumerate() {
        assert_eq!(got.as_ref().unwrap_or_else(|e| panic!("rank {r}: {e}")), &want, "rank {r}");
    }
}

#[test]
fn a_rank_without_a_tag_is_named_as_such() {
    let out = ranks("untagged", |r, c| {
        if r != 3 {
            c.set_context_tag(Some(2));
        }
        c.barrier().expect_err("rank 3 set no tag").to_string()
    });
    for (r, s) in out.iter().enumerate() {
        assert!(s.contains("ranks [0, 1, 2] chose 2, ranks [3] set no tag"), "rank {r}: {s}");
    }
}

#[test]
fn ranks_that_call_different_collectives_all_fail_naming_both() {
    let out = ranks("different", |r, c| {
        c.set_context_tag(Some(0));
        if r < 2 {
            all_reduce_ones(&c).map(|_| ())
        } else {
            c.barrier()
        }
    });
    for (r, o) in out.iter().enumerate() {
        let e = o.as_ref().expect_err("different collectives");
        let s = e.to_string();
        assert_eq!(e.kind(), Some(ErrorKind::Mismatch), "rank {r}: {s}");
        assert!(s.contains("ranks [0, 1] called all_reduce") && s.contains("ranks [2, 3] called barrier"), "{s}");
    }
}

#[test]
fn a_rank_that_stops_calling_is_reported_with_how_far_it_got() {
    let out = ranks("stops", |r, c| {
        c.barrier()?;
        if r == 3 {
            // Done after one call: leaves the group.
            return Ok(());
        }
        all_reduce_ones(&c).map(|_| ())
    });
    assert!(out[3].is_ok());
    for (r, o) in out.iter().enumerate().take(3) {
        let e = o.as_ref().expect_err("rank 3 never calls all_reduce");
        let s = e.to_string();
        assert_eq!(e.kind(), Some(ErrorKind::PeerFailed), "rank {r}: {s}");
        assert!(s.contains("rank 3 left the group"), "rank {r}: {s}");
        assert!(s.contains("after its last call, barrier (call #1)"), "rank {r}: {s}");
        assert!(s.contains(&format!("while rank {r} waited in its call #2")), "rank {r}: {s}");
    }
}

#[test]
fn one_byte_types_move_exactly_and_are_refused_by_reductions() {
    let out = ranks("bytes", |r, c| {
        for dt in [DataType::I8, DataType::U8, DataType::Bool, DataType::F8E4M3, DataType::F8E5M2] {
            // Every byte value, offset by rank, so each rank's block differs.
            let src: Vec<u8> = (0..=255u8).map(|b| b.wrapping_add(r as u8 * 61)).collect();
            let mut dst = vec![0u8; src.len() * WORLD];
            c.all_gather(dt, &src, &mut dst, Ok::<(), Error>(())).expect("all_gather");
            for j in 0..WORLD {
                let want: Vec<u8> = (0..=255u8).map(|b| b.wrapping_add(j as u8 * 61)).collect();
                assert_eq!(&dst[j * 256..(j + 1) * 256], &want[..], "{dt} block {j}");
            }
            let counts = [1, 0, 3, 2];
            let mine: Vec<u8> = (0..counts[r]).map(|i| (r * 10 + i) as u8).collect();
            let mut gathered = vec![0u8; 6];
            c.all_gather_v(dt, &mine, &mut gathered, &counts, Ok::<(), Error>(())).expect("all_gather_v");
            assert_eq!(gathered, [0, 20, 21, 22, 30, 31], "{dt}");
            let mut b = if r == 2 { vec![0x7f, 0x80, 0xff] } else { vec![0; 3] };
            c.broadcast(dt, &mut b, 2, Ok::<(), Error>(())).expect("broadcast");
            assert_eq!(b, [0x7f, 0x80, 0xff], "{dt}");
            let e = c.all_reduce_in_place(dt, ReduceOp::Sum, &mut b, Ok::<(), Error>(())).expect_err("not reducible");
            assert!(matches!(e, Error::InvalidArgument { arg: "dtype", .. }), "{e}");
            assert!(e.to_string().contains(&format!("{dt} cannot be reduced")), "{e}");
        }
    });
    assert_eq!(out.len(), WORLD);
}

/// Collectives of 4 MiB and more per rank stream their copy-outs past the
/// cache (and stage in several 1 MiB rounds); every element still lands
/// where it belongs, at odd lengths (whose tails are not whole cache lines)
/// and odd offsets into the outputs.
#[test]
fn large_collectives_that_stream_their_copies_move_every_element() {
    // 1 Mi + 3 f32 per rank: just over the 4 MiB from which copies stream.
    const N: usize = (1 << 20) + 3;
    let f32s =
        |v: &[u8]| -> Vec<f32> { v.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect() };
    let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let value = |rank: usize, i: usize| (rank * 1000 + i % 997) as f32;
    let out = ranks("stream", |r, c| {
        let mine: Vec<f32> = (0..N).map(|i| value(r, i)).collect();
        let src = bytes(&mine);
        let ok = Ok::<(), Error>(());
        // all_reduce: the sum over ranks, elementwise.
        let mut sum = vec![0u8; src.len()];
        c.all_reduce(DataType::F32, ReduceOp::Sum, &src, &mut sum, ok.clone()).expect("all_reduce");
        // all_gather into an output that starts one element into its buffer.
        let mut gathered = vec![0u8; (WORLD * N + 1) * 4];
        c.all_gather(DataType::F32, &src, &mut gathered[4..], ok.clone()).expect("all_gather");
        // all_to_all: block j (N elements of this rank's data) goes to rank j.
        let big: Vec<f32> = (0..WORLD * N).map(|i| value(r, i)).collect();
        let mut swapped = vec![0u8; WORLD * N * 4];
        c.all_to_all_v(DataType::F32, &bytes(&big), &[N; WORLD], &mut swapped, &[N; WORLD], ok.clone())
            .expect("all_to_all");
        // reduce_scatter: block r of the sum over ranks of `big`.
        let mut scattered = vec![0u8; N * 4];
        c.reduce_scatter(DataType::F32, ReduceOp::Sum, &bytes(&big), &mut scattered, ok.clone())
            .expect("reduce_scatter");
        // broadcast of rank 2's data.
        let mut b = if r == 2 { src.clone() } else { vec![0u8; src.len()] };
        c.broadcast(DataType::F32, &mut b, 2, ok).expect("broadcast");
        (f32s(&sum), f32s(&gathered[4..]), f32s(&swapped), f32s(&scattered), f32s(&b))
    });
    for (r, (sum, gathered, swapped, scattered, b)) in out.iter().enumerate() {
        for i in 0..N {
            let want: f32 = (0..WORLD).map(|q| value(q, i)).sum();
            assert_eq!(sum[i], want, "all_reduce rank {r} element {i}");
            for q in 0..WORLD {
                assert_eq!(gathered[q * N + i], value(q, i), "all_gather rank {r} block {q} element {i}");
                assert_eq!(swapped[q * N + i], value(q, r * N + i), "all_to_all rank {r} block {q} element {i}");
            }
            let want: f32 = (0..WORLD).map(|q| value(q, r * N + i)).sum();
            assert_eq!(scattered[i], want, "reduce_scatter rank {r} element {i}");
            assert_eq!(b[i], value(2, i), "broadcast rank {r} element {i}");
        }
    }
}

/// The reduce-scatter of computed rows, at sizes that take several rounds
/// (1 MiB regions on 4 ranks) with a partial last one: every row of every
/// block is produced exactly once, and the result is bitwise that of
/// reduce_scatter_v over the same rows and of the test's own rank-order f32
/// sum rounded once (the values make the order show), for f32 and f16. Rank 1 has no rows: its output is an empty `Vec<u8>`, whose pointer
/// need not be aligned to the element type, and both calls take it; a
/// non-empty output that is not aligned is refused, naming it.
#[test]
fn computed_rows_are_produced_once_and_reduced_as_reduce_scatter_v_does() {
    const ROW: usize = 1000;
    let rows = [600usize, 0, 263, 1];
    let total: usize = rows.iter().sum();
    // Row g of rank r's blocks (concatenated): values whose f32 sum depends on
    // the order in which ranks are added.
    let value = |r: usize, g: usize, c: usize| (1.0 + r as f32 * 0.37) * ((g * ROW + c) % 8191) as f32 * 1.0e-3 + 0.1;
    for dt in [DataType::F32, DataType::F16] {
        let encode = |v: f32| -> Vec<u8> {
            match dt {
                DataType::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
                _ => v.to_le_bytes().to_vec(),
            }
        };
        let esz = dt.size();
        let out = ranks(&format!("rows-{dt}"), |r, c| {
            let first: Vec<usize> = rows.iter().scan(0, |a, &n| Some(std::mem::replace(a, *a + n))).collect();
            let mut seen = vec![0u32; total];
            let mut produce = |j: usize, lo: usize, out: &mut [u8]| {
                assert_eq!(out.len() % (ROW * esz), 0, "whole rows");
                assert_eq!(out.as_ptr() as usize % 64, 0, "64-byte aligned");
                for (i, row) in out.chunks_exact_mut(ROW * esz).enumerate() {
                    let g = first[j] + lo + i;
                    assert!(lo + i < rows[j], "row {} of block {j} of {} rows", lo + i, rows[j]);
                    seen[g] += 1;
                    for (col, e) in row.chunks_exact_mut(esz).enumerate() {
                        e.copy_from_slice(&encode(value(r, g, col)));
                    }
                }
            };
            let mut fused = vec![0u8; rows[r] * ROW * esz];
            c.reduce_scatter_rows_with(dt, ReduceOp::Sum, &rows, ROW, &mut fused, Ok::<(), Error>(()), &mut produce)
                .expect("reduce_scatter_rows_with");
            assert!(seen.iter().all(|&n| n == 1), "rank {r}: every row produced once");
            let src: Vec<u8> = (0..total * ROW).flat_map(|e| encode(value(r, e / ROW, e % ROW))).collect();
            let counts: Vec<usize> = rows.iter().map(|n| n * ROW).collect();
            let mut plain = vec![0u8; rows[r] * ROW * esz];
            c.reduce_scatter_v(dt, ReduceOp::Sum, &src, &mut plain, &counts, Ok::<(), Error>(()))
                .expect("reduce_scatter_v");
            let mut odd = vec![0u8; (rows[r] * ROW + 1) * esz];
            let odd = &mut odd[1..=rows[r] * ROW * esz];
            let e =
                c.reduce_scatter_v(dt, ReduceOp::Sum, &src, odd, &counts, Ok::<(), Error>(())).expect_err("unaligned");
            if rows[r] > 0 {
                assert!(matches!(e, Error::InvalidArgument { arg: "dst", .. }), "rank {r}: {e}");
                assert!(e.to_string().contains(&format!("is not aligned to the {esz}-byte {dt} elements")), "{e}");
            } else {
                assert_eq!(e.kind(), Some(ErrorKind::Mismatch), "rank {r}: its peers' dst are not aligned: {e}");
            }
            (fused, plain)
        });
        let first: Vec<usize> = rows.iter().scan(0, |a, &n| Some(std::mem::replace(a, *a + n))).collect();
        for (r, (fused, plain)) in out.iter().enumerate() {
            assert!(fused == plain, "{dt} rank {r}: computed rows differ from reduce_scatter_v");
            // Independently: the f32 sum over ranks in rank order of each rank's
            // value as stored (rounded to dt), rounded once to dt.
            let want: Vec<u8> = (0..rows[r] * ROW)
                .flat_map(|e| {
                    let (g, c) = (first[r] + e / ROW, e % ROW);
                    let stored = |q: usize| match dt {
                        DataType::F16 => half::f16::from_f32(value(q, g, c)).to_f32(),
                        _ => value(q, g, c),
                    };
                    encode((0..WORLD).fold(0.0f32, |acc, q| acc + stored(q)))
                })
                .collect();
            assert!(fused == &want, "{dt} rank {r}: not the rank-order f32 sum");
        }
    }
}

/// A reduction reads this rank's own input through typed slices: a non-empty
/// `src` (or in-place `buf`) that is not aligned to its elements is refused
/// before any data moves, naming the buffer, on the rank that passed it; its
/// peers fail the same call quoting it, and the group stays usable.
#[test]
fn a_reduction_refuses_an_unaligned_input_on_every_rank() {
    const N: usize = 64;
    let out = ranks("unaligned-src", |r, c| {
        let bad = r == 2;
        // 4-byte aligned on every rank but rank 2, where it is off by one.
        let mut backing = vec![0u8; (WORLD * N + 2) * 4];
        let shift = backing.as_ptr().align_offset(4) + usize::from(bad);
        let src = &mut backing[shift..shift + WORLD * N * 4];
        assert_eq!((src.as_ptr() as usize) % 4 != 0, bad);
        let ok = Ok::<(), Error>(());
        let mut dst_backing = vec![0u8; (N + 1) * 4];
        let at = dst_backing.as_ptr().align_offset(4);
        let dst = &mut dst_backing[at..at + N * 4];
        let mut all = vec![0u8; WORLD * N * 4];
        let counts = [N; WORLD];
        let calls: Vec<(&str, Result<(), Error>)> = vec![
            ("src", c.all_reduce(DataType::F32, ReduceOp::Sum, src, &mut all, ok.clone())),
            ("buf", c.all_reduce_in_place(DataType::F32, ReduceOp::Max, src, ok.clone())),
            ("src", c.reduce_scatter(DataType::F32, ReduceOp::Sum, src, dst, ok.clone())),
            ("src", c.reduce_scatter_v(DataType::I32, ReduceOp::Min, src, dst, &counts, ok.clone())),
        ];
        let after = all_reduce_ones(&c);
        (calls, after)
    });
    let four: Vec<u8> = (0..8).flat_map(|_| 4f32.to_le_bytes()).collect();
    for (r, (calls, after)) in out.iter().enumerate() {
        for (arg, res) in calls {
            let e = res.as_ref().expect_err("rank 2's input is not aligned");
            let s = e.to_string();
            assert!(s.contains(&format!("`{arg}`: is not aligned to the 4-byte")), "rank {r}: {s}");
            if r == 2 {
                assert!(matches!(e, Error::InvalidArgument { arg: a, .. } if a == arg), "rank {r}: {e:?}");
            } else {
                assert_eq!(e.kind(), Some(ErrorKind::Mismatch), "rank {r}: {s}");
                assert!(s.contains("ranks [2] passed invalid arguments"), "rank {r}: {s}");
            }
        }
        assert_eq!(after.as_ref().expect("the group stays usable"), &four, "rank {r}");
    }
}
