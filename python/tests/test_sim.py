"""The Python API on simulated NPUs: stand-in NPU tensors and streams over
cann-sim device memory (`sim_workers.py`, with the scenarios of
`npu_scenarios.py` that `test_npu.py` runs on real torch_npu tensors), one
process per scenario with the loader pointed at libcann_sim.so, and the
simulator's leak report set to fail the process.

Run by `ci/npu-4card.sh --sim` (ci/sim.sh; ASCEND_MOE_EXPECT_RUNTIME=sim),
the scenarios take the runtime that script loaded: its ASCEND_MOE_*_LIB
variables, CANNSIM_CANN_VERSION and the other simulator settings, and
fail when one is unset. Run by pytest alone, the simulator is `$CANNSIM_LIB`,
else `libcann_sim.so` in cargo's debug target directory (`cargo build -p
cann-sim`), emulating CANN 8.5; without it the tests skip, except under CI,
where they fail."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _sim_lib():
    env = os.environ.get("CANNSIM_LIB")
    if env:
        return Path(env)
    target = Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")
    return target / "debug" / "libcann_sim.so"


# What `ci/npu-4card.sh --sim` hands the scenarios as ci/sim.sh set it.
RUNTIME_VARS = (
    "ASCEND_MOE_ACL_LIB",
    "ASCEND_MOE_HCCL_LIB",
    "ASCEND_MOE_NNOPBASE_LIB",
    "ASCEND_MOE_OPAPI_LIB",
    "CANNSIM_CANN_VERSION",
    "CANNSIM_DEVICES",
)


@pytest.fixture(scope="module")
def sim_env(tmp_path_factory):
    env = dict(os.environ)
    env.pop("ASCEND_MOE_TORCH", None)
    if os.environ.get("ASCEND_MOE_EXPECT_RUNTIME") == "sim":
        unset = [v for v in RUNTIME_VARS if not os.environ.get(v)]
        if unset:
            pytest.fail(
                f"ASCEND_MOE_EXPECT_RUNTIME=sim (ci/npu-4card.sh --sim), but {', '.join(unset)} "
                "is not set: run it through ci/sim.sh",
                pytrace=False,
            )
        env.setdefault("CANNSIM_LEAK_REPORT", "fail")
    else:
        lib = _sim_lib()
        if not lib.is_file():
            msg = f"the simulated CANN runtime {lib} is not built (cargo build -p cann-sim)"
            if os.environ.get("CI"):
                pytest.fail(msg, pytrace=False)
            pytest.skip(msg)
        # CANN 8.5's operator libraries, each a symlink to the one simulator.
        ops = tmp_path_factory.mktemp("cann-sim-ops")
        for name in ("libopapi_transformer.so", "libopapi_math.so"):
            (ops / name).symlink_to(lib)
        env.update(
            ASCEND_MOE_ACL_LIB=str(lib),
            ASCEND_MOE_HCCL_LIB=str(lib),
            ASCEND_MOE_NNOPBASE_LIB=str(lib),
            ASCEND_MOE_OPAPI_LIB=str(ops / "libopapi.so"),
            CANNSIM_CANN_VERSION="8.5",
            CANNSIM_DEVICES="4",
            CANNSIM_LEAK_REPORT="fail",
            ASCEND_MOE_COMM_TIMEOUT="20",
            HCCL_EXEC_TIMEOUT="20",
        )
    env.update(
        ASCEND_MOE_TORCH="0",
        PYTHONPATH=os.pathsep.join(
            [str(HERE)] + [str(Path(p).resolve()) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        ),
    )
    return env


@pytest.mark.parametrize("scenario", ["local_ops", "world4", "world4_procs", "world4_visible", "missing_stream", "live_context", "live_context_records", "stream_ops", "release_in_flight", "side_stream", "capture_stream"])
def test_python_api_on_simulated_npu_memory(sim_env, scenario):
    run = subprocess.run(
        [sys.executable, str(HERE / "sim_workers.py"), scenario],
        env=sim_env,
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0 and f"ok {scenario}" in run.stdout, (
        f"exit {run.returncode}\nstdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    )
