"""`kto-pipeline generate`: reference and policy answers side by side, and their place in the report."""

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from helpers import run_cli, write_jsonl

from kto_pipeline import GenerateConfig, KTOPipelineError, PrecomputeConfig, TrainConfig, precompute, train
from kto_pipeline.generate import file_prompts, generate_samples
from kto_pipeline.report import write_report
from kto_pipeline.rundir import read_samples

TOPICS = [0, 1, 2, 3, 4, 0]  # pair 5 repeats pair 0's prompt: 12 rows, 5 distinct prompts
KEYS = {"prompt", "reference", "policy", "example_id", "label", "dataset_completions", "settings"}


def paired_rows() -> list[dict]:
    return [
        {
            "prompt": [{"role": "user", "content": f"Tell me about topic {topic}."}],
            "chosen": [{"role": "assistant", "content": f"Topic {topic} is great, pair {i}."}],
            "rejected": [{"role": "assistant", "content": f"No {i}."}],
        }
        for i, topic in enumerate(TOPICS)
    ]


@pytest.fixture(scope="module")
def paired_cache(tmp_path_factory, tiny_model_dir) -> Path:
    """A conversational paired cache: each prompt has a desirable and an undesirable row, one prompt four rows."""
    root = tmp_path_factory.mktemp("paired")
    data = write_jsonl(root / "paired.jsonl", paired_rows())
    return precompute(
        PrecomputeConfig(model=str(tiny_model_dir), dataset=str(data), output=str(root / "cache"), max_length=96)
    )


def _train(cache: Path, out: Path, **kw) -> Path:
    settings = {"per_device_train_batch_size": 4, "max_steps": 1, "learning_rate": 0.0, "seed": 0} | kw
    train(TrainConfig(cache=str(cache), output_dir=str(out), **settings))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, paired_cache) -> dict[str, Path]:
    """lr0: the policy is the reference (and --eval-cache is set); trained: full model; lora: an adapter (+ merged)."""
    root = tmp_path_factory.mktemp("runs")
    return {
        "lr0": _train(paired_cache, root / "lr0", eval_cache=str(paired_cache)),
        "trained": _train(paired_cache, root / "trained", learning_rate=5e-3, max_steps=6),
        "lora": _train(paired_cache, root / "lora", learning_rate=2e-2, max_steps=6, lora_r=4, merge=True),
    }


def _generate(tmp_path: Path, run: Path, name: str = "samples.jsonl", **kw) -> list[dict]:
    settings = {"max_new_tokens": 12, "batch_size": 3, "output": str(tmp_path / name)} | kw
    return read_samples(generate_samples(GenerateConfig(run=str(run), **settings)))


@pytest.fixture(scope="module")
def greedy(tmp_path_factory, runs, paired_cache) -> dict[str, list[dict]]:
    """The greedy answers that several tests only read, each generated once: the lr-0 run's to the prompts of its
    --eval-cache, the trained run's to those of --cache (the same cache)."""
    root = tmp_path_factory.mktemp("greedy")
    return {
        "lr0": _generate(root, runs["lr0"], name="lr0.jsonl"),
        "trained": _generate(root, runs["trained"], name="trained.jsonl", cache=str(paired_cache)),
    }


def cache_groups(cache: Path) -> list[dict]:
    """Independent reading of the cache: rows grouped by prompt, groups in order of first appearance."""
    rows = []
    for shard in sorted((cache / "shards").glob("*.arrow")):
        with pa.memory_map(str(shard)) as source:
            rows += pa.ipc.open_stream(source).read_all().to_pylist()
    groups: dict[tuple, dict] = {}
    for row in rows:
        group = groups.setdefault(tuple(row["prompt_ids"]), {"first": row, "rows": []})
        group["rows"].append(row)
    return list(groups.values())


# ------------------------------------------------------------------------------------------ answers


