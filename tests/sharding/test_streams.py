"""The runtime's side streams (sharding/streams.py), checked on CPU.

CPU has no streams, so the runtime normally issues plain async collectives there. These tests hand it a device
module whose streams only record what happens on them (which stream is current when each collective is issued,
what each stream waits on, which events are recorded and who waits on them) and check FSDP2's protocol: every
all-gather on the all-gather stream and every reduce-scatter (and HSDP all-reduce) on the reduce stream, a side
stream waits for the compute stream (directly or through the copy-in stream) before each collective, and the
compute stream waits for every event before the iteration ends. The training results must equal the run without
streams bit for bit: on gloo a collective waited for on its stream is just a collective waited for at once.
"""

import contextlib

import torch
import torch.distributed as dist
from fsdp_models import batch, loss_fn, make_model, shard
from torch.distributed.fsdp import MixedPrecisionPolicy

from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.sharding import CommPolicy, full_tensor, fully_shard
from ragged_optim.sharding import streams as streams_mod

_STREAM_NAMES = ("copy_in", "all_gather", "reduce")  # the order CommStreams makes them in


class _Event:
    def __init__(self, stream, n):
        self.stream, self.n, self.waited_by = stream, n, []


class _Stream:
    def __init__(self, mod, name):
        self.mod, self.name = mod, name

    def wait_stream(self, other):
        self.mod.log.append(("wait_stream", self.name, other.name))

    def record_event(self):
        e = _Event(self.name, len(self.mod.events))
        self.mod.events.append(e)
        self.mod.log.append(("record", self.name, e.n))
        return e

    def wait_event(self, e):
        e.waited_by.append(self.name)
        self.mod.log.append(("wait_event", self.name, e.n))


class RecordingStreams:
    """A device module (``torch.cuda``'s stream API) whose streams record instead of running anything."""

    def __init__(self):
        self.log, self.events, self.made = [], [], 0
        self.compute = self.cur = _Stream(self, "compute")

    def Stream(self, priority=0):  # noqa: N802 (torch.cuda.Stream)
        name = _STREAM_NAMES[self.made % 3]
        self.made += 1
        return _Stream(self, name)

    def current_stream(self):
        return self.cur

    @contextlib.contextmanager
    def stream(self, s):
        prev, self.cur = self.cur, s
        try:
            yield
        finally:
            self.cur = prev


_COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
                "all_reduce", "all_to_all_single")  # fmt: skip


@contextlib.contextmanager
def recording(mod):
    """Make the runtime's streams ``mod``'s and log each collective with the stream current when it is issued."""
    saved = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}
    saved_module = streams_mod.device_module

    def wrap(name, fn):
        def call(*a, **kw):
            mod.log.append(("collective", mod.cur.name, name))
            return fn(*a, **kw)

        return call

    try:
        streams_mod.device_module = lambda device: mod
        for n, fn in saved.items():
            setattr(dist, n, wrap(n, fn))
        yield mod
    finally:
        streams_mod.device_module = saved_module
        for n, fn in saved.items():
            setattr(dist, n, fn)


def _train(cfg: str, rec):
    kw = {}
    if cfg == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif cfg == "int8":
        kw["comm_policy"] = CommPolicy(param_all_gather="int8", grad_reduce="int8", block_size=16)
    elif cfg == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        kw["mesh"] = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    model = make_model()
    shard(model, fully_shard, **kw)  # each block and the root
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    with recording(rec) if rec is not None else contextlib.nullcontext():
        for step in range(2):
            x, y = batch(step)
            loss = loss_fn(model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        with torch.no_grad():  # an eval forward: gathers, no reduce
            losses.append(loss_fn(model, *batch(9)).item())
    return losses, [full_tensor(p) for p in model.parameters()]


def _run(rank, world_size, cfgs):
    out = {}
    for cfg in cfgs:
        plain = _train(cfg, None)
        rec = RecordingStreams()
        streamed = _train(cfg, rec)
        out[cfg] = (plain, streamed, rec.log, [(e.stream, e.waited_by) for e in rec.events])
    return out


def _check_protocol(log, events, cfg):
    ready = dict.fromkeys(_STREAM_NAMES, False)  # the stream has waited for compute since its last collective
    kinds = {"all_gather": 0, "reduce_scatter": 0}
    for entry in log:
        if entry[0] == "wait_stream":
            _, s, other = entry
            ready[s] = other == "compute" or (other == "copy_in" and ready["copy_in"])
        elif entry[0] == "collective":
            _, s, name = entry
            kind = "all_gather" if name.startswith("all_gather") else name
            kind = "reduce_scatter" if name.startswith("reduce_scatter") else kind
            if kind == "all_gather":
                assert s == "all_gather", (cfg, entry)
            elif kind == "reduce_scatter" or (kind == "all_to_all_single" and s != "compute"):  # int8: all-to-all
                assert s == "reduce", (cfg, entry)
            elif kind == "all_reduce" and s != "compute":  # HSDP's all-reduce follows the reduce-scatter
                assert s == "reduce" and cfg == "hsdp", (cfg, entry)
            if s != "compute":
                assert ready[s], f"{cfg}: {name} on the {s} stream before it waited for the compute stream"
                kinds[kind if kind in kinds else "reduce_scatter"] += 1
    # HSDP on a (2, 1) mesh shards over groups of one rank: their gathers are local copies, no collective
    gathers = kinds["all_gather"] == 0 if cfg == "hsdp" else kinds["all_gather"] > 0
    assert gathers and kinds["reduce_scatter"] > 0, (cfg, kinds)
    assert events, cfg
    for stream, waited_by in events:  # every event the compute stream waited for, before the run ended
        assert stream in ("all_gather", "reduce") and waited_by == ["compute"], (cfg, stream, waited_by)
    if cfg == "bf16":  # the mixed-precision cast runs on the copy-in stream, the all-gather after it
        assert ("wait_stream", "all_gather", "copy_in") in log
    if cfg == "hsdp":
        assert any(e[0] == "collective" and e[1] == "reduce" and e[2] == "all_reduce" for e in log)


def test_collectives_run_on_side_streams_with_fsdp2s_protocol_and_equal_results():
    """Before sharding/streams.py every collective ran on the compute stream (the all-gather on the process group's
    internal stream, waited for by blocking the compute stream), and the recording module saw none of them."""
    cfgs = ("fp32", "bf16", "int8", "hsdp")
    results = run_on_ranks(_run, 2, cfgs)
    for rank_out in results:
        for cfg in cfgs:
            (plain_losses, plain_params), (losses, params), log, events = rank_out[cfg]
            assert losses == plain_losses, cfg
            assert all(torch.equal(a, b) for a, b in zip(params, plain_params)), cfg
            _check_protocol(log, events, cfg)


def test_streams_are_off_on_cpu():
    s = streams_mod.CommStreams.for_device(torch.device("cpu"))
    assert not s.enabled and streams_mod.device_module(torch.device("meta")) is None
