"""Stage 2: the step-1 invariant, outputs, cache reuse, train-time truncation and refusals."""

import json

import numpy as np
import pytest
import torch
from helpers import cpu_attention, host_reads_per_step, read_metrics, train_config, unpaired_rows, write_jsonl

from kto_pipeline import KTOPipelineError, PrecomputeConfig, precompute, train
from kto_pipeline.cache import open_cache
from kto_pipeline.config.fields import SCHEDULERS
from kto_pipeline.files import sha256_file
from kto_pipeline.objectives.kto import CacheRows, Collator, imbalance_warning, pair_accuracy
from kto_pipeline.scoring import plan as plan_module
from kto_pipeline.stages.train.batches import EpochSampler
from kto_pipeline.stages.train.step import PolicyScorer

cfg = train_config


@pytest.mark.parametrize("packed", [True, False])
def test_policy_equals_reference_at_step_one(small_cache, tiny_model_dir, packed):
    """With the policy = the reference, training-time log-probs equal the cached ones (rewards 0), both packed
    (one row, KL completions on the prompts' cached keys/values) and padded, although training batches are laid out
    differently from the reference pass's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    rows = CacheRows(open_cache(small_cache), 64)
    batch = Collator(pad_id=0, packed=packed)([rows[i] for i in range(len(rows))])
    with torch.no_grad():
        scored = PolicyScorer(model, cpu_attention(model))(batch)
    assert scored.kl_on_cached_prompt == packed
    assert (scored.completions.logps - batch["ref_logp"]).abs().max() < 1e-4
    assert (scored.kl.logps - batch["ref_kl_logp"]).abs().max() < 1e-4
    needed = int(batch["tokens_needed"])
    assert scored.tokens_executed >= needed
    if packed:
        assert scored.tokens_executed == needed  # the collator's default attention cost 0: one row, no padding
    else:
        assert scored.tokens_executed > needed


def test_first_logged_step_has_zero_rewards(small_cache, tmp_path):
    train(cfg(small_cache, tmp_path / "run", max_steps=1))
    (m,) = read_metrics(tmp_path / "run")
    assert abs(m["rewards/chosen"]) < 1e-4 and abs(m["rewards/rejected"]) < 1e-4 and m["kl"] < 1e-4
    assert m["loss"] == pytest.approx(0.5, abs=1e-4)  # 1 - sigmoid(0)


def test_outputs_metrics_checkpoints_and_final_model(small_cache, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    result = train(cfg(small_cache, out, max_steps=4, logging_steps=2, save_steps=2))
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [2, 4] and result.global_step == 4
    for name in (
        "loss",
        "kl",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "logits/chosen",
        "logits/rejected",
        "learning_rate",
        "grad_norm",
        "epoch",
    ):
        assert all(name in m and np.isfinite(m[name]) for m in metrics), name
    assert metrics[-1]["epoch"] == pytest.approx(4 * 4 / 24, abs=1e-3)
    assert json.loads((out / "run_config.json").read_text())["beta"] == 0.1
    assert (out / "checkpoint-2" / "model.safetensors").exists()
    assert (out / "checkpoint-2" / "trainer_state.json").exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.kto_pipeline_run["max_steps"] == 4
    AutoTokenizer.from_pretrained(out)
    # the model actually moved away from the reference
    assert abs(metrics[-1]["rewards/margins"]) > 0


def test_logged_loss_is_mean_over_forward_passes(small_cache, tmp_path):
    """logging_steps=2 logs the mean of the 2 steps' losses that logging_steps=1 reports one by one."""
    train(cfg(small_cache, tmp_path / "a", max_steps=4, logging_steps=1))
    train(cfg(small_cache, tmp_path / "b", max_steps=4, logging_steps=2))
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert b[0]["loss"] == pytest.approx((a[0]["loss"] + a[1]["loss"]) / 2, rel=1e-5)
    assert b[1]["loss"] == pytest.approx((a[2]["loss"] + a[3]["loss"]) / 2, rel=1e-5)


@pytest.mark.parametrize("kernel", ["dense", "auto"])
def test_a_step_reads_the_device_once_and_the_grad_norm_only_where_it_logs(small_cache, tmp_path, monkeypatch, kernel):
    """A step reads values back from tensors once (its metrics: one copy to the host, which also finds a non-finite
    loss), and the grad norm only at the steps that log it: on an accelerator each read waits for the device, and
    the host cannot queue the next batch's copy and forward ahead of it. The packed layout's sizes and the token
    count stay Python ints in the batch. (dense: one attention call a layer, as the accelerator's path makes; auto:
    the CPU's tree attention, which reads each tree's size on the host, where it runs.)"""
    with host_reads_per_step(monkeypatch) as reads:
        train(cfg(small_cache, tmp_path / "run", max_steps=6, logging_steps=3, attention_kernel=kernel))
    assert reads["after_step"] == [0, 0, 1, 0, 0, 1]
    if kernel == "dense":
        assert reads["train_step"] == [1] * 6
    else:
        assert len(reads["train_step"]) == 6 and min(reads["train_step"]) > 1  # the count can see the trees' reads
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [3, 6]


