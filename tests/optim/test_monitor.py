"""Routing statistics: what the MoE layer publishes, how a step sums them, how the heatmap colours them,
and what TensorBoard gets: the labelled figure and each expert's load."""

import numpy as np
import torch
from torch import nn

from moe import MoE
from optim.figure import BACKGROUND, expert_load_figure, load_colours, text_image
from optim.monitor import LayerStats, Monitor, StepStats, load_heatmap


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


def test_max_vio_is_the_largest_load_over_the_mean_minus_one():
    stats = LayerStats("x", 0.0, 0.0, torch.tensor([6.0, 2.0, 0.0, 0.0]), torch.tensor([4.0, 2.0, 0.0, 0.0]))
    assert stats.max_vio == 6.0 / 2.0 - 1.0
    even = LayerStats("y", 0.0, 0.0, torch.tensor([3.0, 3.0]), torch.tensor([3.0, 3.0]))
    idle = LayerStats("z", 0.0, 0.0, torch.zeros(2), torch.zeros(2))
    assert even.max_vio == 0.0 and idle.max_vio == 0.0


def test_the_scalars_read_in_python_equal_the_tensor_formulas():
    """max_vio, dropped_fraction and max_load come from the counts as Python floats; whole counts give
    the tensors' own values, bit for bit."""
    generator = torch.Generator().manual_seed(0)
    for experts in (1, 3, 8, 64):
        exp = torch.randint(0, 5000, (experts,), generator=generator).double()
        kept = torch.minimum(exp, torch.full_like(exp, 1200.0))
        stats = LayerStats("x", 0.0, 0.0, exp, kept)
        assert stats.max_vio == float(exp.max()) / float(exp.mean()) - 1.0
        assert stats.dropped_fraction == 1.0 - float(kept.sum()) / float(exp.sum())
        assert stats.max_load == float(stats.load.max()) == float((exp * (experts / exp.sum())).max())
    idle = LayerStats("z", 0.0, 0.0, torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64))
    assert idle.max_load == float(idle.load.max()) == 1.0 and idle.dropped_fraction == 0.0


def test_the_bias_range_is_read_after_the_step():
    model = nn.ModuleDict({"a": FakeLayer(2), "b": FakeLayer(3)})
    model["a"].expert_bias = torch.tensor([-0.25, 0.5])
    model["b"].expert_bias = None
    stats = StepStats(model)
    model["a"].routing_stats = _stats(1.0, 0.5, [3, 1], [2, 1])
    model["b"].routing_stats = _stats(1.0, 0.5, [3, 1, 2], [2, 1, 2])
    stats.collect()
    model["a"].expert_bias += 0.25  # the update after the optimizer step
    _, (a, b) = stats.reduce()
    assert a.bias_range == (0.0, 0.75) and b.bias_range is None


