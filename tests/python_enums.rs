//! The Python package's enums and C ABI constants (`python/ascend_moe/_enums.py`)
//! are exactly what this test renders from the library's enum table
//! (`ascend_moe::capi::ENUMS`) and constants, so a type checker sees
//! `CommType.MC2` and no number is typed in Python.
//!
//! Regenerate after changing an enum: `AMOE_BLESS_PYTHON=1 cargo test --test python_enums`.

use std::fmt::Write as _;
use std::path::Path;

use ascend_moe::capi::{CEnum, AMOE_GUARD_ACTUAL_TOKENS, AMOE_HCCL_WORLD, AMOE_MAX_EP_RANKS, AMOE_MAX_NDIM, ENUMS};

/// The Python class name of a C enum: `amoe_shared_mode` -> `SharedMode`
/// (`amoe_dtype` -> `DType`, as the Rust enum).
fn class_name(c_name: &str) -> String {
    let bare = c_name.strip_prefix("amoe_").expect("C enum names start with amoe_");
    if bare == "dtype" {
        return "DType".into();
    }
    bare.split('_').map(|w| w[..1].to_uppercase() + &w[1..]).collect()
}

/// What an error message calls a value of the enum: `amoe_shared_mode` -> `shared mode`.
fn label(c_name: &str) -> String {
    c_name.strip_prefix("amoe_").expect("amoe_ prefix").replace('_', " ")
}

fn docstring(out: &mut String, indent: &str, text: &str) {
    let text = text.replace('\\', "\\\\").replace("\"\"\"", "\\\"\\\"\\\"");
    let mut lines = text.lines();
    let first = lines.next().unwrap_or("");
    let rest: Vec<&str> = lines.collect();
    if rest.is_empty() {
        let _ = writeln!(out, "{indent}\"\"\"{first}\"\"\"");
    } else {
        let _ = writeln!(out, "{indent}\"\"\"{first}");
        for l in rest {
            if l.trim().is_empty() {
                out.push('\n');
            } else {
                let _ = writeln!(out, "{indent}{l}");
            }
        }
        let _ = writeln!(out, "{indent}\"\"\"");
    }
}

fn comment(out: &mut String, indent: &str, text: &str) {
    for l in text.lines() {
        let l = l.strip_prefix(' ').unwrap_or(l);
        let _ = writeln!(out, "{indent}#:{}", if l.is_empty() { String::new() } else { format!(" {l}") });
    }
}

