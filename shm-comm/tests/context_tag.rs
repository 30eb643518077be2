//! The caller's context tag in the collective descriptor, on 4 thread ranks:
//! ranks that disagree on it, call different collectives, or stop calling all
//! fail together, and the error names who did what.

use std::time::Duration;

use shm_comm::{Config, DataType, Error, ErrorKind, ReduceOp, ShmComm};

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
