"""One FSDP unit: its params live in one planned flat buffer. This is its state (buffers, views, the params on
their modules, when grads are reduced); its collectives are in ``unit_collectives.py``, re-planning in
``unit_relayout.py``.

Rank k owns elements ``[k*S, (k+1)*S)`` of the ``W*S`` buffer (the *local shard*, persistent, master dtype).
Sharded params are 1-D views into the local shard; unsharded params are views into one ``W*S`` buffer that an
all-gather fills in place and whose storage is freed at reshard; unsharded grads are views into one flat grad
buffer that one reduce-scatter sums into the sharded grad buffer. No per-param copy on the hot path.
"""

from __future__ import annotations

import bisect
import math
import warnings
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ragged_optim.comm.collectives import p2p_serves
from ragged_optim.sharding import grad_buckets, unit_collectives, unit_messages
from ragged_optim.sharding.comm_policy import CommPolicy
from ragged_optim.sharding.layout import BlockSpec, Layout
from ragged_optim.sharding.planner import TensorSpec, plan_unit
from ragged_optim.sharding.ragged_dtensor import RaggedDTensor, build_ragged, normalize_ranges
from ragged_optim.sharding.sharded_param import _INFO_ATTR, ShardInfo, local_of
from ragged_optim.sharding.streams import NO_STREAMS
from ragged_optim.sharding.tensor_parallel import TensorParallelPart

ALIGNMENT_BYTES = 16


def default_block_spec(param: torch.Tensor) -> BlockSpec:
    """Element granularity: every element may sit on any rank."""
    return BlockSpec.elements(1, param.numel())


