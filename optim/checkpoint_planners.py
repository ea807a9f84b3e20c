"""torch.distributed.checkpoint planners for `optim.checkpoint`'s boxes: one write item per box a rank
holds, and reads of whatever stored chunks overlap the boxes a rank needs.

A module of its own so that DCP is imported only when a checkpoint is written or read (see
`optim.checkpoint._dcp`).
"""

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

__all__ = ["BoxLoadPlanner", "BoxSavePlanner"]


class BoxSavePlanner(DefaultSavePlanner):
    """Plans one DCP write item per box a rank holds (the state dict handed to dcp.save is a Boxes)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, (size, views) in self.state_dict.items():
            for offsets, view in views.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=view.shape)
                data = TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(view),
                                       size=torch.Size(size))
                items.append(WriteItem(index=MetadataIndex(key, offsets), type=WriteItemType.SHARD, tensor_data=data))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        return _compact(self.state_dict[index.fqn][1][tuple(index.offset)])


_SAME_SIZE_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _compact(view: torch.Tensor) -> torch.Tensor:
    """A contiguous host view as a tensor whose storage is exactly its bytes, sharing its memory.

    DCP's file writer copies every tensor whose storage is larger than itself (a box of a flat ZeRO
    buffer) and holds each copy until the file is written, which would add up to this rank's whole
    share; through numpy the box gets a storage of its own size and nothing is copied.
    """
    if view.device.type != "cpu" or not view.is_contiguous() or view.untyped_storage().nbytes() == view.nbytes:
        return view
    bits = _SAME_SIZE_INTEGER.get(view.element_size())
    if bits is None:
        return view
    return torch.from_numpy(view.detach().view(bits).numpy()).view(view.dtype)


class BoxLoadPlanner(DefaultLoadPlanner):
    """Reads, for each box a rank needs, the overlapping parts of whatever chunks the checkpoint holds,
    straight into the box's view."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        requests = []
        for key, (_, views) in self.state_dict.items():
            chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=v.shape) for o, v in views.items()]
            requests += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], chunks)
        return LoadPlan(requests)

    def resolve_tensor(self, read_item):
        view = self.state_dict[read_item.dest_index.fqn][1][tuple(read_item.dest_index.offset)]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view
