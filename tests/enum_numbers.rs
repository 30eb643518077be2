//! No enum number is typed outside its one definition (`numbered!` in Rust;
//! the header and `python/ascend_moe/_enums.py` are rendered from it).
//!
//! The scan looks for the ways a number has been typed by hand before: a
//! message listing codes with their names (`0 (f32), 1 (f16)`, `0 sum, 1 max`),
//! a Python comparison with literal codes (`in (1, 3)`), and a C ABI constant
//! repeated as a literal in Python (`MAX_NDIM = 8`). Messages should name the
//! valid values from the table (`Numbered::TABLE`) instead.
//!
//! [`KNOWN`] lists the places that still type numbers: a listed place that no
//! longer matches fails the test too (remove it from the list), so the list
//! can only shrink.

use std::path::{Path, PathBuf};

use ascend_moe::capi::{AMOE_GUARD_ACTUAL_TOKENS, AMOE_MAX_NDIM, ENUMS};

/// `(file, what)` pairs that still type numbers by hand; `what` is the C name
/// of the enum whose numbers are typed, or the literal found.
const KNOWN: &[(&str, &str)] = &[
    // The unknown-dtype and unknown-device-kind messages of the C descriptor conversion.
    ("src/capi/ffi.rs", "amoe_dtype"),
    ("src/capi/ffi.rs", "amoe_device_kind"),
    // The unknown-reduce-op message of the collective exports.
    ("src/capi/comm.rs", "amoe_reduce_op"),
];

fn files(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("readable dir") {
        let p = e.expect("dir entry").path();
        if p.is_dir() {
            files(&p, ext, out);
        } else if p.extension().is_some_and(|x| x == ext) {
            out.push(p);
        }
    }
}

/// The hand-typed forms of every variant of every enum, with the enum's C
/// name: `V (name)` and `V name,` / `V name)` with the variant's lower-case
/// name. Statuses get only the first form: `0 ok,` is also how prose lists
/// process exit codes (the CLI's), which are no enum of the ABI.
fn variant_patterns() -> Vec<(String, &'static str)> {
    let mut out = Vec::new();
    for e in ENUMS {
        let c_name = e.name.to_str().expect("ASCII enum name");
        for v in e.variants {
            let n = v.name.to_lowercase();
            out.push((format!("{} ({n})", v.value), c_name));
            if c_name != "amoe_status" {
                out.push((format!("{} {n},", v.value), c_name));
                out.push((format!("{} {n})", v.value), c_name));
            }
        }
    }
    out
}

/// `(file relative to the repository root, what)` for every file and enum (or
/// literal) found, once each.
fn scan() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut rust = Vec::new();
    files(&root.join("src"), "rs", &mut rust);
    let mut python = Vec::new();
    files(&root.join("python/ascend_moe"), "py", &mut python);
    let variants = variant_patterns();
    let python_literals = [
        format!("MAX_NDIM = {AMOE_MAX_NDIM}"),
        format!("GUARD_ACTUAL_TOKENS = {AMOE_GUARD_ACTUAL_TOKENS}"),
        "in (1, 3)".to_string(),
        "in (0, 1)".to_string(),
        "in (0, 2)".to_string(),
        "in (1, 2)".to_string(),
        "in (2, 3)".to_string(),
    ]
    .map(|p| (p.clone(), p));
    let mut hits = Vec::new();
    let rel = |p: &Path| p.strip_prefix(root).expect("under the root").to_string_lossy().into_owned();
    for p in &rust {
        let text = std::fs::read_to_string(p).expect("readable source");
        for (pat, what) in &variants {
            if text.contains(pat.as_str()) {
                hits.push((rel(p), what.to_string()));
            }
        }
    }
    for p in &python {
        if p.file_name().is_some_and(|n| n == "_enums.py") {
            continue; // rendered from the table by tests/python_enums.rs
        }
        let text = std::fs::read_to_string(p).expect("readable module");
        let literals = python_literals.iter().map(|(p, w)| (p.clone(), w.as_str()));
        for (pat, what) in variants.iter().map(|(p, w)| (p.clone(), *w)).chain(literals) {
            if text.contains(pat.as_str()) {
                hits.push((rel(p), what.to_string()));
            }
        }
    }
    hits.sort();
    hits.dedup();
    hits
}

#[test]
fn no_enum_number_is_typed_by_hand() {
    let hits = scan();
    let new: Vec<&(String, String)> =
        hits.iter().filter(|(f, what)| !KNOWN.iter().any(|&(kf, kw)| kf == f && kw == what)).collect();
    assert!(new.is_empty(), "enum numbers typed by hand (name the values from the enum's TABLE instead): {new:?}");
    let gone: Vec<&(&str, &str)> =
        KNOWN.iter().filter(|&&(f, pat)| !hits.iter().any(|(hf, hp)| hf == f && hp == pat)).collect();
    assert!(gone.is_empty(), "these listed places no longer type numbers; remove them from KNOWN: {gone:?}");
}

/// The scan finds the forms it looks for.
#[test]
fn the_scan_knows_the_hand_typed_forms() {
    let v = variant_patterns();
    for (want, what) in [
        ("0 (f32)", "amoe_dtype"),
        ("9 (f8e5m2)", "amoe_dtype"),
        ("1 max,", "amoe_reduce_op"),
        ("2 min)", "amoe_reduce_op"),
        ("3 (fused_mc2)", "amoe_comm_type"),
    ] {
        assert!(v.iter().any(|(p, w)| p == want && *w == what), "{want} not among {v:?}");
    }
}
