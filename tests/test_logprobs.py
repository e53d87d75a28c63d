"""The chunked log-prob function against a plain full-logits log_softmax + gather: values and gradients."""

import pytest
import torch
import torch.nn.functional as F
from helpers import reorder_bound

from kto_pipeline.scoring import head
from kto_pipeline.scoring.head import chunked_token_logps, logits_grad, softmax_stats
from kto_pipeline.scoring.logprobs import score_sequences


def reference_logps(hidden, weight, targets, bias=None, scale=1.0, softcap=None):
    logits = (hidden @ weight.T + (0 if bias is None else bias)).float() * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)


@pytest.mark.parametrize("n,h,v,chunk", [(1, 8, 11, 4), (37, 16, 50, 8), (64, 32, 97, 1024), (10, 8, 13, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("scale,softcap", [(1.0, None), (0.5, None), (1.0, 3.0)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # float32: matmuls into the reused buffer
@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])  # the backward's two sources of logits
# a chunk's math: the eager in-place steps, or the functions --torch-compile compiles (here uncompiled)
@pytest.mark.parametrize("regions", [None, (softmax_stats, logits_grad)], ids=["in-place", "regions"])
def test_values_and_gradients_match_full_logits(
    n, h, v, chunk, with_bias, scale, softcap, dtype, keep, regions, monkeypatch
):
    if not keep:
        monkeypatch.setattr(head, "KEEP_LOGITS_BYTES", 0)
    g = torch.Generator().manual_seed(n * 1000 + v)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    bias = torch.randn(v, generator=g, dtype=torch.float64) if with_bias else None
    targets = torch.randint(v, (n,), generator=g)
    upstream = torch.randn(n, generator=g, dtype=torch.float64)
    params = [x.to(dtype).requires_grad_() for x in (hidden, weight) + ((bias,) if with_bias else ())]
    hidden, weight = params[:2]
    bias = params[2] if with_bias else None
    tol = 1e-5 if dtype == torch.float64 else 1e-4

    got, mean_logits, entropy = chunked_token_logps(
        hidden, weight, targets, bias, chunk, scale, softcap, compiled=regions
    )
    exact = [x.detach().double().requires_grad_() for x in params]
    want = reference_logps(exact[0], exact[1], targets, exact[2] if with_bias else None, scale, softcap)
    torch.testing.assert_close(got, want.float(), atol=tol, rtol=tol)

    got_grads = torch.autograd.grad((got.double() * upstream).sum(), params)
    want_grads = torch.autograd.grad((want * upstream).sum(), exact)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a.double(), b, atol=tol, rtol=1e-4 if dtype == torch.float64 else 1e-3)
    hidden, weight, bias = exact[0], exact[1], exact[2] if with_bias else None

    logits = (hidden @ weight.T + (0 if bias is None else bias)) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    torch.testing.assert_close(mean_logits, logits.mean(-1).float().detach(), atol=tol, rtol=tol)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(entropy, -(p * torch.log(p)).sum(-1).float().detach(), atol=tol, rtol=tol)


def reorder_bounds(hidden, weight, targets):
    """How far two float32 evaluations of `chunked_token_logps` and its gradients (of logps.sum()) can lie apart when
    their sums add in other orders, for each of: log-probs, mean logits, entropy, hidden's gradient, weight's gradient
    (`reorder_bound`). The chains of sums: a logit adds H products; the log-sum-exp adds V terms of logits; the
    gradient of the logits, onehot - softmax, carries the rounding of both (relative to |logit| + |log-sum-exp|);
    hidden's gradient adds V of its terms times the weight, weight's gradient N rows of them times hidden. Each
    magnitude is the sum of its terms' absolute values, in float64, on absolute values throughout."""
    h, w = hidden.double(), weight.double()
    (n, dim), vocab = h.shape, w.shape[0]
    logits, logits_abs = h @ w.T, h.abs() @ w.abs().T  # (N, V)
    p = torch.softmax(logits, -1)
    lse = logits_abs.max(-1, keepdim=True).values - torch.log(p).max(-1, keepdim=True).values  # >= |log-sum-exp|
    logps = lse[:, 0] + logits_abs.max(-1).values  # |logit - log-sum-exp|, the terms of both
    grad = (F.one_hot(targets, vocab).double() - p).abs() + p * (1 + logits_abs + lse)  # (N, V): value + rounding
    return [
        reorder_bound(dim + vocab, logps),  # log-probs
        reorder_bound(dim + vocab, logits_abs.mean(-1)),  # mean logits
        reorder_bound(dim + vocab, logps + (p * logits_abs).sum(-1)),  # entropy: sum p (log-sum-exp - logit)
        reorder_bound(dim + vocab, grad @ w.abs()),  # (N, H)
        reorder_bound(n + dim + vocab, grad.T @ h.abs()),  # (V, H)
    ]


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
def test_compiled_chunk_math_gives_the_eager_values_with_one_graph_for_every_row_count(keep, monkeypatch):
    """--torch-compile's regions of the head (softmax statistics, logits' gradient) compiled as the stages compile
    them: the eager steps' values, statistics and gradients, and new row counts compile nothing more after the first
    of each (rows dynamic from the first call). Compiled and eager add in other orders (inductor fuses and vectorizes
    the sums by the CPU's vector width): they may differ by float32 rounding, bounded by `reorder_bound` from the
    sums' lengths and the exact magnitudes of their terms, not by what one CPU happened to give."""
    from torch._dynamo.utils import counters

    from kto_pipeline.runtime.compiled import _dynamic_first_dims

    torch._dynamo.reset()
    if not keep:
        monkeypatch.setattr(head, "KEEP_LOGITS_BYTES", 0)

    def dynamic(fn):
        compiled = torch.compile(fn, backend="inductor")
        return lambda *args: _dynamic_first_dims(*args) or compiled(*args)

    regions = (dynamic(softmax_stats), dynamic(logits_grad))
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(97, 32, generator=g)
    graphs, before = [], counters["stats"]["unique_graphs"]
    for n in (37, 50, 64, 5):
        hidden, targets = torch.randn(n, 32, generator=g), torch.randint(97, (n,), generator=g)
        runs = []
        for compiled in (None, regions):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            logps, mean_logits, entropy = chunked_token_logps(h, w, targets, chunk_size=16, compiled=compiled)
            logps.sum().backward()
            runs.append([logps.detach(), mean_logits, entropy, h.grad, w.grad])
        for a, b, bound in zip(*runs, reorder_bounds(hidden, weight, targets), strict=True):
            assert b.shape == a.shape and bool(((b - a).abs() <= bound.float()).all()), (n, (b - a).abs().max())
        graphs.append(counters["stats"]["unique_graphs"] - before)
    assert graphs[0] == graphs[-1] == 2, graphs  # statistics and gradient: once each, for every row count
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_logits_give_the_recomputed_gradients(dtype, monkeypatch):
    """Logits kept from the forward (small batches) and logits recomputed in the backward give the same bits, and
    keeping them saves the backward's matmul; no-grad forwards (the KL forward, the reference pass) keep nothing."""
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(70, 32, generator=g), torch.randn(300, 32, generator=g) * 0.1
    targets, upstream = torch.randint(300, (70,), generator=g), torch.randn(70, generator=g)
    calls = []
    chunk_logits = head._chunk_logits
    monkeypatch.setattr(head, "_chunk_logits", lambda *a: calls.append(1) or chunk_logits(*a))

    def run(keep_bytes):
        monkeypatch.setattr(head, "KEEP_LOGITS_BYTES", keep_bytes)
        h, w = hidden.to(dtype).detach().requires_grad_(), weight.to(dtype).detach().requires_grad_()
        calls.clear()
        logps = chunked_token_logps(h, w, targets, chunk_size=16)[0]
        forward_calls = len(calls)
        grads = torch.autograd.grad((logps * upstream).sum(), (h, w))
        return logps, grads, forward_calls, len(calls) - forward_calls

    kept_logps, kept_grads, kept_fwd, kept_bwd = run(1 << 30)
    logps, grads, fwd, bwd = run(0)
    assert (kept_fwd, kept_bwd, fwd, bwd) == (5, 0, 5, 5)
    assert torch.equal(kept_logps, logps)
    for a, b in zip(kept_grads, grads, strict=True):
        assert torch.equal(a, b)

    seen = []
    function = head._ChunkedTokenLogps.forward
    monkeypatch.setattr(head, "KEEP_LOGITS_BYTES", 1 << 30)
    monkeypatch.setattr(
        head._ChunkedTokenLogps, "forward", staticmethod(lambda ctx, *a: seen.append(a[-2]) or function(ctx, *a))
    )
    w = weight.to(dtype).detach().requires_grad_()
    with torch.no_grad():
        chunked_token_logps(hidden.to(dtype), w, targets)
    chunked_token_logps(hidden.to(dtype), weight.to(dtype), targets)  # nothing requires grad
    assert seen == [False, False]


def test_autocast_head_gives_autograds_gradients(monkeypatch):
    """Under bf16 autocast over a float32 head (training's regime): the head casts its weight inside, returns the
    weight's gradient in float32, accumulated in vocabulary slices (3 here); values and gradients as autograd's
    through `F.linear` under autocast and a float32 log-softmax."""
    monkeypatch.setattr(head, "CHUNK_LOGITS_BYTES", 100 * 32 * 2)  # 100-row vocabulary slices
    monkeypatch.setattr(head, "KEEP_LOGITS_BYTES", 0)  # recompute in the backward
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(70, 32, generator=g), torch.randn(300, 32, generator=g) * 0.3
    targets, upstream = torch.randint(300, (70,), generator=g), torch.randn(70, generator=g)
    results = []
    for ours in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if ours:
                logps = chunked_token_logps(h, w, targets, chunk_size=16)[0]
            else:
                logits = F.linear(h, w).float()
                logps = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
        grads = torch.autograd.grad((logps * upstream).sum(), (h, w))
        assert grads[1].dtype == torch.float32
        results.append((logps, *grads))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)  # bf16 products summed in another order


def test_bfloat16_close_to_float32():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(20, 32, generator=g), torch.randn(64, 32, generator=g) * 0.1
    targets = torch.randint(64, (20,), generator=g)
    full = chunked_token_logps(hidden, weight, targets)[0]
    half = chunked_token_logps(hidden.bfloat16(), weight.bfloat16(), targets)[0]
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, full, atol=0.05, rtol=0.02)


def test_score_sequences_matches_model_logits(tiny_model_dir):
    """score_sequences on a real model == log_softmax of the model's own logits, padding ignored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 100, (3, 12), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 9:] = 0  # right padding
    comp = torch.zeros_like(ids)
    comp[0, 5:] = 1
    comp[1, 3:9] = 1
    comp[2, 1:] = 1
    scores = score_sequences(model, ids, attn, comp, chunk_size=4)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    full = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = comp[:, 1:].bool()
    torch.testing.assert_close(scores.token_logps, full[mask], atol=1e-5, rtol=1e-5)  # row by row, in order
    torch.testing.assert_close(scores.sequence, mask.nonzero()[:, 0])
    torch.testing.assert_close(scores.logps, (full * mask).sum(-1), atol=1e-4, rtol=1e-5)
    assert [len(t) for t in scores.per_sequence()] == mask.sum(-1).tolist()


def test_score_sequences_gradient_reaches_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.randint(4, 100, (2, 8))
    comp = torch.zeros_like(ids)
    comp[:, 4:] = 1
    score_sequences(model, ids, torch.ones_like(ids), comp).logps.sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0
