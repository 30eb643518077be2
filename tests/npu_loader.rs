//! The NPU layer where CANN is absent (this CI): load errors that list every
//! path tried, code newtypes, the HCCL config layout, root-info serialisation.
//! These run everywhere; under real or simulated CANN the absent-library
//! checks turn into "it loads".

use std::path::Path;

use acl_sys::loader::{self, LibSpec};
use ascend_moe::backend::npu::{self, HcclRootInfo};
use ascend_moe::{DType, Device, Error};
use hccl_sys::{HcclCommConfig, HcclDataType, HcclResult};

fn expected_candidates(soname: &str, subdirs: &[&str]) -> Vec<String> {
    let mut v = vec![soname.to_string()];
    for root in loader::cann_roots() {
        for s in subdirs {
            v.push(root.path.join(s).join(soname).to_string_lossy().into_owned());
        }
    }
    v
}

#[test]
fn absent_library_error_lists_every_path_tried() {
    let spec = LibSpec {
        soname: "libascend_moe_test_absent.so",
        env: "ASCEND_MOE_TEST_ABSENT_LIB",
        subdirs: &["lib64", "opp/lib"],
    };
    let err = loader::open(&spec, &[]).expect_err("no such library exists");
    let want = expected_candidates(spec.soname, spec.subdirs);
    let tried: Vec<String> = err.attempts.iter().map(|a| a.candidate.path.to_string_lossy().into_owned()).collect();
    assert_eq!(tried, want, "attempts in search order");
    assert!(want.len() >= 5, "loader path + at least two default roots x two subdirs: {want:?}");
    let text = err.to_string();
    assert!(text.contains("ASCEND_MOE_TEST_ABSENT_LIB"), "names the override variable: {text}");
    for path in &want {
        assert!(text.contains(path.as_str()), "{path} missing from:\n{text}");
    }
    for a in &err.attempts {
        assert!(!a.reason.is_empty(), "every attempt says why it failed");
    }
    assert_eq!(err.attempts[0].candidate.source, "loader path");
}

#[test]
fn override_to_a_missing_file_is_the_only_attempt() {
    let var = "ASCEND_MOE_ACL_LIB";
    let spec = LibSpec { soname: "libascendcl.so", env: var, subdirs: &["lib64"] };
    let cands = loader::candidates_with(&spec, Some("/nonexistent/dir/libascendcl.so".into()));
    let err = loader::open_candidates(&spec, cands, &["aclInit"]).expect_err("the override path does not exist");
    assert_eq!(err.attempts.len(), 1, "an override replaces the search: {err}");
    let a = &err.attempts[0];
    assert_eq!(a.candidate.path.to_string_lossy(), "/nonexistent/dir/libascendcl.so");
    assert_eq!(a.candidate.source, var);
    assert!(a.reason.contains("No such file"), "dlopen's reason is kept: {}", a.reason);
    assert!(err.to_string().contains("/nonexistent/dir/libascendcl.so"));
}

#[test]
fn library_without_required_symbols_is_rejected_with_their_names() {
    // libc loads everywhere but is not ACL.
    let spec = LibSpec { soname: "libc.so.6", env: "ASCEND_MOE_TEST_LIBC_LIB", subdirs: &[] };
    let cands = loader::candidates_with(&spec, Some("libc.so.6".into()));
    let err =
        loader::open_candidates(&spec, cands, &["malloc", "aclInit", "aclrtMalloc"]).expect_err("libc has no ACL");
    assert_eq!(err.attempts.len(), 1);
    let reason = &err.attempts[0].reason;
    assert!(reason.contains("aclInit") && reason.contains("aclrtMalloc"), "{reason}");
    assert!(!reason.contains("malloc,") && !reason.ends_with(" malloc"), "malloc exists: {reason}");
}

