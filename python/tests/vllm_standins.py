"""Stand-ins for what vLLM-Ascend's pinned files import but cannot be installed
here (torch_npu, triton, the parts of vllm they use, and the vLLM-Ascend
modules outside the pinned subset), so the pinned files run unmodified, loaded
from `../shared/third_party/vllm-ascend-182b75e` (relative to the repository
root) at run time. torch_npu and triton are stubbed as vLLM-Ascend's own
tests/ut/conftest.py stubs them.

`setup(real_vllm=False)` installs them; with `real_vllm=True` the `vllm`
package itself is imported (ci/vllm-ascend.sh) and only torch_npu, triton and
the vLLM-Ascend modules outside the subset are stood in for.

`GroupCoordinator` is vLLM's group API (`world_size`, `rank_in_group`, `ranks`,
`cpu_group`, `device_group`, `all_reduce`, `all_gather`, `reduce_scatter`) over
a torch.distributed gloo group; its all-reduce is a custom op, as vLLM's is,
so a compiled graph calls it at run time.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import types
from dataclasses import dataclass
from types import SimpleNamespace
from unittest.mock import MagicMock

import torch

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PINNED = os.path.normpath(os.path.join(REPO_ROOT, "..", "shared", "third_party", "vllm-ascend-182b75e"))


def pinned_available() -> bool:
    return os.path.isfile(os.path.join(PINNED, "vllm_ascend", "ops", "register_custom_ops.py"))


class _AutoStub(types.ModuleType):
    """A module whose every missing attribute is a MagicMock (the way their
    conftest stubs torch_npu's attributes)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path: any `vllm_ascend.*` module the pinned subset
    lacks (and, without real vllm, any `vllm.*` one) becomes an `_AutoStub`."""

    def __init__(self, prefixes):
        self.prefixes = tuple(prefixes)

    def find_spec(self, fullname, path=None, target=None):
        if any(fullname == p or fullname.startswith(p + ".") for p in self.prefixes):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _AutoStub(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


_STANDINS = set()


def standin_modules() -> list:
    """The modules in sys.modules that are stand-ins, not real code."""
    return sorted(
        n for n, m in list(sys.modules.items())
        if n in _STANDINS or isinstance(m, (_AutoStub, MagicMock))
    )


def _module(name, **attrs):
    m = types.ModuleType(name)
    m.__spec__ = importlib.util.spec_from_loader(name, loader=None)
    m.__path__ = []
    for k, v in attrs.items():
        setattr(m, k, v)
    sys.modules[name] = m
    _STANDINS.add(name)
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, m)
    return m


# ------------------------------------------------------------- vllm pieces

_STATE = SimpleNamespace(forward_context=None, groups={}, vl_model=False, setup=False, real_vllm=False)


class DPMetadata:
    """vLLM's `DPMetadata`: `num_tokens_across_dp_cpu` and the SP chunk sizes
    the MoE runner installs (`get_chunk_sizes_across_dp_rank` asserts they are set)."""

    def __init__(self, num_tokens_across_dp, local_sizes=None):
        import torch

        self.num_tokens_across_dp_cpu = torch.tensor(list(num_tokens_across_dp), dtype=torch.int32)
        self.local_sizes = None if local_sizes is None else list(local_sizes)

    def get_chunk_sizes_across_dp_rank(self):
        assert self.local_sizes is not None
        return self.local_sizes


class ForwardContext(SimpleNamespace):
    # vLLM's ForwardContext field MoERunner reads (None: no layer registry).
    all_moe_layers = None


def get_forward_context():
    assert _STATE.forward_context is not None, "Forward context is not set."
    return _STATE.forward_context


@contextlib.contextmanager
def forward_context(**fields):
    """Sets vLLM's forward context (attributes as vLLM-Ascend's set_ascend_forward_context sets them)."""
    prev = _STATE.forward_context
    set_forward_context_obj(ForwardContext(**fields))
    try:
        yield _STATE.forward_context
    finally:
        set_forward_context_obj(prev)


def set_forward_context_obj(ctx):
    _STATE.forward_context = ctx
    if _STATE.real_vllm:
        sys.modules["vllm.forward_context"]._forward_context = ctx


_GROUPS_BY_ID = {}


class GroupCoordinator:
    """vLLM's GroupCoordinator over a gloo group of `ranks` (global ranks)."""

    def __init__(self, ranks, unique_name):
        import torch.distributed as dist

        self.ranks = list(ranks)
        self.world_size = len(self.ranks)
        self.rank = dist.get_rank()
        self.unique_name = unique_name
        self.cpu_group = dist.new_group(self.ranks, backend="gloo")
        self.device_group = self.cpu_group
        self.rank_in_group = self.ranks.index(self.rank) if self.rank in self.ranks else -1
        self.group_id = len(_GROUPS_BY_ID) + 1
        _GROUPS_BY_ID[self.group_id] = self

    def all_reduce(self, x):
        import torch

        if self.world_size == 1:
            return x
        return torch.ops.vllm_standin.all_reduce(x, self.group_id)

    def _all_reduce_eager(self, x):
        import torch.distributed as dist

        out = x.clone()
        dist.all_reduce(out, group=self.cpu_group)
        return out

    def all_gather(self, x, dim=0):
        import torch
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.cpu_group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, x, dim=0):
        import torch
        import torch.distributed as dist

        assert dim == 0
        total = x.clone()
        dist.all_reduce(total, group=self.cpu_group)
        return torch.tensor_split(total, self.world_size, dim=0)[self.rank_in_group].clone()


