"""megatron-core on CPU: a device layer for `trainer.device=cpu`.

megatron-core has no CPU mode. Its model, schedule and optimizer code asks for CUDA directly:
`torch.cuda.current_device()` for placement, `device="cuda"` in tensor factories, the CUDA RNG
state in its RNG tracker, `Tensor.cuda()`, `torch.cuda.synchronize()`, and a CUDA-tensor
assertion in gradient clipping. Inside `cpu_device_layer()` each of those is answered on the CPU:

- a `TorchFunctionMode` rewrites every CUDA device argument (`"cuda"`, `"cuda:N"`, an int, a
  CUDA `torch.device`) of tensor factories and `Tensor.to` to the CPU, and makes `Tensor.cuda`
  return the tensor, drops `pin_memory=True` (the rotary embedding's context-parallel chunk
  indices ask for it), and `Tensor.type()` answers the CUDA type name (`torch.cuda.FloatTensor`)
  that the optimizers sort parameters by;
- `torch.cuda.current_device` answers the CPU device (the mode does not reach backward passes,
  which place their buffers there), `synchronize` is a no-op, and the CUDA RNG calls megatron
  makes (`torch.cuda.get_rng_state`, `manual_seed`, its `_get/_set_cuda_rng_state`) use the CPU
  generator, which is the one CPU dropout draws from;
- gradient clipping by the total norm scales the gradients in place without the CUDA assertion;
- CUDA streams and events (the mixture-of-experts all-to-all dispatcher copies its token counts
  to the host on a side stream and waits on an event) are stand-ins that do nothing: CPU work is
  already in order; the counts it copies to numpy arrays are made numpy arrays on the host too.

Everything is restored on exit, so vLLM and the FSDP engine in the same process never see it.
The set of calls was found by running megatron-core's model, DDP, distributed optimizer and
pipeline schedules on gloo; it is checked against the versions in `CHECKED_VERSIONS` only, and
`check_version` refuses any other at start.
"""

from __future__ import annotations

import contextlib
import importlib.metadata

import torch
from torch.overrides import TorchFunctionMode

CHECKED_VERSIONS = ("0.16.1",)


def check_version() -> str:
    """The installed megatron-core version, if the CPU device layer was checked against it."""
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError("strategy=megatron needs megatron-core: pip install 'hybrid-rl[megatron]' "
                           f"(megatron-core=={CHECKED_VERSIONS[-1]}).") from None
    if version not in CHECKED_VERSIONS:
        raise RuntimeError(f"megatron-core {version} is installed, but the CPU device layer (trainer.device=cpu) "
                           f"was checked only against {', '.join(CHECKED_VERSIONS)}: pip install "
                           f"megatron-core=={CHECKED_VERSIONS[-1]}, or train on GPU.")
    return version


