"""Stage 2 with a pair loss (DPO and its variants): each pair one tree, packed = padded, the step-1 invariant, the
flags' checks, and the refusals of caches a loss cannot train on."""

import json

import pytest
import torch
from helpers import cpu_attention, host_reads_per_step, read_metrics, train_config, write_jsonl

from kto_pipeline import KTOPipelineError, PrecomputeConfig, TrainConfig, precompute, train
from kto_pipeline.cache import open_cache
from kto_pipeline.objectives.pairs import CachePairs, PairCollator
from kto_pipeline.scoring import plan as plan_module
from kto_pipeline.stages.train.step import PolicyScorer


def pairs(n: int = 12) -> list[dict]:
    return [
        {
            "prompt": f"Q{i}: what is {i} plus {i}?\nA:",
            "chosen": f" It is {2 * i}" + "!" * (i % 3),
            "rejected": " No idea" + "." * (i % 4),
        }
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def pair_cache(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("pair-cache")
    data = write_jsonl(root / "pairs.jsonl", pairs())
    return precompute(
        PrecomputeConfig(model=str(tiny_model_dir), dataset=str(data), output=str(root / "cache"), max_length=48)
    )


def cfg(cache, out, **kw):
    kw.setdefault("loss_type", "sigmoid")
    kw.setdefault("per_device_train_batch_size", 4)
    return train_config(cache, out, **kw)


@pytest.mark.parametrize("ld_alpha", [None, 0.5])
@pytest.mark.parametrize("packed", [True, False])
def test_policy_equals_reference_at_step_one(pair_cache, tiny_model_dir, packed, ld_alpha):
    """With the policy = the reference, both answers' log-probs equal the cached ones exactly (rewards 0), packed
    (each pair one tree: its prompt once) and padded, with and without LD-DPO's weighting."""
    from transformers import AutoModelForCausalLM

    from kto_pipeline.objectives.loss import length_desensitized

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    items = CachePairs(open_cache(pair_cache), 48)
    assert len(items) == 12
    batch = PairCollator(pad_id=0, packed=packed, ld_alpha=ld_alpha)([items[i] for i in range(len(items))])
    with torch.no_grad():
        scores = PolicyScorer(model, cpu_attention(model))(batch).completions
    logps = scores.logps
    if ld_alpha is not None:
        lengths = (batch["chosen_length"], batch["rejected_length"])
        logps = length_desensitized(scores.token_logps, scores.sequence, *lengths, ld_alpha)
    assert (logps[0::2] - batch["ref_chosen_logp"]).abs().max() < 1e-4
    assert (logps[1::2] - batch["ref_rejected_logp"]).abs().max() < 1e-4
    counts = torch.bincount(scores.sequence, minlength=24)
    assert counts[0::2].tolist() == batch["chosen_length"].tolist()
    assert counts[1::2].tolist() == batch["rejected_length"].tolist()
    needed = sum(len(i["prompt_ids"]) + len(i["chosen_ids"]) + len(i["rejected_ids"]) for i in items)
    assert int(batch["tokens_needed"]) == needed  # each prompt once


def test_first_step_rewards_are_exactly_zero(pair_cache, tmp_path):
    (first, *_) = read_metrics(train(cfg(pair_cache, tmp_path / "run", max_steps=2)).output_dir)
    assert first["rewards/chosen"] == 0.0 and first["rewards/rejected"] == 0.0 and first["rewards/margins"] == 0.0
    assert first["loss"] == pytest.approx(0.6931472, abs=1e-6)  # -log sigmoid(0)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo+sft"])
def test_packed_training_equals_padded_training(pair_cache, tmp_path, monkeypatch, loss_type):
    """Packed pairs (each pair one tree) and padded pairs (prompt + chosen, prompt + rejected) give the same losses,
    metrics and weights; the packed run executes fewer tokens, and runs each prompt once."""
    from transformers import AutoModelForCausalLM

    settings = dict(loss_type=loss_type, train_sampling_strategy="sequential", max_steps=3, learning_rate=1e-3)
    packed = train(cfg(pair_cache, tmp_path / "packed", **settings))
    with monkeypatch.context() as mp:
        mp.setattr(plan_module, "packing_unsupported", lambda model: "attention implementation 'x'")
        padded = train(cfg(pair_cache, tmp_path / "padded", **settings))
    assert len(packed.metrics) == len(padded.metrics) == 3
    for a, b in zip(packed.metrics, padded.metrics, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key
    assert packed.metrics[-1]["rewards/margins"] != 0.0
    wa = AutoModelForCausalLM.from_pretrained(tmp_path / "packed").state_dict()
    wb = AutoModelForCausalLM.from_pretrained(tmp_path / "padded").state_dict()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=1e-5, rtol=1e-4, msg=name)
    state_a = json.loads((tmp_path / "packed" / "trainer_state.json").read_text())
    state_b = json.loads((tmp_path / "padded" / "trainer_state.json").read_text())
    assert state_a["packing"] == "packed" and state_a["kl_forward"].startswith("none (pair loss")
    assert state_b["packing"].startswith("padded")
    assert state_a["tokens_needed"] == state_b["tokens_needed"]
    assert state_a["tokens_executed"] < state_b["tokens_executed"]


def test_a_pair_step_reads_the_device_once_and_the_grad_norm_only_where_it_logs(pair_cache, tmp_path, monkeypatch):
    """As KTO's step: one read back from the device a step (its metrics), the grad norm where the step logs."""
    with host_reads_per_step(monkeypatch) as reads:
        train(cfg(pair_cache, tmp_path / "run", max_steps=4, logging_steps=2, attention_kernel="dense"))
    assert reads == {"train_step": [1] * 4, "after_step": [0, 1, 0, 1]}


def test_batches_count_pairs_and_eval_reports_pair_metrics(pair_cache, tmp_path):
    result = train(cfg(pair_cache, tmp_path / "run", eval_cache=str(pair_cache), max_steps=3))
    state = json.loads((tmp_path / "run" / "trainer_state.json").read_text())
    assert result.metrics[-2]["epoch"] == 1.0  # 12 pairs / 4 a batch = 3 steps an epoch
    assert state["tokens_needed"] > 0
    (final,) = [m for m in result.metrics if "eval_loss" in m]
    assert final["eval_pairs"] == 12 and final["eval_rows"] == 24
    assert final["eval_pair_accuracy"] == final["eval_rewards/accuracies"]
    for name in ("chosen", "rejected"):
        assert f"eval_rewards/{name}" in final and f"eval_logps/{name}" in final
    assert final["eval_rewards/margins"] == pytest.approx(
        final["eval_rewards/chosen"] - final["eval_rewards/rejected"], abs=1e-6
    )


def test_a_pair_loss_refuses_caches_without_pairs(small_cache, tmp_path):
    with pytest.raises(KTOPipelineError, match="holds none: its rows come from unpaired data.*--pairs-only"):
        train(cfg(small_cache, tmp_path / "a"))
    cache = open_cache(small_cache)
    assert not cache.manifest.paired


def test_a_pairs_only_cache_trains_pair_losses_and_refuses_kto(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs(8))
    cache = precompute(
        PrecomputeConfig(
            model=str(tiny_model_dir), dataset=str(data), output=str(tmp_path / "c"), max_length=48, pairs_only=True
        )
    )
    result = train(cfg(cache, tmp_path / "dpo", max_steps=1))
    assert result.metrics[0]["rewards/chosen"] == 0.0
    with pytest.raises(KTOPipelineError, match="--pairs-only.*no KL completions.*or train a pair loss"):
        train(train_config(cache, tmp_path / "kto", max_steps=1))


def test_a_version_1_cache_is_refused_with_how_to_make_a_paired_one(tiny_model_dir, tmp_path):
    from test_pairs_cache import as_version_1

    data = write_jsonl(tmp_path / "pairs.jsonl", pairs(8))
    cache = precompute(
        PrecomputeConfig(model=str(tiny_model_dir), dataset=str(data), output=str(tmp_path / "c"), max_length=48)
    )
    as_version_1(cache)
    with pytest.raises(KTOPipelineError, match="cache format version 1, which does not record.*Precompute paired"):
        train(cfg(cache, tmp_path / "dpo", max_steps=1))
    train(train_config(cache, tmp_path / "kto", max_steps=1))  # KTO still trains on it


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(loss_type="sigmoid,ipo"), "join the terms of a combination with \\+"),
        (dict(loss_type="dpo"), "unknown 'dpo'"),
        (dict(loss_type="kto+sigmoid"), "only pair losses combine"),
        (dict(loss_type="sigmoid+sigmoid"), "names a term twice"),
        (dict(loss_type="sigmoid+sft", loss_weights="1"), "1 weights for the 2 terms"),
        (dict(loss_type="sigmoid", loss_weights="a"), "cannot read 'a'"),
        (dict(loss_type="kto", loss_weights="1"), "--loss-weights: weights the terms of a pair loss"),
        (dict(loss_type="kto", label_smoothing=0.1), "--label-smoothing: applies to pair losses only"),
        (dict(loss_type="apo_zero_unpaired", ld_alpha=0.5), "--ld-alpha: applies to pair losses only"),
        (dict(loss_type="sigmoid", desirable_weight=2.0), "--desirable-weight: applies to KTO only"),
        (dict(loss_type="exo_pair"), "must be > 0 with exo_pair"),
        (dict(loss_type="robust", label_smoothing=0.5), "in \\[0, 0.5\\) with robust"),
        (dict(loss_type="bco_pair", f_divergence_type="js_divergence"), "needs reverse_kl"),
        (dict(loss_type="sigmoid", f_divergence_type="kl"), "must be one of reverse_kl"),
        (dict(loss_type="sigmoid", ld_alpha=1.5), "--ld-alpha: must be in \\[0, 1\\]"),
        (dict(loss_type="discopop", discopop_tau=0.0), "--discopop-tau: must be > 0"),
    ],
)
def test_loss_flags_are_checked(options, message):
    with pytest.raises(KTOPipelineError, match=message):
        TrainConfig(cache="c", output_dir="o", **options)


