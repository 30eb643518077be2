//! Worlds of ranks as threads or as processes (the same binary, `worker` subcommand).

use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

use ascend_moe::backend::cpu::check_world_size;

/// What one worker process printed and how it ended.
pub struct ProcOutput {
    pub rank: usize,
    pub status: ExitStatus,
    pub stdout: String,
}

/// A `--timeout` in seconds (fractions allowed): positive, not NaN; more
/// seconds than a `Duration` holds (`inf`) wait without practical bound.
pub fn parse_timeout(s: &str) -> Result<Duration, String> {
    let secs: f64 = s.trim().parse().map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if secs.is_nan() || secs <= 0.0 {
        return Err(format!("{s} seconds: a timeout is a positive number of seconds"));
    }
    Ok(Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX))
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
