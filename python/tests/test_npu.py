"""The Python API and the torch custom ops on real torch_npu tensors, on a
host with 4 Ascend NPUs: the scenarios of `npu_scenarios` (which
`test_sim.py` runs on the simulator's stand-ins) on one NPU and on 4 ranks,
one process per rank (`world.run_world`, `npu_workers.py`).

`ci/npu-4card.sh` runs this file on real hardware, with
ASCEND_MOE_EXPECT_RUNTIME=real: then a missing torch_npu, torch custom ops
that did not register, or fewer than 4 NPUs fail the run (a missing native
library already fails it in conftest.py), as the Rust NPU tests do. Under any
other value (unset: a CPU machine, ci/test.sh; sim: the simulator, where
`test_sim.py` runs the same scenarios) the NPU tests are skipped, and only
the rank bodies' compile check runs."""

import os
from pathlib import Path

import pytest

import ascend_moe as am
from world import run_world

HERE = Path(__file__).resolve().parent
WORLD = 4
EXPECT = os.environ.get("ASCEND_MOE_EXPECT_RUNTIME")
# Seconds a scenario may take; each process first initialises torch_npu.
DEADLINE_S = 600.0


def _missing():
    """What this host lacks for the tests, or None."""
    try:
        import torch
        import torch_npu  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"torch_npu does not import ({type(e).__name__}: {e})"
    if not am.TORCH_OPS:
        return f"the torch custom ops did not register ({am.TORCH_OPS_ERROR})"
    n = torch.npu.device_count()
    if n < WORLD:
        return f"torch_npu sees {n} NPU(s), the multi-rank tests need {WORLD}"
    return None


if EXPECT == "real":
    _why = _missing()
    if _why is not None:
        pytest.fail(f"ASCEND_MOE_EXPECT_RUNTIME=real: {_why}", pytrace=False)

needs_npus = pytest.mark.skipif(
    EXPECT != "real",
    reason="needs torch_npu and 4 Ascend NPUs; ci/npu-4card.sh runs it on such a host "
    f"(ASCEND_MOE_EXPECT_RUNTIME=real, here {EXPECT!r})",
)


def test_the_npu_rank_bodies_compile():
    """npu_workers.py imports torch_npu, so only an NPU host imports it: here
    it is at least compiled, so a syntax error shows on every machine."""
    path = HERE / "npu_workers.py"
    compile(path.read_text(), str(path), "exec")


@needs_npus
def test_finalize_and_unpermute_on_an_npu_tensor():
    import npu_workers

    # NPU 1: a non-zero ordinal, which a descriptor must carry.
    results, _ = run_world(npu_workers.local_ops, 1, args=(1,), deadline_s=DEADLINE_S, torch_ops=True)
    assert results == {0: "ok"}, results


@needs_npus
def test_live_context_guards_on_an_npu_stream():
    import npu_workers

    results, _ = run_world(npu_workers.live_context, 1, args=(2,), deadline_s=DEADLINE_S, torch_ops=True)
    assert results == {0: "ok"}, results


@needs_npus
def test_world_ops_on_4_npus():
    import npu_workers

    results, _ = run_world(npu_workers.world_ops, WORLD, deadline_s=DEADLINE_S, torch_ops=True)
    assert results == {r: "ok" for r in range(WORLD)}, results
