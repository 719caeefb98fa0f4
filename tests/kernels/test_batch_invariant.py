"""Batch invariance (fastbert.batch_invariant, what the server runs its model under): a text's outputs must not depend
on what else is in its batch. On the kernel path three things could make them depend on it, and each is pinned:
the GEMMs' tile (autotuned per token-count bucket), attention's tile (per sequence-length bucket), and "auto"'s
kernel-or-twin choice (measured per bucket on a GPU). Here: the tile each launch takes, read at the launch, for
token counts and lengths of different buckets; "auto" never measuring inside the block; and the whole kernel path
(Triton's interpreter on CPU) giving each sequence the same bits alone and in other batches. A GPU proves the bits
there: bench/gpu_check.py's invariance-bf16 cell."""
import pytest
import torch
from helpers import DEVICE, random_hf_bert

import fastbert
from fastbert import dispatch
from fastbert.encode import pool_packed

kernels = pytest.importorskip("fastbert.kernels.utils", reason="Triton is not installed: no kernel path to pin")
gemm_module = pytest.importorskip("fastbert.kernels.gemm")
attention_module = pytest.importorskip("fastbert.kernels.attention")


class Spy:
    """Stands in for a @triton.jit kernel: records the tile of each launch (`fn[grid](*args, **kwargs)`), then
    launches the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.tiles = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.tiles.append(tuple(kwargs[k] for k in ("BLOCK_M", "BLOCK_N") if k in kwargs)
                              + (kwargs.get("BLOCK_K"), kwargs.get("num_warps"), kwargs.get("num_stages")))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.fixture
def compiled_choices(monkeypatch):
    """The launchers' choice as on a GPU: the interpreter's own fixed tile switched off (the kernels still run in
    the interpreter, at whatever tile is chosen)."""
    monkeypatch.setattr(kernels, "INTERPRET", False)


def test_gemm_takes_one_tile_whatever_the_token_count(compiled_choices, monkeypatch):
    spy = Spy(gemm_module.gemm_kernel)
    monkeypatch.setattr(gemm_module, "gemm_kernel", spy)
    w = torch.randn(96, 64, device=DEVICE) * 0.1
    b = torch.randn(96, device=DEVICE)
    x = torch.randn(300, 64, device=DEVICE)
    with fastbert.batch_invariant():
        outs = []
        for tokens in (1, 37, 300):  # token-count buckets 16, 64 and 512
            out = torch.empty(tokens, 96, device=DEVICE)
            gemm_module.gemm(x[:tokens], w, b, out, activation="gelu")
            outs.append(out)
    assert len(spy.tiles) == 3 and len(set(spy.tiles)) == 1, spy.tiles
    assert spy.tiles[0][:3] == gemm_module.CAPTURE_CONFIGS[("ptr", 4, False)][:3]
    want = torch.nn.functional.gelu(x @ w.T + b)
    for out in outs:
        assert (out - want[:out.shape[0]]).abs().max() <= 1e-4


def test_attention_takes_one_tile_whatever_the_lengths(compiled_choices, monkeypatch):
    spy = Spy(attention_module._attention_fwd_kernel)
    monkeypatch.setattr(attention_module, "_attention_fwd_kernel", spy)
    qkv = torch.randn(200, 3, 2, 32, device=DEVICE)
    with fastbert.batch_invariant():
        for lengths in ([5], [70, 3], [130, 70]):  # sequence-length buckets 8, 128 and 256
            T = sum(lengths)
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
            attention_module.launch(qkv[:T], cu, max(lengths), 32 ** -0.5)
    assert len(spy.tiles) == 3 and len(set(spy.tiles)) == 1, spy.tiles
    pinned = attention_module.invariant_config(torch.float32, 32, "ieee", False, False)
    assert spy.tiles[0][:2] == (pinned.kwargs["BLOCK_M"], pinned.kwargs["BLOCK_N"])


def test_auto_never_measures_inside_the_block(monkeypatch):
    """Where "auto" measures (a GPU: here the CPU stands in), a forward inside batch_invariant resolves every op
    without timing any contender, for any size; outside it, sizes are measured."""
    model = fastbert.BertModel.from_hf(random_hf_bert(), kernels="auto")
    measured = []
    monkeypatch.setattr(dispatch, "MEASURED_DEVICE_TYPES", (DEVICE,))
    monkeypatch.setattr(dispatch, "_measured", lambda op, situation, training: measured.append(op) or False)
    with fastbert.batch_invariant():
        for tokens, longest in ((16, 16), (1024, 128), (8192, 512)):
            model.resolve_ops(False, None, tokens, longest)
    assert measured == []
    model.resolve_ops(False, None, 1024, 128)
    assert measured, "outside batch_invariant, 'auto' measures (the reference for the assertion above)"


def test_the_block_is_per_thread_and_restores():
    import threading
    seen = {}
    with fastbert.batch_invariant():
        thread = threading.Thread(target=lambda: seen.update(other=dispatch.invariant(), kernels=kernels.invariant()))
        thread.start()
        thread.join()
        seen.update(inside=dispatch.invariant(), inside_kernels=kernels.invariant())
        with fastbert.batch_invariant(False):
            seen.update(nested_off=dispatch.invariant())
        seen.update(after_nested=dispatch.invariant())
    seen.update(after=dispatch.invariant(), after_kernels=kernels.invariant())
    assert seen == {"other": False, "kernels": False, "inside": True, "inside_kernels": True, "nested_off": False,
                    "after_nested": True, "after": False, "after_kernels": False}


def test_each_sequence_is_the_same_bits_in_any_batch_on_the_kernels():
    """The whole kernel path (every op's kernel; the interpreter on CPU): each sequence's last hidden state and mean
    pool alone, then packed beside others in batches of other sizes and orders, bit for bit."""
    model = fastbert.BertModel.from_hf(random_hf_bert(hidden=64, heads=2, layers=2, max_pos=80), kernels="triton")
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(1, 99, (n,), generator=g).to(DEVICE) for n in (1, 70, 9, 33, 2, 40)]

    def run(group):
        lengths = torch.tensor([len(sequences[i]) for i in group], device=DEVICE)
        cu = torch.tensor([0, *lengths.cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        hidden = model(input_ids=torch.cat([sequences[i] for i in group]), cu_seqlens=cu).last_hidden_state
        return list(torch.split(hidden, lengths.tolist())), pool_packed(hidden, lengths, 0 * lengths, ("mean",))

    with fastbert.batch_invariant(), torch.inference_mode():
        alone = [run([i]) for i in range(len(sequences))]
        for group in ([0, 1, 2, 3, 4, 5], [5, 3, 1], [2, 4], [1, 0]):
            hidden, pooled = run(group)
            for k, i in enumerate(group):
                assert torch.equal(hidden[k], alone[i][0][0]), (group, i)
                assert torch.equal(pooled[k], alone[i][1][0]), (group, i)