def test_gradient_accumulation_counts_optimizer_steps(small_cache, tmp_path):
    train(
        cfg(
            small_cache,
            tmp_path / "ga",
            max_steps=-1,
            num_train_epochs=1,
            gradient_accumulation_steps=2,
            logging_steps=1,
        )
    )
    metrics = read_metrics(tmp_path / "ga")
    assert [m["step"] for m in metrics] == [1, 2, 3]  # 24 rows / 4 per pass / 2 passes per step
    assert metrics[-1]["epoch"] == pytest.approx(1.0)


def test_one_cache_many_runs(small_cache, tmp_path):
    manifest = open_cache(small_cache).manifest
    hashes = {s["file"]: sha256_file(small_cache / s["file"]) for s in manifest["shards"]}
    mtime = (small_cache / "manifest.json").stat().st_mtime_ns
    r1 = train(cfg(small_cache, tmp_path / "r1", beta=0.05, learning_rate=1e-3, per_device_train_batch_size=4))
    r2 = train(cfg(small_cache, tmp_path / "r2", beta=0.3, learning_rate=5e-4, per_device_train_batch_size=6))
    assert r1.global_step == r2.global_step == 3
    assert read_metrics(tmp_path / "r1")[-1]["loss"] != read_metrics(tmp_path / "r2")[-1]["loss"]
    assert {f: sha256_file(small_cache / f) for f in hashes} == hashes
    assert (small_cache / "manifest.json").stat().st_mtime_ns == mtime


def test_apo_zero_unpaired_skips_kl(small_cache, tmp_path):
    train(cfg(small_cache, tmp_path / "apo", loss_type="apo_zero_unpaired"))
    assert all(m["kl"] == 0 for m in read_metrics(tmp_path / "apo"))


def test_train_time_max_length_equals_precompute_at_that_length(tmp_path, tiny_model_dir):

    data = write_jsonl(tmp_path / "d.jsonl", unpaired_rows())
    # a length that truncates completions but drops no row, so both caches pair rows identically
    short_len = max(len(r["prompt"]) for r in unpaired_rows()) + 3  # the tokenizer is character-level
    long = precompute(
        PrecomputeConfig(model=str(tiny_model_dir), dataset=str(data), output=str(tmp_path / "l"), max_length=64)
    )
    short = precompute(
        PrecomputeConfig(model=str(tiny_model_dir), dataset=str(data), output=str(tmp_path / "s"), max_length=short_len)
    )
    truncated, direct = CacheRows(open_cache(long), short_len), CacheRows(open_cache(short), short_len)
    assert len(truncated) == len(direct) == 24
    n_cut = 0
    for i in range(24):
        a, b = truncated[i], direct[i]
        n_cut += len(a["completion_ids"]) < len(CacheRows(open_cache(long), 64)[i]["completion_ids"])
        assert a["completion_ids"] == b["completion_ids"] and a["kl_completion_ids"] == b["kl_completion_ids"]
        np.testing.assert_allclose(a["ref_token_logps"], b["ref_token_logps"], atol=1e-5)
        assert a["ref_logp"] == pytest.approx(b["ref_logp"], abs=1e-4)
        assert a["ref_kl_logp"] == pytest.approx(b["ref_kl_logp"], abs=1e-4)
    assert n_cut > 0  # the test exercises truncation


def test_max_length_above_cached_is_refused(small_cache, tmp_path):
    with pytest.raises(KTOPipelineError, match="--max-length 128 is above the cache's max length 64"):
        train(cfg(small_cache, tmp_path / "x", max_length=128))


def test_non_empty_output_dir_is_refused(small_cache, tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "precious.txt").write_text("keep me")
    with pytest.raises(KTOPipelineError, match="--overwrite-output-dir"):
        train(cfg(small_cache, tmp_path / "x"))
    assert (tmp_path / "x" / "precious.txt").read_text() == "keep me"


def test_tokenizer_mismatch_is_refused(small_cache, tmp_path, other_tokenizer_model_dir):
    with pytest.raises(KTOPipelineError, match="tokenizer of --model .* differs"):
        train(cfg(small_cache, tmp_path / "x", model=str(other_tokenizer_model_dir)))


