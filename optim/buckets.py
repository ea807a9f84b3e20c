"""Gradient buckets: the reduction of gradients during the backward, as each bucket of gradients fills.

One `GradientBuckets` serves every stage-2 flat group of an engine (dense groups over the
data-parallel group, expert groups over their expert-data-parallel group). Each group's parameters
are cut, last first, into buckets of at most `bucket_size` elements, whole parameters each (a
parameter larger than that is a bucket of its own); all buckets go into one sending order, the
order a backward completes them (by the earliest-registered parameter each holds, latest first).
A post-accumulate-grad hook copies each gradient into its bucket's buffer and frees it at once.
When a bucket is complete, and every bucket before it in the sending order has gone out, its
elements are reduced to the ranks that own them: a flat group's shards are contiguous (rank r owns
[r * shard, (r + 1) * shard)), so a bucket overlaps one owner's shard, or two at a shard boundary,
and gets one `dist.reduce` per owner, as DeepSpeed's stage 2 does. Every element crosses the wire
once, the same bytes as one reduce-scatter.

The one sending order is what keeps ranks in step: collectives on one process group must be issued
in the same order everywhere, and dense groups share the data-parallel group. Every rank sends the
same buckets in the same order whatever order its hooks fire in; a bucket with a parameter that got
no gradient waits, with every bucket after it, until `finish` at the end of the micro-batch, where
the missing gradient counts as zeros. Ranks whose backward reaches a bucket at different points
(a parameter used on one rank and not on another) still send in the same order; as with
DistributedDataParallel, a model whose ranks use different parameters around another collective
(an expert-parallel all-to-all) can make one rank wait for another that waits in turn.

With `overlap` the reduces are asynchronous and run beside the rest of the backward: a bucket on
the wire is waited for, added (divided) into its group's gradient shard, and its buffer handed to
the next bucket when that bucket takes its first gradient (the backward that computed that gradient
ran beside the reduce), or when the next bucket goes out. Buffers are reused within a micro-batch
and released at its end, so when gradients arrive in bucket order one buffer serves every bucket
and at most two buckets' worth of gradients are alive: the buffer and the gradient autograd just
handed over. A second gradient for a parameter in one micro-batch is added in while its bucket has
not gone out (reentrant checkpointing); once every bucket has gone out, it starts a new round (a
second backward before `engine.step()`: the shards add up both); in between it is an error.

Stages 0 and 1 (`FlatShard.all_reduce`) use the same buckets on the micro-batch that ends an
accumulation window: every rank needs the whole reduced gradient, so a bucket is all-reduced and
added into the flat gradient. The earlier micro-batches of the window accumulate locally in the flat
gradient; the first time a parameter's gradient is taken in the window, that local sum goes into the
bucket with it and its place in the flat gradient is zeroed, so what comes back is added once.
"""

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["FlatShard", "GradientBuckets", "release_hooks"]

_HOOK = "_zero2_bucket_hook"  # the parameter attribute holding its hook's handle


@dataclass
class FlatShard:
    """One flat group's side of the reduction.

    Args:
        params: the group's parameters, in flat-buffer order.
        offsets: each parameter's first element in the flat buffer.
        shard: elements per rank's shard.
        shard_out: this rank's gradient shard (fp32, or the model dtype), added into.
        group: the reduction process group, None alone.
        group_size, group_rank: its size and this rank's position.
        wire_dtype: the dtype buckets are reduced in (fp32 for half-precision gradients).
        all_reduce: stages 0/1: every rank gets every element; `shard_out` is the whole flat gradient,
            which also holds the local sums of the window's earlier micro-batches.
        grads_are_views: (all-reduce mode) each .grad is its view into `shard_out` and autograd adds
            into it; a .grad that is not (set to None or replaced by hand during the window) replaces
            the local sum, as it would without buckets. Else .grad holds this backward's gradient
            alone and adds to the local sum.
    """

    params: list[nn.Parameter]
    offsets: list[int]
    shard: int
    shard_out: torch.Tensor
    group: object
    group_size: int
    group_rank: int
    wire_dtype: torch.dtype
    all_reduce: bool = False
    grads_are_views: bool = False


@dataclass
class _Bucket:
    flat: int  # which FlatShard
    lo: int
    hi: int
    members: list[int]  # parameter indices within the flat group


def release_hooks(params) -> None:
    """Remove the bucket hooks an earlier engine left on these parameters (a rebuilt engine must not
    have its gradients taken by the old one)."""
    for param in params:
        handle = getattr(param, _HOOK, None)
        if handle is not None:
            handle.remove()
            delattr(param, _HOOK)


