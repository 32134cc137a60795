"""What megatron-core needs to run without CUDA, or without Transformer Engine and apex — and nothing else.

megatron-core targets GPUs with Transformer Engine; on a CPU box (gloo, local layer spec) a handful of
CUDA assumptions stand in its way, and on a GPU without TE/apex (the local spec) two TE assumptions do.
Each shim below is named, says what it fixes, and is covered by tests/train/test_cpu_compat.py.
`apply()` installs once the shims this machine needs (`wanted`): all without CUDA; te_names and
optimizer_step without Transformer Engine, CUDA or not; none on a GPU with TE.

  rng_tracker        model-parallel RNG tracker backed by CPU generators (dropout / init forks); the
                     CUDA-generator save/restore of activation recompute becomes a no-op (the CPU
                     generator is saved and restored by megatron already)
  cuda_streams       torch.cuda.Stream/Event/current_stream/synchronize and Tensor.record_stream as
                     no-ops (MoE dispatchers, DDP and the optimizer create them)
  cuda_device        torch.cuda.current_device() -> "cpu" (used as a device in many places, some inside
                     autograd backward); a TorchFunctionMode maps device="cuda" literals to cpu.
                     `native_torch` lifts it for a model's forward and loss (its one literal there,
                     the CP rotary index's pinned memory, keeps it: `_rope_cp_index`)
  te_names           names megatron imports from Transformer Engine / apex bound to None; multi-latent
                     attention told TE is absent where its TE names are not classes
  optimizer_type     the optimizer asserts param.type() == 'torch.cuda.FloatTensor'
  gloo_all_to_all    gloo's all_to_all_single wants split sizes as lists, the dispatcher passes tensors
  optimizer_step     without apex/TE the distributed optimizer keeps torch Adam's per-param "step":
                     state_dict() of a fresh optimizer (the template a checkpoint loads into) asserts
                     on the missing step, and load_state_dict() gives every param one shared step
                     tensor, which Adam then increments once per param per update (wrong bias
                     correction after resume): give the template a step, and each param its own copy;
                     the fully-reshardable loader copies every state key but skips "step" (KeyError)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

APPLIED: list[str] = []


def te_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


# --------------------------------------------------------------------------------------------------
# rng_tracker
# --------------------------------------------------------------------------------------------------


class CpuRngTracker:
    """Same interface as megatron's CudaRNGStatesTracker, with CPU generator states."""

    def __init__(self, *args, **kwargs):
        self.reset()

    def is_initialized(self) -> bool:
        return self._initialized

    def reset(self) -> None:
        self._initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._initialized = True
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name: str, seed: int) -> None:
        self._initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def seed_model_parallel(seed: int) -> None:
    """megatron's model_parallel_cuda_manual_seed, for CPU generators (offsets as megatron's)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + ps.get_tensor_model_parallel_rank())
    expert_seed = (seed + 1024 + 100 * ps.get_expert_model_parallel_rank()
                   + ps.get_expert_tensor_parallel_rank())
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, expert_seed)


def _rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRngTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # activation recompute saves and restores "the CUDA generator" around each checkpointed block:
    # there is none, so the (already saved) CPU generator stands in; states are tensors either way
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: None
    # initialize_rng_tracker(force_reset=True) would replace it with a CUDA tracker: keep ours
    mrandom.initialize_rng_tracker = lambda *a, **k: None


# --------------------------------------------------------------------------------------------------
# cuda_streams, cuda_device
# --------------------------------------------------------------------------------------------------


class _NoStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NoEvent()

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _NoEvent(_NoStream):
    def record(self, *args, **kwargs):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _cuda_streams() -> None:
    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoEvent
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.default_stream = lambda *a, **k: _NoStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.record_stream = lambda self, *a, **k: None


class CudaToCpu(TorchFunctionMode):
    """Rewrites device='cuda' (or cuda:N) in tensor factory calls to cpu, and drops pin_memory=True
    (no pinned allocator without an accelerator; rotary embeddings under context parallelism ask)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if dev is not None and "cuda" in str(dev):
            kwargs = dict(kwargs, device="cpu")
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        return func(*args, **kwargs)


_MODE: CudaToCpu | None = None


def _cuda_device() -> None:
    global _MODE
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.device_count = lambda: 0
    torch.cuda.memory_allocated = lambda *a, **k: 0
    torch.cuda.max_memory_allocated = lambda *a, **k: 0
    torch.cuda.empty_cache = lambda: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self
    _MODE = CudaToCpu()
    _MODE.__enter__()  # process-wide, for megatron's literal device="cuda" factories
    _rope_cp_index()