#[test]
fn npu_device_is_unavailable_with_the_paths_when_cann_is_absent() {
    match acl_sys::acl() {
        Ok(api) => {
            // Real or simulated CANN is present: the device must open.
            let dev =
                Device::npu(0).unwrap_or_else(|e| panic!("ACL loaded from {:?} but npu:0 failed: {e}", api.origin));
            assert_eq!(dev.to_string(), "npu:0");
        }
        Err(load) => {
            let err = Device::npu(0).expect_err("no CANN here");
            let Error::Unavailable(text) = &err else { panic!("expected Error::Unavailable, got {err:?}") };
            for a in &load.attempts {
                assert!(text.contains(&*a.candidate.path.to_string_lossy()), "{text}");
            }
            for path in expected_candidates("libascendcl.so", &["lib64"]) {
                if std::env::var_os("ASCEND_MOE_ACL_LIB").is_none() {
                    assert!(text.contains(&path), "{path} missing from {text}");
                }
            }
            assert!(text.contains("ASCEND_MOE_ACL_LIB"), "{text}");
            // Every other entry point says the same, without panicking.
            assert!(matches!(npu::device_count(), Err(Error::Unavailable(_))));
            assert!(matches!(npu::NpuDevice::open(3), Err(Error::Unavailable(_))));
        }
    }
}

#[test]
fn probe_report_names_every_library_and_path() {
    let report = npu::probe();
    let text = report.to_string();
    for (spec, _) in [(loader::ACL, 0), (loader::HCCL, 0), (loader::NNOPBASE, 0), (loader::OPAPI, 0)] {
        assert!(text.contains(spec.soname), "{text}");
        assert!(text.contains(spec.env), "{text}");
        for c in loader::candidates(&spec) {
            assert!(text.contains(&*c.path.to_string_lossy()), "{:?} missing:\n{text}", c.path);
        }
    }
    for r in loader::cann_roots() {
        assert!(text.contains(&*r.path.to_string_lossy()));
    }
    assert!(text.contains("acl-sys: ") && text.contains("hccl-sys: "), "bindings origin: {text}");
    if acl_sys::acl().is_err() {
        assert!(!report.all_found());
        assert!(text.contains("NOT FOUND"));
    }
}

/// `ascend-moe info` says why the AI Core kernel library did not load (here:
/// `ASCEND_MOE_KERNEL_LIB` names a missing file), instead of leaving the
/// fall-back to aclnn unexplained.
#[test]
fn info_reports_why_the_kernel_library_did_not_load() {
    let missing = std::env::temp_dir().join("ascend-moe-no-such-dir/libamoe_kernels_npu.so");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_ascend-moe"))
        .arg("info")
        .env("ASCEND_MOE_KERNEL_LIB", &missing)
        .output()
        .expect("run info");
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{text}\n{}", String::from_utf8_lossy(&o.stderr));
    assert!(text.contains("AI Core library: NOT LOADED"), "{text}");
    assert!(text.contains(&format!("loading {}", missing.display())), "{text}");
}

#[test]
fn codes_are_newtypes_that_keep_unknown_values() {
    // Values a newer CANN might return survive the round trip.
    let unknown = HcclResult(4242);
    assert_eq!(unknown.0, 4242);
    assert_ne!(unknown, HcclResult::HCCL_SUCCESS);
    let err = npu::result::hccl::check("HcclAllReduce", unknown).expect_err("non-zero code");
    match err {
        Error::Hccl { call, code, .. } => {
            assert_eq!(call, "HcclAllReduce");
            assert_eq!(code, 4242);
        }
        other => panic!("expected Error::Hccl, got {other:?}"),
    }
    assert!(npu::result::hccl::check("HcclBarrier", HcclResult::HCCL_SUCCESS).is_ok());
    let acl_err = npu::result::acl::check("aclrtMalloc", 207001).expect_err("OOM code");
    assert!(matches!(acl_err, Error::Acl { call: "aclrtMalloc", code: 207001, .. }), "{acl_err:?}");
    assert!(acl_err.to_string().contains("aclrtMalloc") && acl_err.to_string().contains("207001"));
    assert_eq!(acl_sys::aclDataType(1234).0, 1234);
    assert_eq!(HcclDataType(77).0, 77);

    // The values of cann-api.md sections 1.3 / 2.1.
    let hccl: Vec<u32> = DType::REDUCIBLE.iter().map(|&d| npu::hccl_dtype(d).0).collect();
    assert_eq!(hccl, [4, 3, 11, 2, 5], "f32 f16 bf16 i32 i64");
    let acl: Vec<i32> = DType::REDUCIBLE.iter().map(|&d| npu::acl_dtype(d).0).collect();
    assert_eq!(acl, [0, 1, 27, 3, 9], "f32 f16 bf16 i32 i64");
    assert_eq!(HcclResult::HCCL_E_TIMEOUT.0, 9);
    assert_eq!(acl_sys::ACL_ERROR_RT_MEMORY_ALLOCATION, 207001);
    assert_eq!(acl_sys::ACL_ERROR_REPEAT_INITIALIZE, 100002);
}

