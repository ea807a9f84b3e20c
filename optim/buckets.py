"""Gradient buckets: ZeRO-2's reduction during the backward, as each bucket of gradients fills.

A flat group's parameters, taken in reverse order (the order a backward produces their gradients),
are cut into buckets of at most `bucket_size` elements, whole parameters each (a parameter larger
than that is a bucket of its own). A post-accumulate-grad hook copies each gradient into its
bucket's buffer and frees it at once. When a bucket is complete, and every bucket before it has gone
out, its elements are reduced to the ranks that own them: the flat buffer's shards are contiguous
(rank r owns [r * shard, (r + 1) * shard)), so a bucket overlaps one owner's shard, or two at a
shard boundary, and gets one `dist.reduce` per owner, as DeepSpeed's stage 2 does. Every element
crosses the wire once, the same bytes as one reduce-scatter.

With `overlap` the reduces are asynchronous and run beside the rest of the backward: a bucket on
the wire is waited for, added (divided) into this rank's gradient shard, and its buffer handed to
the next bucket when that bucket takes its first gradient (the backward that computed that gradient
ran beside the reduce), or when the next bucket goes out. Buffers are reused within a micro-batch
and released at its end, so when gradients arrive in bucket order one buffer serves every bucket
and at most two buckets' worth of gradients are alive: the buffer and the gradient autograd just
handed over. Buckets go out in the same order on every rank whatever order the hooks fire in (a
complete bucket waits for the ones before it; one that fills early takes a buffer of its own), and
`finish` sends whatever is left at the end of the micro-batch: a parameter that got no gradient, on
this rank or in this backward, counts as zeros.
"""

import functools

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["GradientBuckets"]


