//! Every enum the C ABI carries is numbered once, by its Rust enum, and the
//! committed header and the library's enum table (`amoe_enum_*`, which the
//! Python package reads) say the same, every variant, in both directions.
//! `python/tests/test_enums.py` ties the Python package to the same header
//! and table.

use std::collections::BTreeMap;
use std::ffi::{c_char, CStr};
use std::fmt::Debug;

use ascend_moe::capi::{
    amoe_comm_type_name, amoe_device_kind, amoe_enum_count, amoe_enum_entry, amoe_enum_info, amoe_status,
    amoe_status_name, ENUMS,
};
use ascend_moe::types::{Numbered, UnknownValue};
use ascend_moe::{CommType, DType, DropPadMode, ReduceOp, SharedMode};

type Variants = BTreeMap<String, u32>;

/// Every `enum amoe_*` block of the committed header: C name -> (variant
/// name without the `AMOE_<ENUM>_` prefix -> value).
fn header_enums() -> BTreeMap<String, Variants> {
    let h = include_str!("../include/ascend_moe.h");
    let mut out = BTreeMap::new();
    let mut rest = h;
    while let Some(at) = rest.find("\nenum amoe_") {
        let body = &rest[at + 6..];
        let name: String = body.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        let block = &body[body.find('{').expect("enum body") + 1..body.find("};").expect("enum end")];
        let prefix = format!("{}_", name.to_uppercase());
        let mut variants = Variants::new();
        for line in block.lines().map(str::trim).filter(|l| l.starts_with("AMOE_")) {
            let (k, v) = line.trim_end_matches(',').split_once(" = ").unwrap_or_else(|| panic!("odd line {line:?}"));
            let k = k.strip_prefix(&prefix).unwrap_or_else(|| panic!("{k} lacks the prefix {prefix}"));
            let v: u32 = v.parse().unwrap_or_else(|_| panic!("{name}: {k} = {v:?} is not a number"));
            assert!(variants.insert(k.to_string(), v).is_none(), "{k} twice in {name}");
        }
        assert!(!variants.is_empty(), "enum {name} has no variants");
        assert!(out.insert(name.clone(), variants).is_none(), "enum {name} twice in the header");
        rest = &body[1..];
    }
    out
}

/// The library's enum table through the C exports the Python package uses.
fn exported_enums() -> BTreeMap<String, Variants> {
    let text = |p: *const c_char| {
        assert!(!p.is_null());
        // SAFETY: the exports write static NUL-terminated strings.
        unsafe { CStr::from_ptr(p) }.to_str().expect("ASCII").to_string()
    };
    let mut out = BTreeMap::new();
    for i in 0..amoe_enum_count() {
        let (mut name, mut len) = (std::ptr::null(), 0usize);
        // SAFETY: valid out-pointers.
        assert_eq!(unsafe { amoe_enum_info(i, &mut name, &mut len) }, amoe_status::Ok);
        let mut variants = Variants::new();
        for j in 0..len {
            let (mut vname, mut value) = (std::ptr::null(), u32::MAX);
            // SAFETY: valid out-pointers.
            assert_eq!(unsafe { amoe_enum_entry(i, j, &mut vname, &mut value) }, amoe_status::Ok);
            assert!(variants.insert(text(vname), value).is_none());
        }
        assert!(out.insert(text(name), variants).is_none());
    }
    out
}

/// One Rust enum's variants, from the enum itself (`VARIANTS`, `as u32`,
/// `TryFrom`), checked against its own table.
fn rust_enum<E: Numbered + Debug>(variants: &[E], discriminant: impl Fn(E) -> u32) -> Variants {
    assert_eq!(variants.len(), E::TABLE.len(), "{}: VARIANTS and TABLE differ in length", E::NAME);
    let mut out = Variants::new();
    for (v, entry) in variants.iter().zip(E::TABLE) {
        let n = discriminant(*v);
        assert_eq!(v.value(), n, "{}::{v:?}", E::NAME);
        assert_eq!(entry.value, n, "{}::{v:?}: the table says {}", E::NAME, entry.value);
        assert_eq!(v.variant(), entry, "{}::{v:?}", E::NAME);
        assert_eq!(E::try_from(n).ok(), Some(*v), "{}: {n} does not map back to {v:?}", E::NAME);
        assert_eq!(entry.c_name.to_str(), Ok(entry.name));
        assert!(out.insert(entry.name.to_string(), n).is_none(), "{}: {} twice", E::NAME, entry.name);
    }
    let past = out.values().max().copied().unwrap_or(0) + 1;
    assert_eq!(E::try_from(past).err(), Some(UnknownValue { type_name: E::NAME, value: past }));
    assert!(E::try_from(u32::MAX).is_err());
    out
}

/// Every enum of the C ABI, from the Rust enums themselves.
fn rust_enums() -> BTreeMap<String, Variants> {
    BTreeMap::from([
        ("amoe_status".to_string(), rust_enum(&amoe_status::VARIANTS, |v| v as u32)),
        ("amoe_dtype".to_string(), rust_enum(&DType::VARIANTS, |v| v as u32)),
        ("amoe_device_kind".to_string(), rust_enum(&amoe_device_kind::VARIANTS, |v| v as u32)),
        ("amoe_reduce_op".to_string(), rust_enum(&ReduceOp::VARIANTS, |v| v as u32)),
        ("amoe_comm_type".to_string(), rust_enum(&CommType::VARIANTS, |v| v as u32)),
        ("amoe_shared_mode".to_string(), rust_enum(&SharedMode::VARIANTS, |v| v as u32)),
        ("amoe_drop_pad_mode".to_string(), rust_enum(&DropPadMode::VARIANTS, |v| v as u32)),
    ])
}

