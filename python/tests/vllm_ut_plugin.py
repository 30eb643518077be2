"""pytest plugin (`-p vllm_ut_plugin`) that runs vLLM-Ascend's own unit tests
from the pinned files with `ascend_moe.vllm_ascend.install()` active.

The stand-ins go in before vLLM-Ascend's tests/ut/conftest.py is imported.
The TP group is a single-process stand-in of world size 2 without a
torch.distributed group, so the adapter takes the group's own collectives,
which vLLM-Ascend's tests replace by mocks. Where a test passes "is the
routed output already reduced?" as a bool, the forward context carries the
comm type that bool stands for (True: MC2, False or no such parameter:
ALLGATHER), because the adapter decides from the live comm type.
"""

from types import SimpleNamespace

import pytest

import vllm_standins as vs

vs.setup()


class _SingleProcessTp:
    """vLLM's TP group as their unit tests see it: world size 2, rank 0, no process group."""

    world_size = 2
    rank_in_group = 0
    unique_name = "tp"

    def all_reduce(self, x):
        raise AssertionError("the unit tests mock tensor_model_parallel_all_reduce; the group's own is not called")


vs.set_groups(tp=_SingleProcessTp())


def pytest_sessionstart(session):
    import ascend_moe.vllm_ascend as av

    av.install()


@pytest.fixture(autouse=True)
def _adapter_active_with_comm_type(request):
    import ascend_moe.vllm_ascend as av

    assert av.status()["active"], "ascend_moe.vllm_ascend.install() is not active"
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    fa = vs.load("ascend_forward_context")
    ct = params.get("moe_comm_type")
    for name in ("fused_output_is_reduced", "output_is_reduced"):
        if ct is None and name in params:
            ct = fa.MoECommType.MC2 if params[name] else fa.MoECommType.ALLGATHER
    if ct is None:
        # The tests that pass a literal False ("not reduced yet").
        ct = fa.MoECommType.ALLGATHER
    prev = vs._STATE.forward_context
    vs.set_forward_context_obj(SimpleNamespace(moe_comm_type=ct, dp_metadata=None))
    yield
    vs.set_forward_context_obj(prev)