#[test]
fn comm_config_layout_matches_version_10() {
    use std::mem::{align_of, offset_of, size_of};
    assert_eq!(size_of::<HcclCommConfig>(), 2240);
    assert_eq!(align_of::<HcclCommConfig>(), 8);
    let offsets = [
        (offset_of!(HcclCommConfig, reserved), 0),
        (offset_of!(HcclCommConfig, hcclBufferSize), 24),
        (offset_of!(HcclCommConfig, hcclDeterministic), 28),
        (offset_of!(HcclCommConfig, hcclCommName), 32),
        (offset_of!(HcclCommConfig, hcclUdi), 160),
        (offset_of!(HcclCommConfig, hcclOpExpansionMode), 288),
        (offset_of!(HcclCommConfig, hcclRdmaTrafficClass), 292),
        (offset_of!(HcclCommConfig, hcclRdmaServiceLevel), 296),
        (offset_of!(HcclCommConfig, hcclWorldRankID), 300),
        (offset_of!(HcclCommConfig, hcclJobID), 304),
        (offset_of!(HcclCommConfig, aclGraphZeroCopyEnable), 312),
        (offset_of!(HcclCommConfig, hcclExecTimeOut), 316),
        (offset_of!(HcclCommConfig, hcclAlgo), 320),
        (offset_of!(HcclCommConfig, hcclRetryEnable), 1920),
        (offset_of!(HcclCommConfig, hcclRetryParams), 1970),
        (offset_of!(HcclCommConfig, hcclBufferName), 2098),
        (offset_of!(HcclCommConfig, hcclQos), 2228),
        (offset_of!(HcclCommConfig, hcclSymWinMaxMemSizePerRank), 2232),
    ];
    for (i, (got, want)) in offsets.iter().enumerate() {
        assert_eq!(got, want, "field {i}");
    }
}

#[test]
fn comm_config_init_writes_the_header_and_defaults() {
    // Start from garbage so every field the init must write is checked.
    let mut c: HcclCommConfig = HcclCommConfig::default();
    // SAFETY: HcclCommConfig is repr(C), 2240 bytes, and every bit pattern is
    // valid for its integer and byte-array fields.
    let bytes: &mut [u8; 2240] = unsafe { &mut *(&mut c as *mut HcclCommConfig).cast() };
    bytes.fill(0xa5);
    hccl_sys::HcclCommConfigInit(&mut c);
    // SAFETY: as above (read-only view).
    let raw: &[u8; 2240] = unsafe { &*(&c as *const HcclCommConfig).cast() };
    assert_eq!(u64::from_ne_bytes(raw[0..8].try_into().unwrap()), 2240, "size");
    assert_eq!(u32::from_ne_bytes(raw[8..12].try_into().unwrap()), 0xf0f0_f0f0, "magic");
    assert_eq!(u32::from_ne_bytes(raw[12..16].try_into().unwrap()), 10, "version");
    assert_eq!(u64::from_ne_bytes(raw[16..24].try_into().unwrap()), 0, "reserved");
    assert_eq!(c.hcclBufferSize, 0xffff_ffff);
    assert_eq!(c.hcclDeterministic, 0xffff_ffff);
    assert_eq!(c.hcclOpExpansionMode, 0);
    assert_eq!((c.hcclRdmaTrafficClass, c.hcclRdmaServiceLevel), (0xffff_ffff, 0xffff_ffff));
    assert_eq!((c.hcclWorldRankID, c.hcclJobID, c.aclGraphZeroCopyEnable), (0, 0, 0));
    assert_eq!(c.hcclExecTimeOut, -1);
    assert_eq!(c.hcclQos, 0xffff_ffff);
    assert_eq!(c.hcclSymWinMaxMemSizePerRank, 16);
    for s in [&c.hcclCommName[..], &c.hcclUdi, &c.hcclAlgo, &c.hcclRetryEnable, &c.hcclRetryParams, &c.hcclBufferName] {
        assert_eq!(s[0], 0, "strings start empty");
    }

    // Capability check: COMM_NAME (2) supported iff the capability count > 2.
    assert_eq!(hccl_sys::capability::COMM_NAME, 2);
    for (cap, keeps) in [(None, false), (Some(0), false), (Some(2), false), (Some(3), true), (Some(12), true)] {
        let mut c = HcclCommConfig::default();
        assert_eq!(c.adapt_to_capability(cap), keeps, "capability {cap:?}");
        assert_eq!(c.header_size(), if keeps { 2240 } else { 32 }, "capability {cap:?}");
        assert_eq!(c.header_version(), 10);
    }
    assert!(HcclCommConfig::supports(Some(10), hccl_sys::capability::EXEC_TIMEOUT));
    assert!(!HcclCommConfig::supports(Some(8), hccl_sys::capability::EXEC_TIMEOUT));
}

