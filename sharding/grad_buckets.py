"""A unit's grads reduced in buckets while its backward runs, on CPU gloo ranks (as DDP reduces its buckets).

A unit that reduces its grads whole after its backward holds, at the end of that backward, its unsharded params
and all their grads: 2U. Here each grad, as autograd accumulates it, moves into its bucket (a run of adjacent
params of at most ``BUCKET_BYTES``, or one larger param) and leaves the param; a bucket whose params all have
their grads is posted at once (:class:`~ragged_optim.comm.bucketed_reduce.BucketedReduceScatter`), and its bytes
go when every rank has summed them. Buckets are posted strictly in one order, the same on every rank (descending
flat offset: the order a backward makes grads in), whatever grads a rank got or when: a bucket waiting for a grad
holds back the ones after it, and the unit's post-backward posts what is left (zeros for grads that never came),
so every rank sends the same messages. The post-backward waits for all of it, where the whole-unit reduce-scatter
waited; a grad hook waits, bounded, for the buckets it posted (``GradBuckets.patient``). The result is bit for
bit the whole-unit one (the same rank-order sum of the same values).
"""

from __future__ import annotations

import math
import warnings
import weakref

import torch

from ragged_optim.comm.bucketed_reduce import BucketedReduceScatter

#: How long a grad hook waits for its buckets to be summed on every rank before it lets the backward go on (see
#: ``GradBuckets.patient``).
PEER_WAIT_S = 2.0

#: The most bytes of adjacent params one bucket takes (a larger param is a bucket of its own); None: every unit's
#: grads are reduced whole after its backward.
BUCKET_BYTES: int | None = 1 << 20

#: Reduce in buckets only the units whose whole-unit reduction would raise the backward's peak above the one that
#: buckets everywhere reach (:func:`units_worth_bucketing`): the last few in backward order, which hold the most
#: reduced shards beside them. Each bucket costs a wait for the peers; on bench fsdp's GPT (4 CPU ranks) buckets in
#: every unit made the step 1.2-1.5x slower for no lower peak. False: every unit that can.
ONLY_AT_PEAK = True


#: A unit whose grads go in buckets holds its unsharded params in parts (runs of params, about ``BUCKET_BYTES``
#: each, a larger param alone) and frees each part in the backward once all its params' grads are taken: the rest of
#: the unit's backward no longer holds them. False: the unit's params stay whole until its post-backward.
FREE_PARAMS_IN_BACKWARD = True


def plan_parts(layout, itemsize: int) -> tuple[tuple[int, int], ...]:
    """Flat ranges covering ``[0, layout.total_size)``, cut only where a param starts: the buckets'
    runs (:func:`plan_buckets`) over every param, frozen or not, padding with the param before it. Empty without
    buckets."""
    if BUCKET_BYTES is None or not layout.offsets:
        return ()
    numels = [math.prod(s) for s in layout.shapes]
    runs = plan_buckets(layout.offsets, numels, [True] * len(numels), itemsize, BUCKET_BYTES)
    cuts = sorted(lo for lo, _, _ in runs)
    cuts[0] = 0
    return tuple(zip(cuts, [*cuts[1:], layout.total_size]))


def plan_buckets(offsets, numels, trainable, itemsize: int, cap: int) -> list[tuple[int, int, list]]:
    """``(lo, hi, params)`` per bucket, in posting order: runs of trainable params adjacent in the flat buffer (no
    frozen param between; padding between them is part of the range), each at most ``cap`` bytes unless it is
    one param. Frozen params are in no bucket (nothing is reduced for them, as in the whole-unit reduction)."""
    order = sorted(range(len(offsets)), key=lambda i: offsets[i])
    runs, cur = [], []
    for i in order:
        if not trainable[i]:
            if cur:
                runs.append(cur)
            cur = []
            continue
        if cur and (offsets[i] + numels[i] - offsets[cur[0]]) * itemsize > cap:
            runs.append(cur)
            cur = []
        cur.append(i)
    if cur:
        runs.append(cur)
    return [(offsets[r[0]], offsets[r[-1]] + numels[r[-1]], r) for r in reversed(runs)]