def _register_standin_ops():
    import torch

    @torch.library.custom_op("vllm_standin::all_reduce", mutates_args=(), device_types="cpu")
    def all_reduce(x: torch.Tensor, group: int) -> torch.Tensor:
        return _GROUPS_BY_ID[group]._all_reduce_eager(x)

    @all_reduce.register_fake
    def _(x, group):
        return torch.empty_like(x)


_REAL_GROUP_GLOBALS = {"ep": "_EP", "dp": "_DP", "tp": "_TP", "pcp": "_PCP"}


def set_groups(**groups):
    """Sets the groups get_{ep,dp,tp,pcp}_group return (keys ep, dp, tp, pcp);
    with the real vllm, its parallel_state globals."""
    _STATE.groups.update(groups)
    if _STATE.real_vllm:
        ps = sys.modules["vllm.distributed.parallel_state"]
        for k, g in groups.items():
            setattr(ps, _REAL_GROUP_GLOBALS[k], g)


def _getter(name):
    def get():
        g = _STATE.groups.get(name)
        assert g is not None, f"{name} group is not initialized"
        return g

    get.__name__ = f"get_{name}_group"
    return get


def _direct_register_custom_op(op_name, op_func, mutates_args=None, fake_impl=None, target_lib=None, dispatch_key=None, tags=()):
    """vllm.utils.torch_utils.direct_register_custom_op: define the schema
    inferred from op_func in the `vllm` library, one kernel, one fake."""
    import torch

    lib = target_lib or _vllm_lib()
    schema = torch.library.infer_schema(op_func, mutates_args=mutates_args or [])
    lib.define(op_name + schema, tags=tags)
    lib.impl(op_name, op_func, dispatch_key=dispatch_key or "CUDA")
    if fake_impl is not None:
        lib._register_fake(op_name, fake_impl)


_VLLM_LIB = []


def _vllm_lib():
    import torch

    if not _VLLM_LIB:
        _VLLM_LIB.append(torch.library.Library("vllm", "FRAGMENT"))
    return _VLLM_LIB[0]


