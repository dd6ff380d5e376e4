"""TransformerConfig(cuda_graph=True) from Python (tests/cpp/test_cuda_graph.cpp has the C++
side): on a CPU the layers run eagerly with the same numbers and the model says why; on a
GPU (run by scripts/gpu_check.sh) the captured layer stack gives the eager loss and
gradients over three SGD steps, one capture per shape, and a second capture while the
first micro-batch still waits for its backward."""
import pytest
import torch

import megatorch  # noqa: F401
import megatorch.cpp as mt
from tolerance import assert_close

CONFIGS = {
    "gpt": dict(hidden_size=64, num_attention_heads=4, num_layers=2, seq_length=16, vocab_size=128, seed=3),
    "llama": dict(hidden_size=64, num_attention_heads=8, num_query_groups=2, num_layers=2, seq_length=16,
                  vocab_size=128, position_embedding_type="rope", activation="swiglu", normalization="RMSNorm",
                  add_bias_linear=False, tie_embeddings=False, seed=3),
}


def train(model, batches):
    losses, grads = [], {}
    for ids, labels in batches:
        for p in model.parameters():
            p.grad = None
        loss = model.loss(ids, labels)
        loss.backward()
        losses.append(loss.item())
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad)
    return losses, grads


def batches(device, vocab, s):
    g = torch.Generator().manual_seed(9)
    out = []
    for _ in range(3):
        t = torch.randint(vocab, (2, s + 1), generator=g)
        out.append((t[:, :-1].to(device), t[:, 1:].to(device)))
    return out


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_cpu_runs_eagerly_with_the_same_numbers_and_says_why(arch):
    c = CONFIGS[arch]
    plain, graphed = mt.GPTModel(mt.TransformerConfig(**c)), mt.GPTModel(mt.TransformerConfig(**c, cuda_graph=True))
    data = batches("cpu", c["vocab_size"], c["seq_length"])
    (la, ga), (lb, gb) = train(plain, data), train(graphed, data)
    assert la == lb
    assert all(torch.equal(ga[n], gb[n]) for n in ga)
    assert graphed.cuda_graph_captures() == 0
    assert "the layers run on cpu" in graphed.cuda_graph_fallback_reason()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the CUDA-graph capture needs a GPU")
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_cuda_captured_layers_give_the_eager_numbers(arch):
    c = dict(CONFIGS[arch], device=torch.device("cuda"))
    plain, graphed = mt.GPTModel(mt.TransformerConfig(**c)), mt.GPTModel(mt.TransformerConfig(**c, cuda_graph=True))
    data = batches("cuda", c["vocab_size"], c["seq_length"])
    (la, ga), (lb, gb) = train(plain, data), train(graphed, data)
    assert graphed.cuda_graph_fallback_reason() == ""
    assert graphed.cuda_graph_captures() == 1
    assert lb == pytest.approx(la, rel=1e-5)
    for n in ga:
        assert_close(gb[n].cpu(), ga[n].cpu(), 1e-4, msg=n)
    ids, labels = data[0]
    l1, l2 = graphed.loss(ids, labels), graphed.loss(ids, labels)  # two in flight
    assert graphed.cuda_graph_captures() == 2
    assert l1.item() == l2.item()
    (l1 + l2).backward()
