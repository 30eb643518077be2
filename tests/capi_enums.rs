//! The numbers of every enum the C ABI carries agree between the Rust enums
//! and `include/ascend_moe.h`, every variant in both directions
//! (`python/tests/test_enums.py` ties the Python package to the same header).

use std::collections::BTreeMap;
use std::ffi::CStr;

use ascend_moe::capi::amoe_status_name;
use ascend_moe::moe::SharedMode;
use ascend_moe::types::DropPadMode;
use ascend_moe::{CommType, DType, ReduceOp};

/// `AMOE_<ENUM>_<VARIANT> = N` entries of the `enum amoe_<enum>` block.
fn header_enum(name: &str) -> BTreeMap<String, u32> {
    let h = include_str!("../include/ascend_moe.h");
    let start = h.find(&format!("enum {name}\n")).unwrap_or_else(|| panic!("no enum {name} in the header"));
    let body = &h[start..];
    let body = &body[body.find('{').expect("enum body")..body.find("};").expect("enum end")];
    let prefix = format!("{}_", name.to_uppercase());
    let mut out = BTreeMap::new();
    for line in body.lines().map(str::trim).filter(|l| l.starts_with("AMOE_")) {
        let (k, v) = line.trim_end_matches(',').split_once(" = ").unwrap_or_else(|| panic!("odd line {line:?}"));
        let k = k.strip_prefix(&prefix).unwrap_or_else(|| panic!("{k} lacks the prefix {prefix}"));
        assert!(out.insert(k.to_string(), v.parse().expect("number")).is_none(), "{k} twice in {name}");
    }
    assert!(!out.is_empty(), "enum {name} has no variants");
    out
}

/// `TensorParallel` -> `TENSOR_PARALLEL`, the rename cbindgen applies.
fn screaming(camel: &str) -> String {
    let mut s = String::new();
    for (i, c) in camel.chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            s.push('_');
        }
        s.push(c.to_ascii_uppercase());
    }
    s
}

fn same(name: &str, rust: Vec<(String, u32)>) {
    let header = header_enum(name);
    let rust: BTreeMap<String, u32> = rust.into_iter().collect();
    assert_eq!(rust, header, "{name}: the Rust enum (left) and the header (right) disagree");
}

#[test]
fn dtypes_agree() {
    same("amoe_dtype", DType::EVERY.iter().map(|d| (d.name().to_uppercase(), *d as u32)).collect());
    for (_, v) in header_enum("amoe_dtype") {
        assert_eq!(DType::from_u32(v).map(|d| d as u32), Some(v), "dtype code {v}");
    }
    assert_eq!(DType::from_u32(DType::EVERY.len() as u32), None);
}

#[test]
fn comm_types_reduce_ops_shared_and_drop_pad_modes_agree() {
    same("amoe_comm_type", CommType::ALL.iter().map(|c| (c.name().to_string(), *c as u32)).collect());
    same("amoe_reduce_op", ReduceOp::ALL.iter().map(|o| (o.name().to_uppercase(), *o as u32)).collect());
    same("amoe_shared_mode", SharedMode::ALL.iter().map(|m| (screaming(&format!("{m:?}")), *m as u32)).collect());
    let modes: Vec<DropPadMode> = (0..).map_while(DropPadMode::from_u32).collect();
    same("amoe_drop_pad_mode", modes.iter().map(|m| (screaming(&format!("{m:?}")), *m as u32)).collect());
    for (_, v) in header_enum("amoe_comm_type") {
        assert!(CommType::from_u32(v).is_ok(), "comm type {v}");
    }
    assert!(CommType::from_u32(CommType::ALL.len() as u32).is_err());
    assert!(SharedMode::from_u32(SharedMode::ALL.len() as u32).is_err());
}

#[test]
fn every_status_has_a_name_and_nothing_else_does() {
    let header = header_enum("amoe_status");
    let name = |v: u32| {
        // SAFETY: amoe_status_name returns a static NUL-terminated string.
        unsafe { CStr::from_ptr(amoe_status_name(v)) }.to_str().expect("utf-8").to_string()
    };
    let max = *header.values().max().expect("statuses");
    assert_eq!(header.len() as u32, max + 1, "status codes are dense from 0: {header:?}");
    let mut seen = std::collections::BTreeSet::new();
    for (k, v) in &header {
        let n = name(*v);
        assert_ne!(n, "unknown status", "AMOE_STATUS_{k} = {v} has no name");
        assert!(seen.insert(n.clone()), "two statuses are named {n:?}");
    }
    assert_eq!(name(max + 1), "unknown status");
    assert_eq!(name(u32::MAX), "unknown status");
}