fn render(enums: &[CEnum]) -> String {
    let mut out = String::new();
    out.push_str(
        "# Rendered from ascend_moe::capi::ENUMS and the C ABI's constants by\n\
         # tests/python_enums.rs; do not edit. Regenerate:\n\
         # AMOE_BLESS_PYTHON=1 cargo test --test python_enums\n\
         \"\"\"The library's enums as static `IntEnum` classes, and the C ABI's constants.\n\
         \n\
         Numbered once, by the library's Rust enums; `_lib` checks at load that the\n\
         library's table (`amoe_enum_info` / `amoe_enum_entry`) is this one.\"\"\"\n\
         \n\
         from __future__ import annotations\n\
         \n\
         import enum\n\
         import operator\n\
         \n\
         from ._errors import error\n\n",
    );
    let _ = writeln!(out, "#: `AMOE_MAX_NDIM`: most dimensions an `amoe_tensor` may have.");
    let _ = writeln!(out, "MAX_NDIM = {AMOE_MAX_NDIM}");
    let _ = writeln!(out, "#: `AMOE_GUARD_ACTUAL_TOKENS`: a live-context guard also compares the actual tokens.");
    let _ = writeln!(out, "GUARD_ACTUAL_TOKENS = {AMOE_GUARD_ACTUAL_TOKENS}");
    let _ = writeln!(out, "#: `AMOE_HCCL_WORLD`: `amoe_comm_from_hccl` flag, the borrowed communicator is the world.");
    let _ = writeln!(out, "HCCL_WORLD = {AMOE_HCCL_WORLD}");
    let _ = writeln!(out, "#: `AMOE_MAX_EP_RANKS`: most EP ranks a layout or a forward context may have.");
    let _ = writeln!(out, "MAX_EP_RANKS = {AMOE_MAX_EP_RANKS}");
    out.push_str("\n#: The dtypes a reduction (sum, max, min) takes, as the library's `DType::REDUCIBLE`;\n");
    out.push_str("#: every other dtype is only moved (all_gather, all_to_all, broadcast).\n");
    let names: Vec<String> = ascend_moe::DType::REDUCIBLE.iter().map(|d| format!("\"{}\"", d.name())).collect();
    let _ = writeln!(out, "REDUCIBLE_DTYPE_NAMES = ({})", names.join(", "));
    out.push_str(
        "\n\nclass _Numbered(enum.IntEnum):\n    \
         \"\"\"An enum of the library; members are its C names without the enum's prefix.\"\"\"\n\n    \
         @classmethod\n    \
         def parse(cls, v):\n        \
         \"\"\"A member from itself, its number, or its name in any case (`\"tensor_parallel\"`);\n        \
         a number is taken by `operator.index`, so a float is refused, never truncated.\"\"\"\n        \
         what = LABELS[cls.__name__]\n        \
         if isinstance(v, str):\n            \
         try:\n                \
         return cls[v.strip().upper()]\n            \
         except KeyError:\n                \
         names = \", \".join(m.name.lower() for m in cls)\n                \
         raise error(Status.INVALID_ARGUMENT, f\"unknown {what} {v!r} (expected one of {names})\") from None\n        \
         try:\n            \
         return cls(operator.index(v))\n        \
         except (TypeError, ValueError):\n            \
         top = int(max(cls))\n            \
         raise error(Status.INVALID_ARGUMENT, f\"unknown {what} {v!r} (expected 0..={top})\") from None\n",
    );
    for e in enums {
        let c_name = e.name.to_str().expect("ASCII enum name");
        let _ = write!(out, "\n\nclass {}(_Numbered):\n", class_name(c_name));
        docstring(&mut out, "    ", &format!("`{c_name}`: {}", e.doc));
        out.push('\n');
        for v in e.variants {
            comment(&mut out, "    ", v.doc);
            let _ = writeln!(out, "    {} = {}", v.name, v.value);
        }
    }
    out.push_str("\n\n#: The class of each C enum, in the library's order.\nTABLES = {\n");
    for e in enums {
        let c_name = e.name.to_str().expect("ASCII enum name");
        let _ = writeln!(out, "    \"{c_name}\": {},", class_name(c_name));
    }
    out.push_str("}\n#: What an error message calls a value of each enum.\nLABELS = {\n");
    for e in enums {
        let c_name = e.name.to_str().expect("ASCII enum name");
        let _ = writeln!(out, "    \"{}\": \"{}\",", class_name(c_name), label(c_name));
    }
    out.push_str("}\n");
    out
}

#[test]
fn python_enums_match_committed() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/ascend_moe/_enums.py");
    let fresh = render(&ENUMS);
    if std::env::var_os("AMOE_BLESS_PYTHON").is_some() {
        std::fs::write(&path, &fresh).expect("write python/ascend_moe/_enums.py");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != fresh {
        let line = committed.lines().zip(fresh.lines()).position(|(a, b)| a != b).unwrap_or(0) + 1;
        panic!(
            "python/ascend_moe/_enums.py is stale (first difference at line {line}); \
             regenerate with `AMOE_BLESS_PYTHON=1 cargo test --test python_enums` and commit it"
        );
    }
}

#[test]
fn every_enum_and_variant_is_rendered() {
    let text = render(&ENUMS);
    for e in ENUMS {
        let c_name = e.name.to_str().unwrap();
        assert!(text.contains(&format!("class {}(_Numbered):", class_name(c_name))), "{c_name} missing");
        for v in e.variants {
            assert!(text.contains(&format!("\n    {} = {}\n", v.name, v.value)), "{c_name}::{} missing", v.name);
        }
    }
    assert_eq!(class_name("amoe_shared_mode"), "SharedMode");
    assert_eq!(class_name("amoe_dtype"), "DType");
    assert_eq!(label("amoe_drop_pad_mode"), "drop pad mode");
}