class GradientBuckets:
    """Reduce the gradients of stage-2 flat groups into this rank's shards, bucket by bucket, in the backward.

    Args:
        flats: each flat group's side.
        position: a parameter's registration index in the model (by id); buckets are sent latest first.
        divisor: reduced gradients are divided by this (the data-parallel world size).
        bucket_size: elements per bucket (at most, unless one parameter is larger; whole parameters).
        overlap: reduce asynchronously, beside the rest of the backward.
        active: whether gradients arriving now are reduced (stages 0/1: only at the end of an
            accumulation window); None: always.
    """

    def __init__(self, flats: list[FlatShard], position: dict[int, int], divisor: float, bucket_size: int,
                 overlap: bool, active=None):
        self.flats, self.divisor, self.overlap = flats, divisor, overlap
        self.active = active or (lambda: True)
        self.taken: set[tuple[int, int]] = set()  # all-reduce mode: parameters whose local sum was taken
        buckets = [_Bucket(f, lo, hi, members) for f, flat in enumerate(flats)
                   for lo, hi, members in _cut(flat.params, flat.offsets, bucket_size)]
        first = [min(position.get(id(flats[b.flat].params[i]), 0) for i in b.members) for b in buckets]
        self.buckets = [b for _, b in sorted(zip(first, buckets), key=lambda pair: -pair[0])]
        self.bucket_of = {(b.flat, i): n for n, b in enumerate(self.buckets) for i in b.members}
        self.largest = max((b.hi - b.lo for b in self.buckets), default=0)
        self.peak_buffers = 0  # most buffer elements held at once (for tests and reports)
        for f, flat in enumerate(flats):
            release_hooks(flat.params)
            for i, param in enumerate(flat.params):
                setattr(param, _HOOK, param.register_post_accumulate_grad_hook(functools.partial(self._ready, f, i)))
        self._reset()

    def _reset(self) -> None:
        self.spare: dict[torch.dtype, list[torch.Tensor]] = {}  # buffers of drained buckets, for the next ones
        self.buffers = [None] * len(self.buckets)
        self.missing = [len(b.members) for b in self.buckets]
        self.done = {(b.flat, i): False for b in self.buckets for i in b.members}
        self.next = 0  # the next bucket to send
        self.in_flight = None  # (bucket index, async works)

    # 1. A gradient arrives: into its bucket, freed, and every complete bucket in order goes out.

    @torch.no_grad()
    def _ready(self, flat: int, index: int, param: nn.Parameter) -> None:
        if not self.active():
            return
        n = self.bucket_of[(flat, index)]
        bucket = self.buckets[n]
        if self.done[(flat, index)] and n < self.next:
            if self.next < len(self.buckets):
                raise RuntimeError(
                    f"a parameter of shape {list(param.shape)} got a second gradient in one micro-batch after its "
                    "gradient bucket had been reduced, while an earlier bucket still waits for a parameter that got no "
                    "gradient: call engine.step() after each backward, or raise zero_optimization.reduce_bucket_size")
            self._drain()  # every bucket went out: another backward in this micro-batch starts a new round
            self._reset()
        start = self.flats[flat].offsets[index] - bucket.lo
        view = self._buffer(n)[start:start + param.numel()]
        if self.done[(flat, index)]:
            view.add_(param.grad.reshape(-1))
        else:
            local = self._take_local(flat, index)
            if local is None:
                view.copy_(param.grad.reshape(-1))
            elif param.grad.data_ptr() == local.data_ptr():  # the gradient is the flat gradient's view
                view.copy_(local)
            elif self.flats[flat].grads_are_views:  # .grad was replaced by hand: it replaces the local sum
                view.copy_(param.grad.reshape(-1))
            else:
                torch.add(local, param.grad.reshape(-1), out=view)
            if local is not None:
                local.zero_()
            self.done[(flat, index)] = True
            self.missing[n] -= 1
        param.grad = None
        while self.next < len(self.buckets) and self.missing[self.next] == 0:
            self._send(self.next)
            self.next += 1

    def _buffer(self, n: int) -> torch.Tensor:
        """The bucket's buffer: the bucket on the wire finishes first and hands over its buffer, if any."""
        if self.buffers[n] is None:
            self._drain()
            flat = self.flats[self.buckets[n].flat]
            pool = self.spare.setdefault(flat.wire_dtype, [])
            self.buffers[n] = pool.pop() if pool else \
                torch.empty(self.largest, dtype=flat.wire_dtype, device=flat.shard_out.device)
            held = self.largest * (sum(b is not None for b in self.buffers) + sum(map(len, self.spare.values())))
            self.peak_buffers = max(self.peak_buffers, held)
        bucket = self.buckets[n]
        return self.buffers[n][:bucket.hi - bucket.lo]  # a bucket uses the first hi - lo elements

    def _take_local(self, flat: int, index: int) -> torch.Tensor | None:
        """All-reduce mode: the parameter's place in the flat gradient if its local sum is still to be sent."""
        shard = self.flats[flat]
        if not shard.all_reduce or (flat, index) in self.taken:
            return None
        self.taken.add((flat, index))
        start = shard.offsets[index]
        return shard.shard_out[start:start + shard.params[index].numel()]

    def _fill_missing(self, n: int) -> None:
        """Where a member got no gradient: its local sum (all-reduce mode) or zeros (the buffer holds an
        earlier bucket's values there)."""
        bucket = self.buckets[n]
        flat = self.flats[bucket.flat]
        for index in bucket.members:
            if not self.done[(bucket.flat, index)]:
                start = flat.offsets[index] - bucket.lo
                part = self.buffers[n][start:start + flat.params[index].numel()]
                local = self._take_local(bucket.flat, index)
                if flat.grads_are_views and local is not None and flat.params[index].grad is None:
                    local.zero_()  # .grad set to None during the window: its local sum is dropped
                if local is None:
                    part.zero_()
                else:
                    part.copy_(local)
                    local.zero_()

    # 2. A bucket goes out: one reduce per owner of the elements it holds.

    def _send(self, n: int) -> None:
        self._drain()
        bucket = self.buckets[n]
        flat = self.flats[bucket.flat]
        buffer = self._buffer(n)
        self._fill_missing(n)
        works = []
        if flat.all_reduce and flat.group is not None:
            works.append(dist.all_reduce(buffer, group=flat.group, async_op=self.overlap))
        elif flat.group is not None:
            for rank, start, end in _owners(bucket.lo, bucket.hi, flat.shard, flat.group_size):
                works.append(dist.reduce(buffer[start - bucket.lo:end - bucket.lo],
                                         dst=dist.get_global_rank(flat.group, rank), group=flat.group,
                                         async_op=self.overlap))
        self.in_flight = (n, works)
        if not self.overlap:
            self._drain()

    def _drain(self) -> None:
        """Wait for the bucket on the wire, add this rank's part into its shard, keep its buffer for the next."""
        if self.in_flight is None:
            return
        n, works = self.in_flight
        for work in works:
            if work is not None:
                work.wait()
        bucket = self.buckets[n]
        flat = self.flats[bucket.flat]
        mine_lo = 0 if flat.all_reduce else flat.group_rank * flat.shard
        start, end = max(bucket.lo, mine_lo), min(bucket.hi, mine_lo + flat.shard)
        if start < end:
            part = self.buffers[n][start - bucket.lo:end - bucket.lo]
            flat.shard_out[start - mine_lo:end - mine_lo].add_(part.div_(self.divisor))
        self.spare.setdefault(flat.wire_dtype, []).append(self.buffers[n])
        self.buffers[n] = None
        self.in_flight = None

    # 3. The micro-batch ends: the rest goes out, in order, and everything is in the shards.

    @torch.no_grad()
    def finish(self) -> None:
        """Send every bucket not yet sent (gradients set by hand are taken; missing ones are zeros), then wait."""
        for (flat, index), done in list(self.done.items()):
            param = self.flats[flat].params[index]
            if not done and param.grad is not None:
                self._ready(flat, index, param)
        while self.next < len(self.buckets):
            self._send(self.next)
            self.next += 1
        self._drain()
        self._reset()

    def discard(self) -> None:
        """Drop what this micro-batch has gathered so far (gradients being zeroed): wait, then start over."""
        self._drain()
        self._reset()
        self.taken.clear()  # the flat gradients are zeroed: a new accumulation window begins


def _owners(lo: int, hi: int, shard: int, group_size: int):
    """(owner rank, start, end) of each shard that [lo, hi) overlaps, in flat coordinates."""
    for rank in range(lo // shard, min((hi - 1) // shard, group_size - 1) + 1):
        yield rank, max(lo, rank * shard), min(hi, (rank + 1) * shard)


def _cut(params: list[nn.Parameter], offsets: list[int], bucket_size: int) -> list[tuple[int, int, list[int]]]:
    """Buckets of whole parameters, last parameter first, each of at most bucket_size elements (a larger
    parameter alone); each is a contiguous range [lo, hi) of the flat buffer."""
    buckets, members, size = [], [], 0
    for index in reversed(range(len(params))):
        numel = params[index].numel()
        if members and size + numel > bucket_size:
            buckets.append(members)
            members, size = [], 0
        members.append(index)
        size += numel
    if members:
        buckets.append(members)
    return [(offsets[m[-1]], offsets[m[0]] + params[m[0]].numel(), m) for m in buckets]
