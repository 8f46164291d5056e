"""The iteration state machine of ``fully_shard`` modules, kept per root as FSDP2 keeps it.

One ``ModuleState`` per ``fully_shard`` call (its one or two ``FlatUnit``s: trainable params, frozen params) and
one ``RootContext`` per root module, shared by every state under it; nothing is per process, so a failed
iteration or another model in the process cannot leak into this one. Hooks drive the transitions:

- pre-forward: the first forward outside backward with no iteration in flight starts one (a failed earlier
  iteration is reset first, params are checked, gathered data is marked stale); the unit is gathered, its module
  points at the unsharded params, the next unit in forward order is prefetched, and the inputs are routed through
  ``_PostBackward`` so the unit's post-backward runs when autograd reaches them.
- post-forward (``always_call``: it runs when forward raises too): the module points back at the sharded params;
  the unit reshards unless it is the root or ``reshard_after_forward=False``; outputs get a pre-backward hook.
- forward inside backward (activation checkpointing recomputes it): gather, but never reshard, reset or record:
  the unit's backward is about to read the recomputed tensors.
- pre-backward (the outputs' first grad): gather, point ``.grad`` at the flat grad buffer, prefetch the next unit
  in backward order, queue the root's end-of-backward callback once.
- post-backward (the inputs' grads are done): reduce-scatter the unit's whole flat grad buffer (zeros where a
  param got no grad, so every rank issues the same collectives whatever was used), reshard; at most one
  reduce-scatter stays in flight. The end-of-backward callback does the same, in a fixed order, for units whose
  inputs needed no grad, then lands every reduced gradient.

Collectives run on the root's side streams where the device has them (``streams.py``, bound at each iteration's
start); on CPU they are async work handles.
"""

from __future__ import annotations

import enum
from collections import deque

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from ragged_optim.sharding import grad_buckets
from ragged_optim.sharding.flat_unit import FlatUnit
from ragged_optim.sharding.rank_agreement import first_difference
from ragged_optim.sharding.streams import CommStreams

# Reduce-scatters whose input buffers may be alive at once (FSDP2 keeps one, too).
MAX_REDUCES_IN_FLIGHT = 1
#: Without side streams (a CPU), issue the backward prefetch at the running unit's post-backward, not its
#: pre-backward (see ModuleState.pre_backward).
PREFETCH_AT_POST_BACKWARD_WITHOUT_STREAMS = True


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


def in_backward() -> bool:
    """True while autograd runs a backward (a forward then is activation checkpointing's recompute)."""
    return torch._C._current_graph_task_id() != -1