def test_engine_advances_the_bias_and_writes_max_vio_and_bias_to_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from optim import initialize

    torch.manual_seed(0)
    layer = MoE(8, nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), num_experts=4, k=2,
                scoring_func="sigmoid", bias_update_speed=0.01, load_balancing_type="none", drop_tokens=False)
    engine, *_ = initialize(layer, config={
        "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "run"}})
    gate = layer.deepspeed_moe.gate
    counts = torch.zeros(4, dtype=torch.int64)
    for micro in range(2):
        out, _, exp_counts = engine(torch.randn(8, 8))
        counts += exp_counts
        engine.backward(out.square().mean())
        if micro == 0:
            assert torch.equal(gate.expert_bias, torch.zeros(4)), "no update inside the accumulation"
        engine.step()
    expected = 0.01 * torch.sign(counts.double().mean() - counts.double()).float()
    torch.testing.assert_close(gate.expert_bias, expected, rtol=0, atol=1e-7)
    (stats,) = engine.last_routing_stats
    assert stats.exp_counts.tolist() == counts.double().tolist()
    assert stats.bias_range == (float(expected.min()), float(expected.max()))
    engine.monitor.flush()
    board = EventAccumulator(str(tmp_path / "run"))
    board.Reload()
    tags = set(board.Tags()["scalars"])
    assert {"MoE/max_vio", "MoE//max_vio", "MoE//bias_min", "MoE//bias_max"} <= tags, tags
    value = board.Scalars("MoE/max_vio")[0].value
    assert abs(value - (float(counts.max()) / float(counts.double().mean()) - 1)) < 1e-6


def test_text_is_drawn_in_the_built_in_font():
    one, two = text_image("1"), text_image("expert 0")
    assert one.shape == (10, 6) and one.any() and two.shape == (10, 8 * 8 - 2)
    assert np.array_equal(text_image("moe"), text_image("MOE"))  # lower case drawn in capitals
    assert not np.array_equal(text_image("0"), text_image("8"))


def _ink(region):
    """Whether a part of the figure holds anything but the page colour."""
    return bool((region != BACKGROUND).any())


def test_the_figure_names_layers_and_experts_and_has_a_colour_bar():
    small = expert_load_figure(["blocks.0.ffn", "blocks.1.ffn"], [[1.0, 2.0, 0.0, 1.0]] * 2, step=120)
    assert small.dtype == np.uint8 and small.shape[2] == 3
    more_layers = expert_load_figure(["blocks.0.ffn", "blocks.1.ffn", "blocks.2.ffn"], [[1.0] * 4] * 3, step=120)
    more_experts = expert_load_figure(["blocks.0.ffn", "blocks.1.ffn"], [[1.0] * 16] * 2, step=120)
    assert more_layers.shape[0] > small.shape[0] and more_layers.shape[1] == small.shape[1]
    assert more_experts.shape[1] > small.shape[1] and more_experts.shape[0] == small.shape[0]

    # the cells: the over-loaded expert's red and the idle expert's blue, once per layer
    red, blue = load_colours(2.0).tolist(), load_colours(0.0).tolist()
    rows_red = np.nonzero((small == red).all(axis=2).any(axis=1))[0]
    assert len(rows_red) > 0
    # the colour bar: one row that runs from blue through white to red, left to right, under the cells
    bar_rows = [y for y in range(small.shape[0]) if (small[y] == blue).all(axis=1).any()
                and (small[y] == red).all(axis=1).any() and (small[y] == [255, 255, 255]).all(axis=1).any()]
    bar = [y for y in bar_rows if (np.nonzero((small[y] == blue).all(axis=1))[0].max()
                                   < np.nonzero((small[y] == red).all(axis=1))[0].min())]
    cell_rows = [y for y in rows_red if y not in bar]
    assert len(bar) == 10 and max(bar) - min(bar) == 9 and min(bar) > max(cell_rows), "no colour bar under the cells"
    # the labels: ink left of the cells (layer names), above them (title, expert ids) and under the bar (ticks)
    cells = np.nonzero((small == red).all(axis=2))
    top, left = cells[0].min(), cells[1].min() - 1
    assert _ink(small[top:top + 10, :left - 8])  # the first layer's name
    assert _ink(small[:top - 2, :])  # title and expert ids
    assert _ink(small[max(bar) + 1:, :])  # the scale's ticks
    # the step is in the title: another step draws another top line, the rest is the same picture
    other = expert_load_figure(["blocks.0.ffn", "blocks.1.ffn"], [[1.0, 2.0, 0.0, 1.0]] * 2, step=130)
    assert not np.array_equal(other[:20], small[:20]) and np.array_equal(other[20:], small[20:])


def test_each_experts_load_is_a_scalar_as_a_fraction_of_the_mean_and_charted_per_layer(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    collapsed = LayerStats("blocks.1.ffn", 0.0, 0.0, torch.tensor([30.0, 10.0, 0.0, 0.0]),
                           torch.tensor([30.0, 10.0, 0.0, 0.0]))
    even = LayerStats("blocks.3.ffn", 0.0, 0.0, torch.tensor([5.0, 5.0]), torch.tensor([5.0, 5.0]))
    assert collapsed.loads == collapsed.load.tolist() == [3.0, 1.0, 0.0, 0.0]
    monitor = Monitor(str(tmp_path))
    monitor.train_step(1, 8, 1e-3, 1.0, 0.1, 8, 2.0, [collapsed, even])
    monitor.routing(2, [even, collapsed], pictures=False)
    monitor.flush()
    board = EventAccumulator(str(tmp_path))
    board.Reload()
    values = {tag: [e.value for e in board.Scalars(tag)] for tag in board.Tags()["scalars"] if "/expert_load/" in tag}
    assert values == {"MoE/blocks.1.ffn/expert_load/0": [3.0, 3.0], "MoE/blocks.1.ffn/expert_load/1": [1.0, 1.0],
                      "MoE/blocks.1.ffn/expert_load/2": [0.0, 0.0], "MoE/blocks.1.ffn/expert_load/3": [0.0, 0.0],
                      "MoE/blocks.3.ffn/expert_load/0": [1.0, 1.0], "MoE/blocks.3.ffn/expert_load/1": [1.0, 1.0]}
    assert board.Tags()["images"] == ["MoE/expert_load"]
    assert board.Tags()["histograms"] == ["MoE/blocks.1.ffn/expert_load", "MoE/blocks.3.ffn/expert_load"]
    monitor.close()
    from tensorboard.plugins.custom_scalar import layout_pb2

    (config,) = board.Tensors("custom_scalars__config__")  # written once, with the first routing
    layout = layout_pb2.Layout.FromString(config.tensor_proto.string_val[0])
    (category,) = layout.category
    charts = {chart.title: list(chart.multiline.tag) for chart in category.chart}
    assert charts == {"blocks.1.ffn": [r"^MoE/blocks\.1\.ffn/expert_load/\d+$"],
                      "blocks.3.ffn": [r"^MoE/blocks\.3\.ffn/expert_load/\d+$"]}
