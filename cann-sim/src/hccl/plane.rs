//! The data plane of the simulated HCCL: how the ranks of one communicator,
//! threads of one process or separate processes alike, meet and exchange bytes.
//!
//! A communicator is a set of files in `/dev/shm` (the temporary directory when
//! there is none), named after its rendezvous key:
//! - a header, mapped shared by every rank: the world size, and one slot per
//!   rank with its process id, its join stage and two generation counters
//!   (`arrived`, `departed`);
//! - one data file per rank, written only by that rank and read by all.
//!
//! Joining: each rank claims its slot, records its device, creates its data
//! file, waits for every rank to do the same, checks that no two ranks share a
//! device, opens every data file, and waits again; then rank 0 unlinks all the
//! files (the open descriptors and mappings keep them), so a crashed run
//! leaves nothing behind.
//!
//! A collective is one round, generation `g`:
//! 1. wait until every rank has departed round `g - 1` (nobody still reads this
//!    rank's data file);
//! 2. write `[g, descriptor length, descriptor words..., payload]` to the own
//!    data file, then publish `arrived = g` ([`Group::publish`]);
//! 3. wait until every rank has arrived at `g`;
//! 4. read every rank's descriptor, check that they agree, read the payload
//!    bytes needed and compute the result locally;
//! 5. publish `departed = g` ([`Group::complete`]).
//!
//! The join is bounded by the connect timeout, every round by the round
//! timeout the group was joined with (`HCCL_E_TIMEOUT`, naming the missing
//! ranks; no bound when HCCL's execution timeout is 0, "never"), and every
//! wait notices a peer process that exited (`HCCL_E_REMOTE`). Waiting polls:
//! a few yields, then short sleeps.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::ffi::*;
use crate::status::{fail, SimError, SimResult};

const MAGIC: u64 = u64::from_le_bytes(*b"CSIMHCCL");
/// Bytes of the header before the slots, and of one slot (a cache line each,
/// so ranks polling their counters do not share lines).
const LINE: usize = 64;

/// The start of the header file.
#[repr(C)]
struct Head {
    magic: AtomicU64,
    world: AtomicU64,
}

/// One rank's slot in the header file.
#[repr(C)]
struct Slot {
    /// 1 once a rank took this slot.
    claimed: AtomicU32,
    /// Its process id.
    pid: AtomicU32,
    /// The host device behind its current device (set before `stage`
    /// becomes 1).
    device: AtomicU32,
    /// 1: its data file exists; 2: it opened every data file.
    stage: AtomicU64,
    /// Last round whose data it published.
    arrived: AtomicU64,
    /// Last round it finished reading.
    departed: AtomicU64,
}

const _: () = assert!(std::mem::size_of::<Head>() <= LINE && std::mem::size_of::<Slot>() <= LINE);

/// The header file mapped shared.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is only accessed through atomics.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len are the live mapping made in `Mapping::new`, unmapped once.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

fn sys(what: String, e: std::io::Error) -> SimError {
    SimError::new(HCCL_E_SYSCALL, format!("{what}: {e}"))
}

impl Mapping {
    fn new(file: &File, len: usize, what: &str) -> SimResult<Mapping> {
        use std::os::fd::AsRawFd;
        // SAFETY: a shared read-write mapping of `len` bytes of an open file the
        // caller sized to at least `len`; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(sys(format!("mmap of {what}"), std::io::Error::last_os_error()));
        }
        Ok(Mapping { ptr: p as *mut u8, len })
    }

    fn head(&self) -> &Head {
        // SAFETY: the mapping is page-aligned and at least LINE bytes; every bit
        // pattern is a valid atomic.
        unsafe { &*(self.ptr as *const Head) }
    }

    fn slot(&self, rank: u32) -> &Slot {
        let off = LINE * (1 + rank as usize);
        assert!(off + LINE <= self.len, "slot {rank} lies outside the header mapping");
        // SAFETY: in bounds (checked above), 64-byte aligned; every bit pattern
        // is a valid atomic.
        unsafe { &*(self.ptr.add(off) as *const Slot) }
    }
}

/// The directory of the communicator files.
fn shm_dir() -> PathBuf {
    let shm = PathBuf::from("/dev/shm");
    if shm.is_dir() {
        shm
    } else {
        std::env::temp_dir()
    }
}

/// How many times this process joined `key` as `rank` before: the members of
/// a group make the same sequence of joins, so the count names the same files
/// on every rank even when a key is joined again.
fn next_epoch(key: &str, rank: u32) -> u32 {
    static JOINS: Mutex<Option<HashMap<(String, u32), u32>>> = Mutex::new(None);
    let mut g = JOINS.lock().unwrap_or_else(|e| e.into_inner());
    let n = g.get_or_insert_with(HashMap::new).entry((key.to_string(), rank)).or_insert(0);
    *n += 1;
    *n
}