class RootContext:
    """Iteration state of one root module and every ``fully_shard`` module under it."""

    def __init__(self, root: ModuleState):
        self.root = root
        self.states: list[ModuleState] = []  # module pre-order: the fixed order of end-of-backward work
        self.iter_forward_root: ModuleState | None = None
        self.callback_queued = False
        self.forward_order: list[ModuleState] = []  # first training forward's order: forward prefetch
        self.forward_order_done = False
        self.post_forward_order: list[ModuleState] = []  # this iteration's, with multiplicity: backward prefetch
        self.ran_forward: set[int] = set()
        self.reduces_in_flight: deque[FlatUnit] = deque()
        self.streams: CommStreams | None = None  # side streams of this root's collectives (none on CPU)

    def busy(self) -> bool:
        return self.iter_forward_root is not None or self.callback_queued

    # ----- iteration boundaries ---------------------------------------------------------------------------
    def start_iteration(self, state: ModuleState) -> None:
        """A forward outside backward with no iteration in flight: reset what a failed one left, check every
        unit's params, mark gathered data stale (an optimizer step may have changed the shards)."""
        if self.callback_queued or any(s.training_state != TrainingState.IDLE for s in self.states):
            self.reset()
        self._bind_streams()
        self.choose_grad_buckets()  # before the forward gathers: a unit that buckets holds its params in parts
        for s in self.states:
            for u in s.units:
                u.sync_with_sharded_params()
        for s in self.states:
            for u in s.units:
                u.mark_stale(unless_unchanged=not s.reshard_after_backward)
        if len(self.post_forward_order) > 16 * max(1, len(self.states)):  # forwards with grad, never backwarded
            self._clear_post_forward_order()
        self.iter_forward_root = state
        self.ran_forward = set()

    def _bind_streams(self) -> None:
        """Every unit of this root issues its collectives on the root's streams, made for the params' device
        (again if the model moved since the last iteration)."""
        units = [u for s in self.states for u in s.units if u.sharded_params]
        if not units:
            return
        if self.streams is None or not self.streams.serves(units[0].device):
            self.streams = CommStreams.for_device(units[0].device)
        for u in units:
            u.streams = self.streams

    def finish_forward(self) -> None:
        """The iteration's outermost forward returned (or raised): release units prefetched but never run."""
        for s in self.states:
            if id(s) not in self.ran_forward:
                for u in s.units:
                    if u.pending_gather is not None:
                        u.reshard()
        self.iter_forward_root = None

    def reset(self) -> None:
        """Forget a failed forward or backward: collectives in flight are waited for (every rank issued them) and
        their results dropped, buffers freed, every state idle. Sharded grads of finished iterations are kept."""
        for s in self.states:
            for u in s.units:
                u.reset_iteration()
            s.training_state = TrainingState.IDLE
            s.prefetch_after_backward = []
        self.reduces_in_flight.clear()
        self._clear_post_forward_order()
        self.callback_queued = False
        self.iter_forward_root = None

    def choose_grad_buckets(self) -> None:
        """Which units reduce their grads in buckets (``grad_buckets.ONLY_AT_PEAK``), from the units' sizes in
        reverse module order: a stack of blocks' backward order, the root (a unit with units inside) last."""
        units = [u for s in reversed(self.states) for u in s.units]
        key = (
            grad_buckets.ONLY_AT_PEAK,
            grad_buckets.BUCKET_BYTES,
            tuple((id(u.layout), tuple(u.requires_grad)) for u in units),
        )
        if getattr(self, "bucket_choice", None) == key:
            return
        chosen = grad_buckets.units_worth_bucketing(units) if grad_buckets.ONLY_AT_PEAK else {id(u) for u in units}
        for u in units:
            u.buckets.wanted = id(u) in chosen
        self.bucket_choice = key

    def _clear_post_forward_order(self) -> None:
        self.post_forward_order.clear()
        for s in self.states:
            s.post_forward_indices.clear()

    # ----- backward ---------------------------------------------------------------------------------------
    def queue_final_callback(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            Variable._execution_engine.queue_callback(self._final_callback)

    def make_room_for_reduce(self) -> None:
        """Finish reduce-scatters in flight until one more may start without exceeding the limit: the previous one's
        input and output are freed before the next one's output is allocated (issuing the next first would put two
        in flight at the backward's peak)."""
        while len(self.reduces_in_flight) >= MAX_REDUCES_IN_FLIGHT:
            self.reduces_in_flight.popleft().finish_reduce_grads()

    def track_reduce(self, unit: FlatUnit) -> None:
        self.reduces_in_flight.append(unit)
        if not unit.streams.enabled:
            # No side streams (a CPU): gloo's worker copies the whole unit's grads and keeps the copy until its next
            # work, so a reduce-scatter left in flight through the next unit's backward held a unit more than FSDP2
            # (which waits at once here): land it now.
            self.reduces_in_flight.popleft().finish_reduce_grads()

    def _final_callback(self) -> None:
        for s in self.states:  # the backward is over: nothing is gathered for it any more
            s.prefetch_after_backward = []
        for s in self.states:  # units whose inputs needed no grad: their post-backward runs here, in a fixed order
            if s.training_state != TrainingState.IDLE or s.post_forward_indices or s.has_grads_to_sync():
                s.post_backward(last=True)
            s.training_state = TrainingState.IDLE
        while self.reduces_in_flight:
            self.reduces_in_flight.popleft().finish_reduce_grads()
        for s in self.states:
            for u in s.units:
                if u.pending_gather is not None:  # a backward prefetch whose unit got no backward
                    u.reshard()
        self._clear_post_forward_order()
        self.callback_queued = False


class ModuleState:
    """What one ``fully_shard`` call keeps: its units, its options and where it is in the iteration."""

    def __init__(self, module, units: list[FlatUnit], reshard_after_forward: bool):
        self.module = module
        self.modules = [module]  # fully_shard([m1, m2]): hooks on each; module is the first
        self.units = units
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True  # FSDPModule.set_reshard_after_backward
        self.is_last_backward = True  # FSDPModule.set_is_last_backward (recorded; see there)
        # FSDPModule.set_modules_to_{forward,backward}_prefetch: the states to prefetch instead of the next in order
        self.forward_prefetch: list[ModuleState] | None = None
        self.backward_prefetch: list[ModuleState] | None = None
        self.ctx: RootContext | None = None
        self.is_root: bool | None = None  # fixed at lazy init: the first module to run forward is the root
        self.training_state = TrainingState.IDLE
        self.post_forward_indices: list[int] = []
        self.prefetch_after_backward: list[ModuleState] = []  # the backward prefetch, issued at post-backward
        # (param name here, weakref to the module whose fully_shard took the other side, its name there): ties to a
        # param sharded by a call outside this module, refused by a later call that encloses both (fully_shard.py)
        self.ties_outside: list[tuple] = []

    # ----- lazy init --------------------------------------------------------------------------------------
    def lazy_init(self, states_under) -> RootContext:
        """At this module's first forward, unless an enclosing root already claimed it: it becomes a root and every
        state under it joins its context (a sub-module that ran forward on its own before is re-homed)."""
        if self.ctx is not None:
            return self.ctx
        ctx = RootContext(self)
        for s in states_under:
            if s.ctx is not None and s.ctx.busy():
                raise RuntimeError(
                    f"fully_shard: {type(s.module).__name__} is in the middle of an iteration of another root "
                    "module; finish its forward and backward before running an enclosing module"
                )
            s.ctx = ctx
            s.is_root = s is self
            ctx.states.append(s)
        _check_ranks_shard_alike(ctx.states)
        for n, u in enumerate(u for s in ctx.states for u in s.units):  # the same on every rank (module order)
            u.bucket_tag = n % 0x10000
        for s in ctx.states:  # a unit with units inside: their collectives run within its backward (grad_buckets)
            inside = {id(m) for m in s.module.modules()} - {id(s.module)}
            if any(id(o.module) in inside for o in ctx.states if o is not s):
                for u in s.units:
                    u.buckets.patient = False
        ctx.bucket_choice = None
        self.ctx = ctx
        return ctx

    # ----- forward ----------------------------------------------------------------------------------------
    def pre_forward(self, args, kwargs):
        ctx = self.ctx
        if in_backward():  # recompute for activation checkpointing: the unit's backward reads what this makes
            self._gather()
            self._set_unsharded_attrs()
            return self._register_post_backward(args, kwargs)
        if ctx.iter_forward_root is None:
            ctx.start_iteration(self)
        ctx.ran_forward.add(id(self))
        self.training_state = TrainingState.FORWARD
        grad = torch.is_grad_enabled()
        if grad and not ctx.forward_order_done and self not in ctx.forward_order:
            ctx.forward_order.append(self)
        self._gather()
        self._set_unsharded_attrs()
        if self.forward_prefetch is not None:
            ahead = self.forward_prefetch
        else:
            ahead = [nxt] if (nxt := _next_in(ctx.forward_order, self)) is not None else []
        for nxt in ahead:
            if id(nxt) not in ctx.ran_forward:
                for u in nxt.units:
                    u.start_unshard()
        return self._register_post_backward(args, kwargs)

    def post_forward(self, output):
        ctx = self.ctx
        grad = torch.is_grad_enabled()
        if in_backward():  # between its pre- and post-backward a module holds its unsharded params, as in FSDP2
            if self.training_state != TrainingState.PRE_BACKWARD:
                for u in self.units:
                    u.set_sharded_attrs()
            return self._register_pre_backward(output) if grad else output
        for u in self.units:
            u.set_sharded_attrs()
        if grad:
            self.post_forward_indices.append(len(ctx.post_forward_order))
            ctx.post_forward_order.append(self)
        # the forward hook runs when forward raised too, with no output: nothing will read the params then
        keep = grad and output is not None and (self.is_root or not self.reshard_after_forward)
        if not keep:
            for u in self.units:
                u.reshard()
        self.training_state = TrainingState.IDLE
        if ctx.iter_forward_root is self:
            ctx.forward_order_done = ctx.forward_order_done or grad
            ctx.finish_forward()
        return self._register_pre_backward(output) if grad else output

    def _gather(self):
        for u in self.units:
            u.start_unshard()
        for u in self.units:
            u.wait_unshard()

    def _set_unsharded_attrs(self):
        for u in self.units:
            u.set_unsharded_attrs()

    # ----- backward ---------------------------------------------------------------------------------------
    def _register_pre_backward(self, output):
        tensors = [t for t in _tensors(output) if t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward_hook, mode="any")
        return output

    def _pre_backward_hook(self, _grad):
        self.pre_backward()

    def _register_post_backward(self, args, kwargs):
        if not torch.is_grad_enabled():
            return args, kwargs
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return args, kwargs
        outs = _PostBackward.apply(self, *[flat[i] for i in idx])
        for i, t in zip(idx, outs):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def pre_backward(self):
        if self.training_state == TrainingState.PRE_BACKWARD:
            return
        self.training_state = TrainingState.PRE_BACKWARD
        ctx = self.ctx
        ctx.queue_final_callback()
        self._gather()
        once = len(self.post_forward_indices) == 1  # one forward to backward through: all its grads come now
        ctx.choose_grad_buckets()
        for u in self.units:
            u.set_unsharded_attrs()  # a recompute that bypasses this module's hooks (checkpoint_wrapper) sees them
            u.prepare_grads(forward_once=once, free_early=self.reshard_after_backward)
        ahead = []
        if self.post_forward_indices:  # prefetch the unit whose backward comes next
            i = self.post_forward_indices.pop()
            if i > 0:
                ahead = [ctx.post_forward_order[i - 1]]
        if self.backward_prefetch is not None:
            ahead = self.backward_prefetch
        elif PREFETCH_AT_POST_BACKWARD_WITHOUT_STREAMS and not (ctx.streams is not None and ctx.streams.enabled):
            # Without side streams (a CPU) the next unit is gathered once this one's grads are reduced: a prefetch
            # here held a third unit (the next one's params) through this unit's backward, beside its params and
            # grads, for an overlap that gloo's threads, on the cores the backward computes on, barely give.
            self.prefetch_after_backward, ahead = ahead, []
        self._prefetch(ahead)

    @staticmethod
    def _prefetch(ahead) -> None:
        for nxt in ahead:
            if nxt.training_state != TrainingState.PRE_BACKWARD:
                for u in nxt.units:
                    u.start_unshard()

    def has_grads_to_sync(self) -> bool:
        """A unit that ran only in earlier no-sync micro-batches (a task head, a skipped layer) holds their grads;
        the synced backward reduces them even though this unit is not in its graph."""
        return any(u.holds_unreduced_grads and u.requires_grad_sync for u in self.units)

    def post_backward(self, *, last: bool = False):
        """Reduce-scatter what this unit's backward produced and reshard. Runs once per use of the module in the
        forward; while another use's backward is still to come (a block run twice, two forwards before one
        backward) the grads stay in the flat grad buffer, where that backward adds to them, and one reduce-scatter
        follows the last use (as FSDP2 does; not one per use). ``last``: the end-of-backward callback, which
        reduces whatever is left (a use whose output the loss did not need)."""
        self.training_state = TrainingState.POST_BACKWARD
        defer = self.post_forward_indices and not last
        for u in self.units:
            # free the unsharded params first (FSDP2's order): the unit's backward is done reading them, and the
            # reduce-scatter's output (and a backend's copy of its input) are allocated next
            if self.reshard_after_backward:
                u.reshard()
            else:
                u.set_sharded_attrs()  # the gathered buffer stays for the next forward; the module shows its shards
            if not defer and u.holds_unreduced_grads and u.requires_grad_sync:
                self.ctx.make_room_for_reduce()
            if not defer and u.post_backward_grads():
                self.ctx.track_reduce(u)
        ahead, self.prefetch_after_backward = self.prefetch_after_backward, []
        # (only units whose backward has not started: the root's post-backward comes last, after every other's)
        self._prefetch([s for s in ahead if s.training_state == TrainingState.IDLE])


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward runs once the grads of those inputs are computed, i.e.
    when the unit's backward is done: every rank reaches it at the same point of the same graph."""

    @staticmethod
    def forward(ctx, state, *inputs):
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.state.post_backward()
        return (None, *grads)


def _check_ranks_shard_alike(states: list[ModuleState]) -> None:
    """Every rank of a unit's group must have sharded the same params (names, shapes, dtype): a model built
    differently on one rank made the first forward's all-gathers mismatch, and gloo aborted the process ("op.preamble
    .length <= op.nbytes ... Is there a distributed collective mismatch"). One all_reduce of a digest per process
    group, at a root's first forward; on a mismatch the descriptions are gathered and every rank raises the same
    error, naming the first difference."""
    by_group: dict[int, tuple] = {}
    for s in states:
        for u in s.units:
            if u.world_size > 1 and u.device.type != "meta" and dist.is_initialized():
                by_group.setdefault(id(u.group), (u.group, u.device, []))[2].append(u)
    for group, device, units in by_group.values():
        desc = [(u.module_name, list(u.layout.names), [list(x) for x in u.layout.shapes], str(u.dtype)) for u in units]
        if (where := first_difference(group, device, desc)) is None:
            continue
        raise ValueError(
            f"fully_shard: ranks sharded different models ({where}). Every rank must build the same model (same "
            "config, same shapes, same dtype) and call fully_shard on the same modules"
        )


def _next_in(order: list, item):
    for i, s in enumerate(order):
        if s is item:
            return order[i + 1] if i + 1 < len(order) else None
    return None


def cast_floating(obj, dtype: torch.dtype):
    """``obj`` (a pytree) with its floating-point tensors cast to ``dtype``, as MixedPrecisionPolicy does."""
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, obj)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list | tuple):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from _tensors(getattr(obj, name))
    elif hasattr(obj, "keys") and hasattr(obj, "__getitem__"):  # transformers' ModelOutput and other mappings
        for k in obj.keys():
            yield from _tensors(obj[k])
