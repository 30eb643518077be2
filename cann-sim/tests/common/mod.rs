//! Loads the built simulator (`libcann_sim.so`) through libloading.
//!
//! The library is found, in order, at `$CANNSIM_LIB`, next to the test binary
//! (`target/<profile>/deps/`), or one directory up (`target/<profile>/`).
//! `cargo test -p cann-sim` builds it before the tests run.

#![allow(dead_code, non_snake_case, clippy::missing_safety_doc)]

use std::ffi::{c_char, c_void, CStr};
use std::path::PathBuf;
use std::sync::OnceLock;

pub type Ptr = *mut c_void;

macro_rules! api {
    ($($name:ident : fn($($arg:ty),*) -> $ret:ty;)*) => {
        pub struct Api {
            $(pub $name: unsafe extern "C" fn($($arg),*) -> $ret,)*
            _lib: libloading::Library,
        }
        impl Api {
            fn load(lib: libloading::Library) -> Api {
                // SAFETY: each symbol is looked up with its C signature from the
                // symbol contract; the library stays loaded for the process.
                unsafe {
                    Api {
                        $($name: *lib
                            .get::<unsafe extern "C" fn($($arg),*) -> $ret>(concat!(stringify!($name), "\0").as_bytes())
                            .unwrap_or_else(|e| panic!("symbol {} missing: {e}", stringify!($name))),)*
                        _lib: lib,
                    }
                }
            }
        }
    };
}

pub type KernelEntry = unsafe extern "C" fn(u32, u32, *const Ptr, *const c_void);
pub type KernelEntryEx = unsafe extern "C" fn(u32, u32, *const Ptr, *const c_void, *mut c_char, usize) -> i32;

api! {
    aclInit: fn(*const c_char) -> i32;
    aclFinalize: fn() -> i32;
    aclrtSetDevice: fn(i32) -> i32;
    aclrtResetDevice: fn(i32) -> i32;
    aclrtGetDevice: fn(*mut i32) -> i32;
    aclrtGetDeviceCount: fn(*mut u32) -> i32;
    aclrtCreateStream: fn(*mut Ptr) -> i32;
    aclrtDestroyStream: fn(Ptr) -> i32;
    aclrtSynchronizeStream: fn(Ptr) -> i32;
    aclrtSynchronizeStreamWithTimeout: fn(Ptr, i32) -> i32;
    aclrtStreamWaitEvent: fn(Ptr, Ptr) -> i32;
    aclrtMalloc: fn(*mut Ptr, usize, i32) -> i32;
    aclrtFree: fn(Ptr) -> i32;
    aclrtMallocHost: fn(*mut Ptr, usize) -> i32;
    aclrtFreeHost: fn(Ptr) -> i32;
    aclrtMemcpy: fn(Ptr, usize, *const c_void, usize, i32) -> i32;
    aclrtMemcpyAsync: fn(Ptr, usize, *const c_void, usize, i32, Ptr) -> i32;
    aclrtMemset: fn(Ptr, usize, i32, usize) -> i32;
    aclrtMemsetAsync: fn(Ptr, usize, i32, usize, Ptr) -> i32;
    aclrtGetMemInfo: fn(i32, *mut usize, *mut usize) -> i32;
    aclrtCreateEvent: fn(*mut Ptr) -> i32;
    aclrtCreateEventExWithFlag: fn(*mut Ptr, u32) -> i32;
    aclrtRecordEvent: fn(Ptr, Ptr) -> i32;
    aclrtSynchronizeEvent: fn(Ptr) -> i32;
    aclrtQueryEventStatus: fn(Ptr, *mut i32) -> i32;
    aclrtEventElapsedTime: fn(*mut f32, Ptr, Ptr) -> i32;
    aclrtDestroyEvent: fn(Ptr) -> i32;
    aclGetRecentErrMsg: fn() -> *const c_char;
    aclrtGetLastError: fn(i32) -> i32;
    aclrtPeekAtLastError: fn(i32) -> i32;
    aclrtGetSocName: fn() -> *const c_char;
    aclrtGetVersion: fn(*mut i32, *mut i32, *mut i32) -> i32;
    aclCreateTensor: fn(*const i64, u64, i32, *const i64, i64, i32, *const i64, u64, Ptr) -> Ptr;
    aclDestroyTensor: fn(*const c_void) -> i32;
    aclCreateScalar: fn(Ptr, i32) -> Ptr;
    aclDestroyScalar: fn(*const c_void) -> i32;
    aclnnMoeFinalizeRoutingV2GetWorkspaceSize: fn(Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, i64, Ptr, *mut u64, *mut Ptr) -> i32;
    aclnnMoeFinalizeRoutingV2: fn(Ptr, u64, Ptr, Ptr) -> i32;
    aclnnMoeTokenUnpermuteGetWorkspaceSize: fn(Ptr, Ptr, Ptr, bool, Ptr, Ptr, *mut u64, *mut Ptr) -> i32;
    aclnnMoeTokenUnpermute: fn(Ptr, u64, Ptr, Ptr) -> i32;
    aclnnAddGetWorkspaceSize: fn(Ptr, Ptr, Ptr, Ptr, *mut u64, *mut Ptr) -> i32;
    aclnnAdd: fn(Ptr, u64, Ptr, Ptr) -> i32;
    HcclGetRootInfo: fn(*mut u8) -> i32;
    HcclCommInitRootInfo: fn(u32, *const u8, u32, *mut Ptr) -> i32;
    HcclCommInitRootInfoConfig: fn(u32, *const u8, u32, *const u8, *mut Ptr) -> i32;
    HcclCreateSubCommConfig: fn(*mut Ptr, u32, *mut u32, u64, u32, *mut u8, *mut Ptr) -> i32;
    HcclCommDestroy: fn(Ptr) -> i32;
    HcclGetRankId: fn(Ptr, *mut u32) -> i32;
    HcclGetRankSize: fn(Ptr, *mut u32) -> i32;
    HcclGetCommName: fn(Ptr, *mut c_char) -> i32;
    HcclGetErrorString: fn(i32) -> *const c_char;
    HcclGetCommAsyncError: fn(Ptr, *mut i32) -> i32;
    HcclGetCommConfigCapability: fn() -> u32;
    HcclAllReduce: fn(Ptr, Ptr, u64, i32, i32, Ptr, Ptr) -> i32;
    HcclReduceScatter: fn(Ptr, Ptr, u64, i32, i32, Ptr, Ptr) -> i32;
    HcclReduceScatterV: fn(Ptr, *const c_void, *const c_void, Ptr, u64, i32, i32, Ptr, Ptr) -> i32;
    HcclAllGather: fn(Ptr, Ptr, u64, i32, Ptr, Ptr) -> i32;
    HcclAllGatherV: fn(Ptr, u64, Ptr, *const c_void, *const c_void, i32, Ptr, Ptr) -> i32;
    HcclAlltoAllV: fn(*const c_void, *const c_void, *const c_void, i32, *const c_void, *const c_void, *const c_void, i32, Ptr, Ptr) -> i32;
    HcclBroadcast: fn(Ptr, u64, i32, u32, Ptr, Ptr) -> i32;
    HcclBarrier: fn(Ptr, Ptr) -> i32;
    cannsim_launch_kernel: fn(Ptr, u32, Option<KernelEntry>, *const Ptr, usize, *const c_void, usize) -> i32;
    cannsim_launch_kernel_ex: fn(Ptr, u32, Option<KernelEntryEx>, *const Ptr, usize, *const c_void, usize) -> i32;
}

