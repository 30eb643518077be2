"""The vLLM-Ascend adapter: a running vLLM-Ascend uses ascend-moe for its EP/SP
token ops and its MoE reduction points.

Switching on: `pip install` this package (it declares the `vllm.general_plugins`
entry point `ascend_moe = ascend_moe.vllm_ascend:register`) and set
`ASCEND_MOE_VLLM=1`; vLLM calls `register()` in every process, which calls
`install()`. `install()` can also be called directly; it is idempotent and
returns what it replaced, `uninstall()` restores vLLM-Ascend's own code, and
`status()` says whether the adapter is active and what it replaced.

What `install()` replaces:

- `torch.ops.vllm.maybe_all_gather_and_maybe_unpad(x)` and
  `torch.ops.vllm.maybe_pad_and_reduce(x)`: same names, same one-tensor
  schema, kernels for CPU and PrivateUse1 (the NPU) and fakes sized by
  `ascend_moe.shapes`; like vLLM-Ascend's, the fakes keep a symbolic token
  count symbolic (vLLM compiles with a dynamic token dimension), and the
  real ops check the count when they run. Where the output's count comes
  from the forward context (an SP layout, `padded_length`), the fakes give
  it to a compiler as a fresh data-dependent size (with dynamic and static
  shapes alike), so a compiled graph takes the count of the context it runs
  under, never the trace-time one (SPEC section 5). They read, when they run, what vLLM-Ascend's own
  implementations read (`vllm_ascend.ops.register_custom_ops`'s
  `get_forward_context`, `get_ep_group`, `get_dp_group` and `_EXTRA_CTX`): the
  forward context's `dp_metadata` (`get_chunk_sizes_across_dp_rank()`,
  `num_tokens_across_dp_cpu`) and `_EXTRA_CTX.padded_length`.
  `maybe_pad_and_reduce` always returns this rank's EP shard (SPEC section 3);
  it never takes the draft-model TP all-reduce path. A dtype the library
  does not take (float64, complex, int16, ...) is gathered as bytes and
  reduce-scattered on the group's own collectives, as vLLM-Ascend's ops do;
  one that is only moved (int8, uint8, bool, fp8, MX) is never summed.
- vLLM's `GroupCoordinator.destroy`: it also closes what the adapter made
  for the group (`release_group`).
- The reduction points of `AscendMoERunner`
  (`_maybe_reduce_routed_output_before_transform`,
  `_reduce_shared_output_if_needed`, `_maybe_reduce_shared_expert_output`,
  `_maybe_reduce_final_output`): each calls the custom op
  `torch.ops.ascend_moe.vllm_reduce_point`, which reads the live
  `_EXTRA_CTX.moe_comm_type` when it runs and applies SPEC section 5, so a
  compiled graph never freezes "is the routed output already reduced?". The
  boolean arguments vLLM passes between these methods are ignored. A dtype
  the library does not take (float64, complex, ...) is reduced by vLLM's
  own TP all-reduce; one that is only moved is never summed.

vLLM's `GroupCoordinator`s map to communicators once each (`comm_for_group`),
cached per group and device kind for the group's life (held weakly: a group
destroyed or garbage-collected takes its communicators, MoE groups and
reduction policies with it; `uninstall()` closes them all): on the NPU the group's HCCL communicator is
borrowed (`Comm.from_process_group(group.device_group)`); on the CPU, a CPU
world joined by the group's ranks when all of them are on one host (checked
over the group's `cpu_group`; its waits are bounded by
`$ASCEND_MOE_COMM_TIMEOUT`, default 60 s), otherwise the group's own collectives
(`group.all_gather`, `group.reduce_scatter`, `group.all_reduce`).

Graph capture: `torch.npu.graph` captures, without `stream=`, on torch_npu's
own side stream, while vLLM-Ascend's warm-up runs on the current stream; the
library's workspace, capture records and pinned staging are reserved per
stream. So every capture first reserves on its capture stream what the streams
the package ran ops on hold (`ascend_moe.prepare_capture`, from a hook on
`torch.npu.graph.__enter__`, which `uninstall()` removes).

What stays vLLM-Ascend's: the comm-type selection, the MC2 / all-to-all
dispatch and combine, the MC2 mask and padding (`PrepareAndFinalizeWithMC2`
writes the mask into the forward context's engine-owned buffer and pads to
`padded_num_tokens`), the PCP all-gather / reduce-scatter around the EP ops,
and the shared-expert token communication of `AscendSharedExperts`.
"""

import contextlib
import enum
import itertools
import operator
import os
import socket
import sys
import threading
import uuid
import weakref

from . import comm as _comm
from . import ops as _ops
from . import shapes as _shapes
from . import streams as _streams
from ._errors import AmoeError, error
from ._lib import Status
from ._tensor import DTYPE_CODES, dtype_name
from .comm import Comm
from .ops import CommType, ReducePolicy, SharedMode, SpLayout
from .prepare import MoeContext, MoeGroups

SWITCH = "ASCEND_MOE_VLLM"

GATHER_OP = "maybe_all_gather_and_maybe_unpad"
REDUCE_OP = "maybe_pad_and_reduce"
RUNNER_METHODS = (
    "_maybe_reduce_routed_output_before_transform",
    "_reduce_shared_output_if_needed",
    "_maybe_reduce_shared_expert_output",
    "_maybe_reduce_final_output",
)
OPS_MODULE = "vllm_ascend.ops.register_custom_ops"
RUNNER_MODULE = "vllm_ascend.ops.fused_moe.fused_moe"


# ------------------------------------------------------------ engine values


