"""The Python package numbers no enum itself: its enums are `_enums`, rendered
from the library's table by tests/python_enums.rs (which fails when the
committed file is stale), and here they are tied to the header and to the
loaded library's table (`amoe_enum_*`), every enum and variant in both
directions (tests/capi_enums.rs ties the Rust enums to the same header and
table)."""

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import ascend_moe as am
from ascend_moe import _enums, _errors, _tensor

# The module (the package's `_lib` attribute is its `lib()` function).
_lib = importlib.import_module("ascend_moe._lib")

ROOT = Path(__file__).resolve().parents[2]
HEADER = (ROOT / "include" / "ascend_moe.h").read_text()

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

# The package's class for each header enum (the dtype and device-kind codes
# also make tables of `_tensor`, checked below).
CLASSES = {
    "amoe_status": am.Status,
    "amoe_dtype": am.DType,
    "amoe_device_kind": _enums.DeviceKind,
    "amoe_comm_type": am.CommType,
    "amoe_shared_mode": am.SharedMode,
    "amoe_reduce_op": am.ReduceOp,
    "amoe_drop_pad_mode": am.DropPadMode,
}


def header_enums():
    """`{enum name: {variant name without the prefix: value}}` of every `enum amoe_*` block."""
    out = {}
    for name, body in re.findall(r"^enum (amoe_\w+)\n[^{]*\{(.*?)\};", HEADER, re.S | re.M):
        prefix = name.upper() + "_"
        entries = {}
        for k, v in re.findall(r"^\s*(AMOE_\w+) = (\d+),?$", body, re.M):
            assert k.startswith(prefix), (name, k)
            assert k[len(prefix) :] not in entries, (name, k)
            entries[k[len(prefix) :]] = int(v)
        assert entries, f"enum {name} has no variants"
        assert name not in out, f"enum {name} twice"
        out[name] = entries
    return out


def test_the_library_table_is_the_header():
    header = header_enums()
    assert len(header) >= 7, sorted(header)
    # Dict equality is both directions: same enums, same variants, same numbers.
    table = _lib.library_enum_tables()
    assert table == header
    assert list(table) == list(header), "the table is in header order"


def test_the_static_enums_are_the_library_table():
    table = _lib.library_enum_tables()
    assert list(_enums.TABLES) == list(table)
    for name, cls in _enums.TABLES.items():
        assert [(m.name, int(m)) for m in cls] == list(table[name].items()), name


def test_every_header_enum_has_a_python_counterpart():
    assert set(CLASSES) == set(header_enums()) == set(_enums.TABLES)
    for name, cls in CLASSES.items():
        assert _enums.TABLES[name] is cls, name


def test_int_enums_match_the_header_both_ways():
    header = header_enums()
    for name, cls in CLASSES.items():
        assert {m.name: int(m) for m in cls} == header[name], cls.__name__
        for k, v in header[name].items():
            assert cls[k] is cls(v), (name, k, v)
        assert cls.__doc__, cls.__name__


def test_status_names_cover_every_status():
    lb = _lib.lib()
    names = {int(s): lb.amoe_status_name(int(s)) for s in am.Status}
    assert len(set(names.values())) == len(am.Status)
    assert b"unknown status" not in names.values()
    assert lb.amoe_status_name(max(names) + 1) == b"unknown status"


def test_dtype_codes_match_the_header():
    header = header_enums()["amoe_dtype"]
    assert set(DTYPE_NAMES) == set(_tensor.DTYPE_CODES), "a dtype the package knows is missing here, or vice versa"
    assert {DTYPE_NAMES[n]: c for n, c in _tensor.DTYPE_CODES.items()} == header
    assert set(_tensor.NUMPY_DTYPES) == set(header.values())
    for n, c in _tensor.DTYPE_CODES.items():
        assert _tensor.NUMPY_DTYPES[c].name == n, (n, c)


def test_device_kinds_match_the_header():
    assert header_enums()["amoe_device_kind"] == {"CPU": _tensor.DEVICE_CPU, "NPU": _tensor.DEVICE_NPU}


def test_default_drop_pad_mode_is_the_first():
    for f in (am.moe_finalize_routing, am.finalize_and_reduce, am.shapes.moe_finalize_routing):
        default = inspect.signature(f).parameters["drop_pad_mode"].default
        assert default is am.DropPadMode.DROP_LESS_COLUMN and int(default) == 0, f


def test_shared_mode_parse_names_the_valid_numbers():
    top = max(header_enums()["amoe_shared_mode"].values())
    try:
        am.SharedMode.parse(top + 1)
    except ValueError as e:
        assert isinstance(e, am.InvalidArgumentError) and isinstance(e, am.AmoeError)
        assert e.status is am.Status.INVALID_ARGUMENT
        assert f"expected 0..={top}" in str(e), str(e)
    else:
        raise AssertionError("an unknown shared mode was accepted")


def test_every_error_class_names_a_status():
    for name, cls in _errors.BY_STATUS_NAME.items():
        status = am.Status[name]
        e = _errors.error(status, "m")
        assert type(e) is cls and e.status is status and isinstance(e, am.AmoeError)
        assert isinstance(e, (ValueError, TypeError, MemoryError)), name
    assert type(_errors.error(am.Status.HCCL, "m")) is am.AmoeError
    assert isinstance(_errors.error(am.Status.DTYPE, "m"), TypeError)
    assert isinstance(_errors.error(am.Status.HOST_MEMORY, "m"), MemoryError)


# Enums that mirror another project's numbering, not the library's: the
# vLLM-Ascend adapter's copy of vLLM-Ascend's SharedExpertParallelMode
# (test_vllm_ascend.py compares it with the pinned vLLM-Ascend source).
FOREIGN_ENUMS = {("vllm_ascend.py", "SharedExpertParallelMode")}


def test_no_enum_number_is_written_in_the_package():
    """No enum class of the package assigns a member, except in `_enums`,
    which tests/python_enums.rs renders from the library's table, and the
    mirrors of another project's enums in FOREIGN_ENUMS."""
    found_foreign = set()
    for path in sorted((ROOT / "python" / "ascend_moe").glob("*.py")):
        if path.name == "_enums.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (path.name, getattr(node, "name", None)) in FOREIGN_ENUMS:
                found_foreign.add((path.name, node.name))
                continue
            if isinstance(node, ast.ClassDef) and any("Enum" in ast.unparse(b) for b in node.bases):
                assigns = [s for s in node.body if isinstance(s, ast.Assign | ast.AnnAssign)]
                members = [ast.unparse(s) for s in assigns]
                assert not members, f"{path.name}: class {node.name} numbers {members} itself"
    assert found_foreign == FOREIGN_ENUMS, f"FOREIGN_ENUMS names classes that are gone: {FOREIGN_ENUMS - found_foreign}"


def test_import_without_the_library_still_works_and_the_first_call_names_it(tmp_path):
    env = dict(os.environ, ASCEND_MOE_LIB=str(tmp_path / "missing.so"))
    code = (
        "import ascend_moe as am\nprint(am.CommType.MC2.name)\n"
        "try:\n    am.version()\nexcept OSError as e:\n    print(e)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.startswith("MC2\n") and "missing.so" in out, out
