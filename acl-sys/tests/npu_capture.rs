//! The ACL graph capture calls and the simulator's counters through acl-sys's
//! bindings (NPU-only: `ci/sim.sh` runs it against cann-sim, and it runs on a
//! real CANN host too, where the counters are absent).

use std::ffi::c_void;
use std::ptr::{null, null_mut};

use acl_sys::{acl, acl_symbol, aclmdlRI, aclmdlRICaptureMode, aclrtMemMallocPolicy, aclrtMemcpyKind, CannsimCounters};

#[test]
#[ignore = "needs a CANN runtime: run by ci/sim.sh, or on an NPU host"]
fn a_captured_memset_replays_through_the_bindings() {
    let api = acl().expect("libascendcl loads");
    let lib = &api.lib;
    let begin = acl_symbol!(api, aclmdlRICaptureBegin).expect("the runtime exports aclmdlRICaptureBegin");
    let end = acl_symbol!(api, aclmdlRICaptureEnd).expect("aclmdlRICaptureEnd");
    let execute = acl_symbol!(api, aclmdlRIExecuteAsync).expect("aclmdlRIExecuteAsync");
    let destroy = acl_symbol!(api, aclmdlRIDestroy).expect("aclmdlRIDestroy");
    // SAFETY: the calls follow the ACL signatures, with live handles and
    // buffers of the sizes passed.
    unsafe {
        let r = lib.aclInit(null());
        assert!(r == 0 || r == 100002, "aclInit: {r}");
        assert_eq!(lib.aclrtSetDevice(0), 0);
        let mut st = null_mut();
        assert_eq!(lib.aclrtCreateStream(&mut st), 0);
        let mut dev: *mut c_void = null_mut();
        assert_eq!(lib.aclrtMalloc(&mut dev, 256, aclrtMemMallocPolicy::ACL_MEM_MALLOC_HUGE_FIRST), 0);

        assert_eq!(begin(st, aclmdlRICaptureMode::ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL), 0);
        assert_eq!(lib.aclrtMemsetAsync(dev, 256, 0x11, 256, st), 0);
        let mut model: aclmdlRI = null_mut();
        assert_eq!(end(st, &mut model), 0);
        assert!(!model.is_null());

        let mut back = [0u8; 256];
        for round in 0..3 {
            assert_eq!(lib.aclrtMemset(dev, 256, round, 256), 0);
            api.reset_counters();
            assert_eq!(execute(model, st), 0);
            if let Some(c) = api.counters() {
                assert_eq!(c, CannsimCounters::default(), "a replay makes no host-side call");
            }
            assert_eq!(lib.aclrtSynchronizeStream(st), 0);
            let kind = aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_HOST;
            assert_eq!(lib.aclrtMemcpy(back.as_mut_ptr() as *mut c_void, 256, dev, 256, kind), 0);
            assert!(back.iter().all(|&b| b == 0x11), "round {round}: the replay ran the captured memset");
        }
        if let Some(c) = api.counters() {
            assert_eq!((c.host_syncs, c.d2h_copies), (2, 1), "the sync and the blocking read of the last round");
        }
        assert_eq!(destroy(model), 0);
        assert_eq!(lib.aclrtFree(dev), 0);
        assert_eq!(lib.aclrtDestroyStream(st), 0);
        assert_eq!(lib.aclrtResetDevice(0), 0);
    }
}