/// Whether process `pid` still runs (a zombie does not).
fn alive(pid: u32) -> bool {
    if pid == 0 || pid == std::process::id() {
        return true;
    }
    // SAFETY: signal 0 only checks that the process exists.
    if unsafe { libc::kill(pid as libc::pid_t, 0) } != 0
        && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
    {
        return false;
    }
    // An exited process not yet reaped by its parent still answers kill; its
    // state in /proc/PID/stat (the field after the parenthesised name) is Z.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s
            .rsplit_once(')')
            .is_some_and(|(_, rest)| matches!(rest.trim_start().as_bytes().first(), Some(b'Z' | b'X'))),
        Err(_) => true,
    }
}

/// `timeout` from now; `None` (or one past what an `Instant` holds): a
/// year, i.e. no bound.
fn deadline_after(timeout: Option<Duration>) -> Instant {
    let now = Instant::now();
    let year = Duration::from_secs(365 * 24 * 3600);
    timeout.and_then(|t| now.checked_add(t)).unwrap_or_else(|| now + year)
}

/// One rank's membership of a communicator.
pub struct Group {
    name: String,
    rank: u32,
    size: u32,
    /// Bound of each round (`None`: none).
    timeout: Option<Duration>,
    header: Mapping,
    own: File,
    files: Vec<File>,
    generation: u64,
    /// When the current round times out.
    deadline: Instant,
    /// Whether reductions combine the ranks in one fixed order
    /// (`hcclDeterministic` / `HCCL_DETERMINISTIC`, see `collectives.rs`).
    pub deterministic: bool,
}

/// Appends a round's payload to this rank's data file.
pub struct Writer<'a> {
    group: &'a Group,
    at: u64,
}

impl Writer<'_> {
    /// Appends `bytes`.
    pub fn append(&mut self, bytes: &[u8]) -> SimResult<()> {
        let rank = self.group.rank;
        self.group.own.write_all_at(bytes, self.at).map_err(|e| sys(format!("write rank {rank}'s data"), e))?;
        self.at += bytes.len() as u64;
        Ok(())
    }
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Group({} rank {}/{}, round {})", self.name, self.rank, self.size, self.generation)
    }
}

/// Files of a group.
struct Paths {
    header: PathBuf,
    base: String,
}

impl Paths {
    fn data(&self, rank: u32) -> PathBuf {
        PathBuf::from(format!("{}.{rank}", self.base))
    }

    fn remove(&self, ranks: impl Iterator<Item = u32>) {
        let _ = std::fs::remove_file(&self.header);
        for r in ranks {
            let _ = std::fs::remove_file(self.data(r));
        }
    }
}

impl Group {
    /// Joins the communicator `key` as `rank` of `size` on host device
    /// `device` (the physical id behind the rank's current device), waiting
    /// up to `connect` for the other ranks; each round then waits up to
    /// `timeout` (`None`: without bound).
    pub fn join(
        key: &str,
        size: u32,
        rank: u32,
        device: u32,
        connect: Duration,
        timeout: Option<Duration>,
    ) -> SimResult<Group> {
        if size == 0 || rank >= size {
            return fail(HCCL_E_PARA, format!("rank {rank} of {size} ranks"));
        }
        let base = shm_dir().join(format!("cannsim-hccl-{key}-{}", next_epoch(key, rank)));
        let base = base.to_string_lossy().into_owned();
        let paths = Paths { header: PathBuf::from(format!("{base}.head")), base };
        Self::join_files(&paths, key, (size, rank, device), connect, timeout)
    }

