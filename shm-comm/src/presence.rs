//! Presence: which ranks of a group hold a live handle, also once the
//! group's file is gone.
//!
//! The segment's file is unlinked as soon as every rank has attached, so a
//! later rendezvous under the same name cannot find the running world there.
//! Each rank therefore binds an abstract Unix socket for the lifetime of its
//! handle, named after the group (a hash of its name), the world size, the
//! staging size, its rank and its pid. The kernel releases the name when the
//! handle is dropped or the process dies, SIGKILL included: presence never
//! leaks and never outlives its rank. The bound names are listed in
//! `/proc/net/unix` (abstract names are per network namespace, like the ranks
//! of one host).

use std::io::BufRead;

/// A rank of a group that holds a live handle on this host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    /// Its rank.
    pub rank: usize,
    /// Its world size.
    pub world: usize,
    /// Its staging bytes per slot.
    pub staging: usize,
    /// Its process.
    pub pid: u32,
}

/// FNV-1a hash of a group name: the segment file's and the presence names' key.
pub(crate) fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

fn prefix(hash: u64) -> String {
    format!("ascend-moe/{hash:016x}/")
}

/// One rank's bound presence name; released on drop.
pub(crate) struct Presence {
    fd: libc::c_int,
}

impl Presence {
    /// Binds the presence name of `rank`. `Err(true)` when this very name is
    /// bound already (the same rank of the same world in this process),
    /// `Err(false)` when presence is not available here (no abstract sockets).
    pub(crate) fn announce(hash: u64, m: &Member) -> Result<Presence, bool> {
        let name = format!("{}{}/{}/{}/{}", prefix(hash), m.world, m.staging, m.rank, m.pid);
        // SAFETY: plain socket creation; the fd is owned by the returned value.
        let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(false);
        }
        // SAFETY: sockaddr_un is plain data; zeroed is a valid value.
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        // Abstract name: a leading NUL, then the bytes (no terminator).
        let bytes = name.as_bytes();
        debug_assert!(bytes.len() < addr.sun_path.len());
        for (d, s) in addr.sun_path[1..].iter_mut().zip(bytes) {
            *d = *s as libc::c_char;
        }
        let len = std::mem::size_of::<libc::sa_family_t>() + 1 + bytes.len();
        // SAFETY: addr is a valid sockaddr_un and len covers the family, the
        // NUL and the name, all inside it.
        let r = unsafe {
            libc::bind(fd, &addr as *const libc::sockaddr_un as *const libc::sockaddr, len as libc::socklen_t)
        };
        if r != 0 {
            let in_use = std::io::Error::last_os_error().raw_os_error() == Some(libc::EADDRINUSE);
            // SAFETY: fd is open and owned here.
            unsafe { libc::close(fd) };
            return Err(in_use);
        }
        Ok(Presence { fd })
    }
}

impl Drop for Presence {
    fn drop(&mut self) {
        // SAFETY: fd is open and owned here.
        unsafe { libc::close(self.fd) };
    }
}

/// The ranks of group `name` that hold a live handle on this host (in any
/// world of that name), as their presence names say. Empty where
/// `/proc/net/unix` cannot be read.
pub fn live_members(name: &str) -> Vec<Member> {
    members_of(name_hash(name))
}

pub(crate) fn members_of(hash: u64) -> Vec<Member> {
    let Ok(f) = std::fs::File::open("/proc/net/unix") else { return Vec::new() };
    let want = format!("@{}", prefix(hash));
    let mut out: Vec<Member> = std::io::BufReader::new(f)
        .lines()
        .map_while(|l| l.ok())
        .filter_map(|l| {
            let path = l.split_whitespace().nth(7)?;
            let f: Vec<&str> = path.strip_prefix(&want)?.split('/').collect();
            match f[..] {
                [w, s, r, p] => Some(Member {
                    world: w.parse().ok()?,
                    staging: s.parse().ok()?,
                    rank: r.parse().ok()?,
                    pid: p.parse().ok()?,
                }),
                _ => None,
            }
        })
        .collect();
    out.sort_by_key(|m| (m.rank, m.pid));
    out.dedup();
    out
}
