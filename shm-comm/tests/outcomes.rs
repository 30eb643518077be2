//! Thread ranks at the edges of the protocol: timeouts too large for a
//! deadline, and calls whose failure on one rank must not leave another
//! rank succeeding or waiting without a cause.

use std::time::Duration;

use shm_comm::{Config, DataType, Error, ShmComm};

fn group(tag: &str) -> String {
    format!("outcomes-{tag}-{}", std::process::id())
}

/// Runs `f(rank, comm)` on `world` threads of a fresh group joined with `timeout`.
fn ranks<R: Send>(tag: &str, world: usize, timeout: Duration, f: impl Fn(usize, ShmComm) -> R + Sync) -> Vec<R> {
    let name = group(tag);
    let f = &f;
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let name = &name;
                s.spawn(move || {
                    let cfg = Config { staging_bytes: 1 << 16 };
                    let c = ShmComm::rendezvous(name, world, r, timeout, &cfg).expect("rendezvous");
                    f(r, c)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank panicked")).collect()
    })
}

/// `Duration::MAX` cannot be added to an instant: it means no practical
/// bound, for the rendezvous, every collective and a split alike.
#[test]
fn a_timeout_too_large_for_a_deadline_bounds_nothing_and_panics_nowhere() {
    let out = ranks("huge-timeout", 2, Duration::MAX, |r, c| -> Result<u8, Error> {
        c.barrier()?;
        let mut buf = vec![r as u8 + 7; 4];
        c.broadcast(DataType::U8, &mut buf, 1, Ok::<(), Error>(()))?;
        let sub = c.split(&[1, 0])?;
        sub.barrier()?;
        assert_eq!(sub.timeout(), Duration::MAX);
        Ok(buf[0])
    });
    assert_eq!(out, vec![Ok(8), Ok(8)]);
}
