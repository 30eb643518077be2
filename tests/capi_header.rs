//! The committed C header is exactly what the pinned cbindgen generates from
//! `src/capi`, and its version macro matches Cargo.toml.
//!
//! Regenerate after changing the C ABI: `AMOE_BLESS_HEADER=1 cargo test --test capi_header`.

use std::path::Path;
use std::sync::OnceLock;

fn generated() -> &'static str {
    static HEADER: OnceLock<String> = OnceLock::new();
    HEADER.get_or_init(|| {
        let root = env!("CARGO_MANIFEST_DIR");
        let config = cbindgen::Config::from_file(Path::new(root).join("cbindgen.toml")).expect("cbindgen.toml parses");
        let bindings = cbindgen::Builder::new()
            // Only the C ABI module: the rest of the crate is not part of the header.
            .with_src(Path::new(root).join("src/capi/mod.rs"))
            .with_config(config)
            .generate()
            .expect("cbindgen generates the header");
        let mut out = Vec::new();
        bindings.write(&mut out);
        String::from_utf8(out).expect("header is UTF-8")
    })
}

#[test]
fn header_matches_committed() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("include/ascend_moe.h");
    let fresh = generated();
    if std::env::var_os("AMOE_BLESS_HEADER").is_some() {
        std::fs::write(&path, fresh).expect("write include/ascend_moe.h");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != fresh {
        let line = committed.lines().zip(fresh.lines()).position(|(a, b)| a != b).unwrap_or(0) + 1;
        panic!(
            "include/ascend_moe.h is stale (first difference at line {line}); \
             regenerate with `AMOE_BLESS_HEADER=1 cargo test --test capi_header` and commit it"
        );
    }
}

#[test]
fn header_version_matches_cargo() {
    let want = format!("#define AMOE_VERSION \"{}\"", env!("CARGO_PKG_VERSION"));
    assert!(generated().contains(&want), "cbindgen.toml's AMOE_VERSION differs from Cargo.toml ({want})");
}

#[test]
fn header_declares_the_abi() {
    let header = generated();
    for f in ["amoe_version", "amoe_last_error_message", "amoe_comm_cpu_new", "amoe_comm_free", "amoe_all_reduce"] {
        assert!(header.contains(&format!("{f}(")), "{f} missing from the header");
    }
    for c in ["AMOE_STATUS_OK = 0", "AMOE_STATUS_PANIC = 17", "AMOE_DTYPE_BF16 = 2", "AMOE_COMM_TYPE_FUSED_MC2 = 3"] {
        assert!(header.contains(c), "{c} missing from the header");
    }
}
