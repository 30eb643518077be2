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

    /// Reads `ASCEND_MOE_COMM_TIMEOUT` (seconds, may be fractional, read by
    /// [`CommOptions::timeout_from_secs`]); falls back to
    /// [`CommOptions::DEFAULT_TIMEOUT`] when unset, 0 or no timeout
    /// ([`CommOptions::env_timeout`] says which). A value that is no timeout
    /// is named on stderr, once per process: a timeout of `2s` silently
    /// taken as 60 s would be found only at the first wait that runs out.
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

    /// `ASCEND_MOE_COMM_TIMEOUT`: `Ok(None)` when unset,
    /// its timeout when a positive number of seconds that
    /// [`CommOptions::timeout_from_secs`] takes, else
    /// `Err` with the value as set, which [`CommOptions::from_env`] ignores.
    pub fn env_timeout() -> Result<Option<Duration>, String> {
        super::env::env_setting("ASCEND_MOE_COMM_TIMEOUT", parse_timeout).map(Option::flatten)
    }

    /// Options with the given timeout.
    pub fn with_timeout(timeout: Duration) -> Self {
        CommOptions { timeout }
    }

    /// The one reading of a timeout given in seconds, shared by every way to
    /// give one (the C ABI's `timeout_s`, `ASCEND_MOE_COMM_TIMEOUT`, the
    /// CLI's `--timeout`, Python's `timeout_s`):
    ///
    /// - `0`, a negative value or NaN: `Ok(None)`, the default:
    ///   `ASCEND_MOE_COMM_TIMEOUT`, else [`CommOptions::DEFAULT_TIMEOUT`]
    ///   ([`CommOptions::from_secs`]; for the variable itself, the default of
    ///   60 s), as the C ABI's `timeout_s` has always read them (the variable
    ///   and the CLI's `--timeout` refuse them before: there, the default is
    ///   the setting left out);
    /// - a positive number of seconds of at least 1 ns: that timeout;
    /// - infinity, or more seconds than a [`Duration`] holds: no limit,
    ///   [`Duration::MAX`] (every wait bounded only by a peer's death);
    /// - positive but under 1 ns (a `Duration`'s unit: it would be no wait
    ///   at all): `Err` with why, to follow the name of the argument that
    ///   gave it.
    pub fn timeout_from_secs(secs: f64) -> Result<Option<Duration>, String> {
        if secs.is_nan() || secs <= 0.0 {
            return Ok(None);
        }
        match Duration::try_from_secs_f64(secs) {
            Ok(d) if d.is_zero() => Err(format!("{secs} s is less than the least timeout, 1 ns (1e-9 s)")),
            Ok(d) => Ok(Some(d)),
            // Infinite or past `Duration::MAX`.
            Err(_) => Ok(Some(Duration::MAX)),
        }
    }

    /// The options of a timeout of `secs` seconds as
    /// [`CommOptions::timeout_from_secs`] reads it, 0 being
    /// [`CommOptions::from_env`]; `Err` says why `secs` is no timeout.
    pub fn from_secs(secs: f64) -> Result<Self, String> {
        Ok(match Self::timeout_from_secs(secs)? {
            Some(t) => Self::with_timeout(t),
            None => Self::from_env(),
        })
    }
}

/// The warning for an `ASCEND_MOE_COMM_TIMEOUT` of `value` that is no timeout.
fn ignored_timeout(value: &str) -> String {
    let why = match value.trim().parse::<f64>() {
        Ok(secs) if secs > 0.0 => CommOptions::timeout_from_secs(secs).err().unwrap_or_default(),
        _ => "not a positive number of seconds".into(),
    };
    format!(
        "ascend-moe: warning: ASCEND_MOE_COMM_TIMEOUT={value:?} is no timeout ({why}): every wait uses the \
         default of {} s",
        CommOptions::DEFAULT_TIMEOUT.as_secs()
    )
}

/// `ASCEND_MOE_COMM_TIMEOUT`'s value: a positive number of seconds read by
/// [`CommOptions::timeout_from_secs`]; `None` when it is no timeout (0,
/// negative and NaN included: a variable set to them asks for no default,
/// so it is warned about).
fn parse_timeout(s: &str) -> Option<Option<Duration>> {
    let secs = s.trim().parse::<f64>().ok().filter(|s| *s > 0.0)?;
    CommOptions::timeout_from_secs(secs).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_in_seconds_have_one_rule() {
        let t = CommOptions::timeout_from_secs;
        assert_eq!(t(2.5), Ok(Some(Duration::from_millis(2500))));
        assert_eq!(t(1e-9), Ok(Some(Duration::from_nanos(1))));
        for default in [0.0, -0.0, -1.0, f64::NEG_INFINITY, f64::NAN] {
            assert_eq!(t(default), Ok(None), "{default}");
        }
        for big in [f64::INFINITY, 1e30, 1e300, f64::MAX] {
            assert_eq!(t(big), Ok(Some(Duration::MAX)), "{big}");
        }
        for bad in [1e-12, 1e-300, f64::MIN_POSITIVE] {
            let e = t(bad).unwrap_err();
            assert!(e.contains("1 ns"), "{bad}: {e}");
        }
    }

    #[test]
    fn the_variable_reads_seconds_by_the_same_rule() {
        assert_eq!(parse_timeout(" 2.5 "), Some(Some(Duration::from_millis(2500))));
        assert_eq!(parse_timeout("inf"), Some(Some(Duration::MAX)));
        assert_eq!(parse_timeout("1e300"), Some(Some(Duration::MAX)));
        for bad in ["0", "-1", "NaN", "soon", "1e-10", "1e-300", "2s"] {
            assert_eq!(parse_timeout(bad), None, "{bad}");
        }
        let w = ignored_timeout("2s");
        assert!(w.contains("ASCEND_MOE_COMM_TIMEOUT=\"2s\"") && w.contains("default of 60 s"), "{w}");
        let w = ignored_timeout("-1");
        assert!(w.contains("not a positive number of seconds"), "{w}");
        let w = ignored_timeout("1e-12");
        assert!(w.contains("least timeout, 1 ns"), "{w}");
    }
}