pub const H2H: i32 = 0;
pub const H2D: i32 = 1;
pub const D2H: i32 = 2;
pub const D2D: i32 = 3;

pub const ACL_FLOAT: i32 = 0;
pub const ACL_FLOAT16: i32 = 1;
pub const ACL_INT32: i32 = 3;
pub const ACL_BF16: i32 = 27;
pub const ND: i32 = 2;

pub const HCCL_FP32: i32 = 4;
pub const HCCL_INT32: i32 = 2;
pub const HCCL_SUM: i32 = 0;
pub const HCCL_MAX: i32 = 2;

/// Path of the simulator library.
pub fn lib_path() -> PathBuf {
    if let Ok(p) = std::env::var("CANNSIM_LIB") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe.parent().expect("test binary directory");
    for cand in [dir.join("libcann_sim.so"), dir.join("../libcann_sim.so")] {
        if cand.exists() {
            return cand;
        }
    }
    panic!("libcann_sim.so not found next to {} (run `cargo build -p cann-sim` or set CANNSIM_LIB)", exe.display());
}

/// The loaded simulator (loaded once, never unloaded).
pub fn sim() -> &'static Api {
    static API: OnceLock<Api> = OnceLock::new();
    API.get_or_init(|| {
        // SAFETY: loading the simulator runs no initialisers with preconditions.
        let lib = unsafe { libloading::Library::new(lib_path()) }.expect("load libcann_sim.so");
        Api::load(lib)
    })
}

/// `aclInit` (tolerating a previous call) + `aclrtSetDevice(d)` on this thread.
pub fn use_device(d: i32) -> &'static Api {
    let s = sim();
    unsafe {
        let r = (s.aclInit)(std::ptr::null());
        assert!(r == 0 || r == 100002, "aclInit: {r}");
        assert_eq!((s.aclrtSetDevice)(d), 0, "aclrtSetDevice({d})");
    }
    s
}

