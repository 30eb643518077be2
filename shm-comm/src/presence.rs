//! Presence: which ranks of a group hold a live handle, also once the
//! group's file is gone.
//!
//! The segment's file is unlinked as soon as every rank has attached, so a
//! later rendezvous under the same name cannot find the running world there.
//! Each rank therefore binds an abstract Unix socket for the lifetime of its
//! handle, named after the group (a hash of its name), the world size, the
//! staging size, its rank, its pid, the start time of that process and a
//! random nonce. The kernel releases the name when the handle is dropped or
//! the process dies, SIGKILL included. A child forked without exec closes its
//! copy of the socket at once ([`crate::process::tracked`]), so the name goes
//! with the handle also while such children live. Where one keeps a copy all
//! the same (a fork that skips the `pthread_atfork` handlers), a name whose
//! process (pid and start time) is gone does not count, so presence never
//! outlives its rank's process.
//!
//! Any local user can bind an abstract name, so names are trusted by their
//! owner, not by their text: the bound names and the uid of each socket come
//! from the kernel's socket diagnostics (`NETLINK_SOCK_DIAG`, `UDIAG_SHOW_UID`,
//! Linux 5.3 and later), and only sockets of this process's effective uid count
//! as members. Another user's names are ignored, so they can neither pose as a
//! running world nor make a rendezvous wait; the nonce keeps them from taking
//! the name a rank is about to bind. Where the kernel cannot tell a socket's
//! uid, presence is not used at all (as where abstract sockets are missing): a
//! running world is then only found while its file exists. Abstract names are
//! per network namespace, like the ranks of one host.

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

/// A random 64-bit value from the kernel (0 if it cannot give one).
fn nonce() -> u64 {
    let mut v = 0u64;
    // SAFETY: the buffer is the 8 bytes of v; getrandom writes at most that.
    let n = unsafe { libc::getrandom(&mut v as *mut u64 as *mut libc::c_void, 8, 0) };
    if n == 8 {
        v
    } else {
        0
    }
}

/// One rank's bound presence name; released on drop.
pub(crate) struct Presence {
    fd: libc::c_int,
    /// The process that bound it (a child forked later holds a copy of this
    /// value, not of the socket).
    owner: u32,
}

impl Presence {
    /// Binds a presence name of `m`, whose process started at `start` (a
    /// fresh nonce each time); `None` where abstract Unix sockets are not
    /// available.
    pub(crate) fn announce(hash: u64, m: &Member, start: u64) -> Option<Presence> {
        for _ in 0..4 {
            let (w, s, r, p) = (m.world, m.staging, m.rank, m.pid);
            let name = format!("{}{w}/{s}/{r}/{p}/{start}/{:016x}", prefix(hash), nonce());
            match bind_abstract(&name) {
                Ok(fd) => return Some(Presence { fd, owner: std::process::id() }),
                // Taken (only by chance, the nonce being random): draw another.
                Err(true) => continue,
                Err(false) => return None,
            }
        }
        None
    }
}

/// A datagram socket bound to abstract name `name`: `Err(true)` when the name
/// is taken, `Err(false)` when the socket cannot be made or bound otherwise.
fn bind_abstract(name: &str) -> Result<libc::c_int, bool> {
    // SAFETY: plain socket creation; the fd is owned by the caller on
    // success. Tracked, so that no forked child keeps the name bound.
    let fd =
        crate::process::tracked(|| unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) });
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
    // SAFETY: addr is a valid sockaddr_un and len covers the family, the NUL
    // and the name, all inside it.
    let r =
        unsafe { libc::bind(fd, &addr as *const libc::sockaddr_un as *const libc::sockaddr, len as libc::socklen_t) };
    if r != 0 {
        let in_use = std::io::Error::last_os_error().raw_os_error() == Some(libc::EADDRINUSE);
        crate::process::close_fd(fd);
        return Err(in_use);
    }
    Ok(fd)
}

impl Drop for Presence {
    fn drop(&mut self) {
        // A forked child's copy was closed by the fork.
        crate::process::close_owned_fd(self.fd, self.owner);
    }
}

/// The ranks of group `name` that hold a live handle on this host (in any
/// world of that name) and belong to this user, as their presence names say
/// (names of processes that have ended, held on by a child that kept a
/// copy, do not count). Empty where the kernel cannot list sockets with their owners.
pub fn live_members(name: &str) -> Vec<Member> {
    members_of(name_hash(name))
}

pub(crate) fn members_of(hash: u64) -> Vec<Member> {
    let me = crate::process::my_uid();
    // In a user namespace where this user is the overflow uid, every user
    // the namespace does not map shows as this one (user_namespaces(7)):
    // their sockets' names cannot be told from this user's, and another
    // user could pose as live ranks of any name. Presence tells nothing
    // there, as where the kernel cannot list sockets with their owners.
    if crate::file::unmapped_uid() == Some(me) {
        return Vec::new();
    }
    let Some(names) = sock_diag::abstract_names_of(me) else { return Vec::new() };
    let want = prefix(hash);
    let mut out: Vec<Member> = names
        .iter()
        .filter_map(|n| {
            let f: Vec<&str> = std::str::from_utf8(n).ok()?.strip_prefix(&want)?.split('/').collect();
            let [w, s, r, p, start, _nonce] = f[..] else { return None };
            let m = Member {
                world: w.parse().ok()?,
                staging: s.parse().ok()?,
                rank: r.parse().ok()?,
                pid: p.parse().ok()?,
            };
            // A child that kept a copy of the socket may hold the name after
            // the rank's process ended.
            crate::process::pid_alive(m.pid, start.parse().ok()?).then_some(m)
        })
        .collect();
    out.sort_by_key(|m| (m.rank, m.pid));
    out.dedup();
    out
}