class GradientBuckets:
    """Reduce a flat group's gradients into this rank's shard, bucket by bucket, during the backward.

    Args:
        params: the group's parameters, in flat-buffer order.
        offsets: each parameter's first element in the flat buffer.
        shard: elements per rank's shard.
        shard_out: this rank's gradient shard (fp32, or the model dtype), added into.
        group: the reduction process group, None alone.
        group_size, group_rank: its size and this rank's position.
        divisor: the sum is divided by this (the data-parallel world size).
        bucket_size: elements per bucket (at most, unless one parameter is larger; whole parameters).
        overlap: reduce asynchronously, beside the rest of the backward.
        wire_dtype: the dtype buckets are reduced in (fp32 for half-precision gradients).
    """

    def __init__(self, params: list[nn.Parameter], offsets: list[int], shard: int, shard_out: torch.Tensor, group,
                 group_size: int, group_rank: int, divisor: float, bucket_size: int, overlap: bool,
                 wire_dtype: torch.dtype):
        self.params, self.offsets, self.shard, self.shard_out = params, offsets, shard, shard_out
        self.group, self.group_size, self.group_rank = group, group_size, group_rank
        self.divisor, self.overlap, self.wire_dtype = divisor, overlap, wire_dtype
        self.buckets = _cut(params, offsets, bucket_size)  # (lo, hi, member indices), in sending order
        self.bucket_of = {i: b for b, (_, _, members) in enumerate(self.buckets) for i in members}
        self.handles = [param.register_post_accumulate_grad_hook(functools.partial(self._ready, i))
                        for i, param in enumerate(params)]
        self.largest = max((hi - lo for lo, hi, _ in self.buckets), default=0)
        self.peak_buffers = 0  # most buffer elements held at once (for tests and reports)
        self._reset()

    def _reset(self) -> None:
        self.spare: list[torch.Tensor] = []  # buffers of drained buckets, for the next ones
        self.buffers = [None] * len(self.buckets)
        self.missing = [len(members) for _, _, members in self.buckets]
        self.done = [False] * len(self.params)
        self.next = 0  # the next bucket to send
        self.in_flight = None  # (bucket index, async works)

    # 1. A gradient arrives: into its bucket, freed, and every complete bucket in order goes out.

    @torch.no_grad()
    def _ready(self, index: int, param: nn.Parameter) -> None:
        if self.done[index]:
            raise RuntimeError("a parameter got a second gradient in one micro-batch under ZeRO stage 2: call "
                               "engine.step() after each backward")
        bucket = self.bucket_of[index]
        start = self.offsets[index] - self.buckets[bucket][0]
        self._buffer(bucket)[start:start + param.numel()].copy_(param.grad.reshape(-1))
        param.grad = None
        self.done[index] = True
        self.missing[bucket] -= 1
        while self.next < len(self.buckets) and self.missing[self.next] == 0:
            self._send(self.next)
            self.next += 1

    def _buffer(self, bucket: int) -> torch.Tensor:
        """The bucket's buffer: the bucket on the wire finishes first and hands over its buffer, if any."""
        if self.buffers[bucket] is None:
            self._drain()
            lo, hi, _ = self.buckets[bucket]
            whole = self.spare.pop() if self.spare else \
                torch.empty(self.largest, dtype=self.wire_dtype, device=self.shard_out.device)
            self.buffers[bucket] = whole  # the bucket uses its first hi - lo elements
            held = self.largest * (sum(b is not None for b in self.buffers) + len(self.spare))
            self.peak_buffers = max(self.peak_buffers, held)
        return self.buffers[bucket][:self.buckets[bucket][1] - self.buckets[bucket][0]]

    def _zero_missing(self, bucket: int) -> None:
        """Zeros where a member got no gradient (the buffer holds a previous bucket's values there)."""
        lo, _, members = self.buckets[bucket]
        for index in members:
            if not self.done[index]:
                start = self.offsets[index] - lo
                self.buffers[bucket][start:start + self.params[index].numel()].zero_()

    # 2. A bucket goes out: one reduce per owner of the elements it holds.

    def _owners(self, lo: int, hi: int):
        """(owner rank, start, end) of each shard that [lo, hi) overlaps, in flat coordinates."""
        for rank in range(lo // self.shard, min((hi - 1) // self.shard, self.group_size - 1) + 1):
            yield rank, max(lo, rank * self.shard), min(hi, (rank + 1) * self.shard)

    def _send(self, bucket: int) -> None:
        self._drain()
        lo, hi, _ = self.buckets[bucket]
        buffer = self._buffer(bucket)
        self._zero_missing(bucket)
        works = []
        if self.group is not None:
            for rank, start, end in self._owners(lo, hi):
                work = dist.reduce(buffer[start - lo:end - lo], dst=dist.get_global_rank(self.group, rank),
                                   group=self.group, async_op=self.overlap)
                works.append(work)
        self.in_flight = (bucket, works)
        if not self.overlap:
            self._drain()

    def _drain(self) -> None:
        """Wait for the bucket on the wire, add this rank's part into the shard, free its buffer."""
        if self.in_flight is None:
            return
        bucket, works = self.in_flight
        for work in works:
            if work is not None:
                work.wait()
        lo, hi, _ = self.buckets[bucket]
        mine_lo, mine_hi = self.group_rank * self.shard, (self.group_rank + 1) * self.shard
        start, end = max(lo, mine_lo), min(hi, mine_hi)
        if start < end:
            part = self.buffers[bucket][start - lo:end - lo]
            self.shard_out[start - mine_lo:end - mine_lo].add_(part.div_(self.divisor))
        self.spare.append(self.buffers[bucket])
        self.buffers[bucket] = None
        self.in_flight = None

    # 3. The micro-batch ends: the rest goes out, in order, and everything is in the shard.

    @torch.no_grad()
    def finish(self) -> None:
        """Send every bucket not yet sent (gradients set by hand are taken; missing ones are zeros), then wait."""
        for index, param in enumerate(self.params):
            if not self.done[index] and param.grad is not None:
                self._ready(index, param)
        while self.next < len(self.buckets):
            self._send(self.next)
            self.next += 1
        self._drain()
        self._reset()

    def discard(self) -> None:
        """Drop what this micro-batch has gathered so far (gradients being zeroed): wait, then start over."""
        self._drain()
        self._reset()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


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