/// This thread's recent error text ("" when `aclGetRecentErrMsg` returns NULL:
/// no error yet).
pub fn err_msg() -> String {
    // SAFETY: no arguments; the result is NULL or a NUL-terminated string.
    let p = unsafe { (sim().aclGetRecentErrMsg)() };
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-NULL, NUL-terminated, valid until the next call on this thread.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

pub fn malloc(size: usize) -> Ptr {
    let mut p = std::ptr::null_mut();
    let r = unsafe { (sim().aclrtMalloc)(&mut p, size, 0) };
    assert_eq!(r, 0, "aclrtMalloc({size}): {}", err_msg());
    p
}

pub fn free(p: Ptr) {
    assert_eq!(unsafe { (sim().aclrtFree)(p) }, 0, "aclrtFree: {}", err_msg());
}

pub fn stream() -> Ptr {
    let mut s = std::ptr::null_mut();
    assert_eq!(unsafe { (sim().aclrtCreateStream)(&mut s) }, 0);
    s
}

pub fn destroy_stream(s: Ptr) {
    assert_eq!(unsafe { (sim().aclrtDestroyStream)(s) }, 0);
}

pub fn sync(s: Ptr) {
    let r = unsafe { (sim().aclrtSynchronizeStream)(s) };
    assert_eq!(r, 0, "aclrtSynchronizeStream: {}", err_msg());
}

pub fn bytes_of<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data slices viewed as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// A device buffer holding `v`.
pub fn upload<T: Copy>(v: &[T]) -> Ptr {
    let b = bytes_of(v);
    let p = malloc(b.len().max(1));
    if !b.is_empty() {
        let r = unsafe { (sim().aclrtMemcpy)(p, b.len(), b.as_ptr() as *const c_void, b.len(), H2D) };
        assert_eq!(r, 0, "H2D: {}", err_msg());
    }
    p
}

/// `n` elements read back from device memory.
pub fn download<T: Copy + Default>(p: Ptr, n: usize) -> Vec<T> {
    let mut v = vec![T::default(); n];
    let bytes = std::mem::size_of_val(v.as_slice());
    if bytes > 0 {
        let r = unsafe { (sim().aclrtMemcpy)(v.as_mut_ptr() as Ptr, bytes, p, bytes, D2H) };
        assert_eq!(r, 0, "D2H: {}", err_msg());
    }
    v
}

/// A contiguous ND aclTensor over device memory.
pub fn tensor(dims: &[i64], dtype: i32, data: Ptr) -> Ptr {
    let t = unsafe {
        (sim().aclCreateTensor)(
            dims.as_ptr(),
            dims.len() as u64,
            dtype,
            std::ptr::null(),
            0,
            ND,
            dims.as_ptr(),
            dims.len() as u64,
            data,
        )
    };
    assert!(!t.is_null(), "aclCreateTensor: {}", err_msg());
    t
}

pub fn destroy_tensor(t: Ptr) {
    assert_eq!(unsafe { (sim().aclDestroyTensor)(t) }, 0);
}

/// Deterministic pseudo-random numbers (xorshift), so failures reproduce.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// A random permutation of 0..n.
    pub fn perm(&mut self, n: usize) -> Vec<i32> {
        let mut v: Vec<i32> = (0..n as i32).collect();
        for i in (1..n).rev() {
            v.swap(i, self.below(i + 1));
        }
        v
    }
}

/// This test binary run again as a child with `role` (selecting the test
/// `test_name`, alone) and extra environment, its output piped.
pub fn child(test_name: &str, role: &str, env: &[(&str, &str)]) -> std::process::Command {
    let exe = std::env::current_exe().expect("test binary path");
    let mut cmd = std::process::Command::new(exe);
    cmd.args([test_name, "--exact", "--nocapture", "--test-threads=1"])
        .env("CANNSIM_TEST_ROLE", role)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    cmd
}

/// Runs [`child`] to its end; returns its output.
pub fn run_child(test_name: &str, role: &str, env: &[(&str, &str)]) -> std::process::Output {
    child(test_name, role, env).output().expect("spawn child test process")
}

/// Asserts that the child test process of `o` (`run_child`, or the test
/// binary spawned with a role) ran its test and passed; `what` names it.
pub fn assert_child_passed(o: &std::process::Output, what: &str) {
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.contains("1 passed"),
        "{what} failed:\n{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// `b` as hex digits (a root info passed to a child process).
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The bytes of [`hex`]'s digits.
pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// The role this process plays (`None` in the parent test run).
pub fn role() -> Option<String> {
    std::env::var("CANNSIM_TEST_ROLE").ok()
}