/// The kernel's Unix socket diagnostics (`linux/sock_diag.h`,
/// `linux/unix_diag.h`): one dump of every Unix socket of this network
/// namespace with its name and the uid that created it.
mod sock_diag {
    /// `SOCK_DIAG_BY_FAMILY` (linux/sock_diag.h).
    const SOCK_DIAG_BY_FAMILY: u16 = 20;
    /// `UDIAG_SHOW_NAME | UDIAG_SHOW_UID` (linux/unix_diag.h).
    const SHOW: u32 = 0x1 | 0x40;
    /// Attribute types `UNIX_DIAG_NAME` and `UNIX_DIAG_UID` (linux/unix_diag.h).
    const ATTR_NAME: u16 = 0;
    const ATTR_UID: u16 = 7;
    /// `sizeof(struct unix_diag_msg)`.
    const MSG_LEN: usize = 16;

    /// `struct unix_diag_req`.
    #[repr(C)]
    struct UnixDiagReq {
        family: u8,
        protocol: u8,
        pad: u16,
        states: u32,
        ino: u32,
        show: u32,
        cookie: [u32; 2],
    }

    #[repr(C)]
    struct Request {
        hdr: libc::nlmsghdr,
        req: UnixDiagReq,
    }

    struct Fd(libc::c_int);

    impl Drop for Fd {
        fn drop(&mut self) {
            // SAFETY: the descriptor is open and owned here.
            unsafe { libc::close(self.0) };
        }
    }

    fn u16_at(b: &[u8], at: usize) -> Option<u16> {
        Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
    }

    fn u32_at(b: &[u8], at: usize) -> Option<u32> {
        Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
    }

    fn align4(n: usize) -> usize {
        (n + 3) & !3
    }

    /// The abstract names (without the leading NUL) of the Unix sockets that
    /// `uid` created; `None` when the kernel gives no dump or no socket uids.
    pub(super) fn abstract_names_of(uid: u32) -> Option<Vec<Vec<u8>>> {
        // SAFETY: plain socket creation; the fd is owned by `fd`.
        let raw =
            unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, libc::NETLINK_SOCK_DIAG) };
        if raw < 0 {
            return None;
        }
        let fd = Fd(raw);
        // A dump from the kernel never waits on anyone; still, bound every receive.
        let tv = libc::timeval { tv_sec: 2, tv_usec: 0 };
        // SAFETY: tv is a valid timeval of the size passed.
        unsafe {
            libc::setsockopt(
                fd.0,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                &tv as *const libc::timeval as *const libc::c_void,
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        let req = Request {
            hdr: libc::nlmsghdr {
                nlmsg_len: std::mem::size_of::<Request>() as u32,
                nlmsg_type: SOCK_DIAG_BY_FAMILY,
                nlmsg_flags: (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16,
                nlmsg_seq: 1,
                nlmsg_pid: 0,
            },
            req: UnixDiagReq {
                family: libc::AF_UNIX as u8,
                protocol: 0,
                pad: 0,
                states: u32::MAX,
                ino: 0,
                show: SHOW,
                cookie: [u32::MAX; 2],
            },
        };
        // SAFETY: sockaddr_nl is plain data; zeroed (pid 0: the kernel) is valid.
        let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: req and kernel are valid for the sizes passed.
        let sent = unsafe {
            libc::sendto(
                fd.0,
                &req as *const Request as *const libc::c_void,
                std::mem::size_of::<Request>(),
                0,
                &kernel as *const libc::sockaddr_nl as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if sent < 0 {
            return None;
        }
        let mut names = Vec::new();
        let mut saw_uid = false;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            // SAFETY: buf is valid for its length.
            let n = unsafe { libc::recv(fd.0, buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0) };
            if n <= 0 {
                return None;
            }
            let data = &buf[..n as usize];
            let mut at = 0;
            while at + 16 <= data.len() {
                let len = u32_at(data, at)? as usize;
                let kind = u16_at(data, at + 4)?;
                if len < 16 || at + len > data.len() {
                    return None;
                }
                match kind {
                    k if k == libc::NLMSG_DONE as u16 => return saw_uid.then_some(names),
                    k if k == libc::NLMSG_ERROR as u16 => return None,
                    SOCK_DIAG_BY_FAMILY => {
                        let msg = &data[at + 16..at + len];
                        let (mut name, mut owner) = (None, None);
                        let mut a = MSG_LEN;
                        while a + 4 <= msg.len() {
                            let alen = u16_at(msg, a)? as usize;
                            let akind = u16_at(msg, a + 2)?;
                            if alen < 4 || a + alen > msg.len() {
                                break;
                            }
                            let payload = &msg[a + 4..a + alen];
                            match akind {
                                ATTR_NAME => name = Some(payload),
                                ATTR_UID => owner = u32_at(payload, 0),
                                _ => {}
                            }
                            a += align4(alen);
                        }
                        saw_uid |= owner.is_some();
                        if let (Some(&[0, ref rest @ ..]), Some(o)) = (name, owner) {
                            if o == uid {
                                names.push(rest.to_vec());
                            }
                        }
                    }
                    _ => {}
                }
                at += align4(len);
            }
        }
    }
}
