"""Forward passes on fake CUDA tensors (FakeTensorMode): the CUDA branches by device, not by a switch.

Under FakeTensorMode tensors on "cuda" carry shapes and a device but no values: a CUDA tensor meeting
a CPU tensor raises (torch 2.13's FakeTensorDeviceMismatchError, torch 2.11's RuntimeError naming
both devices), and a host read raises. On this CPU-only build
autograd and random initialisation on fake CUDA abort, so this tier runs forward passes under
no_grad, with the model made on meta and materialised on the fake device. Python slicing and
tensor indexing (`x[1:]`, `x[idx]`) also reach the device guard there, so the forward path uses
narrow, select, index_select, take and scatter, which fake CUDA runs.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch import nn

from moe import MoE
from recipes import gpt
from recipes.gpt_model import GPT

CUDA = torch.device("cuda")


def _on_fake_cuda(build, dtype=torch.float32):
    """The model made on meta, its parameters and buffers replaced by fake CUDA tensors without grad
    (autograd on fake CUDA aborts this CPU-only build)."""
    with torch.device("meta"):
        model = build()
    mode = FakeTensorMode()
    with mode:
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None:
                    fake = torch.empty(param.shape, dtype=dtype, device=CUDA)
                    module._parameters[name] = nn.Parameter(fake, requires_grad=False)
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=CUDA)
    return model, mode


@pytest.mark.parametrize("compute, kwargs", [("padded", {}), ("grouped", {}), ("grouped", dict(dropless=True)),
                                             ("padded", dict(k=1)), ("auto", dict(k=3))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_layer_forward_on_fake_cuda(compute, kwargs, dtype):
    options = {"num_experts": 8, "k": 2, "min_capacity": 0, "expert_layout": compute, **kwargs}
    layer, mode = _on_fake_cuda(lambda: MoE(32, nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 32)), **options),
                                dtype)
    with mode, torch.no_grad():
        x = torch.empty(2, 40, 32, device=CUDA, dtype=dtype)
        out, l_aux, counts = layer(x)
    assert out.shape == x.shape and out.device.type == "cuda" and out.dtype == dtype
    assert l_aux.device.type == "cuda" and counts.device.type == "cuda"
    assert layer.deepspeed_moe.routing.weight_SK.dtype == torch.float32  # the router stays fp32


def test_gpt_forward_on_fake_cuda():
    cfg = gpt.TrainConfig(n_layer=2, n_head=2, n_embd=32, ffn=64, seq_len=16, num_experts=4, top_k=2)
    model, mode = _on_fake_cuda(lambda: GPT(gpt.model_config(cfg)))
    with mode, torch.no_grad():
        logits, l_aux, z_loss = model(torch.empty(2, 16, dtype=torch.long, device=CUDA))
    assert logits.shape == (2, 16, 256) and logits.device.type == "cuda"


def test_a_cpu_tensor_meeting_fake_cuda_is_caught():
    from torch._subclasses import fake_tensor

    # torch 2.13 has an error class of its own; torch 2.11 raises a RuntimeError with "two different devices"
    error = getattr(fake_tensor, "FakeTensorDeviceMismatchError", RuntimeError)
    layer, mode = _on_fake_cuda(lambda: MoE(8, nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), num_experts=2))
    with mode, torch.no_grad(), pytest.raises(error, match=r"two (different )?devices,? cuda(:0)?(,| and) cpu"):
        layer(torch.empty(4, 8, device=CUDA) + torch.ones(4, 8, device="cpu"))