/// Each header generation's `HcclCommConfigInit`, as its `hccl_types.h` /
/// `hccl.h` writes it: CANN 8.1.RC1 (version 5: 300 bytes, 200 MB buffer,
/// deterministic 0), torch-npu 2.9.0 (version 6: 312 bytes, "not set"),
/// CANN 8.5.0 (version 8: 2104 bytes, hicann/hcomm v8.5.0
/// `include/hccl/hccl_types.h:124,135-151` and `hccl_comm.h:188-222`),
/// CANN 9.0 / torch-npu 2.11.0+ (version 10: 2240 bytes).
#[test]
fn comm_config_init_per_header_generation() {
    use hccl_sys::CommConfigLayout::{V10, V5, V6, V8};
    let expected = [
        (V5, 5, 300, 200, 0),
        (V6, 6, 312, 0xffff_ffff, 0xffff_ffff),
        (V8, 8, 2104, 0xffff_ffff, 0xffff_ffff),
        (V10, 10, 2240, 0xffff_ffff, 0xffff_ffff),
    ];
    for (layout, version, size, buffer, deterministic) in expected {
        let c = layout.new_config();
        assert_eq!((c.header_version(), c.header_size(), c.header_magic()), (version, size, 0xf0f0_f0f0), "{layout:?}");
        assert_eq!((c.hcclBufferSize, c.hcclDeterministic), (buffer, deterministic), "{layout:?}");
        assert_eq!((c.hcclRdmaTrafficClass, c.hcclRdmaServiceLevel), (0xffff_ffff, 0xffff_ffff), "{layout:?}");
        // Fields past the generation's size are never written.
        let untouched = if layout == V10 { 16 } else { 0 };
        assert_eq!(c.hcclSymWinMaxMemSizePerRank, untouched, "{layout:?}");
        let with_timeout = matches!(layout, V8 | V10);
        assert_eq!(c.hcclExecTimeOut, if with_timeout { -1 } else { 0 }, "{layout:?}");
        assert_eq!(layout.has_exec_timeout(), with_timeout, "{layout:?}");
        // The field lies inside the bytes the header says HCCL may read.
        assert_eq!(std::mem::offset_of!(HcclCommConfig, hcclExecTimeOut) + 4 <= size, with_timeout, "{layout:?}");
    }
    // The generation follows the capability count each header's enum defines
    // (4, 7, 11, 12); counts in between get the newest generation they reach.
    for (cap, want) in [
        (None, V5),
        (Some(0), V5),
        (Some(4), V5),
        (Some(6), V5),
        (Some(7), V6),
        (Some(10), V6),
        (Some(11), V8),
        (Some(12), V10),
        (Some(40), V10),
    ] {
        assert_eq!(hccl_sys::CommConfigLayout::for_capability(cap), want, "capability {cap:?}");
    }
}