class MoERunner:
    """vLLM's MoERunner as the pinned AscendMoERunner subclasses it (vLLM
    v0.27.1, commit 6e448d0ea, vllm/model_executor/layers/fused_moe/runner/
    moe_runner.py): `forward` runs the experts, then the reduction points in
    that file's order, passing "already reduced?" from one to the next."""

    def __init__(self, layer_name, moe_config, router, routed_experts, enable_dbo=False, gate=None,
                 shared_experts=None, shared_expert_gate=None, routed_input_transform=None,
                 routed_output_transform=None, routed_scaling_factor=1.0):
        self.layer_name, self.moe_config, self.router, self.routed_experts = layer_name, moe_config, router, routed_experts
        self.gate, self.shared_experts = gate, shared_experts
        self.routed_input_transform = routed_input_transform
        self.routed_output_transform = routed_output_transform
        self.routed_scaling_factor = routed_scaling_factor
        self._quant_method = getattr(routed_experts, "quant_method", None)

    @contextlib.contextmanager
    def _sequence_parallel_context(self):
        yield

    def _maybe_reduce_routed_output_before_transform(self, fused_output, fused_output_is_reduced):
        # moe_runner.py:441-460
        cfg = self.moe_config
        if (
            self.routed_output_transform is not None
            and not getattr(cfg, "is_sequence_parallel", False)
            and (getattr(cfg, "tp_size", 1) > 1 or getattr(cfg, "ep_size", 1) > 1)
            and not fused_output_is_reduced
        ):
            fused_output = sys.modules["vllm.distributed"].tensor_model_parallel_all_reduce(fused_output)
            fused_output_is_reduced = True
        return fused_output, fused_output_is_reduced

    def _maybe_apply_routed_scale_to_output(self, shared_output, fused_output):
        # moe_runner.py:391-408
        if getattr(self, "routed_scaling_factor", 1.0) != 1.0:
            if fused_output.dtype != torch.float16 or shared_output is None:
                fused_output = fused_output * self.routed_scaling_factor
            else:
                shared_output = shared_output * (1.0 / self.routed_scaling_factor)
        return shared_output, fused_output

    def apply_routed_output_transform(self, fused_output):
        # moe_runner.py:376-389
        if self.routed_output_transform is not None:
            r = self.routed_output_transform(fused_output)
            fused_output = r[0] if isinstance(r, tuple) else r
        return fused_output

    def forward(self, hidden_states, router_logits, input_ids=None, shared_experts_input=None):
        # The order of moe_runner.py:747-778 (MoERunner.forward, from line 671):
        # "already reduced?" read once (747), the routed output reduced before
        # its transform (751-756), the shared output reduced to match (760),
        # the routed scale (764), the transform (769), shared + routed
        # (771-774), the final reduction of the sum with the flag of 747-756
        # (776-778). The routed input transform, the hidden-dim padding and
        # the custom-op entry (704-730) and the zero-expert output (780) are
        # left out: the stand-in pads nothing, so both truncation sizes are None.
        result = self._forward_impl(hidden_states, router_logits, shared_experts_input, input_ids)
        shared_output, fused_output = result if isinstance(result, tuple) else (None, result)
        fused_output_is_reduced = self._fused_output_is_reduced
        fused_output, fused_output_is_reduced = self._maybe_reduce_routed_output_before_transform(
            fused_output, fused_output_is_reduced
        )
        shared_output = self._maybe_reduce_shared_expert_output(shared_output, fused_output_is_reduced)
        shared_output, fused_output = self._maybe_apply_routed_scale_to_output(shared_output, fused_output)
        fused_output = self.apply_routed_output_transform(fused_output)
        result = shared_output + fused_output if shared_output is not None else fused_output
        return self._maybe_reduce_final_output(result, None, fused_output_is_reduced)


def _install_vllm():
    import torch

    _module("vllm")
    dist_mod = _module(
        "vllm.distributed",
        get_ep_group=_getter("ep"),
        get_dp_group=_getter("dp"),
        get_tp_group=_getter("tp"),
        get_pcp_group=_getter("pcp"),
        tensor_model_parallel_all_reduce=lambda x: _getter("tp")().all_reduce(x),
        tensor_model_parallel_all_gather=lambda x, dim=-1: _getter("tp")().all_gather(x, dim),
        tensor_model_parallel_reduce_scatter=lambda x, dim=-1: _getter("tp")().reduce_scatter(x, dim),
        get_tensor_model_parallel_world_size=lambda: _getter("tp")().world_size,
        get_tensor_model_parallel_rank=lambda: _getter("tp")().rank_in_group,
        GroupCoordinator=GroupCoordinator,
    )
    _module("vllm.distributed.parallel_state", **{k: getattr(dist_mod, k) for k in dir(dist_mod) if not k.startswith("_")})
    _module(
        "vllm.forward_context",
        get_forward_context=get_forward_context,
        set_forward_context=lambda **kw: forward_context(**kw),
        BatchDescriptor=SimpleNamespace,
        DPMetadata=DPMetadata,
    )
    _module("vllm.utils")
    _module("vllm.utils.torch_utils", direct_register_custom_op=_direct_register_custom_op)
    _module("vllm.envs", VLLM_USE_V2_MODEL_RUNNER=False)
    _module("vllm.config", CUDAGraphMode=enum.Enum("CUDAGraphMode", "NONE PIECEWISE FULL"), VllmConfig=object)
    _module("vllm.logger", logger=_Logger("vllm"))
    _module("vllm.model_executor")
    _module("vllm.model_executor.layers")

    class FusedMoEConfig:
        pass

    class FusedMoERouter:
        pass

    class FusedMoEMethodBase:
        pass

    _module(
        "vllm.model_executor.layers.fused_moe",
        FusedMoEConfig=FusedMoEConfig,
        FusedMoERouter=FusedMoERouter,
        FusedMoEMethodBase=FusedMoEMethodBase,
    )
    _module("vllm.model_executor.layers.fused_moe.layer", MoERunner=MoERunner)
    del torch