def units_worth_bucketing(units) -> set[int]:
    """The ids of the units (given in backward order) whose whole-unit reduction would hold more at the end of
    their backward than the highest point a bucketed backward reaches: beside the shards reduced before it, a unit
    holds its params (U) and all its grads (about U) whole, or bucketed its params, its reduced shard and its
    largest grad. Sizes and order only, so every rank chooses the same units. (With ``FREE_PARAMS_IN_BACKWARD`` a
    bucketed unit peaks lower, at its params and its largest grad, as the shard fills while the params go; choosing
    by that bucketed a fourth block of bench20m's 11 for 1 MB less peak and made bench fsdp's step 0.89-0.93 of
    FSDP2's, against 0.83-0.85 with three.) The estimate leaves out what both
    hold beside (activations, the grad of the running op's input, a receive buffer), which differs by less than a
    shard: units within one shard of the bucketed peak are bucketed too (measured on bench20m: without that margin
    the unit before the last two peaked 0.23 MB above them)."""
    held, whole, floor, margin = 0, {}, 0, 0
    for u in units:
        item = torch.empty(0, dtype=u.param_dtype).element_size()
        numels = [math.prod(sh) for sh, rg in zip(u.layout.shapes, u.requires_grad) if rg]
        unsharded = u.layout.total_size * item
        shard = u.layout.shard_size * torch.empty(0, dtype=u.dtype).element_size()
        whole[id(u)] = held + unsharded + sum(numels) * item
        floor = max(floor, held + unsharded + shard + max(numels, default=0) * item if numels else whole[id(u)])
        held += shard
        margin = max(margin, shard)
    return {id(u) for u in units if whole[id(u)] > floor - margin}