#[test]
fn root_info_round_trips_through_bytes_and_hex() {
    let bytes: Vec<u8> = (0..npu::ROOT_INFO_BYTES).map(|i| (i * 7 + 3) as u8).collect();
    let info = HcclRootInfo::from_bytes(&bytes).expect("4108 bytes");
    assert_eq!(&info.as_bytes()[..], &bytes[..]);
    let hex = info.to_hex();
    assert_eq!(hex.len(), 8216);
    assert_eq!(&hex[..6], "030a11", "bytes 3, 10, 17");
    assert_eq!(HcclRootInfo::from_hex(&hex).expect("own hex"), info);
    assert_eq!(HcclRootInfo::from_hex(&format!("  {}\n", hex.to_uppercase())).expect("upper case, padded"), info);

    let short = HcclRootInfo::from_bytes(&bytes[..100]).expect_err("too short");
    assert!(short.to_string().contains("100 bytes, expected 4108"), "{short}");
    let mut bad = hex.clone();
    bad.replace_range(10..11, "g");
    let e = HcclRootInfo::from_hex(&bad).expect_err("not hex");
    assert!(e.to_string().contains("at 10"), "{e}");
    assert!(HcclRootInfo::from_hex(&hex[..8214]).is_err());
}

#[test]
fn committed_bindings_exist_and_carry_no_vendor_comments() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for (krate, needles) in [
        ("acl-sys", &["pub struct AclLib", "pub aclrtMalloc:", "pub struct aclDataType(pub"][..]),
        ("hccl-sys", &["pub struct HcclLib", "pub HcclAlltoAllV:", "pub struct HcclResult(pub"][..]),
    ] {
        let text = std::fs::read_to_string(root.join(krate).join("src/bindings.rs")).expect("committed bindings");
        for n in needles {
            assert!(text.contains(n), "{krate}: {n}");
        }
        assert!(!text.contains("///") && !text.contains("Copyright"), "{krate}: header prose leaked into bindings");
        assert!(!text.contains("pub enum "), "{krate}: C enums must be newtypes");
    }
}

/// The runtime is the one the run expects (`ASCEND_MOE_EXPECT_RUNTIME`, which
/// `ci/npu-4card.sh` sets: `real`, or `sim` with `--sim`): a run meant for an
/// Ascend host never goes green on the simulator, nor the reverse, and on a
/// host the bindings were generated from its headers. Then enough devices
/// are visible and each reports its memory.
#[test]
#[ignore = "needs an Ascend NPU"]
fn npu_host_has_the_devices() {
    use ascend_moe::testing::runtime::{expected_runtime, ExpectedRuntime, EXPECT_RUNTIME_ENV};
    let report = npu::probe();
    println!("{report}");
    let acl = &report.libraries[0];
    let simulated = report.runtime.as_ref().map(|r| r.simulator);
    let from = acl.result.as_deref().unwrap_or("nowhere");
    match (expected_runtime(), simulated) {
        (_, None) => panic!("{} did not load: {:?}\n{report}", acl.library, acl.result),
        (Some(ExpectedRuntime::Real), Some(true)) => panic!(
            "{EXPECT_RUNTIME_ENV}=real (ci/npu-4card.sh without --sim), but the runtime loaded from {from} is the \
             simulator (it exports cannsim_* entry points); run ci/sim.sh (or ci/npu-4card.sh --sim) for the \
             simulator, or point {} at real CANN\n{report}",
            acl.env
        ),
        (Some(ExpectedRuntime::Simulator), Some(false)) => panic!(
            "the run expects the simulator (ci/npu-4card.sh --sim, or CANNSIM_CANN_VERSION), but the runtime \
             loaded from {from} exports no cannsim_* entry point: it is not cann-sim\n{report}"
        ),
        _ => {}
    }
    // On a real host the bindings are generated from its CANN headers
    // (ci/npu-4card.sh sets ASCEND_MOE_BINDINGS_DUMP, which makes a failed
    // generation a build error), never the committed ones.
    if expected_runtime() == Some(ExpectedRuntime::Real) {
        for (krate, origin) in report.bindings {
            assert!(
                origin.starts_with("generated"),
                "{EXPECT_RUNTIME_ENV}=real: the {krate} bindings are {origin:?}, not generated from this host's CANN \
                 headers (build with ASCEND_MOE_BINDINGS_DUMP set, as ci/npu-4card.sh does, to see why)\n{report}"
            );
        }
    }
    let want: u32 = match std::env::var("ASCEND_MOE_MIN_DEVICES") {
        Ok(s) => s.parse().unwrap_or_else(|_| panic!("ASCEND_MOE_MIN_DEVICES={s:?}: expected a count of devices")),
        Err(_) => 1,
    };
    let have = npu::device_count().unwrap_or_else(|e| panic!("{e}"));
    // CANN counts only the devices ASCEND_RT_VISIBLE_DEVICES leaves visible.
    let visible = match std::env::var("ASCEND_RT_VISIBLE_DEVICES") {
        Ok(v) => format!(" (ASCEND_RT_VISIBLE_DEVICES={v:?})"),
        Err(_) => String::new(),
    };
    assert!(have >= want, "{have} devices visible{visible}, the run needs {want}");
    for ordinal in 0..have {
        let dev = npu::NpuDevice::open(ordinal).unwrap_or_else(|e| panic!("npu:{ordinal}: {e}"));
        let (free, total) = dev.mem_info().unwrap_or_else(|e| panic!("npu:{ordinal}: {e}"));
        assert!(total > 0 && free <= total, "npu:{ordinal}: {free} free of {total}");
    }
}