def test_incomplete_cache_is_refused(small_cache, tmp_path):
    import shutil

    broken = tmp_path / "cache"
    shutil.copytree(small_cache, broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["complete"] = False
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(KTOPipelineError, match="incomplete"):
        train(cfg(broken, tmp_path / "x"))


def test_imbalance_warning_matches_trl_rule():
    assert imbalance_warning(100, 100, 1.0, 1.0) is None
    assert imbalance_warning(100, 120, 1.3, 1.0) is None  # 1.3 * 100 / 120 is in [1, 4/3]
    assert "[1.2, 1.6]" in imbalance_warning(100, 120, 1.1, 1.0)
    assert "with no undesirable rows, KTO's undesirable term is absent" in imbalance_warning(24, 0, 1.0, 1.0)
    assert "no weight balances" in imbalance_warning(0, 5, 1.0, 1.0)
    msg = imbalance_warning(100, 300, 1.0, 1.0)
    assert "--desirable-weight in [3.0, 3.99]" in msg and "--undesirable-weight in [0.25, 0.33]" in msg
    assert imbalance_warning(100, 300, 3.5, 1.0) is None


def test_config_validation_names_the_flag(small_cache, tmp_path):
    with pytest.raises(KTOPipelineError, match="--per-device-train-batch-size: must be > 1 with --loss-type kto"):
        cfg(small_cache, tmp_path, per_device_train_batch_size=1)
    with pytest.raises(KTOPipelineError, match="--loss-type"):
        cfg(small_cache, tmp_path, loss_type="dpo")


def test_bf16_mixed_precision_on_cpu(small_cache, tmp_path):
    """--bf16 runs through accelerate's autocast (CPU here; on GPUs it is the default where supported)."""
    train(cfg(small_cache, tmp_path / "bf16", bf16=True, max_steps=2))
    metrics = read_metrics(tmp_path / "bf16")
    assert all(np.isfinite(m["loss"]) for m in metrics)
    assert abs(metrics[0]["rewards/chosen"]) < 0.05  # bf16 log-probs vs float32 reference: close, not exact


def test_pair_accuracy_counts_desirable_over_undesirable_within_a_prompt():

    reward = torch.tensor([0.5, 0.1, -1.0, -0.2, 3.0, 2.0, 9.0])
    label = torch.tensor([True, False, True, False, False, True, True])
    group = torch.tensor([0, 0, 1, 1, 2, 2, 3])  # prompt 3 has no undesirable row: no pair
    accuracy, count = pair_accuracy(reward, label, group)
    assert count == 3 and accuracy == pytest.approx(1 / 3)  # wins only in prompt 0
    # a shift of every reward changes the sign accuracy but not the pair accuracy
    assert pair_accuracy(reward + 10, label, group) == (accuracy, count)
    # several rows per prompt: every (desirable, undesirable) combination counts
    accuracy, count = pair_accuracy(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([True, False, False]), torch.zeros(3))
    assert (accuracy, count) == (1.0, 2)
    assert pair_accuracy(torch.ones(2), torch.tensor([True, True]), torch.tensor([0, 1]))[1] == 0


def test_eval_pair_accuracy_on_paired_data_only(tmp_path, tiny_model_dir, small_cache):
    pairs = [
        {"prompt": f"Q{i}: help?", "chosen": f" Sure, here is help {i}.", "rejected": " No." + "!" * (i % 3)}
        for i in range(8)
    ]
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    cache = precompute(
        PrecomputeConfig(model=str(tiny_model_dir), dataset=str(data), output=str(tmp_path / "c"), max_length=64)
    )
    result = train(cfg(cache, tmp_path / "run", eval_cache=str(cache), max_steps=2))
    (final,) = [m for m in result.metrics if "eval_loss" in m]
    assert final["eval_pairs"] == 8 and 0.0 <= final["eval_pair_accuracy"] <= 1.0
    # unpaired rows (every prompt distinct) have no pairs: the metric is left out, not reported as 0
    result = train(cfg(small_cache, tmp_path / "run2", eval_cache=str(small_cache), max_steps=1))
    (final,) = [m for m in result.metrics if "eval_loss" in m]
    assert "eval_pair_accuracy" not in final and final["eval_rows"] == 24


def test_packed_training_equals_padded_training(small_cache, tmp_path, monkeypatch):
    """Packed micro-batches (KL on cached prompt keys/values) and padded ones give the same losses, metrics and
    weights; the packed run executes exactly the tokens it needs, the padded one more."""
    from transformers import AutoModelForCausalLM

    packed = train(cfg(small_cache, tmp_path / "packed", train_sampling_strategy="sequential"))
    with monkeypatch.context() as mp:
        mp.setattr(plan_module, "packing_unsupported", lambda model: "attention implementation 'x'")
        padded = train(cfg(small_cache, tmp_path / "padded", train_sampling_strategy="sequential"))
    for a, b in zip(packed.metrics, padded.metrics, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key
    wa = AutoModelForCausalLM.from_pretrained(tmp_path / "packed").state_dict()
    wb = AutoModelForCausalLM.from_pretrained(tmp_path / "padded").state_dict()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=1e-5, rtol=1e-4, msg=name)
    state_a = json.loads((tmp_path / "packed" / "trainer_state.json").read_text())
    state_b = json.loads((tmp_path / "padded" / "trainer_state.json").read_text())
    assert state_a["packing"] == "packed" and state_a["kl_forward"] == "on the prompts' cached keys/values"
    assert state_a["tokens_executed"] >= state_a["tokens_needed"] > 0
    assert state_b["packing"].startswith("padded") and state_b["token_efficiency"] < state_a["token_efficiency"]
    assert state_b["tokens_needed"] == state_a["tokens_needed"]


def test_length_grouped_sampler_is_a_seeded_permutation_with_sorted_groups():

    lengths = np.random.default_rng(0).integers(1, 100, size=103)
    sampler = EpochSampler(103, seed=3, shuffle=True, lengths=lengths, group=20)
    order = list(sampler)
    assert sorted(order) == list(range(103)) and order == list(sampler)  # a permutation, reproducible
    for start in range(0, 103, 20):
        group = lengths[order[start : start + 20]]
        assert (np.diff(group) <= 0).all()  # longest first within each group
    sampler.use_epoch(1)
    assert list(sampler) != order
    plain = EpochSampler(103, seed=3, shuffle=True)
    assert sorted(list(plain)) == list(range(103)) and list(plain) != order


def test_a_model_other_than_the_caches_reference_is_noted(small_cache, tiny_model_dir, tmp_path, capsys):
    """--model naming another model than the reference's (here a copy elsewhere) says the policy may start away from
    its reference; the reference's own directory, however spelled, says nothing."""
    import shutil

    reference = open_cache(small_cache).manifest.reference_model
    train(cfg(small_cache, tmp_path / "same", max_steps=1, model=f"{reference}/"))
    assert "is not the model the cache's reference log-probs came from" not in capsys.readouterr().out
    other = shutil.copytree(tiny_model_dir, tmp_path / "other")
    train(cfg(small_cache, tmp_path / "other-run", max_steps=1, model=str(other)))
    assert (
        f"note: --model {other} is not the model the cache's reference log-probs came from" in capsys.readouterr().out
    )


@pytest.mark.parametrize("inside", ["", "runs/a"])
def test_an_output_dir_inside_the_cache_is_refused(small_cache, tmp_path, inside):
    import shutil

    cache = shutil.copytree(small_cache, tmp_path / "cache")
    with pytest.raises(KTOPipelineError, match="is inside the cache --cache .*Choose a directory outside the cache"):
        train(cfg(cache, cache / inside, max_steps=1, overwrite_output_dir=True))
    assert open_cache(cache, verify=True) and not (cache / "model.safetensors").exists()


def test_loader_processes_collate_the_same_batches(small_cache, tmp_path):
    """--dataloader-num-workers 1 (an accelerator's default: a process collates the next micro-batches while the device
    computes) trains exactly as collating in the training process: the same metrics and weights, bit for bit, across
    two epochs (its workers persist between them)."""
    from transformers import AutoModelForCausalLM

    runs = {}
    for workers in (0, 1):
        out = tmp_path / f"workers-{workers}"
        result = train(cfg(small_cache, out, dataloader_num_workers=workers, max_steps=8, logging_steps=1))
        runs[workers] = result.metrics, AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert len(runs[0][0]) == 8 and runs[0][0] == runs[1][0]  # (6 steps an epoch)
    assert all(torch.equal(a, runs[1][1][name]) for name, a in runs[0][1].items())


@pytest.mark.parametrize("name", SCHEDULERS)
def test_every_schedule_is_transformers_at_every_step(name):
    """`--lr-scheduler-type` gives transformers' `get_scheduler` (trl's trainers' schedule) exactly: the same learning
    rate at every step, warmup or not, past the last step too, and the same scheduler state (a checkpoint of either
    resumes under the other)."""
    from transformers import get_scheduler

    from kto_pipeline.stages.train.schedules import schedule

    for warmup, total in ((0, 7), (3, 10), (5, 6), (2, 1)):
        runs = []
        for make in (schedule, get_scheduler):
            optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
            scheduler = make(name, optimizer, warmup, total)
            lrs = []
            for _ in range(total + 3):
                lrs.append(scheduler.get_last_lr())
                optimizer.step()
                scheduler.step()
            runs.append((lrs, scheduler.state_dict()))
        assert runs[0] == runs[1], (name, warmup, total)
