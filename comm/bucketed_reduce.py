"""A reduce-scatter of one flat buffer posted in buckets while the buffer is still being produced (a unit's grads
as the backward makes them), as point-to-point messages on a gloo group of CPU ranks.

Each rank posts the same buckets (flat ranges ``[lo, hi)`` of the ``W*S`` input) in the same order; a bucket's
slice for rank k goes to rank k as it is posted, and a worker thread on rank k sums the W slices of its own range
in rank order into a part of its own (this bucket's share of the S-element output) as they arrive, then lets the
bucket go; :meth:`BucketedReduceScatter.finish` lays the parts out in the output. So while the backward runs a rank
holds only the shares summed so far, not a whole shard, beside the bucket being summed. The sum is the one
``reduce_scatter_p2p`` makes (``((x_0 + x_1) + x_2) + ...``), so bucketing changes no bit of the result. Posting
never blocks; :meth:`BucketedReduceScatter.finish` waits for everything, where a whole-buffer reduce-scatter would
have, and :meth:`~BucketedReduceScatter.wait_summed` lets a caller wait, bounded, for the buckets posted so far.
"""

from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist

from ragged_optim.comm import counter
from ragged_optim.comm.collectives import sum_in_rank_order

#: Tags of bucket messages: this base plus the reduction's own index, so two reductions in flight at once (a root
#: unit's and a block's) never take each other's messages, whatever order their buckets interleave in.
BUCKET_TAG_BASE = 0x52420000

#: Elements per message: a rank's share of a bucket is sent and summed in chunks of at most this many, so a receive
#: buffer is at most one chunk (a large param's share can be a whole shard). Each message costs a wait for a peer,
#: which is why only the units at the backward's peak use buckets (``grad_buckets.ONLY_AT_PEAK``).
CHUNK = 1 << 16


class BucketedReduceScatter:
    """This rank's range (``shard`` elements of ``dtype``) of the sum over ranks of the buckets posted with
    :meth:`post`, zeros where no bucket reached. While a bucket is summed, one receive buffer of at most ``CHUNK``
    elements lives beside the shares summed so far."""

    def __init__(self, shard: int, dtype: torch.dtype, device, group, tag_index: int):
        self.dtype, self.device, self.group = dtype, device, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.shard = shard
        self.parts: list[tuple[int, torch.Tensor]] = []  # (start in the shard, the summed share of one bucket)
        self.tag = BUCKET_TAG_BASE + tag_index
        self.posted = self.summed = 0  # buckets posted, and summed here and received everywhere
        self.in_flight_bytes = 0  # of the buckets posted and not yet summed
        self._progress = threading.Condition()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._sum_buckets, name="ragged_optim-bucket-reduce", daemon=True)
        self._thread.start()

    def post(self, lo: int, hi: int, data: torch.Tensor) -> None:
        """This rank's contribution to flat elements ``[lo, hi)`` (``data``: hi - lo elements of ``out``'s dtype,
        kept until every rank has received its slice)."""
        sends = []
        for k in range(self.world):
            a, b = max(lo, k * self.shard), min(hi, (k + 1) * self.shard)
            for c in range(a, b, CHUNK) if k != self.rank else ():
                piece = data[c - lo : min(b, c + CHUNK) - lo]
                sends.append(dist.isend(piece, group=self.group, group_dst=k, tag=self.tag))
        a, b = max(lo, self.rank * self.shard), min(hi, (self.rank + 1) * self.shard)
        with self._progress:
            self.posted += 1
            self.in_flight_bytes += data.nbytes
        self._queue.put((data[a - lo : b - lo] if a < b else None, a - self.rank * self.shard, sends, data.nbytes))

    def _sum_buckets(self) -> None:
        with torch.no_grad():
            while (item := self._queue.get()) is not None:
                own, start, sends, nbytes = item
                try:
                    if own is not None and self._error is None:
                        part = torch.empty(own.numel(), dtype=self.dtype, device=self.device)
                        # chunk by chunk, one receive buffer: the bytes in flight bound the backward's peak
                        for c in range(0, own.numel(), CHUNK):
                            out = part[c : c + CHUNK]
                            sum_in_rank_order(out, own[c : c + CHUNK], self.rank, self.world, self._receive, ahead=1)
                        self.parts.append((start, part))
                        del part, out
                    while sends:
                        sends.pop().wait()
                except BaseException as e:  # raised by finish(), on the thread that posted
                    self._error = self._error or e
                del own, sends, item  # the bucket's data goes as soon as it is summed and sent (a send's
                # work holds its tensor: no loop variable may keep one)
                with self._progress:
                    self.summed += 1
                    self.in_flight_bytes -= nbytes
                    self._progress.notify_all()

    def _receive(self, buf: torch.Tensor, src: int):
        return dist.irecv(buf, group=self.group, group_src=src, tag=self.tag)

    def wait_summed(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until every bucket posted so far is summed here and received
        everywhere, so its bytes are gone; False when the time ran out (nothing is cancelled)."""
        with self._progress:
            return self._progress.wait_for(lambda: self.summed >= self.posted, timeout=timeout)

    def finish(self) -> torch.Tensor:
        """Wait until every posted bucket is summed here and received by every other rank; returns this rank's
        reduced shard. Counted by ``count_collectives`` as one reduce-scatter of the whole W*S input, as the
        collective it is."""
        self._queue.put(None)
        self._thread.join()
        out = torch.zeros(self.shard, dtype=self.dtype, device=self.device)
        counter.note("reduce_scatter", self.world * self.shard * out.element_size())
        if self._error is not None:
            self.parts = []
            raise self._error
        for start, part in self.parts:
            out[start : start + part.numel()].copy_(part)
        self.parts = []
        return out
