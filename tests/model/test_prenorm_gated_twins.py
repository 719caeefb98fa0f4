"""The twins of ModernBERT's two new op forms against transformers' own modules (random weights, float64): the gated
MLP (bias_gelu_torch(gated=True), then Wo, is ModernBertMLP) and the pre-norm residual + LayerNorm without bias
(residual_layernorm_torch(pre_norm=True) is the layer's `x + attn.Wo(ctx)` and its `mlp_norm` of that). The kernels
are checked against these twins in tests/kernels."""
import pytest
import torch
import torch.nn.functional as F

from fastbert import ops, twins

transformers = pytest.importorskip("transformers")
from transformers.models.modernbert import modeling_modernbert  # noqa: E402

TOL64 = 1e-12


def config(**overrides):
    base = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_hidden_layers=2,
                hidden_activation="gelu", vocab_size=50)
    return transformers.ModernBertConfig(**{**base, **overrides})


def randomised(module, seed=0):
    """Every parameter drawn N(0, 0.3) (LayerNorm weights around 1), in float64."""
    g = torch.Generator().manual_seed(seed)
    module = module.double().eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3 + (1.0 if "norm" in name else 0.0))
    return module


@pytest.mark.parametrize("workspace", [False, True], ids=["fresh", "workspace"])
@pytest.mark.parametrize("mlp_bias", [False, True])
@pytest.mark.parametrize("hidden_activation", ["gelu", "gelu_pytorch_tanh"])
def test_gated_twin_is_modernbert_mlp(mlp_bias, hidden_activation, workspace):
    cfg = config(mlp_bias=mlp_bias, hidden_activation=hidden_activation)
    mlp = randomised(modeling_modernbert.ModernBertMLP(cfg))
    assert mlp.Wi.weight.shape == (2 * cfg.intermediate_size, cfg.hidden_size)
    x = torch.randn(11, cfg.hidden_size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        want = mlp(x)
        ws = twins.Workspace() if workspace else None
        h = ops.bias_gelu_torch(x, mlp.Wi.weight, mlp.Wi.bias, ops.ACTIVATIONS[hidden_activation], gated=True,
                                workspace=ws)
        got = F.linear(h, mlp.Wo.weight, mlp.Wo.bias)
        if ws is not None:  # written into the workspace, and exactly what the allocating twin computes
            assert h.data_ptr() == ws.take("gated", h.shape, h).data_ptr()
            assert torch.equal(h, ops.bias_gelu_torch(x, mlp.Wi.weight, mlp.Wi.bias,
                                                      ops.ACTIVATIONS[hidden_activation], gated=True))
    assert h.shape == (11, cfg.intermediate_size)
    assert (got - want).abs().max().item() <= TOL64


@pytest.mark.parametrize("workspace", [False, True], ids=["fresh", "workspace"])
@pytest.mark.parametrize("norm_bias", [False, True])
def test_pre_norm_twin_is_the_layers_residual_and_mlp_norm(norm_bias, workspace):
    """ModernBertEncoderLayer: s = x + attn.Wo(ctx) (the stream), then mlp_norm(s) (a LayerNorm, bias per config)
    is what the MLP reads; the twin returns both. The MLP's half of the layer, built on them, matches too."""
    cfg = config(norm_bias=norm_bias)
    layer = randomised(modeling_modernbert.ModernBertEncoderLayer(cfg, layer_idx=1))
    norm = layer.mlp_norm
    assert (norm.bias is None) == (not norm_bias)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, cfg.hidden_size, generator=g, dtype=torch.float64)
    ctx = torch.randn(9, cfg.hidden_size, generator=g, dtype=torch.float64)
    with torch.no_grad():
        want_s = x + layer.attn.Wo(ctx)
        want_normed = norm(want_s)
        ws = twins.Workspace() if workspace else None
        s, normed = ops.residual_layernorm_torch(ctx, layer.attn.Wo.weight, layer.attn.Wo.bias, x, norm.weight,
                                                 norm.bias, norm.eps, pre_norm=True, workspace=ws)
        if ws is not None:  # the stream is the workspace's buffer, and exactly what the allocating twin computes
            assert s.data_ptr() == ws.take("stream", s.shape, s).data_ptr()
            fresh = ops.residual_layernorm_torch(ctx, layer.attn.Wo.weight, layer.attn.Wo.bias, x, norm.weight,
                                                 norm.bias, norm.eps, pre_norm=True)
            assert torch.equal(s, fresh[0]) and torch.equal(normed, fresh[1])
        assert (s - want_s).abs().max().item() <= TOL64
        assert (normed - want_normed).abs().max().item() <= TOL64
        # the MLP's half of the layer: s + Wo(act(a) * g) for [a, g] = Wi(mlp_norm(s))
        mlp = layer.mlp
        h = ops.bias_gelu_torch(normed, mlp.Wi.weight, mlp.Wi.bias, ops.ACTIVATIONS[cfg.hidden_activation],
                                gated=True)
        got = s + F.linear(h, mlp.Wo.weight, mlp.Wo.bias)
        assert (got - (want_s + mlp(want_normed))).abs().max().item() <= TOL64