def test_a_checkpoint_of_a_pair_loss_does_not_resume_as_kto(pair_cache, tmp_path):
    train(cfg(pair_cache, tmp_path / "run", max_steps=1, save_steps=1))
    with pytest.raises(KTOPipelineError, match="--loss-type: checkpoint 'sigmoid', now 'kto' \\(pairs vs rows\\)"):
        train(train_config(pair_cache, tmp_path / "run", max_steps=2, resume=True))


def test_one_sweep_over_kto_and_pair_losses_on_one_paired_cache(pair_cache, tmp_path):
    """KTO and pair losses in one grid: each run takes its own loss's options, the summary and the model cards name
    the loss, and every run reports the held-out pair accuracy and reward margin alike."""
    from kto_pipeline.sweep import expand_grid, sweep

    values = {
        "loss_type": "kto,sigmoid,exo_pair",
        "label_smoothing": "0.001",
        "desirable_weight": "1.5",
        "per_device_train_batch_size": "4",
        "max_steps": "2",
        "learning_rate": "1e-3",
        "eval_cache": str(pair_cache),
    }
    grid, varied = expand_grid(values)
    assert varied == ["loss_type"]
    by_loss = {g["loss_type"]: g for g in grid}
    assert "label_smoothing" not in by_loss["kto"] and by_loss["kto"]["desirable_weight"] == 1.5
    assert by_loss["exo_pair"]["label_smoothing"] == 0.001 and "desirable_weight" not in by_loss["exo_pair"]
    rows = sweep(str(pair_cache), str(tmp_path / "sweep"), values)
    assert sorted(r["run"] for r in rows) == ["exo_pair", "kto", "sigmoid"]
    for row in rows:
        assert row["loss_type"] == row["run"]
        assert 0.0 <= row["eval_pair_accuracy"] <= 1.0 and row["eval_margin"] is not None
    keys = [(r["eval_pair_accuracy"], r["eval_margin"]) for r in rows]
    assert keys == sorted(keys, reverse=True)  # best first: pair accuracy, then margin
    summary = (tmp_path / "sweep" / "summary.md").read_text()
    assert "eval_pair_accuracy" in summary and "eval_margin" in summary
    assert "pair loss DPO (`sigmoid`)" in (tmp_path / "sweep" / "sigmoid" / "README.md").read_text()
    assert "trained with KTO" in (tmp_path / "sweep" / "kto" / "README.md").read_text()


