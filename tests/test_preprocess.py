"""Stage 1's preprocessing: checked from Arrow before any heavy work, tokenized with datasets.map into the
datasets cache (reused, independent of --num-proc and --max-length), and bad rows named before any cost."""

import shutil
import time

import datasets
import pytest
from helpers import conversational_rows, unpaired_rows, write_jsonl

from kto_pipeline import KTOPipelineError, PrecomputeConfig, precompute
from kto_pipeline.cache import open_cache, read_manifest
from kto_pipeline.models import load_tokenizer
from kto_pipeline.stages.precompute.stage import prepare_rows


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """A fresh datasets cache for this test (tokenized files land in HF_DATASETS_CACHE/kto_pipeline)."""
    path = tmp_path / "hf-datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(path))
    return path


def tokenized_files(hf_cache):
    return sorted(p.name for p in (hf_cache / "kto_pipeline").glob("tokenized-*"))


def rows_of(cache):
    return open_cache(cache).table.to_pylist()


def paired_rows(n: int) -> list[dict]:
    return [
        {
            "prompt": f"Q{i}: {'what about cats' if i % 2 else 'the weather'}?",
            "chosen": " Yes" + "!" * (i % 4),
            "rejected": " No" + "." * (i % 3),
        }
        for i in range(n)
    ]


def test_second_precompute_reads_the_tokenized_rows_from_the_datasets_cache(tmp_path, tiny_model_dir, hf_cache):
    data = write_jsonl(tmp_path / "d.jsonl", unpaired_rows(24))
    run = dict(model=str(tiny_model_dir), dataset=str(data))
    first = precompute(PrecomputeConfig(**run, output=str(tmp_path / "a"), max_length=64))
    files = tokenized_files(hf_cache)
    assert len(files) == 1 and files[0].startswith("tokenized-kto-")
    # another --max-length keeps other rows from the same tokens: no second tokenization
    second = precompute(PrecomputeConfig(**run, output=str(tmp_path / "b"), max_length=54))
    assert not read_manifest(first)["timing"]["preprocess_cached"]
    assert read_manifest(second)["timing"]["preprocess_cached"]
    assert tokenized_files(hf_cache) == files
    # ... and gives the cache a run without the datasets cache gives
    shutil.rmtree(hf_cache)
    fresh = precompute(PrecomputeConfig(**run, output=str(tmp_path / "c"), max_length=54))
    assert not read_manifest(fresh)["timing"]["preprocess_cached"]
    assert rows_of(second) == rows_of(fresh)
    assert read_manifest(second)["counts"] == read_manifest(fresh)["counts"]


def test_other_data_or_tokenizer_is_tokenized_again(tmp_path, tiny_model_dir, other_tokenizer_model_dir, hf_cache):
    data = write_jsonl(tmp_path / "d.jsonl", unpaired_rows(12))
    precompute(PrecomputeConfig(model=str(tiny_model_dir), dataset=str(data), output=str(tmp_path / "a")))
    precompute(PrecomputeConfig(model=str(other_tokenizer_model_dir), dataset=str(data), output=str(tmp_path / "b")))
    write_jsonl(data, unpaired_rows(13))
    changed = precompute(PrecomputeConfig(model=str(tiny_model_dir), dataset=str(data), output=str(tmp_path / "c")))
    assert len(tokenized_files(hf_cache)) == 3
    assert read_manifest(changed)["counts"]["rows"] == 13


