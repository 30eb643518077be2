//! Worlds of ranks as threads or as processes (the same binary, `worker` subcommand).

use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

use ascend_moe::backend::cpu::check_world_size;
use ascend_moe::CommOptions;

/// What one worker process printed and how it ended.
pub struct ProcOutput {
    pub rank: usize,
    pub status: ExitStatus,
    pub stdout: String,
}

/// The rank to blame among those whose exit `failed`: one killed by a signal
/// first, then one with a code other than 3 (a worker's own or its peers'
/// failure, which every survivor of a dead rank reports), then any; lowest
/// rank first within each.
pub fn culprit(outs: &[ProcOutput], failed: impl Fn(&ExitStatus) -> bool) -> Option<&ProcOutput> {
    let bad = || outs.iter().filter(|o| failed(&o.status));
    bad()
        .find(|o| o.status.code().is_none())
        .or_else(|| bad().find(|o| o.status.code() != Some(3)))
        .or_else(|| bad().next())
}

/// Why a `--staging-bytes` of `bytes` is refused: under the communicator's
/// least staging slot, which it would be raised to unsaid.
pub fn staging_refusal(bytes: usize) -> Option<String> {
    let least = ascend_moe::backend::cpu::CpuCommConfig::MIN_STAGING;
    (bytes < least).then(|| format!("--staging-bytes {bytes}: must be at least {least}"))
}

/// A `--timeout`: a positive number of seconds (fractions allowed), read as
/// every timeout is ([`CommOptions::timeout_from_secs`]): `inf` (or more
/// seconds than a `Duration` holds) is no limit, under 1 ns is refused. 0,
/// negative values and NaN are refused too: the default is the flag left
/// out.
pub fn parse_timeout(s: &str) -> Result<Duration, String> {
    let secs: f64 = s.trim().parse().map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if secs.is_nan() || secs <= 0.0 {
        return Err(format!(
            "{s} seconds: a timeout is a positive number of seconds (leave --timeout out for the default)"
        ));
    }
    CommOptions::from_secs(secs).map(|o| o.timeout)
}

/// A fresh, unique world name.
pub fn world_name(tag: &str) -> String {
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    format!("{tag}-{}-{nanos}", std::process::id())
}

/// Spawns `world` workers running `task` (arguments after the worker options),
/// waits for all of them and returns their stdout in rank order. Their stderr
/// goes to ours (progress, errors).
pub fn spawn_world(
    world: usize,
    timeout: Duration,
    staging: Option<usize>,
    task: &[String],
) -> Result<Vec<ProcOutput>, String> {
    // Refused before a process starts: every rank would fail its rendezvous.
    check_world_size(world)?;
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this executable: {e}"))?;
    let name = world_name("procs");
    let mut children = Vec::new();
    for rank in 0..world {
        let mut cmd = Command::new(&exe);
        cmd.arg("worker")
            .args(["--name", &name, "--world", &world.to_string(), "--rank", &rank.to_string()])
            .args(["--timeout", &timeout.as_secs_f64().to_string()]);
        if let Some(s) = staging {
            cmd.args(["--staging-bytes", &s.to_string()]);
        }
        cmd.args(task).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        let child = cmd.spawn().map_err(|e| format!("spawning rank {rank}: {e}"))?;
        children.push((rank, child));
    }
    // Read every child concurrently: a rank blocked on a full pipe would stall its peers.
    let handles: Vec<_> = children
        .into_iter()
        .map(|(rank, child)| std::thread::spawn(move || (rank, child.wait_with_output())))
        .collect();
    let mut out = Vec::new();
    for h in handles {
        let (rank, res) = h.join().map_err(|_| "a reader thread panicked".to_string())?;
        let o = res.map_err(|e| format!("waiting for rank {rank}: {e}"))?;
        out.push(ProcOutput { rank, status: o.status, stdout: String::from_utf8_lossy(&o.stdout).into_owned() });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    use super::*;

    fn out(rank: usize, raw: i32) -> ProcOutput {
        ProcOutput { rank, status: ExitStatus::from_raw(raw), stdout: String::new() }
    }

    #[test]
    fn the_culprit_is_the_killed_rank_then_one_not_reporting_a_peer() {
        // wait(2) statuses: exit code c is c << 8, a signal its number.
        let (ok, peer, one, killed) = (0, 3 << 8, 1 << 8, 9);
        let failed = |s: &ExitStatus| !s.success();
        let outs = [out(0, peer), out(1, peer), out(2, killed), out(3, peer)];
        assert_eq!(culprit(&outs, failed).map(|o| o.rank), Some(2));
        let outs = [out(0, peer), out(1, one), out(2, ok)];
        assert_eq!(culprit(&outs, failed).map(|o| o.rank), Some(1));
        let outs = [out(0, ok), out(1, peer), out(2, peer)];
        assert_eq!(culprit(&outs, failed).map(|o| o.rank), Some(1));
        assert!(culprit(&[out(0, ok), out(1, one)], |s| !s.success() && s.code() != Some(1)).is_none());
    }

    #[test]
    fn a_timeout_reads_as_every_timeout_does() {
        assert_eq!(parse_timeout("1e-9"), Ok(Duration::from_nanos(1)));
        for s in ["1e-10", "1e-12", "1e-300"] {
            let e = parse_timeout(s).unwrap_err();
            assert!(e.contains("least timeout, 1 ns"), "{s}: {e}");
        }
        assert_eq!(parse_timeout("inf"), Ok(Duration::MAX));
        assert_eq!(parse_timeout("1e300"), Ok(Duration::MAX));
        for bad in ["0", "-1", "NaN"] {
            assert!(parse_timeout(bad).unwrap_err().contains("a positive number of seconds"), "{bad}");
        }
        assert!(parse_timeout("soon").unwrap_err().contains("not a number"));
    }
}
