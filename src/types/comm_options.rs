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
    /// ([`CommOptions::env_timeout`] says which). An unparsable value is
    /// named on stderr, once per process: a timeout of `2s` silently taken
    /// as 60 s would be found only at the first wait that runs out.
    pub fn from_env() -> Self {
        let timeout = match Self::env_timeout() {
            Ok(t) => t,
            Err(v) => {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| eprintln!("{}", ignored_timeout(&v)));
                None
            }
        };
        CommOptions { timeout: timeout.unwrap_or(Self::DEFAULT_TIMEOUT) }
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

/// The warning for an `ASCEND_MOE_COMM_TIMEOUT` of `value` that is no timeout.
fn ignored_timeout(value: &str) -> String {
    format!(
        "ascend-moe: warning: ASCEND_MOE_COMM_TIMEOUT={value:?} is not a positive number of seconds (at least \
         1e-9, finite): every wait uses the default of {} s",
        CommOptions::DEFAULT_TIMEOUT.as_secs()
    )
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
        let w = ignored_timeout("2s");
        assert!(w.contains("ASCEND_MOE_COMM_TIMEOUT=\"2s\"") && w.contains("default of 60 s"), "{w}");
    }
}
