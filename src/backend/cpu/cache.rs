//! What the CPU kernels ask of the host's caches.

use std::sync::OnceLock;

/// The largest data or unified CPU cache Linux reports for CPU 0 (sysfs
/// `cpu0/cache/index*`: `level`, `type`, `size`), in bytes; `None` where it
/// reports none. Read once per process.
pub fn last_level_cache_bytes() -> Option<usize> {
    static LLC: OnceLock<Option<usize>> = OnceLock::new();
    *LLC.get_or_init(read_last_level_cache)
}

fn read_last_level_cache() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    let mut best: Option<(u32, usize)> = None;
    for entry in dir.flatten() {
        let path = entry.path();
        if !entry.file_name().to_string_lossy().starts_with("index") {
            continue;
        }
        let read = |f: &str| std::fs::read_to_string(path.join(f)).ok().map(|v| v.trim().to_string());
        let (Some(level), Some(kind), Some(size)) = (read("level"), read("type"), read("size")) else { continue };
        let (Ok(level), Some(size)) = (level.parse::<u32>(), cache_size_bytes(&size)) else { continue };
        if kind != "Instruction" && best.map_or(true, |b| (level, size) > b) {
            best = Some((level, size));
        }
    }
    best.map(|(_, size)| size)
}

/// A sysfs cache size (`"491520K"`, `"32M"`, `"1G"`, or plain bytes) in bytes.
fn cache_size_bytes(s: &str) -> Option<usize> {
    let (digits, unit) = match s.as_bytes().last()? {
        b'K' => (&s[..s.len() - 1], 1 << 10),
        b'M' => (&s[..s.len() - 1], 1 << 20),
        b'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    digits.parse::<usize>().ok()?.checked_mul(unit)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// sysfs sizes parse with their unit; anything else is no size.
    #[test]
    fn cache_sizes_parse_with_their_unit() {
        assert_eq!(cache_size_bytes("491520K"), Some(480 << 20));
        assert_eq!(cache_size_bytes("32M"), Some(32 << 20));
        assert_eq!(cache_size_bytes("1G"), Some(1 << 30));
        assert_eq!(cache_size_bytes("4096"), Some(4096));
        for bad in ["", "K", "12Q", "-1K", "1.5M"] {
            assert_eq!(cache_size_bytes(bad), None, "{bad:?}");
        }
    }
}