def engine_int(field: str, v) -> int:
    """An integer the engine provides (a size, rank, token count, mode or
    comm-type value) as a Python int: a Python int, a numpy integer or a
    one-element integer host tensor, taken by `operator.index`. A bool, a
    float, a string or anything else is an `InvalidArgumentError` naming
    `field` and the value, never truncated (`int(2.7)` is 2) nor read as 0 / 1
    (`int(True)`). So is a tensor on a device: reading it would synchronise
    the host with the device on every call."""
    if isinstance(v, bool) or str(getattr(v, "dtype", "")) in ("bool", "torch.bool"):
        raise error(Status.INVALID_ARGUMENT, f"{field} is {v!r}, expected an integer, not a bool")
    device = getattr(v, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        raise error(
            Status.INVALID_ARGUMENT,
            f"{field} is a tensor on {device}, expected a host integer: reading it would synchronise the host "
            "with the device",
        )
    try:
        return operator.index(v)
    except TypeError:
        raise error(Status.INVALID_ARGUMENT, f"{field} is {v!r}, expected an integer") from None


# ------------------------------------------------------------ shared experts


class SharedExpertParallelMode(enum.Enum):
    """vLLM-Ascend's shared-expert layouts, with its names and values."""

    TENSOR_PARALLEL = 1
    SHARED_EXPERT_DATA_PARALLEL_ONLY = 2
    SEQUENCE_PARALLEL_ONLY = 3
    SEQUENCE_PARALLEL_SEDP = 4


_MODE_TO_SHARED = {
    "TENSOR_PARALLEL": "TENSOR_PARALLEL",
    "SHARED_EXPERT_DATA_PARALLEL_ONLY": "DATA_PARALLEL_ONLY",
    "SEQUENCE_PARALLEL_ONLY": "SEQUENCE_PARALLEL_ONLY",
    "SEQUENCE_PARALLEL_SEDP": "SEQUENCE_PARALLEL_SEDP",
}


def classify_shared_expert_mode(tp_size: int, enable_shared_expert_dp: bool, is_sequence_parallel: bool):
    """vLLM-Ascend's `AscendSharedExperts.parallel_mode()` from the physical TP
    size, `enable_shared_expert_dp` (replicated weights) and SP on/off."""
    if engine_int("tp_size", tp_size) <= 1:
        return SharedExpertParallelMode.TENSOR_PARALLEL
    if is_sequence_parallel:
        if enable_shared_expert_dp:
            return SharedExpertParallelMode.SEQUENCE_PARALLEL_SEDP
        return SharedExpertParallelMode.SEQUENCE_PARALLEL_ONLY
    if enable_shared_expert_dp:
        return SharedExpertParallelMode.SHARED_EXPERT_DATA_PARALLEL_ONLY
    return SharedExpertParallelMode.TENSOR_PARALLEL


def shared_mode_of(mode) -> "SharedMode":
    """ascend-moe's `SharedMode` for a vLLM-Ascend mode: a member of its
    `SharedExpertParallelMode` (or of this module's copy) by name, checked
    against its value, its value (1..4), its name, or None (no shared expert)."""
    if mode is None:
        return SharedMode.NONE
    if isinstance(mode, SharedMode):
        return mode
    if isinstance(mode, enum.Enum):
        ours = SharedExpertParallelMode.__members__.get(mode.name)
        if ours is None or ours.value != mode.value:
            raise error(
                Status.INVALID_ARGUMENT,
                f"unknown shared-expert mode {mode!r} (expected one of "
                + ", ".join(f"{m.name}={m.value}" for m in SharedExpertParallelMode)
                + ")",
            )
        return SharedMode[_MODE_TO_SHARED[ours.name]]
    if isinstance(mode, str):
        ours = SharedExpertParallelMode.__members__.get(mode.strip().upper())
        if ours is None:
            raise error(Status.INVALID_ARGUMENT, f"unknown shared-expert mode name {mode!r}")
        return SharedMode[_MODE_TO_SHARED[ours.name]]
    value = engine_int("shared-expert mode", mode)
    try:
        ours = SharedExpertParallelMode(value)
    except ValueError:
        raise error(Status.INVALID_ARGUMENT, f"unknown shared-expert mode value {mode!r} (expected 1..=4)") from None
    return SharedMode[_MODE_TO_SHARED[ours.name]]


# ------------------------------------------------- what vLLM-Ascend reads


def _module_attr(module_name: str, name: str, fallback):
    """`module_name.name` when vLLM-Ascend's module is loaded (so the adapter
    reads exactly what vLLM-Ascend's own code reads there), else `fallback()`."""
    mod = sys.modules.get(module_name)
    if mod is not None and hasattr(mod, name):
        return getattr(mod, name)
    return fallback()


def _vllm_forward_context():
    def fb():
        from vllm.forward_context import get_forward_context

        return get_forward_context

    return _module_attr(OPS_MODULE, "get_forward_context", fb)()


def _group_getter(name: str):
    """vLLM's group getter `name` as vLLM-Ascend's ops module imported it,
    else `vllm.distributed`'s."""

    def fb():
        import vllm.distributed as vd

        return getattr(vd, name)

    return _module_attr(OPS_MODULE, name, fb)


def _group(name: str):
    return _group_getter(name)()


def _extra_ctx(module_name: str = OPS_MODULE):
    def fb():
        from vllm_ascend.ascend_forward_context import _EXTRA_CTX

        return _EXTRA_CTX

    return _module_attr(module_name, "_EXTRA_CTX", fb)


# --------------------------------------------------- groups -> communicators


class _CommBackend:
    """A group as an ascend-moe communicator (CPU world or borrowed HCCL comm)."""

    kind = "comm"

    def __init__(self, comm: Comm):
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size

    def close(self) -> None:
        """Leaves the communicator (local: the peers' next call on it fails)."""
        self.comm.close()

    def gather(self, x, layout):
        return _ops.maybe_all_gather_and_maybe_unpad(x, layout, self.comm)

    def reduce(self, x, layout):
        return _ops.maybe_pad_and_reduce(x, layout, self.comm)

    def all_reduce(self, x):
        return _comm.all_reduce(x, self.comm)

    @contextlib.contextmanager
    def refusing(self):
        """The adapter's checks before a gather or reduce: one that fails
        is reported to the peers waiting in it before it is raised."""
        with self.comm.handle as h, _comm.refusing_on(h):
            yield

    @contextlib.contextmanager
    def point_refusing(self):
        """The adapter's checks before a reduction point, reported as
        `refusing` does (the TP peers wait in the point's agreement)."""
        with self.comm.handle as h, _ops.point_refusing(h):
            yield


class _GroupBackend:
    """A group through its own collectives (`GroupCoordinator.all_gather`,
    `.reduce_scatter`, `.all_reduce`), with SPEC sections 3 and 4 done around
    them: used when the group's ranks are not all on one host, or the group
    has no torch.distributed CPU group to derive a CPU world from."""

    kind = "group"

    def __init__(self, group, role: str = ""):
        self.group = group
        self.rank, self.world_size = _rank_and_size(group, role)

    def refusing(self):
        """The group's own collectives take no refusal: a check that fails
        is raised on this rank alone."""
        return contextlib.nullcontext()

    point_refusing = refusing

    def gather(self, x, layout):
        import torch

        if layout is None:
            return self.group.all_gather(x, 0)
        sizes = layout.local_sizes
        m = max(sizes)
        padded = x.new_zeros((m, *x.shape[1:]))
        padded[: x.shape[0]].copy_(x)
        g = self.group.all_gather(padded, 0).view(len(sizes), m, *x.shape[1:])
        return torch.cat([g[r, :s] for r, s in enumerate(sizes)], dim=0)

    def reduce(self, x, layout):
        if layout is None:
            return self.group.reduce_scatter(x, 0)
        sizes = layout.local_sizes
        m = max(sizes)
        padded = x.new_zeros((len(sizes), m, *x.shape[1:]))
        off = 0
        for r, s in enumerate(sizes):
            padded[r, :s] = x[off : off + s]
            off += s
        # Every dimension named: `view(-1, ...)` is ambiguous when a
        # trailing dimension is 0.
        return self.group.reduce_scatter(padded.view(len(sizes) * m, *x.shape[1:]), 0)[: sizes[self.rank]]

    def all_reduce(self, x):
        return self.group.all_reduce(x)


class _OwnCollectives:
    """What the cache keeps for a group served by its own collectives: the
    decision (made by a collective), never the group; `comm_for_group` hands
    out a `_GroupBackend` over the group itself."""

    kind = _GroupBackend.kind

    def close(self) -> None:
        """Nothing to release: the group's collectives are the group's."""


_OWN_COLLECTIVES = _OwnCollectives()


class _Strong:
    """A strong reference called like a weak one, for a group that takes no
    weak reference: its cache entries then live until the group is
    released (`release_group`, its `destroy()`, `uninstall()`)."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __call__(self):
        return self.obj


def _ref(obj, callback=None):
    """A weak reference to `obj` (calling `callback(ref)` when it is
    collected), or a `_Strong` one when `obj` takes none."""
    try:
        return weakref.ref(obj, callback)
    except TypeError:
        return _Strong(obj)


# The backends of vLLM groups, `{(id(group), device kind): (ref to the group,
# backend)}`. The group is held weakly: a group vLLM destroys and drops (re-
# sharding, elastic EP, RL weight-sync groups) is collected, and its entry is
# dropped and its communicator left (`_forget_entry`) when it is. A group's
# `destroy()` (hooked by `install()`), `release_group` and `uninstall()` do it
# at once.
_BACKENDS: dict = {}
_BACKENDS_LOCK = threading.RLock()
_DEVICE_KINDS = ("cpu", "npu")


def _device_kind(device) -> str:
    return "cpu" if getattr(device, "type", "cpu") == "cpu" else "npu"


def comm_for_group(group, device_kind: str = "cpu", role: str = ""):
    """The communicator of a vLLM `GroupCoordinator` for `device_kind` ("cpu"
    or "npu"), built on first use (a collective over the group: every rank of
    the group calls it at the same point, as every rank runs the same op) and
    cached for the group's lifetime. Returns an object with `kind` ("comm":
    an ascend-moe `Comm` in `.comm`; "group": the group's own collectives).
    `role` ("ep", "tp", "dp") names the group in errors (`_rank_and_size`)."""
    key = (id(group), device_kind)
    with _BACKENDS_LOCK:
        hit = _BACKENDS.get(key)
        if hit is not None and hit[0]() is group:
            return hit[1] if hit[1].kind == "comm" else _GroupBackend(group, role)
        backend = _build_backend(group, device_kind, role)
        _remember_backend(group, device_kind, backend)
        return backend


def _remember_backend(group, device_kind: str, backend) -> None:
    """Caches `backend` as the one of `group` for `device_kind`, for the
    group's lifetime: dropped and closed when the group is collected. An
    entry a dead group left under the same id (not yet collected) is closed.
    A backend over the group's own collectives is kept as the decision
    alone: it holds the group."""
    key = (id(group), device_kind)
    if backend.kind != "comm":
        backend = _OWN_COLLECTIVES

    def gone(ref, key=key):
        _forget_entry(key, ref)

    stale = _BACKENDS.get(key)
    _BACKENDS[key] = (_ref(group, gone), backend)
    if stale is not None:
        _close_backends([stale[1]])


def _forget_entry(key, ref) -> None:
    """Drops and closes the cache entry `key` when it is still the one of
    `ref`. Runs where the garbage collector finds the group dead, in any
    thread: it takes no lock (each dict operation is atomic), and leaving a
    communicator is local to this rank (the shared-memory world marks this
    rank as gone, the peers' next call on it fails), so it waits for no peer."""
    entry = _BACKENDS.get(key)
    if entry is not None and entry[0] is ref and _BACKENDS.pop(key, None) is entry:
        _close_backends([entry[1]])


def _close_backends(backends) -> None:
    """Closes the MoE groups built on any of `backends`, then the backends."""
    doomed = {id(b) for b in backends}
    for key, (used, groups) in _MOE_GROUPS.copy().items():
        if any(id(b) in doomed for b in used) and _MOE_GROUPS.pop(key, None) is not None:
            groups.close()
    for b in backends:
        b.close()


def release_group(group) -> bool:
    """Closes and forgets the communicators the adapter made for the vLLM
    group `group` (every device kind), and the MoE groups and reduction
    policies built on them; the next use builds them again. For an engine
    that destroys a group itself: vLLM's `GroupCoordinator.destroy()` does it
    once `install()` ran, and a group that is garbage-collected is released
    then. Every rank of the group releases it (each leaves its own
    communicator; none waits for the others). Returns whether anything was
    cached for the group."""
    with _BACKENDS_LOCK:
        gone = []
        for kind in _DEVICE_KINDS:
            key = (id(group), kind)
            entry = _BACKENDS.get(key)
            if entry is not None and entry[0]() is group and _BACKENDS.pop(key, None) is entry:
                gone.append(entry[1])
        _close_backends(gone)
        dropped = _forget_policies(lambda ref: ref() is group)
    return bool(gone) or dropped


# The timeout of the CPU worlds the adapter makes: 0 takes
# `$ASCEND_MOE_COMM_TIMEOUT` (else 60 s), the engine's one way to say how long
# a rank waits for a peer that failed before it reached a collective.
_ENGINE_TIMEOUT = 0.0


def _build_backend(group, device_kind: str, role: str = ""):
    if device_kind == "npu":
        pg = getattr(group, "device_group", None)
        if pg is None:
            raise error(Status.INVALID_ARGUMENT, f"vLLM group {_group_name(group)} has no device_group to borrow an HCCL communicator from")
        return _CommBackend(Comm.from_process_group(pg))
    cpu_group = getattr(group, "cpu_group", None)
    if cpu_group is None or os.environ.get("ASCEND_MOE_VLLM_CPU_COMM") == "group":
        return _GroupBackend(group, role)
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return _GroupBackend(group, role)
    rank, world = _rank_and_size(group, role)
    if world == 1:
        return _CommBackend(Comm.cpu(f"vllm-{uuid.uuid4().hex}", 1, 0, timeout_s=_ENGINE_TIMEOUT))
    hosts = [None] * world
    dist.all_gather_object(hosts, _host_id(), group=cpu_group)
    if len(set(hosts)) != 1:
        return _GroupBackend(group, role)
    token = [uuid.uuid4().hex if rank == 0 else None]
    src = dist.get_global_rank(cpu_group, 0) if hasattr(dist, "get_global_rank") else group.ranks[0]
    dist.broadcast_object_list(token, src=src, group=cpu_group)
    return _CommBackend(Comm.cpu(f"vllm-{token[0]}", world, rank, timeout_s=_ENGINE_TIMEOUT))


# The groups the adapter reads, by role, as the library names them in errors.
_ROLES = {"ep": "an EP group", "tp": "a TP group", "dp": "a DP group"}


def _rank_and_size(group, role: str = "") -> tuple:
    """`(rank_in_group, world_size)` of a vLLM group, as ints: a world size
    below 1, or a rank outside `0..world_size`, is an `InvalidArgumentError`
    naming the field (`ep_group.rank_in_group` for `role` "ep"; without a
    role, the group's name) and the world size, never an index from the end
    or past it. Every read of a group's rank or size goes through here."""
    name = f"{role}_group" if role else _group_name(group)
    rank = engine_int(f"{name}.rank_in_group", group.rank_in_group)
    world = engine_int(f"{name}.world_size", group.world_size)
    if world < 1:
        raise error(Status.INVALID_ARGUMENT, f"{name}.world_size is {world}: a group has at least one rank")
    if not 0 <= rank < world:
        of = _ROLES.get(role, f"the group {_group_name(group)}")
        raise error(Status.INVALID_ARGUMENT, f"{name}.rank_in_group is {rank}: {rank} is not a rank of {of} of {world}")
    return rank, world


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _group_name(group) -> str:
    return str(getattr(group, "unique_name", type(group).__name__))


def mapped_groups() -> list:
    """`[(group name, device kind, backend kind)]` of the groups mapped so far."""
    out = []
    for k, (ref, b) in _BACKENDS.copy().items():
        g = ref()
        if g is not None:
            out.append((_group_name(g), k[1], b.kind))
    return out


# ---------------------------------------------------- the two vllm:: ops


def _byte_dtypes():
    """The MX dtypes torch has: moved as bytes, never summed."""
    import torch

    return tuple(getattr(torch, n) for n in ("float8_e8m0fnu", "float4_e2m1fn_x2") if hasattr(torch, n))


def _library_dtype(dtype) -> bool:
    """Whether the library takes `dtype` itself (f32, f16, bf16, i32, i64,
    i8, u8, bool, fp8)."""
    return dtype_name(dtype) in DTYPE_CODES


def _as_bytes(x):
    """`x` (contiguous) as `[*x.shape, itemsize]` uint8: the gather moves a
    dtype the library does not take as bytes, which `_from_bytes` undoes."""
    import torch

    return x.unsqueeze(-1).view(torch.uint8)


def _from_bytes(out, dtype):
    return out.view(dtype).squeeze(-1)


# Bytes of one rank's entry in `_leave_library_together`.
_LEAVING_BYTES = 48


def _leave_library_together(backend, x, what: str, agreed: str = "") -> None:
    """Before `x`, of a dtype the library does not take, leaves a CPU world
    for the group's own collectives: the ranks all-gather `"<dtype> <agreed>"`
    through the world first. A peer whose dtype the library takes is in the
    library's own collective meanwhile (the op's, or the comm-type check of a
    reduction point), so both fail at once with a mismatch instead of
    waiting in two transports; ranks of another such dtype, or another
    `agreed` (the comm type), fail naming every rank's. On the NPU the world
    is HCCL, which compares nothing, and nothing is sent."""
    if backend.kind != "comm" or x.device.type != "cpu":
        return
    import torch

    mine = f"{x.dtype} {agreed}".strip().encode()[:_LEAVING_BYTES].ljust(_LEAVING_BYTES, b"\0")
    got = _comm.all_gather(torch.frombuffer(bytearray(mine), dtype=torch.uint8), backend.comm)
    entries = [bytes(row).rstrip(b"\0").decode() for row in got.view(-1, _LEAVING_BYTES).tolist()]
    if len(set(entries)) > 1:
        listed = ", ".join(f"rank {r}: {e}" for r, e in enumerate(entries))
        raise error(Status.COMM_MISMATCH, f"{what}: the ranks disagree on the dtype or comm type ({listed})")


def _ep_local_sizes(dp_metadata, ep_group, what: str):
    """vLLM-Ascend's `_get_ep_local_sizes`: the SP layout when the MoE runner
    installed one of the EP size, else None."""
    if dp_metadata is None:
        return None
    try:
        local_sizes = dp_metadata.get_chunk_sizes_across_dp_rank()
    except (AssertionError, AttributeError):
        return None
    if local_sizes is None or len(local_sizes) != _rank_and_size(ep_group, "ep")[1]:
        return None
    return _counts(local_sizes, "dp_metadata.get_chunk_sizes_across_dp_rank()", "EP", what)


def _host_ints(t, field: str) -> list:
    """The integer values of a host tensor (or sequence) `field`, also inside
    a fake mode (a fake op reading the context)."""
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:  # pragma: no cover - older torch
        import contextlib

        unset_fake_temporarily = contextlib.nullcontext
    with unset_fake_temporarily():
        return [engine_int(field, v) for v in (t.tolist() if hasattr(t, "tolist") else t)]


def _counts(t, field: str, per: str, what: str = "") -> list:
    """`_host_ints(t, field)`, one row or token count per `per` ("DP", "EP")
    rank: a negative one is an `InvalidArgumentError` naming `field`, the
    rank and the count (as `ascend_moe.ForwardContext` refuses its
    `dp_tokens`), never read as 0 rows."""
    counts = _host_ints(t, field)
    for r, n in enumerate(counts):
        if n < 0:
            raise error(
                Status.INVALID_ARGUMENT,
                f"{what + ': ' if what else ''}{field} must be one count >= 0 per {per} rank, got {counts} "
                f"({per} rank {r} has {n})",
            )
    return counts


def _padded_layout(dp_metadata, ep_group, what: str) -> tuple:
    """`(layout, chunk)` of the `padded_length` path (DP metadata, no per-EP
    layout, e.g. PCP > 1): every DP rank's batch is padded to `padded_length`
    rows and split into equal chunks of `chunk = padded_length / (EP / DP)`
    rows over its `EP / DP` ranks in EP order; a chunk's real rows are the
    ones before the DP rank's token count."""
    ctx = _extra_ctx()
    padded = ctx.padded_length
    dp = _rank_and_size(_group("get_dp_group"), "dp")[1]
    ep = _rank_and_size(ep_group, "ep")[1]
    tokens = _counts(dp_metadata.num_tokens_across_dp_cpu, "num_tokens_across_dp_cpu", "DP", what)
    if padded is None:
        raise error(Status.INVALID_ARGUMENT, f"{what}: the forward context has DP metadata but no padded_length")
    padded = engine_int("padded_length", padded)
    if ep % dp or len(tokens) != dp:
        raise error(
            Status.INVALID_ARGUMENT,
            f"{what}: EP size {ep} is not a multiple of the DP size {dp}, or num_tokens_across_dp has {len(tokens)} entries",
        )
    per_dp = ep // dp
    if padded % per_dp or any(t > padded for t in tokens):
        raise error(
            Status.SHAPE,
            f"{what}: padded_length {padded} does not split over the {per_dp} EP ranks of a DP rank "
            f"(EP {ep}, DP {dp}), or a DP token count {tokens} exceeds it",
        )
    chunk = padded // per_dp
    return SpLayout([min(max(t - j * chunk, 0), chunk) for t in tokens for j in range(per_dp)]), chunk


def _token_dim(x, what: str) -> None:
    """Refuses a 0-d `x`: both ops act on dim 0, the tokens."""
    if x.dim() == 0:
        raise error(Status.SHAPE, f"{what}: x is a 0-d tensor; the op takes tokens along dim 0 (x[tokens, ...])")


def _rows(x):
    """`x`'s token count as an int, or None when it is symbolic (a fake traced
    with a dynamic token dimension, as vLLM compiles its model): a fake never
    makes it a constant of the graph; the real op, which runs with the actual
    count, checks it."""
    n = x.shape[0]
    if isinstance(n, int):
        return n
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    return int(n) if is_concrete_int(n) else None


def _context_rows(x, rows: int):
    """The token count of a fake's output whose rows the forward context
    gives (`rows`, the trace-time context's), not `x`'s shape: a fresh
    data-dependent size while a compiler traces (a fake mode with a shape
    environment, dynamic or static shapes alike), `rows` in a plain fake
    mode. A compiled graph runs under other forward contexts (other DP
    token counts, another layout, SPEC section 5), also at the token count
    it was specialised for, so it must neither bake the trace-time count in
    nor assert it: the real op's output gives it."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(x)
    if mode is None or mode.shape_env is None:
        return rows
    import torch

    return torch.library.get_ctx().new_dynamic_size()


def _gather_plan(x):
    """`(layout or None, rows of x the gather takes)`: the same on the real
    and the fake path (rows None: symbolic, without a layout)."""
    what = "maybe_all_gather_and_maybe_unpad"
    _token_dim(x, what)
    ctx = _vllm_forward_context()
    ep = _group("get_ep_group")
    dp_metadata = ctx.dp_metadata
    sizes = _ep_local_sizes(dp_metadata, ep, what)
    rank, rows = _rank_and_size(ep, "ep")[0], _rows(x)
    if sizes is not None:
        if rows is not None and rows > sizes[rank]:
            raise error(
                Status.SHAPE,
                f"{what}: EP rank {rank} holds {rows} rows, more than its "
                f"{sizes[rank]} in the SP layout {sizes}; the extra rows would be dropped",
            )
        return SpLayout(sizes), sizes[rank]
    if dp_metadata is None:
        return None, rows
    layout, chunk = _padded_layout(dp_metadata, ep, what)
    if rows is not None and rows != chunk:
        raise error(
            Status.SHAPE,
            f"{what}: EP rank {rank} holds {rows} rows, not the {chunk} rows per EP rank of padded_length "
            f"{_extra_ctx().padded_length} split over the EP ranks of its DP rank",
        )
    return layout, layout.local_sizes[rank]


def _own_result(out, x):
    """`out` as the result of an op declared functional over input `x`: a
    contiguous tensor at storage offset 0 (the layout the fakes give)
    sharing no memory with `x`, copied when it is not, and no view (a slice
    of a fresh tensor, such as the first rows of a reduce-scatter, is
    detached from it: autograd refuses an in-place update of a view made
    inside the ops' NoGradient Function). vLLM's group collectives return
    their input itself on a group of one rank (`GroupCoordinator.all_gather`,
    `.reduce_scatter`, `.all_reduce`), and `clone()` keeps a non-contiguous
    input's strides."""
    import torch

    if (
        out.is_contiguous()
        and out.storage_offset() == 0
        and out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    ):
        return out.detach() if out._is_view() else out
    return out.clone(memory_format=torch.contiguous_format)


def _fit_rows(x, rows: int):
    """`x` with `rows` rows: its first ones, zero rows appended when short."""
    if x.shape[0] == rows:
        return x
    if x.shape[0] > rows:
        return x[:rows]
    out = x.new_zeros((rows, *x.shape[1:]))
    out[: x.shape[0]].copy_(x)
    return out


def _gather_impl(x):
    # The group's backend first: building it is a collective over the group
    # (on the group's gloo CPU group), which a rank whose input is refused
    # below must still join, or its peers wait there, past every timeout of
    # ours, for gloo's own.
    backend = comm_for_group(_group("get_ep_group"), _device_kind(x.device), "ep")
    with backend.refusing():
        layout, rows = _gather_plan(x)
        as_bytes = not _library_dtype(x.dtype)
        src = x.contiguous()
        src = _fit_rows(_as_bytes(src) if as_bytes else src, rows)
    out = backend.gather(src, layout)
    return _own_result(_from_bytes(out, x.dtype) if as_bytes else out, x)


def _trailing(x) -> tuple:
    """`x`'s dims after the tokens as ints for the shape functions, a
    symbolic one (a fake traced with dynamic shapes) at its traced size:
    reading it adds no guard, so the graph keeps it symbolic. The fakes
    give their outputs `x`'s own trailing dims, which the ops keep."""
    from ._torch_ops import _traced_dim

    return tuple(_traced_dim(d, 1) for d in x.shape[1:])


def _gather_fake(x):
    layout, rows = _gather_plan(x)
    ep = _rank_and_size(_group("get_ep_group"), "ep")
    rest = _trailing(x)
    if rows is not None:
        # Checked on the rows the layout gives this rank. With a layout the
        # output's rows are its total, of the context (data-dependent under a
        # compiler); without one, a plain all-gather's `rows * EP`, of x's shape.
        shape = _shapes.maybe_all_gather_and_maybe_unpad(((rows, *rest), _shape_dtype(x)), layout, ep)
        return x.new_empty((_context_rows(x, shape[0]) if layout is not None else shape[0], *x.shape[1:]))
    # A symbolic token count (no layout): the shape function on one row per
    # rank, its rows scaled symbolically.
    _shapes.maybe_all_gather_and_maybe_unpad(((1, *rest), _shape_dtype(x)), None, ep)
    return x.new_empty((x.shape[0] * ep[1], *x.shape[1:]))


def _reduce_plan(x):
    """`(layout or None, rows of the result on the padded_length path)`."""
    _token_dim(x, "maybe_pad_and_reduce")
    ctx = _vllm_forward_context()
    ep = _group("get_ep_group")
    dp_metadata = ctx.dp_metadata
    if dp_metadata is None:
        return None, None
    sizes = _ep_local_sizes(dp_metadata, ep, "maybe_pad_and_reduce")
    if sizes is not None:
        layout, chunk = SpLayout(sizes), None
    else:
        layout, chunk = _padded_layout(dp_metadata, ep, "maybe_pad_and_reduce")
    rows = _rows(x)
    if rows is not None and rows != layout.total_rows:
        raise error(
            Status.SHAPE,
            f"maybe_pad_and_reduce: x has {rows} rows, the gathered tokens of layout {list(layout.local_sizes)} are {layout.total_rows}",
        )
    return layout, chunk


def _reduce_impl(x):
    # The group's backend first, as in `_gather_impl`.
    group = _group("get_ep_group")
    backend = comm_for_group(group, _device_kind(x.device), "ep")
    with backend.refusing():
        layout, pad_to = _reduce_plan(x)
        if layout is None and x.shape[0] % backend.world_size:
            # SPEC section 3, on the groups' own collectives as on a communicator.
            raise error(
                Status.SHAPE,
                f"maybe_pad_and_reduce: x has {x.shape[0]} rows, which the EP size {backend.world_size} does not "
                "divide (no SP layout)",
            )
        # The fake's checks (a dtype that is only moved is never summed).
        _reduce_shape(x, layout, pad_to)
    if not _library_dtype(x.dtype):
        # A dtype the library does not sum (f64, complex, i16, ...): the
        # group's own reduce-scatter sums it, as vLLM-Ascend's does.
        _leave_library_together(backend, x, "maybe_pad_and_reduce")
        backend = _GroupBackend(group, "ep")
    out = backend.reduce(x.contiguous(), layout)
    return _own_result(out if pad_to is None else _fit_rows(out, pad_to), x)


def _reduce_shape(x, layout, pad_to) -> tuple:
    """The output shape of `maybe_pad_and_reduce(x)` (its token count None
    when symbolic without a layout), from the shape function."""
    ep = _rank_and_size(_group("get_ep_group"), "ep")
    rest = _trailing(x)
    dtype = _summed_dtype(x)
    if layout is not None:
        # The output rows come from the layout; the input's are the gathered tokens.
        shape = _shapes.maybe_pad_and_reduce(((layout.total_rows, *rest), dtype), layout, ep)
        return shape if pad_to is None else (pad_to, *shape[1:])
    rows = _rows(x)
    if rows is not None:
        return _shapes.maybe_pad_and_reduce(((rows, *rest), dtype), None, ep)
    # A symbolic token count (no layout): the shape function on one row per
    # rank, the rows divided symbolically (the real op refuses a remainder).
    shape = _shapes.maybe_pad_and_reduce(((ep[1], *rest), dtype), None, ep)
    return (None, *shape[1:])


def _reduce_fake(x):
    layout, pad_to = _reduce_plan(x)
    shape = _reduce_shape(x, layout, pad_to)
    if shape[0] is None:
        return x.new_empty((x.shape[0] // _rank_and_size(_group("get_ep_group"), "ep")[1], *x.shape[1:]))
    # With a layout the output rows are the context's (this rank's shard, or
    # the padded_length chunk): symbolic when x's are.
    return x.new_empty((_context_rows(x, shape[0]) if layout is not None else shape[0], *x.shape[1:]))


def _shape_dtype(x):
    """A dtype the shape functions know for `x` in a gather (a dtype the
    library does not take moves as bytes: uint8)."""
    import torch

    return x.dtype if _library_dtype(x.dtype) else torch.uint8


def _summed_dtype(x, what: str = "maybe_pad_and_reduce"):
    """A dtype the shape functions know for `x` in a reduce: its own when the
    library takes it (and refuses it there when it is only moved), float32
    for one the group's own collectives sum; an MX dtype is refused, naming
    `what`."""
    import torch

    if x.dtype in _byte_dtypes():
        raise error(Status.DTYPE, f"{what}: cannot sum {x.dtype} values")
    return x.dtype if _library_dtype(x.dtype) else torch.float32


def _check_summable(x, what: str) -> None:
    """Refuses `x` where `what` would sum it with vLLM's TP all-reduce: a
    dtype that is only moved (int8, uint8, bool, fp8 as the library refuses
    them; MX as `_summed_dtype` does) is never summed (SPEC section 8)."""
    if _library_dtype(x.dtype):
        _shapes.all_reduce(x)
    else:
        _summed_dtype(x, what)


# ------------------------------------------- vLLM's forward context as ours


def moe_context(num_tokens: int, *, sp: bool = False, num_actual_tokens=None) -> "MoeContext":
    """This rank's `ascend_moe.MoeContext` from vLLM-Ascend's forward context,
    read when called: the DP token counts (`dp_metadata.num_tokens_across_dp_cpu`,
    or `[num_tokens]` without DP), the TP and DP ranks of vLLM's groups, `sp`,
    and the MC2 / FUSED_MC2 pad target `_EXTRA_CTX.padded_num_tokens`.
    `num_tokens` is this DP rank's token count T_d: the rows of
    `hidden_states` before SP shards them (with `sp` each TP rank holds
    `ceil(T_d / TP)` of them, and still passes T_d);
    `num_actual_tokens` the real ones among them (vLLM-Ascend's
    `set_ascend_forward_context` argument, which the forward context does not
    keep; default all). With it and without `sp`, `ascend_moe.token_prepare(x,
    comm_type, moe_context(...), moe_groups(), mc2_mask=engine_mask_tp_slice)`
    computes what `PrepareAndFinalizeWithMC2.prepare` returns and writes the
    mask into the engine's own buffer. With `sp` the mask has one entry per
    row this rank holds, `ceil(T_d / TP)`, marking its real tokens: pass a
    buffer of that many entries (or none, and take the returned mask).
    vLLM-Ascend's own prepare cuts the engine mask into slices of
    `padded_num_tokens / TP` entries there too, which a DP rank with fewer
    tokens does not hold, and marks its real tokens as padding."""
    ctx = _vllm_forward_context()
    tp, dp = _tp_group(), _group("get_dp_group")
    dp_metadata = getattr(ctx, "dp_metadata", None)
    dp_rank, dp_size = _rank_and_size(dp, "dp")
    num_tokens = engine_int("num_tokens", num_tokens)
    if dp_metadata is not None and dp_size > 1:
        tokens = _counts(dp_metadata.num_tokens_across_dp_cpu, "num_tokens_across_dp_cpu", "DP", "moe_context")
        if len(tokens) != dp_size:
            raise error(Status.INVALID_ARGUMENT, f"moe_context: num_tokens_across_dp has {len(tokens)} entries for DP size {dp_size}")
    else:
        tokens, dp_rank = [num_tokens], 0
    tp_rank, tp_size = _rank_and_size(tp, "tp")
    if tokens[dp_rank] != num_tokens:
        shard = sp and num_tokens == -(-tokens[dp_rank] // tp_size)
        raise error(
            Status.SHAPE,
            f"moe_context: this rank's batch has {num_tokens} rows, the forward context says DP rank {dp_rank} has {tokens[dp_rank]}"
            + (f" (with sp, pass the DP rank's {tokens[dp_rank]} tokens, not the {num_tokens} rows of this TP rank's shard)" if shard else ""),
        )
    padded = getattr(_extra_ctx(), "padded_num_tokens", None)
    return MoeContext(
        tokens,
        tp_size,
        dp_rank,
        tp_rank,
        sp,
        num_actual_tokens=None if num_actual_tokens is None else engine_int("num_actual_tokens", num_actual_tokens),
        padded_num_tokens=None if padded is None else engine_int("padded_num_tokens", padded),
    )


def moe_groups(device_kind: str = "cpu") -> "MoeGroups":
    """`ascend_moe.MoeGroups` of vLLM's EP, TP and DP groups, from the
    communicators `comm_for_group` maps them to (cached per group); the
    groups must be ascend-moe communicators (a CPU world, or with
    `device_kind="npu"` the groups' borrowed HCCL communicators), not the
    group-collectives fallback."""
    backends = [
        comm_for_group(g, device_kind, role)
        for g, role in ((_group("get_ep_group"), "ep"), (_tp_group(), "tp"), (_group("get_dp_group"), "dp"))
    ]
    if any(b.kind != "comm" for b in backends):
        raise error(Status.UNAVAILABLE, "moe_groups: a vLLM group is not an ascend-moe communicator here (ranks on several hosts)")
    key = tuple(id(b) for b in backends)
    with _BACKENDS_LOCK:
        hit = _MOE_GROUPS.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], backends)):
            return hit[1]
        groups = MoeGroups.from_comms(*(b.comm for b in backends))
        _MOE_GROUPS[key] = (tuple(backends), groups)
        return groups


# `{ids of the EP, TP and DP backends: (the backends, MoeGroups)}`: closed with
# the first of its backends that is (`_close_backends`).
_MOE_GROUPS: dict = {}


# ------------------------------------------------------ reduction points

_POINTS = ("reduce_routed_early", "reduce_shared", "reduce_final")
# `{policy id: (ReducePolicy, weak reference to its TP group or None)}` and
# `{configuration: policy id}`. A policy whose TP group is collected or
# released goes with it (its id is then refused); ids are never reused.
_POLICIES: dict = {}
_POLICY_IDS: dict = {}
# The ids of the policies dropped with their TP group, most recent last (as
# keys: an ordered set), so that a call naming one (a compiled graph keeps the
# id as a constant) says the group was released rather than that the id is
# unknown. Bounded: past `_RELEASED_KEPT`, the oldest are forgotten (and then
# refused as unknown ids).
_RELEASED: dict = {}
_RELEASED_KEPT = 4096
_NEXT_POLICY_ID = itertools.count(1)
_REDUCE_OP = None


def _forget_policies(which) -> bool:
    """Drops the policies whose TP group reference `which(ref)` selects;
    whether there were any. Takes no lock (see `_forget_entry`)."""
    dropped = False
    for key, pid in _POLICY_IDS.copy().items():
        entry = _POLICIES.get(pid)
        if entry is not None and entry[1] is not None and which(entry[1]):
            _POLICY_IDS.pop(key, None)
            _remember_released(pid)
            _POLICIES.pop(pid, None)
            dropped = True
    return dropped


def _remember_released(pid) -> None:
    """Records policy id `pid` as dropped with its TP group (`_RELEASED`),
    before the policy goes: a reader that misses it finds the tombstone. No
    lock, as `_forget_policies` (the garbage collector may call it in any
    thread): each dict operation is atomic, and trimming the oldest only
    makes a message less precise if another thread interferes."""
    _RELEASED[pid] = None
    while len(_RELEASED) > _RELEASED_KEPT:
        try:
            _RELEASED.pop(next(iter(_RELEASED)), None)
        except (RuntimeError, StopIteration):  # changed size meanwhile: retry
            continue


def _runner_policy(runner):
    """The policy id of a runner (`_POLICIES[id]` is its `(ReducePolicy, TP
    group or None)`), from its static configuration (shared-expert mode,
    routed transform, SP, TP and EP sizes)."""
    cfg = getattr(runner, "moe_config", None)
    mode = _runner_mode(runner)
    # The physical TP group (EP rewrites moe_config.tp_size to 1).
    tp_group = getattr(cfg, "tp_group", None)
    tp_size = _rank_and_size(tp_group if tp_group is not None else _tp_group(), "tp")[1]
    ep_size = _config_int(cfg, "ep_size")
    if ep_size <= 1:
        # Without expert parallelism vLLM sets ep_size 1 and shards every
        # expert over the flattened DP x TP, its moe_config.tp_size
        # (FusedMoEParallelConfig.make); vLLM-Ascend's runner then reduces as
        # for EP over that group (fused_moe.py:75, 193-199).
        ep_size = _config_int(cfg, "tp_size") or tp_size
    sp = bool(getattr(cfg, "is_sequence_parallel", False))
    transform = getattr(runner, "routed_output_transform", None) is not None
    key = (int(mode), transform, sp, tp_size, ep_size, id(tp_group))
    pid = _POLICY_IDS.get(key)
    if pid is None:
        # Built before it is registered: a configuration the library refuses
        # raises its error at every call, never a missing id.
        policy = ReducePolicy(mode, transform, sp, tp_size, ep_size)
        pid = next(_NEXT_POLICY_ID)
        ref = None
        if tp_group is not None:

            def gone(ref):
                _forget_policies(lambda r: r is ref)

            ref = _ref(tp_group, gone)
        _POLICIES[pid] = (policy, ref)
        _POLICY_IDS[key] = pid
    return pid


def _config_int(cfg, field) -> int:
    """`moe_config.<field>` as an integer, 0 when absent."""
    v = getattr(cfg, field, None)
    return engine_int(f"moe_config.{field}", v) if v is not None else 0


def _runner_mode(runner) -> "SharedMode":
    shared = getattr(runner, "ascend_shared_experts", None)
    return SharedMode.NONE if shared is None else shared_mode_of(runner._get_shared_expert_parallel_mode())


def _tp_group():
    """The TP group as vLLM-Ascend's MoE runner module reads it, else as the
    ops module or vLLM does."""
    return _module_attr(RUNNER_MODULE, "get_tp_group", lambda: _group_getter("get_tp_group"))()


def _live_comm_type() -> int:
    ct = _extra_ctx(RUNNER_MODULE).moe_comm_type
    if ct is None:
        raise error(Status.INVALID_ARGUMENT, "no MoE comm type in vLLM's forward context (_EXTRA_CTX.moe_comm_type is None)")
    return int(comm_type_of(ct))


def comm_type_of(ct) -> "CommType":
    """ascend-moe's `CommType` for vLLM-Ascend's comm type: a member of its
    `MoECommType` by name, checked against its value (a type ascend-moe does
    not know, or another numbering, is refused), or the value itself."""
    if isinstance(ct, CommType):
        return ct
    if isinstance(ct, enum.Enum):
        ours = CommType.__members__.get(ct.name)
        if ours is None or ct.value != int(ours):
            raise error(
                Status.INVALID_ARGUMENT,
                f"unknown MoE comm type {ct!r} (expected one of " + ", ".join(f"{m.name}={int(m)}" for m in CommType) + ")",
            )
        return ours
    value = engine_int("moe_comm_type", ct)
    try:
        return CommType(value)
    except ValueError:
        raise error(Status.INVALID_ARGUMENT, f"unknown MoE comm type value {ct!r} (expected 0..={int(max(CommType))})") from None


# The key of `ReducePolicy.decisions` for each point: whether it all-reduces
# under a given comm type ("early" is the static flag, not a decision).
_DECISIONS = ("routed", "shared", "final")


def _checked_point(point: int, layer: int) -> tuple:
    """`(point, layer)` of `vllm_reduce_point` as ints, refused (the same
    error in the real op and its fake) unless `point` is 0..2 and `layer` a
    registered policy id."""
    point, layer = int(point), int(layer)
    _policy_entry(point, layer)
    return point, layer


def _policy_entry(point: int, layer: int) -> tuple:
    """`_POLICIES[layer]`, or the error of `vllm_reduce_point`: the group of
    a policy dropped with it named as released, else an unknown point or
    layer. Read once (`.get`): the garbage collector may drop the policy in
    another thread at any time, so a check and a later index could disagree."""
    entry = _POLICIES.get(layer)
    if entry is None and layer in _RELEASED:
        raise error(Status.INVALID_ARGUMENT, f"vllm_reduce_point: the TP group of layer {layer} was released")
    if entry is None or not 0 <= point < len(_POINTS):
        raise error(Status.INVALID_ARGUMENT, f"vllm_reduce_point: no point {point} of layer {layer}")
    return entry


def _always_reduces(point: int, layer: int) -> bool:
    """Whether point `point` of policy `layer` all-reduces under every comm type."""
    policy = _policy_entry(point, layer)[0]
    return all(policy.decisions(ct)[_DECISIONS[point]] for ct in CommType)


def _point_impl(x, point: int, layer: int):
    point, layer = _checked_point(point, layer)
    policy, tp_ref = _policy_entry(point, layer)
    name = _POINTS[point]
    tp_group = _tp_group() if tp_ref is None else tp_ref()
    if tp_group is None:
        raise error(Status.INVALID_ARGUMENT, f"vllm_reduce_point: the TP group of layer {layer} was released")
    # The group's backend before the comm type is read, as in `_gather_impl`:
    # a rank without one still joins the collective that builds it.
    backend = comm_for_group(tp_group, _device_kind(x.device), "tp")
    with backend.point_refusing():
        ct = _live_comm_type()
    if backend.kind == "comm" and _library_dtype(x.dtype):
        # The library decides, also where it only copies: on a CPU world it
        # checks there that every TP rank chose the same comm type, so a rank
        # whose choice differs fails with its peers instead of returning an
        # unreduced copy while they wait to reduce with it.
        return getattr(policy, name)(x.contiguous(), ct, backend.comm)
    # The groups' own collectives, or a dtype the library does not take
    # (float64, complex, ...): the decision here, the all-reduce vLLM-Ascend's.
    # The TP ranks still agree on the comm type, with the dtype, on a CPU world.
    _leave_library_together(backend, x, f"vllm_reduce_point {name}", f"comm type {ct}")
    if not policy.decisions(ct)[_DECISIONS[point]]:
        return _own_result(x, x)
    # A dtype that is only moved is never summed, as on a communicator; the
    # TP ranks agreed on the dtype and comm type above, so all refuse it.
    _check_summable(x, f"vllm_reduce_point {name}")
    # The group's own TP all-reduce, the one vLLM-Ascend calls.
    all_reduce = _module_attr(RUNNER_MODULE, "tensor_model_parallel_all_reduce", lambda: tp_group.all_reduce)
    return _own_result(all_reduce(x.contiguous()), x)


def _register_point_op():
    global _REDUCE_OP
    # Made here (`install` calls this), before any trace: Dynamo cannot trace
    # the call that makes it (`assume_constant_result` is on its skip list),
    # so a first `_constant_layer` inside a compiled forward would break the graph.
    _make_constant_layer()
    if _REDUCE_OP is not None:
        return _REDUCE_OP
    import torch

    from ._torch_ops import custom_op

    @custom_op("ascend_moe::vllm_reduce_point", mutates_args=())
    def vllm_reduce_point(x: torch.Tensor, point: int, layer: int) -> torch.Tensor:
        return _point_impl(x, point, layer)

    @vllm_reduce_point.register_fake
    def _(x, point, layer):
        point, layer = _checked_point(point, layer)
        # Whether the point reduces is the live comm type's, which a fake never
        # reads; where the static policy reduces under every comm type it is
        # known here, and a dtype that is never summed refused as the real op
        # refuses it. Elsewhere the real op refuses it when it runs.
        if _always_reduces(point, layer):
            _check_summable(x, f"vllm_reduce_point {_POINTS[point]}")
        # A dtype the library does not take is reduced by vLLM's all-reduce:
        # its shape checked as float32.
        dtype = x.dtype if _library_dtype(x.dtype) else torch.float32
        if x.dim() == 0:
            return x.new_empty(_shapes.reduce_final(((), dtype)))
        rows = _rows(x)
        # Identity; a symbolic token count stays symbolic (dtype and trailing
        # dims checked by the shape function on zero rows).
        shape = _shapes.reduce_final(((0 if rows is None else rows, *_trailing(x)), dtype))
        return x.new_empty(x.shape if rows is None else (shape[0], *x.shape[1:]))

    _REDUCE_OP = vllm_reduce_point
    return _REDUCE_OP


def _point_layer(runner, point: int) -> int:
    """The policy id of `runner` for the op, or 0 when its static policy never
    reduces at `point` (whatever the comm type). Static: evaluated once per
    trace, its result is a constant of the graph."""
    if point == 1 and _runner_mode(runner) != SharedMode.TENSOR_PARALLEL:
        return 0  # SPEC section 5, point 2: other shared modes are left unchanged
    pid = _runner_policy(runner)
    # Point 1 by the static flag: `_routed_before_transform` reads a layer of
    # point 1 as "the routed output leaves it reduced" (early), whichever comm
    # type runs and whether or not the op then reduces.
    which = ("early", "shared", "final")[point]
    return pid if any(_policy_entry(point, pid)[0].decisions(ct)[which] for ct in CommType) else 0


def _reduce_at(runner, point: int, x):
    """Point `point` of SPEC section 5 for `runner`: `x` itself when the static
    policy never reduces there, else the op deciding from the live comm type."""
    pid = _constant_layer(runner, point)
    if not pid:
        return x
    import torch

    return torch.ops.ascend_moe.vllm_reduce_point(x, point, pid)


def _constant_layer(runner, point):
    return (_CONSTANT_LAYER or _make_constant_layer())(runner, point)


def _make_constant_layer():
    """`_point_layer` as Dynamo's `assume_constant_result`, made once."""
    global _CONSTANT_LAYER
    if _CONSTANT_LAYER is None:
        import torch

        # Dynamo evaluates it while tracing and keeps the int (the policy is
        # static); the ctypes calls inside are never traced.
        _CONSTANT_LAYER = torch._dynamo.assume_constant_result(_point_layer)
    return _CONSTANT_LAYER


_CONSTANT_LAYER = None


def _routed_before_transform(self, fused_output, fused_output_is_reduced):
    # With an early reduction the routed output leaves point 1 reduced
    # whatever the comm type (reduced before, or reduced here).
    early = bool(_constant_layer(self, 0))
    return _reduce_at(self, 0, fused_output), (True if early else fused_output_is_reduced)


def _reduce_shared_output_if_needed(self, shared_output, fused_output_is_reduced):
    if shared_output is None:
        return None
    return _reduce_at(self, 1, shared_output)


def _maybe_reduce_shared_expert_output(self, shared_output, fused_output_is_reduced=None):
    return _reduce_shared_output_if_needed(self, shared_output, fused_output_is_reduced)


def _maybe_reduce_final_output(self, states, trunc_size, output_is_reduced=None):
    states = _reduce_at(self, 2, states)
    if trunc_size is not None and trunc_size > 0:
        return states[..., :trunc_size]
    return states


# vLLM-Ascend's Python functions behind the two ops, for callers that use them directly.
_FUNCTION_REPLACEMENTS = {
    "_maybe_all_gather_and_maybe_unpad_impl": _gather_impl,
    "_maybe_all_gather_and_maybe_unpad_fake": _gather_fake,
    "_maybe_pad_and_reduce_impl": _reduce_impl,
    "_maybe_pad_and_reduce_fake": _reduce_fake,
}

_RUNNER_REPLACEMENTS = {
    "_maybe_reduce_routed_output_before_transform": _routed_before_transform,
    "_reduce_shared_output_if_needed": _reduce_shared_output_if_needed,
    "_maybe_reduce_shared_expert_output": _maybe_reduce_shared_expert_output,
    "_maybe_reduce_final_output": _maybe_reduce_final_output,
}


# ------------------------------------------------------ install / status

_LOCK = threading.RLock()
_STATE = {"lib": None, "replaced": [], "saved_methods": {}, "runner": None, "errors": {}}


def _graph_class():
    """torch_npu's graph-capture context manager, `torch.npu.graph` (None
    without torch_npu)."""
    return getattr(getattr(sys.modules.get("torch"), "npu", None), "graph", None)


def _hook_captures():
    """Makes every `torch.npu.graph` capture first reserve on its capture
    stream what the streams the package ran ops on hold (`prepare_capture`):
    without `stream=` it captures on its own side stream, not the stream
    vLLM-Ascend's warm-up ran on, and reservations are per stream. Returns
    `(cls, original __enter__)`, or None without torch_npu or when hooked
    already."""
    cls = _graph_class()
    if not isinstance(cls, type) or getattr(cls.__enter__, "_ascend_moe_capture", False):
        return None
    original = cls.__enter__

    def __enter__(self, *args, **kwargs):
        stream = getattr(self, "capture_stream", None)
        if stream is not None:
            try:
                _streams.prepare_capture(stream)
            except AmoeError as e:
                # A capture without MoE ops must not fail for it; one with
                # them is refused by its first op, saying why.
                with _LOCK:
                    _STATE["errors"]["prepare_capture"] = str(e)
        return original(self, *args, **kwargs)

    __enter__._ascend_moe_capture = True
    cls.__enter__ = __enter__
    return cls, original


GROUPS_MODULE = "vllm.distributed.parallel_state"


def _hook_group_destroy():
    """Makes vLLM's `GroupCoordinator.destroy()` release what the adapter
    cached for the group (`release_group`) once it has destroyed it: every
    rank destroys its groups at the same point (`destroy_model_parallel`),
    and a destroyed group may stay referenced (by a model's config) long
    after. Returns `(cls, original destroy)`, or None when vLLM's class is not
    loaded, has no `destroy` of its own, or is hooked already. A subclass
    whose `destroy` does not call the base one is released when collected."""
    cls = getattr(sys.modules.get(GROUPS_MODULE), "GroupCoordinator", None)
    original = vars(cls).get("destroy") if isinstance(cls, type) else None
    if not callable(original) or getattr(original, "_ascend_moe_release", False):
        return None

    def destroy(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        finally:
            release_group(self)

    destroy._ascend_moe_release = True
    cls.destroy = destroy
    return cls, original


def install() -> list:
    """Makes vLLM-Ascend use ascend-moe (see the module docstring). Imports
    `vllm_ascend.ops.register_custom_ops` first, so vLLM-Ascend's own
    registration precedes the override. Idempotent; returns what is replaced,
    as `"torch.ops.vllm.<op>"` and `"AscendMoERunner.<method>"` names."""
    with _LOCK:
        if _STATE["lib"] is not None:
            return list(_STATE["replaced"])
        import importlib

        import torch

        from ._torch_ops import _autograd_kernel, _ordered

        try:
            importlib.import_module(OPS_MODULE)
        except Exception as e:  # noqa: BLE001
            raise error(
                Status.UNAVAILABLE, f"ascend_moe.vllm_ascend.install: importing {OPS_MODULE} failed: {e}"
            ) from e
        _register_point_op()
        lib = torch.library.Library("vllm", "FRAGMENT")
        replaced = []
        for name, impl, fake in ((GATHER_OP, _gather_impl, _gather_fake), (REDUCE_OP, _reduce_impl, _reduce_fake)):
            if not hasattr(torch.ops.vllm, name):
                lib.define(f"{name}(Tensor x) -> Tensor")
            for key in ("CPU", "PrivateUse1"):
                lib.impl(name, impl, key)
            # Not differentiable: a backward through the op fails naming it.
            lib.impl(name, _autograd_kernel(f"vllm::{name}"), "Autograd")
            lib._register_fake(name, fake)
            # A collective: a compiled graph keeps every call, used or not, in order.
            _STATE.setdefault("effects", []).append(_ordered(f"vllm::{name}"))
            replaced.append(f"torch.ops.vllm.{name}")
        mod = sys.modules[OPS_MODULE]
        saved_fns = {}
        for fname, fn in _FUNCTION_REPLACEMENTS.items():
            if hasattr(mod, fname):
                saved_fns[fname] = getattr(mod, fname)
                setattr(mod, fname, fn)
                replaced.append(f"{OPS_MODULE}.{fname}")
        _STATE["saved_functions"] = saved_fns
        _STATE["errors"] = {}
        try:
            runner_mod = importlib.import_module(RUNNER_MODULE)
            runner = runner_mod.AscendMoERunner
            saved = {m: runner.__dict__.get(m) for m in RUNNER_METHODS}
            for m, fn in _RUNNER_REPLACEMENTS.items():
                setattr(runner, m, fn)
                replaced.append(f"AscendMoERunner.{m}")
            _STATE["runner"], _STATE["saved_methods"] = runner, saved
        except Exception as e:  # noqa: BLE001
            _STATE["errors"]["AscendMoERunner"] = f"{type(e).__name__}: {e}"
        _STATE["destroy_hook"] = _hook_group_destroy()
        if _STATE["destroy_hook"] is not None:
            replaced.append("GroupCoordinator.destroy")
        _STATE["capture_hook"] = _hook_captures()
        if _STATE["capture_hook"] is not None:
            replaced.append("torch.npu.graph.__enter__")
        _STATE["lib"], _STATE["replaced"] = lib, replaced
        return list(replaced)


def _release_all() -> None:
    """Closes and forgets every communicator, MoE group and policy cached."""
    with _BACKENDS_LOCK:
        entries = list(_BACKENDS.values())
        _BACKENDS.clear()
        _close_backends([b for _, b in entries])
        for _, groups in list(_MOE_GROUPS.values()):
            groups.close()
        _MOE_GROUPS.clear()
        for pid in list(_POLICIES):
            _remember_released(pid)
        _POLICIES.clear()
        _POLICY_IDS.clear()


def uninstall() -> list:
    """Restores vLLM-Ascend's own ops and runner methods, and closes and
    forgets the communicators made for vLLM's groups (installed or not);
    returns what was restored."""
    with _LOCK:
        _release_all()
        lib = _STATE["lib"]
        if lib is None:
            return []
        lib._destroy()
        for handle in _STATE.pop("effects", []):
            if handle is not None:
                handle.destroy()
        mod = sys.modules.get(OPS_MODULE)
        saved_fns = _STATE.pop("saved_functions", {})
        for fname, fn in saved_fns.items():
            setattr(mod, fname, fn)
        if {"_maybe_all_gather_and_maybe_unpad_fake", "_maybe_pad_and_reduce_fake"} <= set(saved_fns):
            # Removing the kernels restores vLLM-Ascend's; its fakes are registered again.
            restore = __import__("torch").library.Library("vllm", "FRAGMENT")
            restore._register_fake(GATHER_OP, saved_fns["_maybe_all_gather_and_maybe_unpad_fake"])
            restore._register_fake(REDUCE_OP, saved_fns["_maybe_pad_and_reduce_fake"])
            _STATE.setdefault("restorers", []).append(restore)
        runner = _STATE["runner"]
        if runner is not None:
            for m, fn in _STATE["saved_methods"].items():
                if fn is None:
                    delattr(runner, m)
                else:
                    setattr(runner, m, fn)
        hook = _STATE.pop("capture_hook", None)
        if hook is not None:
            hook[0].__enter__ = hook[1]
        hook = _STATE.pop("destroy_hook", None)
        if hook is not None:
            hook[0].destroy = hook[1]
        restored = list(_STATE["replaced"])
        _STATE.update(lib=None, replaced=[], runner=None, saved_methods={})
        return restored


def status() -> dict:
    """`{"active", "switch", "replaced", "groups", "errors", "native_kernel"}`:
    whether the adapter is installed, the value of `$ASCEND_MOE_VLLM`, what
    it replaced, the vLLM groups mapped to communicators so far, what could
    not be replaced and why, and whether the native kernels can launch here
    (`ascend_moe.native_kernel()`; only asked once the adapter is active:
    without them NPU finalize reads its indices on the host at every call)."""
    with _LOCK:
        active = _STATE["lib"] is not None
        return {
            "active": active,
            "switch": os.environ.get(SWITCH),
            "replaced": list(_STATE["replaced"]),
            "groups": mapped_groups(),
            "errors": dict(_STATE["errors"]),
            "native_kernel": _streams.native_kernel() if active else None,
        }


def register() -> None:
    """The `vllm.general_plugins` entry point: `install()` when `$ASCEND_MOE_VLLM` is 1."""
    if os.environ.get(SWITCH) == "1":
        install()
