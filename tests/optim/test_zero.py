"""optim.zero's bookkeeping, checked by hand: the row-major boxes that cover a flat range of a tensor,
the dimension `shard_placement` gives fully_shard, and the records `describe_parameters` keeps per
trainable parameter (expert or dense, its checkpoint keys, its pieces per global expert). The units
themselves step in test_stages.py and test_precision.py."""

import math

import pytest
import torch
from torch import nn

from optim.zero import describe_parameters, row_major_boxes, shard_placement
from parallel import tag_expert_ids, tag_expert_parameters


def test_row_major_boxes_by_hand():
    # elements 2 ... 9 of a [3, 4] tensor: the end of row 0, row 1 whole, the start of row 2
    assert row_major_boxes((3, 4), 2, 10) == [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 2))]
    assert row_major_boxes((3, 4), 4, 12) == [((1, 0), (2, 4))]
    assert row_major_boxes((3, 4), 5, 5) == [] and row_major_boxes((3, 4), 6, 2) == []
    assert row_major_boxes((), 0, 1) == [((), ())]


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 5), (4, 1, 3)])
def test_row_major_boxes_cover_exactly_the_range_in_order(shape):
    numel = math.prod(shape)
    index = torch.arange(numel).view(shape)
    for start in range(numel + 1):
        for stop in range(start, numel + 1):
            covered = []
            for offsets, sizes in row_major_boxes(shape, start, stop):
                box = index[tuple(slice(o, o + z) for o, z in zip(offsets, sizes))]
                assert box.is_contiguous()  # each box is one run of memory
                covered += box.reshape(-1).tolist()
            assert covered == list(range(start, stop)), (start, stop)


def test_shard_placement_takes_the_first_dimension_the_size_divides():
    place = shard_placement(4)
    assert place(torch.zeros(5, 8)).dim == 1  # dim 0 would leave 2, 2, 1, 0 rows
    assert place(torch.zeros(8, 5)).dim == 0
    assert place(torch.zeros(5, 3)).dim == 0  # none divides: fully_shard pads dim 0
    assert place(torch.zeros(3, 5, 12)).dim == 2
    assert place(torch.zeros(())).dim == 0


def test_describe_parameters_records_experts_their_ids_and_checkpoint_keys():
    model = nn.ModuleDict({"dense": nn.Linear(2, 3), "frozen": nn.Linear(2, 2)})
    model.frozen.requires_grad_(False)
    model.stacked = nn.Parameter(torch.arange(12.0).view(2, 3, 2))  # two experts stacked on dim 0
    model.single = nn.Parameter(torch.zeros(4))  # one expert, renamed to its global id
    model.untracked = nn.Parameter(torch.zeros(2))  # tagged by hand, without ids
    tag_expert_parameters([model.stacked, model.single, model.untracked], "ep_size_2", True)
    tag_expert_ids(model.stacked, (4, 5), 0)
    tag_expert_ids(model.single, (3,), None, "single", "expert3")
    infos = {info.name: info for info in describe_parameters(model, lambda param: 1).values()}
    assert sorted(infos) == ["dense.bias", "dense.weight", "single", "stacked", "untracked"]  # trainable only
    dense, stacked = infos["dense.weight"], infos["stacked"]
    assert not dense.expert and dense.group_name is None and dense.keys() == ["dense.weight"]
    assert stacked.expert and stacked.group_name == "ep_size_2" and stacked.data_before_expert
    assert stacked.keys() == ["stacked#expert4", "stacked#expert5"]
    pieces = stacked.split(model.stacked.detach())
    assert [p.tolist() for p in pieces] == [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9], [10, 11]]]
    assert torch.equal(stacked.join(pieces), model.stacked.detach())
    assert infos["single"].keys() == ["expert3"] and infos["single"].axis is None
    assert infos["untracked"].keys() == ["untracked@ep_rank1"]
