//! How the native kernel is built for the AI Core: the compile line per CANN
//! version (`build/npu_flags.rs`, the pure function build.rs runs), checked
//! against the conventions of CANN 8.1's tikcpp cmake files since bisheng
//! cannot run here, and the launchers of `kernels/npu_launch.cpp`. That the
//! host build happened against the real Ascend C headers is checked in the
//! crate (`the_host_kernel_is_built_against_the_real_headers`, in
//! `src/backend/npu/kernel/finalize_tests.rs`), which sees the kernel module.

use std::path::Path;

#[path = "../build/npu_flags.rs"]
#[allow(dead_code)]
mod npu_flags;

use npu_flags::{bisheng_args, parse_version_file, CannVersion, NpuBuild};

#[test]
fn cann_versions_are_read_from_the_toolkit_info_files() {
    let v81 = CannVersion { major: 8, minor: 1 };
    // compiler/version.info
    assert_eq!(parse_version_file("Version=8.1.RC1\nversion_dir=8.1.RC1\n"), Some(v81));
    // <arch>-linux/ascend_toolkit_install.info
    assert_eq!(parse_version_file("package_name=Ascend-cann-toolkit\nversion=8.1.RC1.alpha002\n"), Some(v81));
    // version.cfg
    assert_eq!(
        parse_version_file("# version\ntoolkit_installed_version=[8.3.0:8.3.0]\n"),
        Some(CannVersion { major: 8, minor: 3 })
    );
    assert_eq!(parse_version_file("Version=8.0.0\n"), Some(CannVersion { major: 8, minor: 0 }));
    assert_eq!(parse_version_file("package_name=x\n"), None);
    assert_eq!(parse_version_file("version=unknown\n"), None);
}

fn args() -> Vec<String> {
    bisheng_args(&NpuBuild {
        home: Path::new("/opt/cann"),
        source: Path::new("kernels/npu_launch.cpp"),
        kernels_dir: Path::new("kernels"),
        output: Path::new("/out/libamoe_kernels_npu.so"),
    })
}

/// The `-mllvm` options of tikcpp's bisheng_intf.cmake in CANN 8.1.
const CMAKE_MLLVM: [&str; 5] = [
    "-cce-aicore-stack-size=0x8000",
    "-cce-aicore-function-stack-size=0x8000",
    "-cce-aicore-record-overflow=true",
    "-cce-aicore-addr-transform",
    "-cce-aicore-dcci-insert-for-scalar=false",
];

fn assert_common(a: &[String]) {
    let has = |s: &str| a.iter().any(|x| x == s);
    assert_eq!(a[0], "-xcce", "{a:?}");
    assert!(has("--cce-auto-sync"), "{a:?}");
    for o in CMAKE_MLLVM {
        let i = a.iter().position(|x| x == o).unwrap_or_else(|| panic!("{o} missing: {a:?}"));
        assert_eq!(a[i - 1], "-mllvm", "{o}");
    }
    for inc in [
        "-I/opt/cann/include",
        "-I/opt/cann/compiler/tikcpp/tikcfw",
        "-I/opt/cann/compiler/tikcpp/tikcfw/impl",
        "-I/opt/cann/compiler/tikcpp/tikcfw/interface",
        "-Ikernels",
    ] {
        assert!(has(inc), "{inc}: {a:?}");
    }
    for f in ["-O2", "-std=c++17", "-fPIC", "-shared", "kernels/npu_launch.cpp"] {
        assert!(has(f), "{f}: {a:?}");
    }
    // The runtime the <<<>>> stub calls: linked, found through the run path.
    for f in ["-L/opt/cann/lib64", "-Wl,-rpath,/opt/cann/lib64", "-lascendcl", "-lruntime"] {
        assert!(has(f), "{f}: {a:?}");
    }
    let src = a.iter().position(|x| x == "kernels/npu_launch.cpp").unwrap();
    let lib = a.iter().position(|x| x == "-lascendcl").unwrap();
    assert!(lib > src, "libraries come after the source for the linker");
    assert_eq!(&a[a.len() - 2..], ["-o", "/out/libamoe_kernels_npu.so"]);
}

#[test]
fn every_cann_8_release_builds_for_the_vector_cores_with_the_aiv_intf_pub_flags() {
    let a = args();
    assert_common(&a);
    assert_eq!(a[1], "--cce-aicore-arch=dav-c220-vec", "the vector-core arch: {a:?}");
    assert!(!a.iter().any(|x| x.starts_with("--npu-arch")), "--npu-arch names no core type: {a:?}");
    assert!(!a.iter().any(|x| x == "--cce-aicore-only"), "the host stub is compiled too: {a:?}");
}

/// Every `<<<>>>` launch of kernels/npu_launch.cpp returns the runtime's
/// launch error: the thread's last error is cleared before the launch and
/// returned after it (`aclrtGetLastError`), and the launchers' own argument
/// checks return ACL_ERROR_INVALID_PARAM (100000), not 107000
/// (ACL_ERROR_RT_PARAM_INVALID, rt_error_codes.h).
#[test]
fn every_npu_launcher_returns_the_launch_error() {
    let src = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/npu_launch.cpp")).unwrap();
    let launchers: Vec<&str> = src.split("extern \"C\" int32_t ").skip(1).collect();
    assert_eq!(launchers.len(), 3, "the finalize, guard and copy launchers");
    for body in launchers {
        let name = body.split('(').next().unwrap();
        let launch = body.find("<<<").unwrap_or_else(|| panic!("{name}: no <<<>>> launch"));
        let end = body.find("\n}").unwrap_or_else(|| panic!("{name}: no end"));
        // Up to the start of the launch's line.
        let line_start = body[..launch].rfind('\n').unwrap_or(0);
        let (before, after) = (&body[..line_start], &body[launch..end]);
        let prev = before.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or_default();
        assert_eq!(
            prev.trim(),
            "(void)amoe_last_launch_error();",
            "{name}: the last error is not cleared right before the launch"
        );
        assert!(
            after.trim_end().ends_with("return amoe_last_launch_error();"),
            "{name}: the launch error is not returned"
        );
        assert!(!body[..end].contains("return 0;"), "{name}: returns 0 regardless");
        assert!(!body[..end].contains("107000"), "{name}: 107000 is the runtime's ACL_ERROR_RT_PARAM_INVALID");
    }
    assert!(src.contains("aclrtGetLastError(ACL_RT_THREAD_LEVEL)"), "the thread level, the only one CANN accepts");
}