@pytest.mark.parametrize("do_sample", [False, True])
def test_policy_equal_to_reference_gives_the_same_answers(
    runs, greedy, paired_cache, tiny_model_dir, tmp_path, do_sample
):
    """lr 0: the policy is the reference, so greedy (and equally seeded sampled) answers are identical."""
    # prompts: the run's --eval-cache
    records = _generate(tmp_path, runs["lr0"], do_sample=True) if do_sample else greedy["lr0"]
    assert len(records) == 5  # one per distinct prompt
    assert any(r["reference"] for r in records)  # not vacuously equal
    assert [r["policy"] for r in records] == [r["reference"] for r in records]
    settings = records[0]["settings"]
    assert settings["cache"] == str(paired_cache) and settings["do_sample"] is do_sample
    assert settings["reference"] == str(tiny_model_dir.resolve())  # the reference the cache was made with


def test_batched_left_padded_answers_equal_one_prompt_at_a_time(runs, paired_cache, tiny_model_dir, tmp_path):
    """Independent check of padding and masking: plain HF greedy generation of each prompt alone, no padding."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = [{"prompt": "Hi"}, {"prompt": "A much longer prompt than the first"}, {"prompt": "Medium prompt"}]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    records = _generate(tmp_path, runs["trained"], prompts=str(prompts), batch_size=3)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for row, record in zip(rows, records, strict=True):
        ids = torch.tensor([tokenizer(row["prompt"])["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id)
        new = out[0, ids.shape[1] :].tolist()
        if tokenizer.eos_token_id in new:
            new = new[: new.index(tokenizer.eos_token_id)]
        assert record["reference"] == tokenizer.decode(new, skip_special_tokens=True).strip()
        assert record["prompt"] == row["prompt"]


def test_trained_run_one_line_per_distinct_prompt_with_the_cache_rows(runs, greedy, paired_cache, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(runs["trained"])
    groups = cache_groups(paired_cache)
    assert len(groups) == 5 and len(groups[0]["rows"]) == 4  # the repeated prompt: rows of pairs 0 and 5

    records = greedy["trained"]
    assert len(records) == 5
    for record, group in zip(records, groups, strict=True):
        assert set(record) == KEYS
        assert record["example_id"] == group["first"]["example_id"]
        assert record["label"] is group["first"]["label"]
        assert record["prompt"] == tokenizer.decode(group["first"]["prompt_ids"])
        assert record["prompt"].startswith("<|im_start|>user\nTell me about topic ")
        assert record["prompt"].endswith("<|im_start|>assistant\n")  # the generation prompt is part of it
        expected = [
            {"label": row["label"], "text": tokenizer.decode(row["completion_ids"], skip_special_tokens=True).strip()}
            for row in group["rows"]
        ]
        assert record["dataset_completions"] == expected
    assert records[0]["dataset_completions"][2] == {"label": True, "text": "Topic 0 is great, pair 5."}
    assert records[0]["label"] is True and records[0]["dataset_completions"][1]["label"] is False
    # the trained policy answers differently; the reference is the same model as for the lr-0 run
    assert any(r["policy"] != r["reference"] for r in records)
    assert [r["reference"] for r in records] == [r["reference"] for r in greedy["lr0"]]

    first_two = _generate(tmp_path, runs["trained"], name="two.jsonl", cache=str(paired_cache), num_prompts=2)
    assert [r["example_id"] for r in first_two] == [g["first"]["example_id"] for g in groups[:2]]
    assert [r["policy"] for r in first_two] == [r["policy"] for r in records[:2]]


def test_seeded_sampling_is_reproducible(runs, greedy, paired_cache, tmp_path):
    sample = {"do_sample": True, "temperature": 1.5, "top_p": 0.95, "max_new_tokens": 16, "cache": str(paired_cache)}
    a = _generate(tmp_path, runs["trained"], "a.jsonl", seed=1, **sample)
    b = _generate(tmp_path, runs["trained"], "b.jsonl", seed=1, **sample)
    c = _generate(tmp_path, runs["trained"], "c.jsonl", seed=2, **sample)
    assert a == b
    for role in ("reference", "policy"):
        assert [r[role] for r in a] != [r[role] for r in c]
        assert [r[role] for r in a] != [r[role] for r in greedy["trained"]]
    assert a[0]["settings"]["seed"] == 1 and a[0]["settings"]["temperature"] == 1.5


def test_lora_run_is_the_adapter_merged_into_the_reference(runs, paired_cache, tiny_model_dir, tmp_path):
    lora = runs["lora"]
    assert (lora / "adapter_config.json").exists() and not (lora / "config.json").exists()
    records = _generate(tmp_path, lora, cache=str(paired_cache))
    assert len(records) == 5 and any(r["policy"] != r["reference"] for r in records)  # the adapter is applied
    assert records[0]["settings"]["reference"] == str(tiny_model_dir.resolve())
    # the merged full model (no run_config.json, so reference and prompts are given) answers the same
    merged = _generate(tmp_path, lora / "merged", "m.jsonl", reference=str(tiny_model_dir), cache=str(paired_cache))
    assert [r["policy"] for r in merged] == [r["policy"] for r in records]
    assert [r["reference"] for r in merged] == [r["reference"] for r in records]


# ------------------------------------------------------------------------------------------ prompts file


def test_prompts_file_with_strings_and_chat_messages(runs, tmp_path):
    messages = [{"role": "user", "content": "Hi <b>there</b>"}]
    rows = [{"prompt": "Is 1 < 2 & 3?"}, {"prompt": messages}, {"prompt": "Is 1 < 2 & 3?"}, {"prompt": "unused"}]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    records = _generate(tmp_path, runs["lr0"], prompts=str(prompts), num_prompts=2)  # --prompts wins over eval cache
    assert [r["prompt"] for r in records] == [
        "Is 1 < 2 & 3?",
        "<|im_start|>user\nHi <b>there</b><|im_end|>\n<|im_start|>assistant\n",
    ]
    for r in records:
        assert set(r) == {"prompt", "reference", "policy", "settings"}  # no dataset rows to show
        assert r["policy"] == r["reference"]
    assert records[0]["settings"]["prompts"] == str(prompts) and "cache" not in records[0]["settings"]


def test_prompts_file_problems_name_the_line(tmp_path):
    from kto_pipeline.demo.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    cases = [
        ('{"prompt": "ok"}\n{"prompt": \n', "line 2: not valid JSON"),
        ('{"text": "hello"}\n', 'line 1: no "prompt" key'),
        ('{"prompt": 3}\n', '"prompt" must be a string or a list of {role, content} messages, got int'),
        ('{"prompt": ""}\n', "line 1: the prompt is empty"),
        ("\n", "holds no prompts"),
    ]
    for text, message in cases:
        (tmp_path / "p.jsonl").write_text(text)
        with pytest.raises(KTOPipelineError, match=message.replace("{", "\\{").replace("}", "\\}")):
            file_prompts(tmp_path / "p.jsonl", tokenizer, 8)
    tokenizer.chat_template = None
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(KTOPipelineError, match="no chat template"):
        file_prompts(tmp_path / "p.jsonl", tokenizer, 8)
    with pytest.raises(KTOPipelineError, match="no such file"):
        file_prompts(tmp_path / "missing.jsonl", tokenizer, 8)


# ------------------------------------------------------------------------------------------ command line


def test_cli_writes_samples_into_the_run_and_previews_them(runs, tmp_path, monkeypatch, capsys):
    run = shutil.copytree(runs["lr0"], tmp_path / "run")
    code, out, err = run_cli(monkeypatch, capsys, "generate", "--run", str(run), "--max-new-tokens", "8")
    assert code == 0, err
    assert f"samples: {run / 'samples.jsonl'}" in out
    assert "5 prompts; the policy's answer differs from the reference's on 0" in out
    assert "[1] prompt    <|im_start|>user\\nTell me about topic 0." in out
    records = read_samples(run / "samples.jsonl")
    assert len(records) == 5 and records[0]["settings"]["max_new_tokens"] == 8


@pytest.mark.parametrize(
    "args,fragment",
    [
        ([], "no prompts to answer: the run was trained without --eval-cache"),
        (["--prompts", "p.jsonl", "--cache", "c"], "--prompts: choose one prompt source"),
        (["--temperature", "0.7"], "--temperature: only applies with --do-sample"),
        (["--top-p", "1.5", "--do-sample"], "--top-p: must be in (0, 1]"),
    ],
)
def test_cli_errors_are_one_line(runs, monkeypatch, capsys, args, fragment):
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--run", str(runs["trained"]), *args)
    assert code == 1 and err.startswith("error: ") and fragment in err, err
    assert err.strip().count("\n") == 0 and "Traceback" not in err


def test_cli_errors_for_a_missing_or_modelless_run(tmp_path, monkeypatch, capsys, paired_cache):
    code, _, err = run_cli(
        monkeypatch, capsys, "generate", "--run", str(tmp_path / "nope"), "--cache", str(paired_cache)
    )
    assert code == 1 and err.startswith(f"error: --run {tmp_path / 'nope'}: no such directory"), err
    assert err.strip().count("\n") == 0
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--run", str(tmp_path / "empty"))
    assert code == 1 and "no saved model here" in err, err


def test_several_processes_are_refused_before_any_model_loads(runs, paired_cache, tmp_path, monkeypatch):
    """generate has no collectives and shards nothing: under torchrun every process would load both models and
    write the same file. It refuses, naming the count, before it reads the run."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "samples.jsonl"
    with pytest.raises(KTOPipelineError, match=r"generate runs in one process \(this launch started 2\)"):
        generate_samples(GenerateConfig(run=str(runs["trained"]), cache=str(paired_cache), output=str(out)))
    assert not out.exists()