@pytest.mark.parametrize("rows", [paired_rows(41), conversational_rows(30)], ids=["paired", "conversational"])
def test_two_tokenizing_processes_give_the_same_cache(tmp_path, tiny_model_dir, hf_cache, monkeypatch, rows):
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    one = precompute(PrecomputeConfig(model=str(tiny_model_dir), dataset=str(data), output=str(tmp_path / "one")))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "other-hf"))
    two = precompute(
        PrecomputeConfig(model=str(tiny_model_dir), dataset=str(data), output=str(tmp_path / "two"), num_proc=2)
    )
    assert (
        len(list((tmp_path / "other-hf" / "kto_pipeline").glob("tokenized-*_of_00002.arrow"))) == 2
    )  # two workers ran
    assert rows_of(one) == rows_of(two)
    assert read_manifest(two)["timing"]["num_proc"] == 2
    if "chosen" in rows[0]:  # pair i -> example ids 2i (chosen, desirable) and 2i + 1, across the workers' split
        by_id = {r["example_id"]: r for r in rows_of(two)}
        assert sorted(by_id) == list(range(82)) and all(by_id[2 * i]["label"] for i in range(41))


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"label": "maybe"}, "row 17777: label 'maybe' is not a boolean"),
        ({"completion": None}, "row 17777: 'completion' must be a string or a non-empty list"),
        (
            {"completion": 5},
            "row 17777: 'completion' must be a string or a non-empty list of {role, content} messages, got int",
        ),
        ({"prompt": [{"role": "user", "content": "hi"}]}, "row 17777: 'prompt' is a messages but in the rows"),
    ],
    ids=["label", "null", "int", "mixed"],
)
def test_a_bad_row_deep_in_a_big_file_is_named_before_any_work(tmp_path, tiny_model_dir, hf_cache, bad, message):
    """`prepare_rows`, the phase that runs before the reference model loads, names the row in seconds."""
    rows = [{"prompt": f"p{i}", "completion": " c", "label": i % 2 == 0} for i in range(20_000)]
    rows[17_777].update(bad)
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    config = PrecomputeConfig(model=str(tiny_model_dir), dataset=str(data), output=str(tmp_path / "c"))
    started = time.perf_counter()
    with pytest.raises(KTOPipelineError, match=message.replace("{", r"\{").replace("}", r"\}")):
        prepare_rows(config, load_tokenizer(str(tiny_model_dir)))
    assert time.perf_counter() - started < 30  # loading 20k rows; tokenizing them would come after
    assert tokenized_files(hf_cache) == []  # nothing was tokenized
    assert not (tmp_path / "c").exists()  # nothing half-written


def test_a_malformed_json_line_is_named(tmp_path, tiny_model_dir, hf_cache):
    data = write_jsonl(tmp_path / "d.jsonl", unpaired_rows(30))
    lines = data.read_text().splitlines()
    lines[21] = lines[21][:-1]  # the closing brace is missing
    data.write_text("\n".join(lines) + "\n")
    with pytest.raises(KTOPipelineError, match="line 22 is not valid JSON"):
        precompute(PrecomputeConfig(model=str(tiny_model_dir), dataset=str(data), output=str(tmp_path / "c")))
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("num_proc", [1, 2])
def test_a_row_the_tokenizer_refuses_is_named_and_nothing_is_left(tmp_path, tiny_model_dir, hf_cache, num_proc):
    """Errors raised while tokenizing (here: the chat template refuses a role), in the workers too."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'robot' %}{{ raise_exception('no robots') }}{% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    rows = conversational_rows(40)
    rows[33]["prompt"] = [{"role": "robot", "content": "beep"}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(KTOPipelineError, match="row 33: the chat template refused its messages.*no robots"):
        precompute(PrecomputeConfig(model=str(model), dataset=str(data), output=str(tmp_path / "c"), num_proc=num_proc))
    assert tokenized_files(hf_cache) == []  # no tokenized file, complete or partial
    assert not (tmp_path / "c").exists()


def test_save_to_disk_sources_are_tokenized_into_the_datasets_cache_not_beside_the_data(
    tmp_path, tiny_model_dir, hf_cache
):
    source = tmp_path / "saved"
    datasets.Dataset.from_list(unpaired_rows(12)).save_to_disk(str(source))
    before = sorted(p.name for p in source.iterdir())
    precompute(PrecomputeConfig(model=str(tiny_model_dir), dataset=str(source), output=str(tmp_path / "c")))
    assert sorted(p.name for p in source.iterdir()) == before
    assert len(tokenized_files(hf_cache)) == 1