class _Logger(logging.LoggerAdapter):
    def __init__(self, name):
        super().__init__(logging.getLogger(name), {})

    def info_once(self, *a, **k):
        self.info(*a, **k)

    def warning_once(self, *a, **k):
        self.warning(*a, **k)


# -------------------------------------------- torch_npu, triton (their conftest)


def _install_torch_npu():
    import torch

    triton_runtime = MagicMock()
    triton_runtime.driver.active.utils.get_device_properties.return_value = {"num_aic": 8, "num_vectorcore": 8}
    sys.modules["triton.runtime"] = triton_runtime
    torch_npu = types.ModuleType("torch_npu")
    torch_npu.__spec__ = importlib.util.spec_from_loader("torch_npu", loader=None)
    torch_npu.__path__ = []
    torch_npu.npu = MagicMock()
    torch_npu.profiler = MagicMock()
    torch_npu._C = MagicMock()
    torch_npu.float4_e2m1fn_x2 = 296
    torch_npu.hifloat8 = 290
    torch_npu.float8_e8m0fnu = 293
    sys.modules["torch_npu"] = torch_npu
    sys.modules["torch_npu._C"] = torch_npu._C
    _STANDINS.update(("torch_npu", "torch_npu._C"))
    try:
        torch.utils.rename_privateuse1_backend("npu")
    except RuntimeError:
        pass
    torch.npu = MagicMock()
    torch.npu.is_available = MagicMock(return_value=False)


# ------------------------------------ vLLM-Ascend modules outside the subset


class AscendDeviceType(enum.Enum):
    A2 = 0
    A3 = 1
    _310P = 2
    A5 = 3


class QuantType(enum.Enum):
    NONE = 0
    W8A8 = 1
    W4A8 = 2
    W8A8MXFP = 3
    W4A8MXFP = 4
    W4A4MXFP = 5


@dataclass
class MoEPrepareOutput:
    hidden_states: object
    router_logits: object
    mc2_mask: object = None
    padded_hidden_states_shape: object = None
    pertoken_scale: object = None


def set_vl_model(flag: bool):
    _STATE.vl_model = bool(flag)


ASCEND_CONFIG = SimpleNamespace(
    multistream_overlap_shared_expert=False,
    enable_shared_expert_dp=False,
    enable_fused_mc2=0,
    enable_prefill_mc2=False,
    enable_context_parallel=False,
)