def _rope_cp_index() -> None:
    """The context-parallel rotary embedding builds its index with pin_memory=True inside the forward,
    where `native_torch` lifts the mode: that function runs under a CudaToCpu of its own, wherever
    megatron imported it."""
    from megatron.core.models.common.embeddings import (
        rope_utils,
        rotary_pos_embedding,
        yarn_rotary_pos_embedding,
    )

    original = rope_utils.get_pos_emb_on_this_cp_rank

    @functools.wraps(original)
    def rewritten(*args, **kwargs):
        with CudaToCpu():
            return original(*args, **kwargs)

    for mod in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        mod.get_pos_emb_on_this_cp_rank = rewritten


@contextlib.contextmanager
def native_torch():
    """The block's torch calls skip CudaToCpu: a Python hook on every torch call costs a few
    microseconds each, and a model's forward makes thousands (about 3,400 calls per training step at
    quickstart size, a tenth of its time). Used around the model's forward and the loss: megatron's
    literal device="cuda" factories sit in its schedules and optimizer, outside the block."""
    from torch.overrides import _get_current_function_mode_stack, _pop_mode_temporarily

    stack = _get_current_function_mode_stack()
    if _MODE is None or not stack or stack[-1] is not _MODE:
        yield
        return
    with _pop_mode_temporarily():
        yield


def natively(fn: Callable) -> Callable:
    """`fn` with its torch calls under `native_torch`."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with native_torch():
            return fn(*args, **kwargs)

    return run


# --------------------------------------------------------------------------------------------------
# te_names, optimizer_type, gloo_all_to_all
# --------------------------------------------------------------------------------------------------


_TE_NAMES = {
    "megatron.core.transformer.moe.moe_utils": (
        "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
        "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
        "fused_topk_with_score_function", "fused_unpermute", "te_general_gemm"),
}


def _te_names() -> None:
    import importlib

    for module, names in _TE_NAMES.items():
        mod = importlib.import_module(module)
        for name in names:
            if not hasattr(mod, name):
                setattr(mod, name, None)
    # multi-latent attention imports TE's names from megatron's extension module, which imports without TE
    # (its names stand-ins, not classes), so it believes TE is there and calls isinstance(linear, TELinear)
    mla = importlib.import_module("megatron.core.transformer.multi_latent_attention")
    if not isinstance(mla.TELinear, type):
        mla.HAVE_TE = False


def _optimizer_type() -> None:
    original = torch.Tensor.type

    @functools.wraps(original)
    def type_(self, *args, **kwargs):
        if not args and not kwargs:
            name = original(self)
            return name.replace("torch.", "torch.cuda.", 1) if name.startswith("torch.") \
                and "cuda" not in name else name
        return original(self, *args, **kwargs)

    torch.Tensor.type = type_


def _gloo_all_to_all() -> None:
    import torch.distributed as dist

    original = dist.all_to_all_single

    @functools.wraps(original)
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        if isinstance(output_split_sizes, torch.Tensor):
            output_split_sizes = output_split_sizes.tolist()
        if isinstance(input_split_sizes, torch.Tensor):
            input_split_sizes = input_split_sizes.tolist()
        return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = all_to_all_single


def _optimizer_step() -> None:
    from megatron.core.optimizer import distrib_optimizer as mdo

    if getattr(mdo, "HAVE_APEX_OR_TE", True):
        return
    cls = mdo.DistributedOptimizer
    original_state_dict, original_load = cls.state_dict, cls.load_state_dict

    def state_dict(self):
        if self.optimizer.state:
            return original_state_dict(self)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for p in params:  # a loading template: the step value is overwritten by the checkpoint's
            self.optimizer.state[p]["step"] = torch.tensor(0.0)
        try:
            return original_state_dict(self)
        finally:
            self.optimizer.state.clear()

    def load_state_dict(self, state_dict):
        original_load(self, state_dict)
        for st in self.optimizer.state.values():
            if "step" in st:
                st["step"] = st["step"].detach().clone()

    original_set = cls._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state.get(main_param, {})
        step = state.pop("step", None) if "step" not in tensors else None
        try:
            original_set(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    cls.state_dict = state_dict
    cls.load_state_dict = load_state_dict
    cls._set_main_param_and_optimizer_states = set_states


SHIMS = {
    "rng_tracker": _rng_tracker,
    "cuda_streams": _cuda_streams,
    "cuda_device": _cuda_device,
    "te_names": _te_names,
    "optimizer_type": _optimizer_type,
    "gloo_all_to_all": _gloo_all_to_all,
    "optimizer_step": _optimizer_step,
}


WITHOUT_TE = ("te_names", "optimizer_step")  # TE / apex assumptions: needed on GPUs without them too


def wanted(cuda: bool, te: bool) -> list[str]:
    """The shims a machine needs: every one without CUDA, the TE ones without Transformer Engine."""
    return [name for name in SHIMS if not cuda or (not te and name in WITHOUT_TE)]


def apply() -> list[str]:
    """Install the shims this machine needs, once. Returns the names installed in this process."""
    if APPLIED:
        return APPLIED
    for name in wanted(torch.cuda.is_available(), te_available()):
        SHIMS[name]()
        APPLIED.append(name)
    return APPLIED