#[test]
fn rust_enums_header_and_exported_table_agree_every_variant_both_ways() {
    let rust = rust_enums();
    let header = header_enums();
    let exported = exported_enums();
    // BTreeMap equality is both directions: same enums, same variants, same numbers.
    assert_eq!(rust, header, "the Rust enums (left) and include/ascend_moe.h (right) disagree");
    assert_eq!(exported, rust, "amoe_enum_* (left) and the Rust enums (right) disagree");
    let table: Vec<String> = ENUMS.iter().map(|e| e.name.to_string_lossy().into_owned()).collect();
    assert_eq!(table.len(), header.len(), "ENUMS lists {table:?}");
}

#[test]
fn every_number_is_dense_from_zero() {
    for (name, variants) in rust_enums() {
        let mut values: Vec<u32> = variants.values().copied().collect();
        values.sort_unstable();
        assert_eq!(values, (0..variants.len() as u32).collect::<Vec<_>>(), "{name}");
    }
}

#[test]
fn the_crate_enums_keep_their_own_lists_and_parsers() {
    // The hand-written dtype lists agree with the predicate reductions use,
    // and the one-byte dtypes are exactly those it refuses.
    let reducible: Vec<DType> = DType::EVERY.into_iter().filter(|d| d.is_reducible()).collect();
    let refused: Vec<DType> = DType::EVERY.into_iter().filter(|d| !d.is_reducible()).collect();
    assert_eq!(DType::REDUCIBLE.to_vec(), reducible);
    assert_eq!(DType::BYTE_MOVES.to_vec(), refused);
    assert!(DType::BYTE_MOVES.iter().all(|d| d.size() == 1), "{:?}", DType::BYTE_MOVES);
    for d in DType::EVERY {
        assert_eq!(DType::from_u32(d as u32), Some(d));
    }
    assert_eq!(DType::from_u32(DType::EVERY.len() as u32), None);
    assert_eq!(DropPadMode::from_u32(DropPadMode::ALL.len() as u32), None);
    assert_eq!(ReduceOp::from_u32(ReduceOp::ALL.len() as u32), None);
    let e = CommType::from_u32(4).expect_err("4 is no comm type").to_string();
    assert!(e.contains("unknown MoE comm type 4 (expected 0..=3)"), "{e}");
    let e = SharedMode::from_u32(5).expect_err("5 is no shared mode").to_string();
    assert!(e.contains("unknown shared-expert mode 5 (expected 0..=4)"), "{e}");
    for c in CommType::ALL {
        assert_eq!(c.name(), c.variant().name);
    }
}

#[test]
fn the_enum_table_refuses_indices_past_its_end() {
    let (mut name, mut len, mut value) = (std::ptr::null(), 0usize, 0u32);
    // SAFETY: valid out-pointers; NULL where the test says.
    unsafe {
        assert_eq!(amoe_enum_info(amoe_enum_count(), &mut name, &mut len), amoe_status::InvalidArgument);
        assert_eq!(amoe_enum_entry(amoe_enum_count(), 0, &mut name, &mut value), amoe_status::InvalidArgument);
        assert_eq!(
            amoe_enum_entry(0, amoe_status::VARIANTS.len(), &mut name, &mut value),
            amoe_status::InvalidArgument
        );
        assert_eq!(amoe_enum_info(0, std::ptr::null_mut(), &mut len), amoe_status::NullArgument);
        assert_eq!(amoe_enum_entry(0, 0, &mut name, std::ptr::null_mut()), amoe_status::NullArgument);
    }
}

#[test]
fn every_status_has_a_name_and_nothing_else_does() {
    let name = |v: u32| {
        // SAFETY: amoe_status_name returns a static NUL-terminated string.
        unsafe { CStr::from_ptr(amoe_status_name(v)) }.to_str().expect("utf-8").to_string()
    };
    let header = &header_enums()["amoe_status"];
    assert_eq!(header.len(), amoe_status::VARIANTS.len());
    let mut seen = std::collections::BTreeSet::new();
    for (k, v) in header {
        let n = name(*v);
        assert_ne!(n, "unknown status", "AMOE_STATUS_{k} = {v} has no name");
        assert!(seen.insert(n.clone()), "two statuses are named {n:?}");
    }
    for s in amoe_status::VARIANTS {
        assert_eq!(name(s as u32), s.message().to_str().expect("utf-8"));
    }
    let past = header.values().max().expect("statuses") + 1;
    assert_eq!(name(past), "unknown status");
    assert_eq!(name(u32::MAX), "unknown status");
}

#[test]
fn comm_type_names_are_vllms() {
    for (c, want) in CommType::ALL.iter().zip(["ALLGATHER", "MC2", "ALLTOALL", "FUSED_MC2"]) {
        let mut out = std::ptr::null();
        // SAFETY: a valid out-pointer.
        assert_eq!(unsafe { amoe_comm_type_name(*c as u32, &mut out) }, amoe_status::Ok);
        // SAFETY: a static NUL-terminated string.
        assert_eq!(unsafe { CStr::from_ptr(out) }.to_str(), Ok(want));
    }
    let mut out = std::ptr::null();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { amoe_comm_type_name(CommType::ALL.len() as u32, &mut out) }, amoe_status::InvalidArgument);
}