def test_resume_lora_init_from_and_append_with_a_pair_loss(pair_cache, tiny_model_dir, tmp_path):
    """The paths a pair loss inherits from train: resuming a checkpoint gives the uninterrupted run's steps and
    weights bit for bit; LoRA (and --merge) starts at the reference; --init-from trains a second round; a paired
    cache grown by `precompute --append` trains on its new pairs too."""
    from safetensors.torch import load_file

    settings = dict(max_steps=4, save_steps=2, learning_rate=1e-3, train_sampling_strategy="random", seed=7)
    whole = train(cfg(pair_cache, tmp_path / "whole", **settings))
    train(cfg(pair_cache, tmp_path / "resumed", resume_from=str(tmp_path / "whole" / "checkpoint-2"), **settings))
    assert read_metrics(tmp_path / "resumed")[-2:] == whole.metrics[-2:]
    a, b = (load_file(tmp_path / run / "model.safetensors") for run in ("whole", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)

    lora = train(cfg(pair_cache, tmp_path / "lora", lora_r=4, merge=True, max_steps=2, learning_rate=1e-3))
    assert lora.metrics[0]["rewards/margins"] == 0.0 and lora.metrics[-1]["rewards/margins"] != 0.0
    assert (tmp_path / "lora" / "adapter_model.safetensors").exists()
    assert (tmp_path / "lora" / "merged" / "model.safetensors").exists()

    second = train(cfg(pair_cache, tmp_path / "round2", init_from=str(tmp_path / "whole"), max_steps=1))
    state = json.loads((tmp_path / "round2" / "trainer_state.json").read_text())
    assert state["round"] == 2 and state["parent_run"]["global_step"] == 4
    assert second.metrics[0]["rewards/margins"] != 0.0  # it starts from the trained policy, not the reference

    root = tmp_path / "grown"
    root.mkdir()
    first = write_jsonl(root / "first.jsonl", pairs(8))
    cache = precompute(
        PrecomputeConfig(model=str(tiny_model_dir), dataset=str(first), output=str(root / "cache"), max_length=48)
    )
    more = write_jsonl(root / "more.jsonl", pairs(12))  # the first 8 again, then 4 new pairs
    precompute(
        PrecomputeConfig(
            model=str(tiny_model_dir), dataset=str(more), output=str(root / "cache"), max_length=48, append=True
        )
    )
    grown = open_cache(cache, verify=True)
    assert grown.manifest.pairs["complete"] == 12 and len(CachePairs(grown, 48)) == 12
    result = train(cfg(cache, root / "run", num_train_epochs=1))
    assert [m["step"] for m in result.metrics] == [1, 2, 3] and result.metrics[0]["rewards/margins"] == 0.0
