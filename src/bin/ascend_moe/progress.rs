//! Progress of a long benchmark on stderr: a bar redrawn in place when stderr is a
//! terminal, one plain line per finished case otherwise (logs, pipes, CI).

use std::io::{IsTerminal, Write};
use std::time::Instant;

/// Counts finished cases out of a known total and shows elapsed time and an estimate of
/// the time left.
pub struct Progress {
    total: usize,
    done: usize,
    start: Instant,
    tty: bool,
}

impl Progress {
    /// A progress display for `total` cases.
    pub fn new(total: usize) -> Self {
        Progress { total, done: 0, start: Instant::now(), tty: std::io::stderr().is_terminal() }
    }

    /// One case finished; `what` describes it (e.g. "4 ranks all_reduce 32 MiB 12.1 ms").
    pub fn step(&mut self, what: &str) {
        self.done = (self.done + 1).min(self.total.max(1));
        let elapsed = self.start.elapsed().as_secs_f64();
        let left = if self.done > 0 { elapsed / self.done as f64 * (self.total - self.done) as f64 } else { 0.0 };
        let mut err = std::io::stderr().lock();
        if self.tty {
            const WIDTH: usize = 24;
            let filled = WIDTH * self.done / self.total.max(1);
            let bar: String = "#".repeat(filled) + &"-".repeat(WIDTH - filled);
            // Clear the line, redraw; the final newline comes from `finish`.
            let _ =
                write!(err, "\r\x1b[2K[{bar}] {}/{} {elapsed:.0}s, ~{left:.0}s left  {what}", self.done, self.total);
        } else {
            let _ = writeln!(err, "[{}/{}] {elapsed:.0}s, ~{left:.0}s left  {what}", self.done, self.total);
        }
        let _ = err.flush();
    }

    /// Ends the bar's line (terminal only).
    pub fn finish(&self) {
        if self.tty {
            eprintln!();
        }
    }
}