class FlatUnit:
    def __init__(
        self,
        module: nn.Module,
        params: list[nn.Parameter],
        names: list[str],
        refs,
        group,
        mp_policy,
        comm_policy=None,
        replicate_group=None,
        device: torch.device | None = None,
        tp_parts: list[TensorParallelPart | None] | None = None,
    ):
        self.module = module
        self.modules = [module]  # fully_shard([m1, m2]): every module of the list (module is the first)
        self.module_name = type(module).__name__  # for messages (fully_shard renames the class afterwards)
        self.replicate_group = replicate_group  # HSDP: replicas of this unit's shards
        self.comm_policy = comm_policy or CommPolicy()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.names = names
        self.refs = refs  # per param: the (module, attribute) pairs that hold it (several when tied)
        self.device = device or (params[0].device if params else torch.device("cpu"))
        self.dtype = params[0].dtype if params else torch.float32
        self.param_dtype = (mp_policy.param_dtype if mp_policy else None) or self.dtype
        self.reduce_dtype = (mp_policy.reduce_dtype if mp_policy else None) or self.param_dtype
        # MixedPrecisionPolicy's forward casts, as FSDP2 applies them per fully_shard module
        cast = mp_policy is not None and mp_policy.param_dtype is not None and mp_policy.cast_forward_inputs
        self.cast_inputs_to = mp_policy.param_dtype if cast else None
        self.output_dtype = mp_policy.output_dtype if mp_policy is not None else None
        self.requires_grad = [p.requires_grad for p in params]
        # per param: its tensor-parallel layout (None: a plain param); the unit lays out the TP-local tensors
        self.tp_parts = list(tp_parts) if tp_parts is not None else [None] * len(params)
        params = [p if tp is None else p.to_local() for p, tp in zip(params, self.tp_parts)]
        self.specs = [default_block_spec(p) for p in params]
        self.allow_split = True
        self.layout_locked = False  # set once an optimizer keeps state shaped by this layout
        self.layout = self.plan([p.shape for p in params])
        self.local_shard = torch.zeros(self.layout.shard_size, dtype=self.dtype, device=self.device)
        if self.device.type != "meta":  # meta params: only shapes now; to_empty + ro.init_weights fill the shards
            with torch.no_grad():
                for i, p in enumerate(params):
                    lo, hi = self.layout.local_range(self.rank, i)
                    self._local_slice(i).copy_(p.detach().reshape(-1)[lo:hi])
        self.sharded_params = []
        for i, p in enumerate(params):
            sp = nn.Parameter(self.as_ragged(self._local_slice(i), i), requires_grad=p.requires_grad)
            setattr(sp, _INFO_ATTR, ShardInfo(self, i, names[i]))
            self.sharded_params.append(sp)
        self._sharded_grad = None  # weakref to the [S] master-dtype buffer of the sharded grads
        self.unsharded = torch.empty(0, dtype=self.param_dtype, device=self.device)
        self.unsharded_params: list[nn.Parameter] = []
        # The unsharded buffer as storages each freed on its own: [self.unsharded], or (the units that reduce in
        # buckets, on CPU) runs of params, so that a run whose grads are all taken is freed inside the backward
        self.unsharded_parts: list[torch.Tensor] = []
        self._parts_key = None
        self._parts_plan = None  # (layout, BUCKET_BYTES, its parts' ranges): planned once per layout and cap
        self._part_missing: list[int] | None = None  # per part, trainable params still to give this backward a grad
        self.parts_freed_in_backward = 0  # (a count, for tests)
        self.grad_buf = None  # [W*S] param dtype, made at post-backward, alive until the reduce-scatter
        self.grads_pending = False  # the unit's backward ran: its params' grads are to be folded and reduced
        self.is_unsharded = False
        self.stale = True
        self.streams = NO_STREAMS  # the root's side streams, bound at each iteration's start (see streams.py)
        self.pending_gather = None  # (work, staging tensor, version, event) of an all-gather in flight
        self.pending_reduce = None  # (work, output, op, post-divisor, event, params to land) of a reduce-scatter
        self.reduce_input = None  # the flat grads a reduce-scatter in flight reads
        self.unsynced_grad = None  # [W*S] reduce dtype: grads of no-sync backwards when it differs from the param's
        # params that were trainable in some backward whose grads are not yet reduced: they get the reduced grad
        # even if frozen since (requires_grad_(False) between micro-batches keeps what was accumulated, as in torch)
        self.accumulating: set[int] = set()
        self.requires_grad_sync = True
        # FSDPModule.set_gradient_divide_factor (None: the data-parallel size) and set_force_sum_reduction_for_comms
        self.gradient_divide_factor: float | None = None
        self.force_sum_reduction = False
        self.buckets = grad_buckets.GradBuckets(self)  # grads reduced in buckets in the backward (CPU gloo)
        self.bucket_tag = 0  # this unit's index in its root: the tag of its bucket messages
        self.drop_unsharded_params()
        self.set_sharded_attrs()

    # ----- layout -------------------------------------------------------------------------------------------
    def plan(self, shapes, compute_load=None) -> Layout:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        tensors = [TensorSpec(n, tuple(sh), itemsize, s) for n, sh, s in zip(self.names, shapes, self.specs)]
        return plan_unit(
            tensors,
            self.world_size,
            alignment=self._alignment(itemsize),
            allow_split=self.allow_split,
            compute_load=compute_load,
        )

    def _alignment(self, itemsize: int) -> int:
        """Bytes: the collective alignment, both buffers' dtypes, and whole quantization blocks per rank."""
        a = max(ALIGNMENT_BYTES, self._itemsize_lcm())
        if self.comm_policy.quantized:
            a = max(a, self.comm_policy.block_size * itemsize)
        return a

    def _itemsize_lcm(self) -> int:
        # The local shard (master dtype) and the unsharded buffer (param dtype) both need aligned S.
        a, b = torch.finfo(self.dtype).bits // 8, torch.finfo(self.param_dtype).bits // 8
        return a * b // math.gcd(a, b)

    def shard_view(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        """Tensor i's local piece inside an S-element per-rank buffer (the local shard, the sharded grad)."""
        lo, hi = self.layout.local_range(self.rank, i)
        start = self.layout.offsets[i] + lo - self.rank * self.layout.shard_size
        return buf[start : start + (hi - lo)] if hi > lo else buf[:0]

    def _local_slice(self, i: int) -> torch.Tensor:
        return self.shard_view(self.local_shard, i)

    def _ranges(self, i: int) -> list[tuple[int, int]]:
        return [self.layout.local_range(r, i) for r in range(self.world_size)]

    def as_ragged(self, view: torch.Tensor, i: int) -> RaggedDTensor:
        """``view`` (this rank's elements of tensor i, a view into an S-element buffer) as the full-shape DTensor
        users see: a sharded param's data, its grad. No copy: the DTensor's local tensor is ``view``."""
        # (not detached: the view keeps its buffer object alive, which the unit holds only weakly for the grads)
        tp = self.tp_parts[i]
        shape = self.layout.shapes[i] if tp is None else tp.shape
        return build_ragged(view, shape, self._ranges(i), self.rank, self.group, tp=tp)

    def repoint(self, sp: nn.Parameter, i: int) -> None:
        """Make the sharded param ``sp`` (tensor i) hold its slice of the current local shard and layout (the same
        object: optimizers and modules keep holding it)."""
        sp._local_tensor = self._local_slice(i)
        sp._ragged_ranges = normalize_ranges(self._ranges(i))

    def full_slice(self, buf: torch.Tensor, i: int, base: int = 0) -> torch.Tensor:
        """Tensor i inside a W*S-element buffer (or, ``base``, the part of one that starts at that flat offset)."""
        off = self.layout.offsets[i] - base
        return buf[off : off + math.prod(self.layout.shapes[i])].view(self.layout.shapes[i])

    def drop_unsharded_params(self):
        """The unsharded buffer and params are made at the first unshard, not here: allocating the buffer only to
        free it again would count a whole unit against every rank while a model is built and initialised."""
        self.unsharded = torch.empty(0, dtype=self.param_dtype, device=self.device)
        self.unsharded_params = []
        self.unsharded_parts, self._parts_key = [], None

    def _wanted_parts(self) -> tuple | None:
        """The flat ranges of the unsharded buffer's separate storages, or None for one buffer: parts only where
        grads go in buckets (whose hooks say when a run of params is done with) and the all-gather is ours."""
        if not (grad_buckets.FREE_PARAMS_IN_BACKWARD and self.buckets.wanted and not self.streams.enabled):
            return None
        if self.comm_policy.param_all_gather != "full" or any(tp is not None for tp in self.tp_parts):
            return None
        if not p2p_serves(self.group, self.device):
            return None
        plan = self._parts_plan
        if plan is None or plan[0] is not self.layout or plan[1] != grad_buckets.BUCKET_BYTES:
            ranges = grad_buckets.plan_parts(self.layout, torch.empty(0, dtype=self.param_dtype).element_size())
            plan = self._parts_plan = (self.layout, grad_buckets.BUCKET_BYTES, ranges if len(ranges) > 1 else None)
        return plan[2]

    def _alloc_unsharded(self):
        """Storage for the unsharded buffer (re-allocated in place after a reshard, so the params stay views)."""
        key = self._wanted_parts()
        freed = all(t.untyped_storage().size() == 0 for t in self.unsharded_parts)
        if not self.unsharded_params or (key != self._parts_key and freed):
            # never an inference tensor, even when the first forward runs under torch.inference_mode(): the buffer
            # lives on, and training forwards save views of it for backward
            with torch.inference_mode(False):
                self._make_unsharded(key)
            return
        for t in self.unsharded_parts:
            if t.untyped_storage().size() == 0:
                t.untyped_storage().resize_(t.numel() * t.element_size())

    def _make_unsharded(self, key: tuple | None) -> None:
        ranges = key or ((0, self.layout.total_size),)
        parts = [torch.empty(hi - lo, dtype=self.param_dtype, device=self.device) for lo, hi in ranges]
        starts = [lo for lo, _ in ranges]
        self._part_of = [bisect.bisect_right(starts, off) - 1 for off in self.layout.offsets]
        views = [self.full_slice(parts[p], i, base=starts[p]) for i, p in enumerate(self._part_of)]
        if not self.unsharded_params:
            self.unsharded_params = [
                nn.Parameter(self._as_unsharded(v, i), requires_grad=rg)
                for i, (v, rg) in enumerate(zip(views, self.requires_grad))
            ]
        else:  # parts chosen (or dropped) since: the same param objects (hooks hold them) over the new storages
            with torch.no_grad():
                for up, v in zip(self.unsharded_params, views):
                    up.data = v
        self.unsharded_parts, self._parts_key = parts, key
        self.unsharded = parts[0] if key is None else torch.empty(0, dtype=self.param_dtype, device=self.device)

    def gather_target(self):
        """What the all-gather fills: the flat buffer, or its parts in order."""
        return self.unsharded if self._parts_key is None else self.unsharded_parts

    def _as_unsharded(self, full: torch.Tensor, i: int) -> torch.Tensor:
        """Tensor i's unsharded value as its module sees it: ``full`` itself, or TP's DTensor over it (no copy)."""
        tp = self.tp_parts[i]
        return full if tp is None else tp.unsharded(full)

    def set_owners(self, layout: Layout) -> None:
        """Take who computes which block from ``layout``: this layout with its owners re-balanced
        (:func:`~ragged_optim.sharding.planner.assign_owners_jointly`). Data placement is the same: nothing moves."""
        self.layout = layout

    def lock(self) -> None:
        """An optimizer keeps state shaped by this layout from now on: refuse re-planning it."""
        self.layout_locked = True

    # ----- module attributes --------------------------------------------------------------------------------
    def _set_attrs(self, params):
        for p, refs in zip(params, self.refs):
            for mod, attr in refs:
                mod._parameters[attr] = p

    def set_sharded_attrs(self):
        self._set_attrs(self.sharded_params)

    def set_unsharded_attrs(self):
        self._set_attrs(self.unsharded_params)

    def sync_with_sharded_params(self):
        """Before a forward: follow requires_grad_ set on the sharded params since fully_shard (a frozen param gets
        no grad: .grad stays None), and refuse params that were cast, moved, given new .data or replaced by a new
        Parameter (they no longer live in the local shard, so training would ignore them or fail in backward)."""
        if self.device.type == "meta" and self.sharded_params:
            raise RuntimeError(unit_messages.still_on_meta(self.label(0)))
        shard_ptr = self.local_shard.untyped_storage().data_ptr()
        for i, sp in enumerate(self.sharded_params):
            if sp.dtype != self.dtype or sp.device != self.device:
                raise RuntimeError(
                    unit_messages.cast_or_moved(self.label(i), sp.dtype, sp.device, self.dtype, self.device)
                )
            if local_of(sp).untyped_storage().data_ptr() != shard_ptr:
                raise RuntimeError(unit_messages.data_replaced(self.label(i)))
            ours = (sp, self.unsharded_params[i]) if self.unsharded_params else (sp,)  # (after module.unshard())
            for mod, attr in self.refs[i]:
                if not any(mod._parameters.get(attr) is q for q in ours):  # a new Parameter: unshard would drop it
                    raise RuntimeError(unit_messages.param_replaced(self.label(i), type(mod).__name__, attr))
            if sp.requires_grad != self.requires_grad[i]:
                self.requires_grad[i] = sp.requires_grad
                if self.unsharded_params:
                    self.unsharded_params[i].requires_grad_(sp.requires_grad)

    def check_apply_keeps_dtype(self, fn) -> None:
        """Before ``module._apply(fn)`` changes anything: a cast would break the layout (its alignment and the
        buffers' dtypes are planned for this dtype), so refuse it while nothing is changed yet."""
        if not self.sharded_params:
            return
        device = torch.device("cpu") if self.device.type == "meta" else self.device
        try:  # on an empty tensor: tells a cast from a move without touching any data
            probe = fn(torch.empty(0, dtype=self.dtype, device=device))
        except (RuntimeError, NotImplementedError):  # fn cannot run here (e.g. no such device): leave it to _apply
            return
        if isinstance(probe, torch.Tensor) and probe.dtype != self.dtype:
            raise RuntimeError(unit_messages.cast_by_apply(self.label(0), probe.dtype, self.dtype))

    def unset_attrs(self) -> None:
        """Take the params off their modules while ``module._apply`` runs, so it does not touch them one by one."""
        for refs in self.refs:
            for mod, attr in refs:
                mod._parameters[attr] = None

    @torch.no_grad()
    def apply_to_shard(self, fn) -> None:
        """``module._apply(fn)`` for this unit (``to_empty``, ``.to(device)``): ``fn`` runs once on the flat local
        shard (and the sharded grads), and the sharded params become views of the result. One allocation per
        unit, so materialising a meta-device model holds nothing but this rank's shards."""
        new = fn(self.local_shard)
        if new is not self.local_shard:
            self.local_shard = new
            self.device = new.device
            for i, sp in enumerate(self.sharded_params):
                view = self._local_slice(i)
                if sp.device == view.device:
                    self.repoint(sp, i)
                    continue
                # meta -> a real device: the same Parameter object with the new tensor swapped in (as FSDP2 keeps
                # its params), so that an optimizer built before to_empty still holds the model's params (with a
                # new object, a torch optimizer built earlier would silently train nothing)
                attrs = dict(sp.__dict__)
                new_sp = nn.Parameter(self.as_ragged(view, i), requires_grad=sp.requires_grad)
                try:
                    torch.utils.swap_tensors(sp, new_sp)  # (swaps the objects' __dict__ too: put ours back)
                except RuntimeError:  # a weak reference to it, which swapping would break: a new object
                    warnings.warn(unit_messages.kept_by_weak_reference(self.label(i)), RuntimeWarning, stacklevel=4)
                    self.sharded_params[i] = sp = new_sp
                sp.__dict__.update(attrs)
            if self.sharded_grad is not None:
                grads = fn(self.sharded_grad)
                self._sharded_grad = weakref.ref(grads)
                for i, sp in enumerate(self.sharded_params):
                    if sp.grad is not None:
                        sp.grad = self.as_ragged(self.shard_view(grads, i), i)
            self.pending_gather = self.pending_reduce = None
            self.is_unsharded, self.stale = False, True
            self.drop_grad_buffers()
            self.drop_unsharded_params()
        self.set_sharded_attrs()

    def label(self, i: int) -> str:
        return f"{self.names[i]!r} (in {self.module_name})"

    # ----- unshard / reshard --------------------------------------------------------------------------------
    def start_unshard(self):
        """Issue the all-gather (async) unless the unsharded buffer is current or a gather is in flight."""
        if self._part_missing is not None and any(t.untyped_storage().size() == 0 for t in self.unsharded_parts):
            raise RuntimeError(unit_messages.forward_after_params_freed(self))
        if (self.is_unsharded and not self.stale) or self.pending_gather is not None or not self.sharded_params:
            return
        self._alloc_unsharded()  # on the compute stream, which reads the buffer and frees it
        version = tuple(t._version for t in self.unsharded_parts)
        work, src, event = unit_collectives.issue_all_gather(self)
        self.pending_gather = (work, src, version, event)
        self.gathered_from = self._shard_version()

    def wait_unshard(self):
        self.start_unshard()
        if self.pending_gather is not None:
            work, _, version, event = self.pending_gather
            self.streams.complete(work, event)
            self.pending_gather = None
            self.is_unsharded, self.stale = True, False
            # The buffer is refilled under autograd's nose on purpose: tensors saved for backward are views of it
            # and the backward all-gather puts the same values back. The collective bumps the version counter
            # (at issue or at completion), so restore it once the data is in.
            torch._C._autograd._unsafe_set_version_counter(tuple(self.unsharded_parts), version)

    def _shard_version(self) -> tuple:
        """What in-place writes to the shard bump: the flat shard's version counter (writes to local pieces, as our
        optimizers make) and each sharded param's own (writes through the DTensor, as torch's optimizers make:
        those run below autograd on the pieces, where no counter is bumped)."""
        return self.local_shard._version, tuple(sp._version for sp in self.sharded_params)

    def mark_stale(self, *, unless_unchanged: bool = False) -> None:
        """At an iteration's start the gathered data may be out of date (an optimizer step changed the shard).
        ``unless_unchanged`` (a unit kept gathered after backward: set_reshard_after_backward(False)): reuse it while
        the shard's version counter says no in-place op changed it (gradient accumulation), as FSDP2 reuses it
        without looking. (Writes through ``p.data`` bypass the counter: FSDP2's contract holds there.)"""
        same = self.is_unsharded and getattr(self, "gathered_from", None) == self._shard_version()
        if not (unless_unchanged and same):
            self.stale = True

    def reshard(self):
        if self.pending_gather is not None:
            self.wait_unshard()
        if self.is_unsharded:
            for t in self.unsharded_parts:
                t.untyped_storage().resize_(0)
            self.is_unsharded = False
        self._part_missing = None
        self.set_sharded_attrs()

    def reset_iteration(self):
        """Drop what a failed forward or backward left behind: wait for collectives in flight (every rank issued
        them, so they complete) and discard their results, free the unsharded and gradient buffers. The sharded
        params and the sharded grads of earlier, finished iterations are kept."""
        if self.pending_gather is not None:
            self.streams.complete(self.pending_gather[0], self.pending_gather[3])
            self.pending_gather = None
            self.is_unsharded, self.stale = True, True
        if self.pending_reduce is not None:
            self.streams.complete(self.pending_reduce[0], self.pending_reduce[4])
            self.pending_reduce = None
        self.buckets.abort()
        self.drop_grad_buffers()
        self.reshard()

    # ----- gradients ----------------------------------------------------------------------------------------
    @property
    def trainable(self) -> bool:
        return any(self.requires_grad)

    def prepare_grads(self, forward_once: bool = False, free_early: bool = False):
        """Before the unit's backward. The flat grad buffer is not made here: autograd makes each param's grad as
        the backward computes it (as under FSDP2), and :meth:`_fold_param_grads` copies them into a buffer made at
        the unit's post-backward. Before, a zero-filled buffer of the whole unit was allocated here and held through
        the unit's backward: 7.1 MB per unit above FSDP2 on bench20m, the gap in our backward peak. Grads kept from
        an earlier no-sync backward stay the accumulator: each param's .grad points into them, so autograd adds in
        place, in torch's order. ``forward_once``: the unit ran one forward this iteration, so this backward makes
        all its grads and they may be reduced in buckets as they come (:meth:`_buckets_apply`). ``free_early``: the
        unit reshards after backward, so a part of its params may go as soon as their grads are all taken."""
        if self.trainable:
            self.grads_pending = True
        if self.grad_buf is not None:
            for i, up in enumerate(self.unsharded_params):
                if up.requires_grad and up.grad is None:
                    up.grad = self._as_unsharded(self.full_slice(self.grad_buf, i), i)
        self.accumulating.update(i for i, rg in enumerate(self.requires_grad) if rg)
        if forward_once and self.buckets.wanted and self._buckets_apply():
            self.buckets.begin(
                unit_collectives.wire_dtype(self),
                unit_collectives.divide_plan(self, unit_collectives.wire_dtype(self))[0],
            )
            if free_early and self._parts_key is not None and self.is_unsharded and self.buckets.clean_closes:
                self._part_missing = [0] * len(self.unsharded_parts)
                for i, p in enumerate(self._part_of):
                    # a frozen param's part stays to the post-backward (no grad says when it is done with)
                    self._part_missing[p] += 1 if self.requires_grad[i] else len(self.layout.offsets) + 1

    def grad_taken(self, i: int) -> None:
        """Param i's grad left for its bucket: autograd accumulates a param's grad once every op that uses it ran
        its backward, so a part whose params all gave theirs is read no more in this backward. (A forward that
        reads a param outside autograd, ``p.detach()`` saved for the backward, breaks that: such models set
        ``grad_buckets.FREE_PARAMS_IN_BACKWARD = False``.) The first bucketed backward of a unit frees nothing:
        its end checks that no grad came twice (a reentrant checkpoint, which reads params again later)."""
        if self._part_missing is None:
            return
        p = self._part_of[i]
        self._part_missing[p] -= 1
        if self._part_missing[p] == 0:
            self.unsharded_parts[p].untyped_storage().resize_(0)
            self.parts_freed_in_backward += 1

    def _buckets_apply(self) -> bool:
        """Reduce in buckets during the backward: a synced backward on CPU gloo ranks without side streams, grads
        that start from nothing (no no-sync accumulation), full or bf16 on the wire, no tensor parallel, a sum
        (what the point-to-point reduction makes), and a unit whose grads make at least two buckets."""
        if not (self.trainable and self.requires_grad_sync and self.grad_buf is None and self.unsynced_grad is None):
            return False
        if (
            self.streams.enabled
            or self.comm_policy.grad_reduce == "int8"
            or any(tp is not None for tp in self.tp_parts)
        ):
            return False
        if not p2p_serves(self.group, self.device) or any(up.grad is not None for up in self.unsharded_params):
            return False
        wire = unit_collectives.wire_dtype(self)
        return unit_collectives.divide_plan(self, wire)[2] == dist.ReduceOp.SUM and len(self.buckets.plan(wire)) > 1

    @property
    def holds_unreduced_grads(self) -> bool:
        """This backward's grads, or an earlier no-sync backward's, wait here to be reduced."""
        return self.grads_pending or self.grad_buf is not None or self.unsynced_grad is not None

    def drop_grad_buffers(self):
        for up in self.unsharded_params:
            up.grad = None
        self.grad_buf = None
        self.unsynced_grad = None
        self.grads_pending = False
        self.accumulating.clear()

    def _fold_param_grads(self):
        """The unit's backward is done: its params' grads go into the flat grad buffer (made now, zeros where a
        param got none, so every rank reduces the same bytes), and the params let go of them."""
        if not self.grads_pending and self.grad_buf is None:
            return
        if self.grad_buf is None:
            self.grad_buf = torch.zeros(self.layout.total_size, dtype=self.param_dtype, device=self.device)
        for i, up in enumerate(self.unsharded_params):
            g = up.grad
            if g is None:
                continue
            if isinstance(g, DTensor):  # tensor parallel: TP's grad, partial over TP ranks where its rules say so
                tp = self.tp_parts[i]
                if tuple(g.placements) != tp.tp_placements:
                    g = g.redistribute(tp.tp_mesh, tp.tp_placements)
                g = g.to_local()
            view = self.full_slice(self.grad_buf, i)
            if g.data_ptr() != view.data_ptr():  # (a grad autograd made, not the accumulator it added into)
                view.add_(g)
            up.grad = None
        self.grads_pending = False

    def post_backward_grads(self):
        """After the unit's backward: without gradient sync, keep the grads for the next backward (in the reduce
        dtype, as FSDP2 does, so bf16 grads do not accumulate in bf16); with it, start the reduce-scatter (async)
        of everything accumulated. Returns True when a reduce-scatter was started."""
        if self.buckets.active:
            return self._finish_buckets()
        if not self.holds_unreduced_grads:
            return False
        self._fold_param_grads()
        if not self.requires_grad_sync:
            if self.grad_buf is not None and self.reduce_dtype != self.param_dtype:
                self._fold_into_unsynced()
            return False
        full = self._grads_to_reduce()  # on the compute stream, like the output buffer (see streams.py)
        work, out, op, post, event = unit_collectives.issue_reduce_scatter(self, full)
        landing = sorted(self.accumulating | {i for i, rg in enumerate(self.requires_grad) if rg})
        self.accumulating.clear()
        self.pending_reduce = (work, out, op, post, event, landing)
        # Alive until the reduce-scatter is done where a side stream reads it (the compute stream's allocator must not
        # reuse it). Without streams the work holds what it reads, and gloo holds a copy of its own: keeping ours
        # too held the unit's grads twice through the next unit's backward.
        self.reduce_input = full if self.streams.enabled else None
        return True

    def _finish_buckets(self) -> bool:
        """Post the buckets still to go, wait for the bucketed reduce-scatter, and leave its result to land."""
        self.grads_pending = False
        _, post, op = unit_collectives.divide_plan(self, unit_collectives.wire_dtype(self))
        out = self.buckets.close()
        landing = sorted(self.accumulating | {i for i, rg in enumerate(self.requires_grad) if rg})
        self.accumulating.clear()
        self.pending_reduce = (None, out, op, post, None, landing)
        return True

    def _fold_into_unsynced(self):
        """Add this backward's grads (param dtype) into the reduce-dtype accumulator and free the grad buffer."""
        if self.unsynced_grad is None:
            self.unsynced_grad = self.grad_buf.to(self.reduce_dtype)
        else:
            self.unsynced_grad.add_(self.grad_buf)
        for up in self.unsharded_params:
            up.grad = None
        self.grad_buf = None

    def _grads_to_reduce(self) -> torch.Tensor:
        """The flat W*S grads to reduce, in the wire dtype, owned by the reduction (the grad buffer is released)."""
        wire = unit_collectives.wire_dtype(self)
        if self.comm_policy.grad_reduce == "int8":
            wire = torch.float32 if self.unsynced_grad is not None else self.param_dtype
        if self.unsynced_grad is not None:
            full = self.unsynced_grad
            if self.grad_buf is not None:
                full.add_(self.grad_buf)
            full = full if full.dtype == wire else full.to(wire)
        else:
            full = self.grad_buf if self.grad_buf.dtype == wire else self.grad_buf.to(wire)
        for up in self.unsharded_params:
            up.grad = None
        self.grad_buf = None
        self.unsynced_grad = None
        return full

    def finish_reduce_grads(self):
        """Wait for the reduce-scatter, average, and land the result in the sharded params' .grad."""
        if self.pending_reduce is None:
            return
        work, out, op, post, event, trainable = self.pending_reduce
        out = unit_collectives.complete_reduce(self, work, out, op, post, event)
        self.pending_reduce = None
        self.reduce_input = None
        kept = [local_of(self.sharded_params[i].grad) for i in trainable if self.sharded_params[i].grad is not None]
        buf = self.sharded_grad
        if kept and buf is not None and all(_same_storage(g, buf) for g in kept):
            for i in trainable:  # accumulate into the grads kept from an earlier backward, in place
                if self.sharded_params[i].grad is None:
                    self.shard_view(buf, i).zero_()
            out = buf.add_(out)
        for i in trainable:
            sp = self.sharded_params[i]
            if sp.grad is None:
                sp.grad = self.as_ragged(self.shard_view(out, i), i)
            elif not _same_storage(local_of(sp.grad), out):  # a grad the user replaced by one of their own: add
                local_of(sp.grad).add_(self.shard_view(out, i))
        # Only a weak reference: once zero_grad() drops the grads the buffer is freed, as FSDP2 holds nothing either.
        self._sharded_grad = weakref.ref(out)

    @property
    def sharded_grad(self) -> torch.Tensor | None:
        """The [S] buffer the sharded params' grads are views of, while any of them is alive."""
        ref = getattr(self, "_sharded_grad", None)
        return ref() if ref is not None else None


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
