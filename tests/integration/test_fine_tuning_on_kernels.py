"""Training on the kernels: a step through transformers' Trainer, a PEFT LoRA step and sentence-transformers' fit
loop, with every op on its Triton kernels (forward and backward: each unit's train_kernel, counted launch by launch),
through the interpreter on CPU and compiled on CUDA (bench/gpu_check.py's tests-train step). With dropout off, each
step is the twins' step: the loss, every gradient and the weights after the step agree with kernels="torch" within
the fp32 bar."""
import copy

import pytest
import torch
import transformers
from helpers import DEVICE, assert_trained_on_kernels, launches, optional, perturb_, torch_dropout_off

import fastbert
from fastbert import dispatch
from fastbert.numerics import FP32_TOL

IDS = torch.tensor([[5, 8, 13, 21, 34, 2, 3, 17, 19], [9, 10, 11, 12, 14, 0, 0, 0, 0], [7, 6, 0, 0, 0, 0, 0, 0, 0]],
                   device=DEVICE)
MASK = (IDS != 0).long()
LABELS = torch.tensor([0, 2, 1], device=DEVICE)

pytestmark = pytest.mark.skipif(dispatch.triton_unavailable(torch.device(DEVICE)) is not None,
                                reason=f"the kernels cannot run on {DEVICE} here: "
                                       f"{dispatch.triton_unavailable(torch.device(DEVICE))}")


def classifier(seed=0, dropout=0.0):
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=96, max_position_embeddings=16, type_vocab_size=2, num_labels=3,
                                  hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    torch.manual_seed(seed)
    return perturb_(transformers.BertForSequenceClassification(cfg), weight_std=0.05).to(DEVICE)


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str):
    assert torch.isfinite(got).all(), f"{what}: NaN/inf"
    err = (got - want).abs().max().item()
    assert err <= FP32_TOL * max(1.0, want.abs().max().item()), f"{what}: {err:.3g}"


def test_trainer_step_on_the_kernels_is_the_twins_step(tmp_path, monkeypatch):
    for name in ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_IPEX"):  # Trainer sets these: unset afterwards
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    reference = classifier()
    data = [{"input_ids": IDS[i].cpu(), "attention_mask": MASK[i].cpu(), "labels": LABELS[i].cpu()}
            for i in range(len(IDS))]

    def train(kernels):
        model = fastbert.optimize(copy.deepcopy(reference), kernels=kernels)
        args = transformers.TrainingArguments(output_dir=str(tmp_path / kernels), per_device_train_batch_size=3,
                                              max_steps=1, learning_rate=0.5, report_to=[], use_cpu=DEVICE == "cpu",
                                              save_strategy="no", logging_steps=1, seed=0, optim="sgd")
        # SGD: the step is the gradient itself (AdamW's first step is its sign, where rounding noise would decide)
        with launches() as launched:
            loss = transformers.Trainer(model=model, args=args, train_dataset=data).train().training_loss
        return loss, model, launched

    loss, model, launched = train("triton")
    assert_trained_on_kernels(launched)
    want_loss, want, twin_launched = train("torch")
    assert not twin_launched
    assert abs(loss - want_loss) <= FP32_TOL
    moved = 0
    for (name, p), (_, q), (_, p0) in zip(model.named_parameters(), want.named_parameters(),
                                          reference.named_parameters(), strict=True):
        assert_close(p.detach(), q.detach(), name)
        moved += not torch.equal(p.detach(), p0.detach())
    assert moved > 20  # the step changed (nearly) every parameter


@pytest.mark.parametrize("order", ["peft-then-optimize", "optimize-then-peft"])
def test_lora_step_on_the_kernels_is_the_twins_step(order):
    """LoRA r=4 on query and value: the adapters add to the fused QKV kernel's output, and their gradients (and the
    new head's) flow back through the attention and row kernels' backwards."""
    peft = optional("peft", "PEFT is a test extra (pip install -e '.[test]')")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["query", "value"],
                             task_type="SEQ_CLS")

    def step(kernels):
        torch.manual_seed(1)
        if order == "peft-then-optimize":
            model = fastbert.optimize(peft.get_peft_model(classifier(), config), kernels=kernels)
        else:
            model = peft.get_peft_model(fastbert.optimize(classifier(), kernels=kernels), config)
        with torch.no_grad():  # B starts at zero: draw every adapter weight, so that A's gradient is not zero
            gen = torch.Generator().manual_seed(2)
            for name, p in sorted(model.named_parameters()):
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        opt = torch.optim.SGD(trainable.values(), lr=0.5)
        with launches() as launched:
            loss = model.train()(IDS, attention_mask=MASK, labels=LABELS).loss
            loss.backward()
        grads = {n: p.grad.clone() for n, p in trainable.items()}
        opt.step()
        return launched, loss.item(), grads, {n: p.detach().clone() for n, p in trainable.items()}

    launched, loss, grads, after = step("triton")
    assert_trained_on_kernels(launched)
    _, want_loss, want_grads, want_after = step("torch")
    assert abs(loss - want_loss) <= FP32_TOL
    assert grads.keys() == want_grads.keys() and any("lora_A" in n for n in grads)
    for name in grads:
        assert_close(grads[name], want_grads[name], f"{name}.grad")
        assert_close(after[name], want_after[name], name)