    fn join_files(
        paths: &Paths,
        key: &str,
        (size, rank, device): (u32, u32, u32),
        connect: Duration,
        timeout: Option<Duration>,
    ) -> SimResult<Group> {
        let deadline = deadline_after(Some(connect));
        let what = paths.header.display().to_string();
        let head = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&paths.header)
            .map_err(|e| sys(format!("open {what}"), e))?;
        let len = LINE * (1 + size as usize);
        let have = head.metadata().map_err(|e| sys(format!("stat {what}"), e))?.len();
        if have < len as u64 {
            head.set_len(len as u64).map_err(|e| sys(format!("resize {what}"), e))?;
        }
        let header = Mapping::new(&head, len, &what)?;
        let h = header.head();
        if let Err(m) = h.magic.compare_exchange(0, MAGIC, Ordering::AcqRel, Ordering::Acquire) {
            if m != MAGIC {
                return fail(HCCL_E_INTERNAL, format!("{what} is not a communicator header"));
            }
        }
        if let Err(w) = h.world.compare_exchange(0, size as u64, Ordering::AcqRel, Ordering::Acquire) {
            if w != size as u64 {
                return fail(HCCL_E_PARA, format!("rank {rank} joins {key} with {size} ranks, another rank with {w}"));
            }
        }
        let slot = header.slot(rank);
        if slot.claimed.compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire).is_err() {
            return fail(HCCL_E_PARA, format!("rank {rank} of {key} is claimed twice"));
        }
        slot.pid.store(std::process::id(), Ordering::Release);
        slot.device.store(device, Ordering::Release);
        let own_path = paths.data(rank);
        let own = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&own_path)
            .map_err(|e| sys(format!("create {}", own_path.display()), e))?;
        slot.stage.store(1, Ordering::Release);
        let mut g = Group {
            name: key.to_string(),
            rank,
            size,
            timeout,
            header,
            own,
            files: Vec::new(),
            generation: 0,
            deterministic: false,
            deadline,
        };
        let r = g.meet(paths, deadline);
        if r.is_err() {
            // A failed join removes the files it made; the ranks that did not
            // come either time out on the files they still hold or start over.
            paths.remove(std::iter::once(rank));
        }
        r.map(|()| g)
    }

    /// The rest of the join, once this rank's data file exists: wait for
    /// every rank's, open them all, and wait until every rank has.
    fn meet(&mut self, paths: &Paths, deadline: Instant) -> SimResult<()> {
        self.wait_all("every rank to join", deadline, |s| s.stage.load(Ordering::Acquire) >= 1)?;
        self.distinct_devices()?;
        for r in 0..self.size {
            let p = paths.data(r);
            self.files.push(File::open(&p).map_err(|e| sys(format!("open {}", p.display()), e))?);
        }
        self.header.slot(self.rank).stage.store(2, Ordering::Release);
        self.wait_all("every rank to open the data files", deadline, |s| s.stage.load(Ordering::Acquire) >= 2)?;
        if self.rank == 0 {
            paths.remove(0..self.size);
        }
        Ok(())
    }

    /// Refuses two ranks on one device, on every rank alike, once every rank
    /// has joined (before any opens a peer's data file, so all refuse).
    ///
    /// HCCL gathers every rank's server (host IP) and device physical id
    /// while it creates a communicator from a root info, and each rank then
    /// verifies the whole table: two ranks of one server with the same
    /// physical id fail the creation with HCCL_E_PARA (EI0015, "rank[a] and
    /// rank[b] has the same device physic id[d]"). hicann/hcomm v8.5.0
    /// `src/framework/common/src/topo/topoinfo_exchange_agent.cc:822-849`
    /// (`VerifyServerDevicePhysicID`), called per server at `:623-649` from
    /// `VerifyClusterInfo`, which every rank runs on the gathered table at
    /// `:94-109` (`Setup`); the rank's physical id is that of its current
    /// device (`topoinfo_detect.cc:476-480`), its server its host IP
    /// (`topoinfo_exchange_agent.cc:500-502`); `HcclCommInitRootInfo[Config]`
    /// reach it through `InitCommRootInfo` (`op_base.cc:1137`) and return its
    /// code. The simulated ranks share one host; a rank's physical id is the
    /// host device behind its current device, which `ASCEND_RT_VISIBLE_DEVICES`
    /// decides ([`crate::config::visible_devices`]), so ranks with device 0 in
    /// processes that see different devices are apart, and ranks that see one
    /// host device under two ids are not.
    fn distinct_devices(&self) -> SimResult<()> {
        let device = |r: u32| self.header.slot(r).device.load(Ordering::Acquire);
        for a in 0..self.size {
            for b in a + 1..self.size {
                if device(a) == device(b) {
                    return fail(
                        HCCL_E_PARA,
                        format!(
                            "EI0015: rank {a} and rank {b} of {} are both on physical device {} (HCCL refuses two \
                             ranks of one communicator on one device)",
                            self.name,
                            device(a)
                        ),
                    );
                }
            }
        }
        Ok(())
    }

    /// Waits until `done` holds for every rank's slot.
    fn wait_all(&self, what: &str, deadline: Instant, done: impl Fn(&Slot) -> bool) -> SimResult<()> {
        let mut polls = 0u32;
        loop {
            let pending = |r: &u32| !done(self.header.slot(*r));
            if !(0..self.size).any(|r| pending(&r)) {
                return Ok(());
            }
            let missing = || (0..self.size).filter(pending).collect::<Vec<_>>();
            if polls % 256 == 255 {
                for r in missing() {
                    let pid = self.header.slot(r).pid.load(Ordering::Acquire);
                    if !alive(pid) {
                        return fail(
                            HCCL_E_REMOTE,
                            format!("rank {r} of {} (process {pid}) exited while waiting for {what}", self.name),
                        );
                    }
                }
            }
            if Instant::now() >= deadline {
                return fail(
                    HCCL_E_TIMEOUT,
                    format!(
                        "rank {} of {} timed out waiting for {what}: ranks {:?} are missing",
                        self.rank,
                        self.name,
                        missing()
                    ),
                );
            }
            if polls < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
            polls = polls.wrapping_add(1);
        }
    }

    /// The bound of each round (`None`: none).
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// Runs `f` (a round) with `timeout` as its bound in place of the group's.
    pub fn with_timeout<R>(&mut self, timeout: Option<Duration>, f: impl FnOnce(&mut Self) -> R) -> R {
        let kept = std::mem::replace(&mut self.timeout, timeout);
        let r = f(self);
        self.timeout = kept;
        r
    }

    /// Starts a round: waits until every rank read the previous one, then
    /// writes `desc` and what `payload` appends to this rank's data file and
    /// announces it. [`Group::complete`] ends the round.
    pub fn publish(&mut self, desc: &[u64], payload: impl FnOnce(&mut Writer<'_>) -> SimResult<()>) -> SimResult<()> {
        self.deadline = deadline_after(self.timeout);
        let g = self.generation + 1;
        self.wait_all("the previous collective's data to be read", self.deadline, |s| {
            s.departed.load(Ordering::Acquire) >= g - 1
        })?;
        let mut head: Vec<u8> = Vec::with_capacity(8 * (2 + desc.len()));
        for w in [g, desc.len() as u64].iter().chain(desc) {
            head.extend_from_slice(&w.to_le_bytes());
        }
        let mut w = Writer { group: self, at: 0 };
        w.append(&head)?;
        payload(&mut w)?;
        self.generation = g;
        self.header.slot(self.rank).arrived.store(g, Ordering::Release);
        Ok(())
    }

    /// Ends the round [`Group::publish`] started: waits for every rank's data,
    /// runs `finish` on it, and lets the ranks write the next round.
    pub fn complete<T>(&mut self, finish: impl FnOnce(&Round<'_>) -> SimResult<T>) -> SimResult<T> {
        let g = self.generation;
        self.wait_all("every rank to arrive", self.deadline, |s| s.arrived.load(Ordering::Acquire) >= g)?;
        let r = (|| {
            let descs = (0..self.size).map(|r| self.read_desc(r, g)).collect::<SimResult<Vec<_>>>()?;
            finish(&Round { group: self, descs })
        })();
        self.header.slot(self.rank).departed.store(g, Ordering::Release);
        r
    }

    fn read_desc(&self, rank: u32, g: u64) -> SimResult<Vec<u64>> {
        let words = |at: u64, n: usize| -> SimResult<Vec<u64>> {
            let mut b = vec![0u8; 8 * n];
            self.files[rank as usize]
                .read_exact_at(&mut b, at)
                .map_err(|e| sys(format!("read rank {rank}'s descriptor"), e))?;
            Ok(b.chunks_exact(8)
                .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                .collect())
        };
        let top = words(0, 2)?;
        if top[0] != g {
            return fail(HCCL_E_INTERNAL, format!("rank {rank} published round {} for round {g}", top[0]));
        }
        words(16, top[1] as usize)
    }
}

/// What the ranks published in one round.
pub struct Round<'a> {
    group: &'a Group,
    /// Every rank's descriptor, by rank.
    pub descs: Vec<Vec<u64>>,
}

impl Round<'_> {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.group.rank as usize
    }

    /// The round's number on this communicator (1 for its first
    /// collective): the same on every rank, since all make the same calls.
    pub fn number(&self) -> u64 {
        self.group.generation
    }

    /// Whether the communicator reduces deterministically.
    pub fn deterministic(&self) -> bool {
        self.group.deterministic
    }

    /// Fills `dst` with payload bytes of `rank`, from byte `offset` of its payload.
    pub fn read_into(&self, rank: usize, offset: usize, dst: &mut [u8]) -> SimResult<()> {
        let at = 8 * (2 + self.descs[rank].len()) + offset;
        self.group.files[rank]
            .read_exact_at(dst, at as u64)
            .map_err(|e| sys(format!("read {} bytes at {offset} of rank {rank}'s payload", dst.len()), e))
    }
}
