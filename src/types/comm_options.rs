//! [`CommOptions`]: communicator options.

use std::time::Duration;

/// Communicator options.
#[derive(Debug, Clone)]
pub struct CommOptions {
    /// Upper bound on every wait (rendezvous, each collective step).
    pub timeout: Duration,
}

impl Default for CommOptions {
    fn default() -> Self {
        Self::from_env()
    }
}

impl CommOptions {
    /// Default timeout when `ASCEND_MOE_COMM_TIMEOUT` is unset.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

    /// Reads `ASCEND_MOE_COMM_TIMEOUT` (seconds, may be fractional); falls back
    /// to [`CommOptions::DEFAULT_TIMEOUT`] when unset or unparsable
    /// ([`CommOptions::env_timeout`] says which).
    pub fn from_env() -> Self {
        CommOptions { timeout: Self::env_timeout().ok().flatten().unwrap_or(Self::DEFAULT_TIMEOUT) }
    }

    /// `ASCEND_MOE_COMM_TIMEOUT`: `Ok(None)` when unset, its timeout when a
    /// positive number of seconds, else `Err` with the value as set, which
    /// [`CommOptions::from_env`] ignores.
    pub fn env_timeout() -> Result<Option<Duration>, String> {
        super::env::env_setting("ASCEND_MOE_COMM_TIMEOUT", parse_timeout)
    }

    /// Options with the given timeout.
    pub fn with_timeout(timeout: Duration) -> Self {
        CommOptions { timeout }
    }
}

/// A timeout in seconds (may be fractional): `None` unless finite and
/// positive and at least a nanosecond (less would be no wait at all); more
/// seconds than a `Duration` holds is `Duration::MAX` (no practical bound),
/// not a panic.
fn parse_timeout(s: &str) -> Option<Duration> {
    let s = s.trim().parse::<f64>().ok().filter(|s| s.is_finite() && *s > 0.0)?;
    Some(Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX)).filter(|d| !d.is_zero())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_parse_in_seconds_and_saturate_instead_of_panicking() {
        assert_eq!(parse_timeout(" 2.5 "), Some(Duration::from_millis(2500)));
        assert_eq!(parse_timeout("1e30"), Some(Duration::MAX));
        assert_eq!(parse_timeout("1e300"), Some(Duration::MAX));
        for bad in ["inf", "NaN", "-1", "0", "soon", "1e-10", "1e-300"] {
            assert_eq!(parse_timeout(bad), None, "{bad}");
        }
    }
}
