"""Routing statistics: what the MoE layer publishes, how a step sums them, how the heatmap colours them."""

import torch
from torch import nn

from moe import MoE
from optim.monitor import LayerStats, StepStats, load_heatmap


class FakeLayer(nn.Module):
    def __init__(self, num_experts):
        super().__init__()
        self.num_experts = num_experts
        self.routing_stats = None


def _stats(l_aux, z_loss, exp_counts, kept_counts):
    return {"l_aux": torch.tensor(l_aux), "z_loss": torch.tensor(z_loss),
            "exp_counts": torch.tensor(exp_counts), "kept_counts": torch.tensor(kept_counts)}


def test_a_step_sums_counts_and_averages_losses_over_micro_batches():
    model = nn.ModuleDict({"a": FakeLayer(2), "b": FakeLayer(3)})
    stats = StepStats(model)
    assert [name for name, _ in stats.layers] == ["a", "b"]
    model["a"].routing_stats = _stats(1.0, 0.5, [3, 1], [2, 1])
    stats.collect()
    stats.add_loss(torch.tensor(2.0))
    model["a"].routing_stats = _stats(3.0, 1.5, [1, 3], [1, 2])
    stats.collect()
    stats.add_loss(torch.tensor(4.0))
    loss, layers = stats.reduce()
    assert loss == 3.0 and len(layers) == 1  # layer b never ran: left out
    a = layers[0]
    assert (a.name, a.l_aux, a.z_loss) == ("a", 2.0, 1.0)
    assert a.exp_counts.tolist() == [4.0, 4.0] and a.kept_counts.tolist() == [3.0, 3.0]
    assert a.dropped_fraction == 0.25 and a.load.tolist() == [1.0, 1.0]
    assert stats.reduce() == (None, [])  # reduce starts the next step from zero


def test_the_moe_layer_publishes_its_routing():
    torch.manual_seed(0)
    layer = MoE(8, nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), num_experts=4, k=2,
                capacity_factor=0.5, min_capacity=1)
    assert layer.routing_stats is None
    _, l_aux, exp_counts = layer(torch.randn(32, 8))
    stats = layer.routing_stats
    assert torch.equal(stats["exp_counts"], exp_counts) and int(exp_counts.sum()) == 64
    assert torch.equal(stats["l_aux"], l_aux.detach()) and torch.equal(stats["z_loss"], layer.z_loss.detach())
    kept = layer.deepspeed_moe.routing.kept_SK.sum()
    assert int(stats["kept_counts"].sum()) == int(kept) < 64  # capacity 8 per expert: some choices dropped
    assert (stats["kept_counts"] <= 8).all()


def test_heatmap_colours_balanced_white_overloaded_red_idle_blue():
    image = load_heatmap([torch.tensor([1.0, 2.0, 0.0]), torch.tensor([1.0, 1.0])], cell=2)
    assert image.shape == (4, 6, 3) and image.dtype == torch.uint8

    def pixel(row, col):
        return image[2 * row, 2 * col].tolist()

    assert pixel(0, 0) == [255, 255, 255] and pixel(0, 1) == [255, 0, 0] and pixel(0, 2) == [0, 0, 255]
    assert pixel(1, 2) == [128, 128, 128]  # the second layer has only two experts


def test_load_is_relative_to_the_mean():
    stats = LayerStats("x", 0.0, 0.0, torch.tensor([6.0, 2.0, 0.0, 0.0]), torch.tensor([4.0, 2.0, 0.0, 0.0]))
    assert stats.load.tolist() == [3.0, 1.0, 0.0, 0.0] and stats.dropped_fraction == 0.25