/// Every piece the NPU suite tests is present: each aclnn operator resolves
/// and the native finalize kernel can be launched (the AI Core build, or the
/// host build under the simulated runtime). `ci/npu-4card.sh` runs this first,
/// so a missing piece fails the run instead of being skipped or replaced.
#[test]
#[ignore = "needs an Ascend NPU"]
fn npu_host_has_every_piece_the_suite_tests() {
    let report = npu::probe();
    let missing: Vec<&str> = report.aclnn_ops.iter().filter(|(_, from)| from.is_none()).map(|(n, _)| *n).collect();
    assert!(report.aclnn_ops.len() == 3 && missing.is_empty(), "aclnn operators missing: {missing:?}\n{report}");
    let dev = npu::NpuDevice::open(0).unwrap_or_else(|e| panic!("npu:0: {e}"));
    let native = dev.with_finalize_impl(npu::FinalizeImpl::Native);
    // The native path reports Unavailable when neither build can be launched.
    let dev = Device::Npu(native);
    let x = ascend_moe::Tensor::zeros_cpu(&[1, 4], DType::F32).to_device(&dev).expect("upload");
    let idx = ascend_moe::Tensor::from_slice(&[0i32], &[1]).and_then(|t| t.to_device(&dev)).expect("upload");
    let args = ascend_moe::backend::FinalizeArgs::new(&x, &idx, ascend_moe::backend::DropPadMode::DropLessColumn);
    let dims = ascend_moe::backend::FinalizeDims { n: 1, k: 1, h: 4, expanded_rows: 1, experts: 0 };
    let mut out = ascend_moe::Tensor::zeros_cpu(&[1, 4], DType::F32).to_device(&dev).expect("upload");
    let r = dev.backend().finalize_routing(&args, &dims, &mut out, ascend_moe::backend::OutputRows::Dense);
    assert!(r.is_ok(), "the native finalize kernel cannot run here (build it, see kernels/): {:?}", r.err());
}

/// Each operator comes from the library that ships it: from CANN 8.5 the MoE
/// ops from `libopapi_transformer.so` and `aclnnAdd` from `libopapi_math.so`
/// (torch_npu's `GetTransformerOpApiLibName`), before that from `libopapi.so`.
#[test]
#[ignore = "needs an Ascend NPU"]
fn loader_takes_each_op_from_the_library_that_ships_it() {
    let api = acl_sys::aclnn::opapi().unwrap_or_else(|e| panic!("{e}"));
    let split = |soname: &str| api.searched.iter().any(|p| p.ends_with(soname));
    for (op, soname) in [
        ("aclnnMoeFinalizeRoutingV2", "libopapi_transformer.so"),
        ("aclnnMoeTokenUnpermute", "libopapi_transformer.so"),
        ("aclnnAdd", "libopapi_math.so"),
    ] {
        let from = api.source_of(op).unwrap_or_else(|| panic!("{op} not found in {:?}", api.searched));
        let want = if split(soname) { soname } else { "libopapi.so" };
        assert!(from.ends_with(want), "{op} resolved from {from}, expected {want} (searched {:?})", api.searched);
    }
    let info = npu::probe_report();
    assert!(info.contains("aclnnAdd: available, from "), "{info}");
}