def _is_cuda(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # The distributed optimizer sorts parameters by their CUDA type name.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):  # page-locked memory is for copies to a GPU
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _clip_in_place(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron's `clip_grad_by_total_norm_fp32` without its CUDA-tensor assertion."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        for param in parameters:
            grad = param.decoupled_grad if use_decoupled_grad else param.grad
            if grad is not None:
                grad.detach().mul_(coeff)


def _to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron's `maybe_move_tensor_to_cpu` for tensors already on the host: the split sizes it
    asks for as numpy arrays come as numpy arrays (a torch tensor is not a sequence of ints to
    the all-to-all)."""
    return tensor.numpy() if torch.is_tensor(tensor) and as_numpy else tensor


class _HostEvent:
    def record(self, stream=None) -> None: ...
    def wait(self, stream=None) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool:
        return True


class _HostStream:
    def wait_stream(self, stream) -> None: ...
    def wait_event(self, event) -> None: ...
    def synchronize(self) -> None: ...
    def record_event(self, event=None) -> _HostEvent:
        return event or _HostEvent()


_HOST_STREAM = _HostStream()  # one stream: megatron compares the current stream with its side stream

# Tags of the two directions of pipeline traffic: activations go to the next stage, gradients to
# the previous one.
_FORWARD_TAG, _BACKWARD_TAG = 1, 2


def _tagged_p2p_ops(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, group,
                    prev_pipeline_rank, next_pipeline_rank):
    """megatron's `_batched_p2p_ops` with each message tagged by its direction. gloo pairs the
    sends and receives between two ranks in the order they are posted, by tag; with two pipeline
    ranks the previous and the next stage are the same rank, and megatron posts a stage's
    gradient to it before its activation while the other side waits for the activation first,
    so untagged messages of the same shape (the interleaved schedule's, or the shape exchange's)
    swap silently."""
    ops = [torch.distributed.P2POp(op, tensor, peer, group, tag) for op, tensor, peer, tag in (
        (torch.distributed.isend, tensor_send_prev, prev_pipeline_rank, _BACKWARD_TAG),
        (torch.distributed.irecv, tensor_recv_prev, prev_pipeline_rank, _FORWARD_TAG),
        (torch.distributed.isend, tensor_send_next, next_pipeline_rank, _FORWARD_TAG),
        (torch.distributed.irecv, tensor_recv_next, next_pipeline_rank, _BACKWARD_TAG)) if tensor is not None]
    return torch.distributed.batch_isend_irecv(ops) if ops else []


def _tagged_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
    """megatron's `P2PCommunicator._communicate_shapes` (variable sequence lengths: each
    message's shape goes first) over the tagged messages of `_tagged_p2p_ops`."""
    def shape_of(tensor):
        return None if tensor is None else torch.tensor(tensor.size(), dtype=torch.int64)

    received = [torch.zeros(3, dtype=torch.int64) if wanted else None for wanted in (recv_prev, recv_next)]
    for request in _tagged_p2p_ops(tensor_send_prev=shape_of(tensor_send_prev), tensor_recv_prev=received[0],
                                   tensor_send_next=shape_of(tensor_send_next), tensor_recv_next=received[1],
                                   group=self.pp_group, prev_pipeline_rank=self.prev_rank,
                                   next_pipeline_rank=self.next_rank):
        request.wait()
    return [[0, 0, 0] if shape is None else shape.tolist() for shape in received]


@contextlib.contextmanager
def cpu_device_layer():
    """Run megatron-core calls on the CPU (see the module docstring); re-entrant."""
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.pipeline_parallel import p2p_communication
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        # The router's linear tests `te_general_gemm is not None` for its torch fallback, but the
        # name is left undefined when Transformer Engine is missing (megatron-core 0.16.1).
        moe_utils.te_general_gemm = None

    patches = [
        (torch.cuda, "current_device", lambda: torch.device("cpu")),
        (torch.cuda, "synchronize", lambda *args, **kwargs: None),
        (torch.cuda, "get_rng_state", lambda *args, **kwargs: torch.get_rng_state()),
        (torch.cuda, "set_rng_state", lambda state, *args, **kwargs: torch.set_rng_state(state)),
        (torch.cuda, "manual_seed", lambda seed: torch.manual_seed(seed)),
        (torch.cuda, "Stream", lambda *args, **kwargs: _HOST_STREAM),
        (torch.cuda, "current_stream", lambda *args, **kwargs: _HOST_STREAM),
        (torch.cuda, "stream", lambda *args, **kwargs: contextlib.nullcontext()),
        (torch.cuda, "Event", lambda *args, **kwargs: _HostEvent()),
        (token_dispatcher, "maybe_move_tensor_to_cpu", _to_host),
        (torch.cuda.random, "get_rng_state", lambda *args, **kwargs: torch.get_rng_state()),
        (mp_random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.get_rng_state()),
        (mp_random, "_set_cuda_rng_state", lambda state, *args, **kwargs: torch.set_rng_state(state)),
        (p2p_communication, "_batched_p2p_ops", _tagged_p2p_ops),
        (p2p_communication.P2PCommunicator, "_communicate_shapes", _tagged_shapes),
        (clip_grads, "clip_grad_by_total_norm_fp32", _clip_in_place),
        (optimizer, "clip_grad_by_total_norm_fp32", _clip_in_place),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        with _CudaToCpu():
            yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
