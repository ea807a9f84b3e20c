"""optim.checkpoint_planners, torch.distributed.checkpoint planners for boxes: tensors written as boxes
of flat buffers (one write item per box) read back, in one process, into boxes cut another way,
straight into the views given; and the box's view DCP writes holds exactly its bytes, sharing the
buffer's memory. Compared exactly with the tensors written."""

import torch
import torch.distributed.checkpoint as dcp

from optim.checkpoint_planners import BoxLoadPlanner, BoxSavePlanner, _compact


def test_boxes_written_one_way_read_back_another(tmp_path):
    weight, vector = torch.randn(4, 6), torch.randn(5)
    flat = torch.zeros(40)  # one flat buffer holding the boxes, as a ZeRO flat group holds them
    flat[3:9], flat[10:28], flat[30:32], flat[35:38] = weight[0], weight[1:].reshape(-1), vector[:2], vector[2:]
    written = {"weight": ((4, 6), {(0, 0): flat[3:9].view(1, 6), (1, 0): flat[10:28].view(3, 6)}),
               "vector": ((5,), {(0,): flat[30:32], (2,): flat[35:38]})}
    dcp.save(written, storage_writer=dcp.FileSystemWriter(str(tmp_path)), planner=BoxSavePlanner(), no_dist=True)
    target = torch.zeros(30)
    read = {"weight": ((4, 6), {(0, 0): target[0:12].view(2, 6), (2, 0): target[12:18].view(2, 3),
                                (2, 3): target[18:24].view(2, 3)}),  # rows 2-3 cut by columns
            "vector": ((5,), {(1,): target[24:28]})}  # elements 1-4 only
    dcp.load(read, storage_reader=dcp.FileSystemReader(str(tmp_path)), planner=BoxLoadPlanner(), no_dist=True)
    assert torch.equal(target[0:12].view(2, 6), weight[:2])
    assert torch.equal(target[12:18].view(2, 3), weight[2:, :3]) and torch.equal(target[18:24].view(2, 3), weight[2:, 3:])
    assert torch.equal(target[24:28], vector[1:]) and not target[28:].any()


def test_a_box_of_a_larger_buffer_is_written_from_its_own_bytes():
    flat = torch.arange(20.0)
    view = flat[4:10].view(2, 3)
    compact = _compact(view)
    assert compact.untyped_storage().nbytes() == view.nbytes == 24
    assert torch.equal(compact, view) and compact.data_ptr() == view.data_ptr()  # the same memory, no copy
    whole = torch.arange(6.0)
    assert _compact(whole) is whole  # its storage is its bytes already
    strided = flat.view(4, 5)[:, 1]
    assert _compact(strided) is strided  # not contiguous: left to DCP