def test_sentence_transformers_fit_on_the_kernels_is_the_twins_fit(minilm_path):
    """sentence-transformers' own fit loop (old_fit: its pre-v3 loop, which needs no `datasets`) over the bundled
    MiniLM, one SGD step of CosineSimilarityLoss, dropout off: the weights after it are the twins'."""
    from sentence_transformers import InputExample, SentenceTransformer
    from sentence_transformers.sentence_transformer import losses
    from torch.utils.data import DataLoader

    pairs = [InputExample(texts=["A man is eating food.", "Someone eats a meal."], label=0.9),
             InputExample(texts=["Two dogs play in the snow.", "The stock market fell today."], label=0.1)]

    def fit(kernels):
        st = SentenceTransformer(minilm_path, device=DEVICE)
        encoder = st[0].auto_model
        encoder.config.hidden_dropout_prob = encoder.config.attention_probs_dropout_prob = 0.0
        for m in encoder.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        fastbert.optimize(st, kernels=kernels)
        torch.manual_seed(0)
        loader = DataLoader(pairs, batch_size=2, shuffle=False)
        # SGD: the step is the gradient itself (AdamW's first step is its sign, where rounding noise would decide
        # for the gradients softmax makes ~0, such as the key bias's)
        with launches() as launched:
            st.old_fit(train_objectives=[(loader, losses.CosineSimilarityLoss(st))], epochs=1, warmup_steps=0,
                       optimizer_class=torch.optim.SGD, optimizer_params={"lr": 1.0}, weight_decay=0.0,
                       show_progress_bar=False)
        return st, launched

    st, launched = fit("triton")
    assert_trained_on_kernels(launched)
    want, _ = fit("torch")
    base = SentenceTransformer(minilm_path, device=DEVICE)
    moved = 0
    for (name, p), (_, q), (_, p0) in zip(st.named_parameters(), want.named_parameters(), base.named_parameters(),
                                          strict=True):
        assert_close(p.detach(), q.detach(), name)
        moved += not torch.equal(p.detach(), p0.detach())
    assert moved > 50


def test_a_dropout_step_on_the_kernels_is_reproducible(monkeypatch):
    """Dropout drawn inside the kernels from torch's generator: every attention kernel launch (forward, dK/dV, dQ)
    and every row kernel launch (forward, backward) drops with the config's 0.1, and with torch's own dropout the
    identity (the embeddings' and the classifier head's, which would make two seeds differ on their own) the same
    seed gives the same loss and gradients, another seed others (the kernels and the twins draw different masks, so
    they are not compared here)."""
    torch_dropout_off(monkeypatch)

    def step(seed):
        model = fastbert.optimize(classifier(dropout=0.1), kernels="triton").train()
        torch.manual_seed(seed)
        with launches() as launched:
            loss = model(IDS, attention_mask=MASK, labels=LABELS).loss
            loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]), launched

    loss, grads, launched = step(3)
    again_loss, again, _ = step(3)
    other_loss, other, _ = step(4)
    assert_trained_on_kernels(launched)
    assert launched.dropouts("attention") == {kernel: {0.1} for kernel in ("_attention_fwd_kernel",
                                                                           "_attention_bwd_dkdv_kernel",
                                                                           "_attention_bwd_dq_kernel")}
    assert launched.dropouts("residual_layernorm") == {"bias_residual_layernorm_kernel": {0.1},
                                                       "layernorm_backward_kernel": {0.1}}
    assert loss == again_loss and torch.equal(grads, again)
    assert loss != other_loss and not torch.equal(grads, other), "another seed, the same step: no dropout drawn"