def test_reference_with_another_tokenizer_is_refused(runs, paired_cache, other_tokenizer_model_dir, tmp_path):
    config = GenerateConfig(run=str(runs["trained"]), reference=str(other_tokenizer_model_dir), cache=str(paired_cache))
    with pytest.raises(KTOPipelineError, match="tokenizer of the reference .* differs from the run's"):
        generate_samples(config)


# ------------------------------------------------------------------------------------------ report


def test_report_shows_samples_side_by_side_escaped(runs, paired_cache, tmp_path):
    sweep = tmp_path / "sweep"
    with_samples = shutil.copytree(runs["trained"], sweep / "a")
    shutil.copytree(runs["lr0"], sweep / "b")  # no samples.jsonl: no section
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Is 1 < 2 & <b>bold</b>?"}])
    generate_samples(GenerateConfig(run=str(with_samples), prompts=str(prompts), max_new_tokens=8))
    generate_samples(
        GenerateConfig(
            run=str(with_samples), cache=str(paired_cache), max_new_tokens=8, output=str(tmp_path / "other.jsonl")
        )
    )
    text = write_report(sweep).read_text()
    assert text.count("<h2>Samples</h2>") == 1
    assert 'id="samples-a"' in text and 'id="samples-b"' not in text
    assert "Is 1 &lt; 2 &amp; &lt;b&gt;bold&lt;/b&gt;?" in text and "<b>bold</b>" not in text
    (record,) = read_samples(with_samples / "samples.jsonl")
    import html

    assert f"<td>{html.escape(record['reference']) or '<em>(empty)</em>'}</td>" in text
    assert "white-space:pre-wrap" in text

    # samples from a cache carry the dataset's labelled completions
    shutil.copy(tmp_path / "other.jsonl", with_samples / "samples.jsonl")
    text = write_report(sweep).read_text()
    assert "<th>dataset</th>" in text and 'class="good">desirable: Topic 0 is great, pair 5.</div>' in text
    assert "&lt;|im_start|&gt;user" in text
    assert "<h2>Samples</h2>" not in write_report(sweep / "b").read_text()