def _install_vllm_ascend():
    import torch

    pkg = types.ModuleType("vllm_ascend")
    pkg.__path__ = [os.path.join(PINNED, "vllm_ascend")]
    pkg.__spec__ = importlib.machinery.ModuleSpec("vllm_ascend", None, is_package=True)
    pkg.__spec__.submodule_search_locations = pkg.__path__
    sys.modules["vllm_ascend"] = pkg
    _module("vllm_ascend._build_info", __device_type__="A3")
    _module(
        "vllm_ascend.utils",
        is_vl_model=lambda *a, **k: _STATE.vl_model,
        vllm_version_is=lambda v: v == "0.27.1",
        AscendDeviceType=AscendDeviceType,
        get_ascend_device_type=lambda: AscendDeviceType.A3,
        npu_stream_switch=lambda *a, **k: contextlib.nullcontext(),
        shared_experts_calculation_stream=MagicMock(),
        has_layer_idx=lambda m: False,
        is_moe_model=lambda c: True,
        adapt_patch=lambda *a, **k: None,
        clear_enable_sp=lambda *a, **k: None,
        register_ascend_customop=lambda *a, **k: None,
        get_ascend_config=lambda: ASCEND_CONFIG,
    )
    _module("vllm_ascend.ascend_config", _MEGA_MOE_SUPPORTED=False, get_ascend_config=lambda: ASCEND_CONFIG)

    def rope_forward_oot(
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        head_dim: int,
        rotary_dim: int,
        is_neox_style: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("rotary embedding stand-in")

    def muls_add_triton(x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
        raise NotImplementedError("muls_add stand-in")

    _module("vllm_ascend.ops.rotary_embedding", rope_forward_oot=rope_forward_oot)
    _module("vllm_ascend.ops.triton.muls_add", muls_add_triton=muls_add_triton)
    _module("vllm_ascend.quantization.quant_type", QuantType=QuantType)
    _module("vllm_ascend.quantization.utils", get_dynamic_mx_quant_scale_alg=lambda: 0)
    _module("vllm_ascend.lora.fused_moe", has_lora=lambda ctx: False, prepare_lora_indices=lambda *a, **k: None)
    _module("vllm_ascend.distributed.parallel_state", get_mc2_group=lambda: _STATE.groups.get("ep"))
    _module("vllm_ascend.ops.fused_moe.dataclass.prepare_finalize", MoEPrepareOutput=MoEPrepareOutput)
    _module("vllm_ascend.ops.fused_moe.moe_comm_method", setup_moe_comm_method=lambda cfg: None,
            get_moe_comm_method=lambda t: None)


def setup(real_vllm=None):
    """Installs the stand-ins (once per process); `real_vllm` defaults to
    `$ASCEND_MOE_REAL_VLLM == "1"` (ci/vllm-ascend.sh)."""
    if _STATE.setup:
        return
    if real_vllm is None:
        real_vllm = os.environ.get("ASCEND_MOE_REAL_VLLM") == "1"
    # The pinned files are test data: never write bytecode next to them.
    sys.dont_write_bytecode = True
    if not pinned_available():
        raise FileNotFoundError(f"vLLM-Ascend's pinned files are not at {PINNED}")
    import torch  # noqa: F401

    _install_torch_npu()
    if real_vllm:
        import vllm
        import vllm.distributed.parallel_state  # noqa: F401
        import vllm.forward_context  # noqa: F401

        if not getattr(vllm, "__version__", None) or isinstance(vllm, _AutoStub):
            raise ImportError(f"ASCEND_MOE_REAL_VLLM=1 but `vllm` is not the vllm package ({vllm!r})")
    else:
        _install_vllm()
    _install_vllm_ascend()
    _register_standin_ops()
    prefixes = ["vllm_ascend"] + ([] if real_vllm else ["vllm"])
    sys.meta_path.append(_StubFinder(prefixes))
    _STATE.setup, _STATE.real_vllm = True, real_vllm


def load(name: str):
    """A pinned module (`register_custom_ops`, `fused_moe`, `shared_experts`,
    `prepare_finalize`, `ascend_forward_context`) imported from the pinned files."""
    full = {
        "register_custom_ops": "vllm_ascend.ops.register_custom_ops",
        "fused_moe": "vllm_ascend.ops.fused_moe.fused_moe",
        "shared_experts": "vllm_ascend.ops.fused_moe.shared_experts",
        "prepare_finalize": "vllm_ascend.ops.fused_moe.prepare_finalize",
        "ascend_forward_context": "vllm_ascend.ascend_forward_context",
    }[name]
    mod = importlib.import_module(full)
    assert os.path.abspath(mod.__file__).startswith(PINNED), f"{full} was not loaded from {PINNED}: {mod.__file__}"
    return mod


@contextlib.contextmanager
def adapter_over_modules(monkeypatch, ep, dp, tp):
    """The adapter (`ascend_moe.vllm_ascend`) installed over plain stand-in
    modules for vLLM-Ascend's ops and MoE runner modules, whose groups are
    `ep`, `dp` and `tp`, taken through their own collectives
    (`ASCEND_MOE_VLLM_CPU_COMM=group`). Yields the engine's state the adapter
    reads (`.ctx`, `.extra`, `.ep`, `.dp`, `.tp`), which a test may change."""
    import ascend_moe.vllm_ascend as av

    st = SimpleNamespace(
        ctx=SimpleNamespace(dp_metadata=None),
        extra=SimpleNamespace(padded_length=None, padded_num_tokens=None, moe_comm_type=None),
        ep=ep,
        dp=dp,
        tp=tp,
    )
    ops_mod = types.ModuleType(av.OPS_MODULE)
    ops_mod.get_forward_context = lambda: st.ctx
    ops_mod.get_ep_group = lambda: st.ep
    ops_mod.get_dp_group = lambda: st.dp
    ops_mod.get_tp_group = lambda: st.tp
    ops_mod._EXTRA_CTX = st.extra
    runner_mod = types.ModuleType(av.RUNNER_MODULE)
    runner_mod.get_tp_group = lambda: st.tp
    runner_mod._EXTRA_CTX = st.extra
    runner_mod.AscendMoERunner = type("AscendMoERunner", (), {})
    monkeypatch.setitem(sys.modules, av.OPS_MODULE, ops_mod)
    monkeypatch.setitem(sys.modules, av.RUNNER_MODULE, runner_mod)
    monkeypatch.setenv("ASCEND_MOE_VLLM_CPU_COMM", "group")
    av.uninstall()
    av._BACKENDS.clear()
    av.install()
    try:
        yield st
    finally:
        av.uninstall()
        av._BACKENDS.clear()
