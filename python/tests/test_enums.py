"""Every enum of the Python package has the numbers of `include/ascend_moe.h`, every
variant in both directions (tests/capi_enums.rs ties the Rust enums to the same header)."""

import re
from pathlib import Path

import ascend_moe as am
from ascend_moe import _tensor

HEADER = (Path(__file__).resolve().parents[2] / "include" / "ascend_moe.h").read_text()

# numpy / torch dtype names of the package -> the header's dtype variant names.
DTYPE_NAMES = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int32": "I32",
    "int64": "I64",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8E4M3",
    "float8_e5m2": "F8E5M2",
}


def header_enum(name):
    body = re.search(r"enum %s\n[^{]*\{(.*?)\};" % name, HEADER, re.S)
    assert body, f"no enum {name} in the header"
    prefix = name.upper() + "_"
    entries = dict(
        (k[len(prefix) :], int(v)) for k, v in re.findall(r"^\s*(AMOE_\w+) = (\d+),?$", body.group(1), re.M)
    )
    assert entries, f"enum {name} has no variants"
    return entries


def test_int_enums_match_the_header():
    for cls, name in [
        (am.Status, "amoe_status"),
        (am.CommType, "amoe_comm_type"),
        (am.SharedMode, "amoe_shared_mode"),
        (am.ReduceOp, "amoe_reduce_op"),
    ]:
        assert {m.name: int(m) for m in cls} == header_enum(name), cls.__name__


def test_dtype_codes_match_the_header():
    header = header_enum("amoe_dtype")
    assert set(DTYPE_NAMES) == set(_tensor.DTYPE_CODES), "a dtype the package knows is missing here, or vice versa"
    assert {DTYPE_NAMES[n]: c for n, c in _tensor.DTYPE_CODES.items()} == header
    assert set(_tensor.NUMPY_DTYPES) == set(header.values())
    for n, c in _tensor.DTYPE_CODES.items():
        assert _tensor.NUMPY_DTYPES[c].name == n, (n, c)
