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
    /// to [`CommOptions::DEFAULT_TIMEOUT`] when unset or unparsable.
    pub fn from_env() -> Self {
        let timeout = std::env::var("ASCEND_MOE_COMM_TIMEOUT")
            .ok()
            .and_then(|s| s.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(Duration::from_secs_f64)
            .unwrap_or(Self::DEFAULT_TIMEOUT);
        CommOptions { timeout }
    }

    /// Options with the given timeout.
    pub fn with_timeout(timeout: Duration) -> Self {
        CommOptions { timeout }
    }
}
