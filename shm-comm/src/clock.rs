//! Deadlines that a timeout of any size cannot overflow, and the backoff of
//! waits on the setup lock.

use std::time::{Duration, Instant};

/// Further than any wait needs: where `timeout` is too large for a deadline,
/// waits are bounded by this instead (over 30 years).
const FAR: Duration = Duration::from_secs(1 << 30);

/// The instant `timeout` after `from`; a timeout too large to add (e.g.
/// `Duration::MAX`) means waiting without practical bound, not a panic.
pub(crate) fn deadline(from: Instant, timeout: Duration) -> Instant {
    from.checked_add(timeout).or_else(|| from.checked_add(FAR)).unwrap_or(from)
}

/// Spin, then yield, then short sleeps (only used while waiting on the setup lock).
#[derive(Default)]
pub(crate) struct Backoff {
    n: u32,
}

impl Backoff {
    pub(crate) fn snooze(&mut self) {
        self.n += 1;
        if self.n < 16 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(200 * u64::from(self.n.min(25))));
        }
    }
}
