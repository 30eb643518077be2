//! The committed C header is exactly what the pinned cbindgen generates from
//! `src/capi`, and its version macro matches Cargo.toml.
//!
//! Regenerate after changing the C ABI: `AMOE_BLESS_HEADER=1 cargo test --test capi_header`.
//!
//! The header's `enum amoe_*` blocks are not written in `src/capi`: the enums
//! are numbered once, by `numbered!` in Rust, and cbindgen does not expand
//! macros. [`enum_source`] renders the library's table of them
//! (`ascend_moe::capi::ENUMS`) as plain Rust enums, which cbindgen reads as
//! one more source, so the header gets them in its usual form.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use ascend_moe::capi::ENUMS;

/// `ENUMS` as Rust source: `#[repr(u32)] pub enum amoe_x { AMOE_X_NAME = value, ... }`
/// with the docs of the table.
fn enum_source() -> String {
    let doc = |out: &mut String, indent: &str, text: &str| {
        for line in text.lines() {
            let _ = writeln!(
                out,
                "{indent}///{}",
                if line.is_empty() || line.starts_with(' ') { line.to_string() } else { format!(" {line}") }
            );
        }
    };
    let mut out = String::from("// Rendered from ascend_moe::capi::ENUMS by tests/capi_header.rs.\n");
    for e in ENUMS {
        let name = e.name.to_str().expect("ASCII enum name");
        out.push('\n');
        doc(&mut out, "", e.doc);
        let _ = writeln!(out, "#[repr(u32)]\npub enum {name} {{");
        for v in e.variants {
            doc(&mut out, "    ", v.doc);
            let _ = writeln!(out, "    {}_{} = {},", name.to_uppercase(), v.name, v.value);
        }
        out.push_str("}\n");
    }
    out
}

fn enum_source_file() -> PathBuf {
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("amoe_enums.rs");
    std::fs::write(&path, enum_source()).expect("write the rendered enums");
    path
}

fn generated() -> &'static str {
    static HEADER: OnceLock<String> = OnceLock::new();
    HEADER.get_or_init(|| {
        let root = env!("CARGO_MANIFEST_DIR");
        let config = cbindgen::Config::from_file(Path::new(root).join("cbindgen.toml")).expect("cbindgen.toml parses");
        let bindings = cbindgen::Builder::new()
            // Only the C ABI module: the rest of the crate is not part of the header.
            .with_src(Path::new(root).join("src/capi/mod.rs"))
            .with_src(enum_source_file())
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
    for f in [
        "amoe_version",
        "amoe_last_error_message",
        "amoe_comm_cpu_new",
        "amoe_comm_free",
        "amoe_all_reduce",
        "amoe_enum_count",
        "amoe_enum_info",
        "amoe_enum_entry",
    ] {
        assert!(header.contains(&format!("{f}(")), "{f} missing from the header");
    }
    for c in [
        "AMOE_STATUS_OK = 0",
        "AMOE_STATUS_PANIC = 17",
        "AMOE_STATUS_STALE_CONTEXT = 19",
        "AMOE_DTYPE_BF16 = 2",
        "AMOE_COMM_TYPE_FUSED_MC2 = 3",
        "AMOE_DROP_PAD_MODE_DROP_PAD_ROW = 3",
    ] {
        assert!(header.contains(c), "{c} missing from the header");
    }
}