class GradBuckets:
    """One unit's bucket plan and, between its pre- and post-backward, the open bucketed reduction."""

    def __init__(self, unit):
        self._unit = weakref.ref(unit)
        self._plan_key = None
        self.buckets: list[tuple[int, int, list]] = []
        self._hooked: set[int] = set()
        self.active = False
        # Whether a hook waits until the buckets it posted are summed everywhere, so a bucket's bytes are gone
        # before autograd makes the next grad (not waiting, a rank ahead of its peers holds every grad it made
        # until they catch up: more than the whole-unit reduction). The wait is bounded: a peer may post a bucket
        # only at its post-backward (a grad it did not get) after collectives of other units that need this rank
        # (a unit with units inside it: the root, set by the runtime); after one wait runs out, never again.
        self.patient = True
        self.wanted = False  # chosen by the runtime at each iteration's start (units_worth_bucketing)
        self.clean_closes = 0  # bucketed backwards that ended with no grad accumulated twice

    def plan(self, wire: torch.dtype) -> list[tuple[int, int, list]]:
        u = self._unit()
        key = (id(u.layout), tuple(u.requires_grad), wire, BUCKET_BYTES)
        if key != self._plan_key:
            lay = u.layout
            numels = [math.prod(s) for s in lay.shapes]
            itemsize = torch.empty(0, dtype=wire).element_size()
            cap = BUCKET_BYTES
            self.buckets = [] if cap is None else plan_buckets(lay.offsets, numels, u.requires_grad, itemsize, cap)
            self._plan_key = key
        return self.buckets

    def begin(self, wire: torch.dtype, pre: float) -> None:
        """At the unit's pre-backward: grads accumulated from now in this graph task go into buckets."""
        u = self._unit()
        self.wire, self.pre = wire, pre
        self.task = torch._C._current_graph_task_id()
        self.bucket_of = {i: b for b, (_, _, ps) in enumerate(self.buckets) for i in ps}
        self.missing = [len(ps) for _, _, ps in self.buckets]
        self.data: list[torch.Tensor | None] = [None] * len(self.buckets)
        self.taken: set[int] = set()
        self.twice: list[int] = []
        self.next = 0
        self.reduction = None
        for i, up in enumerate(u.unsharded_params):
            if up.requires_grad and id(up) not in self._hooked:
                up.register_post_accumulate_grad_hook(_hook(self, i))
                self._hooked.add(id(up))
        self.active = True

    def grad_ready(self, i: int, up: torch.Tensor) -> None:
        if not self.active or torch._C._current_graph_task_id() != self.task or i not in self.bucket_of:
            return  # (another backward, or a reentrant checkpoint's: the post-backward takes the grad)
        if i in self.taken:
            self.twice.append(i)
            return
        b = self.bucket_of[i]
        if self.next > b:  # its bucket was posted without it (only when a grad came in another graph task)
            self.twice.append(i)
            return
        self._take(i, b, up)
        self._unit().grad_taken(i)
        self.missing[b] -= 1
        posted = self.next
        while self.next < len(self.buckets) and self.missing[self.next] == 0:
            self._post(self.next)
        if (
            self.next > posted
            and self.patient
            and self.reduction.in_flight_bytes >= (BUCKET_BYTES or 0)
            and not self.reduction.wait_summed(PEER_WAIT_S)
        ):
            self.patient = False
            warnings.warn(
                f"fully_shard: {self._unit().module_name}'s grad buckets waited {PEER_WAIT_S} s for another rank "
                "(one that got no grad for some of its params posts them at its post-backward); its buckets no "
                "longer wait, which can hold more memory in backward",
                stacklevel=2,
            )

    def _take(self, i: int, b: int, up: torch.Tensor) -> None:
        """Param i's grad into bucket b's data; the param lets go of it (a lone param's grad is the data)."""
        u = self._unit()
        lo, hi, ps = self.buckets[b]
        g, off = up.grad, u.layout.offsets[i]
        self.taken.add(i)
        up.grad = None
        if g is None:
            return
        if len(ps) == 1 and g.dtype == self.wire and g.is_contiguous() and g.numel() == hi - lo:
            self.data[b] = g.view(-1)
            return
        if self.data[b] is None:
            self.data[b] = torch.zeros(hi - lo, dtype=self.wire, device=u.device)
        self.data[b][off - lo : off - lo + g.numel()].copy_(g.reshape(-1))

    def _post(self, b: int) -> None:
        u = self._unit()
        lo, hi, _ = self.buckets[b]
        if self.reduction is None:
            self.reduction = BucketedReduceScatter(u.layout.shard_size, self.wire, u.device, u.group, u.bucket_tag)
        data = self.data[b]
        self.data[b] = None
        if data is None:
            data = torch.zeros(hi - lo, dtype=self.wire, device=u.device)
        elif self.pre != 1.0:
            data.div_(self.pre)
        self.reduction.post(lo, hi, data)
        self.next = b + 1

    def close(self) -> torch.Tensor:
        """At the unit's post-backward: post what is left (with the grads made outside this backward's graph task,
        zeros for grads that never came), wait, return this rank's reduced shard (wire dtype, S elements)."""
        u = self._unit()
        self.active = False
        try:
            while self.next < len(self.buckets):
                b = self.next
                for i in self.buckets[b][2]:
                    if i not in self.taken:
                        self._take(i, b, u.unsharded_params[i])
                self._post(b)
        finally:
            out = self.reduction.finish() if self.reduction is not None else None
            self.reduction, self.data = None, []
        late = self.twice + [i for i in self.bucket_of if u.unsharded_params[i].grad is not None]
        if late:
            names = ", ".join(u.label(i) for i in sorted(set(late)))
            raise RuntimeError(
                f"fully_shard: the grad of {names} was accumulated again after it was reduced in this backward "
                "(a param whose grad comes from two graph tasks, as a reentrant checkpoint makes, or a second "
                "backward through it before the unit's post-backward). Use torch.utils.checkpoint with "
                "use_reentrant=False, or set ragged_optim.sharding.grad_buckets.BUCKET_BYTES = None to reduce each "
                "unit's grads whole after its backward"
            )
        self.clean_closes += 1
        return out

    def abort(self) -> None:
        """A failed backward: finish the messages every rank posts (the rest as zeros) and drop the result."""
        if not self.active:
            return
        try:
            self.close()
        except RuntimeError:
            pass


def _hook(buckets: GradBuckets, i: int):
    ref = weakref.ref(buckets)

    def grad_ready(up: torch.Tensor) -> None:
        b = ref()
        if b is not None:
            b.grad_ready(i, up)

    return grad_ready
