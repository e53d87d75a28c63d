"""`kto-pipeline generate --num-return-sequences N`: sampled completions of a prompts file by the policy alone,
written as dataset rows, labelled by the user's function (--label-with, or `kto-pipeline label`)."""

import json
import shutil
from pathlib import Path

import pytest
from helpers import run_cli, train_config, write_jsonl

from kto_pipeline import GenerateConfig, KTOPipelineError, PrecomputeConfig, precompute, train
from kto_pipeline.generate import generate_completions, generate_samples
from kto_pipeline.label import label_file
from kto_pipeline.stages.precompute.data import check_source, load_source

PROMPTS = [
    {"prompt": "User: say something nice?\nAssistant:", "gold": "nice"},
    {"prompt": "User: what is rain?\nAssistant:", "gold": "water"},
    {"prompt": "User: say something nice?\nAssistant:", "gold": "again"},  # a repeated prompt is a row of its own
]
RULE = 'def label(row):\n    return sum(map(ord, row["completion"])) % 2 == 0\n'


def rule(row: dict) -> bool:
    """RULE, written here again: the labels are checked against an independent reading of it."""
    return sum(map(ord, row["completion"])) % 2 == 0


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_cache) -> Path:
    out = tmp_path_factory.mktemp("rounds") / "run"
    train(train_config(small_cache, out, max_steps=1))
    return out


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", PROMPTS)


def _config(run: Path, prompts: Path, out: Path, **kw) -> GenerateConfig:
    settings = {"num_return_sequences": 3, "max_new_tokens": 8, "batch_size": 9} | kw
    return GenerateConfig(run=str(run), prompts=str(prompts), output=str(out), **settings)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------------------ completions


@pytest.fixture(scope="module")
def unlabeled(run, prompts, tmp_path_factory) -> Path:
    """3 completions of each row of PROMPTS, seed 0, no labeller."""
    return generate_completions(_config(run, prompts, tmp_path_factory.mktemp("unlabeled") / "c.jsonl"))


def test_n_completions_per_prompt_row_with_the_dataset_columns(run, unlabeled):
    rows = _rows(unlabeled)
    assert len(rows) == 9  # 3 prompt rows (one repeated) x 3
    for i, row in enumerate(rows):
        source = PROMPTS[i // 3]
        assert list(row) == ["prompt", "gold", "completion", "label", "policy", "sample_index", "generation"]
        assert row["prompt"] == source["prompt"] and row["gold"] == source["gold"]
        assert isinstance(row["completion"], str) and row["label"] is None
        assert row["policy"] == {"run": str(run.resolve()), "global_step": 1}
        assert row["sample_index"] == i % 3
        assert row["generation"]["do_sample"] is True and row["generation"]["seed"] == 0
    assert len({row["completion"] for row in rows[:3]}) == 3  # sampled: the copies of a prompt differ


def test_message_prompts_get_an_assistant_message_from_the_policy_alone(run, tmp_path, monkeypatch):
    import kto_pipeline.models

    loaded, load_model = [], kto_pipeline.models.load_model

    def spy(name, *args, **kwargs):
        loaded.append(name)
        return load_model(name, *args, **kwargs)

    monkeypatch.setattr(kto_pipeline.models, "load_model", spy)
    messages = [{"role": "user", "content": "Tell me about cats."}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": messages, "tools": None}])
    rows = _rows(generate_completions(_config(run, path, tmp_path / "c.jsonl", num_return_sequences=2)))
    assert loaded == [str(run)]  # no reference
    assert len(rows) == 2
    for row in rows:
        assert row["prompt"] == messages and "tools" in row
        (message,) = row["completion"]
        assert message["role"] == "assistant" and isinstance(message["content"], str)


def test_seeded_sampling_gives_the_same_file(run, prompts, unlabeled, tmp_path):
    again = generate_completions(_config(run, prompts, tmp_path / "a.jsonl"))
    other = generate_completions(_config(run, prompts, tmp_path / "b.jsonl", seed=1))
    assert again.read_bytes() == unlabeled.read_bytes()
    assert [r["completion"] for r in _rows(other)] != [r["completion"] for r in _rows(unlabeled)]
    assert _rows(other)[0]["generation"]["seed"] == 1


# ------------------------------------------------------------------------------------------ labels


def test_rule_labeller_labels_rows_that_precompute_accepts(run, prompts, unlabeled, tmp_path, tiny_model_dir):
    rules = tmp_path / "rules.py"
    rules.write_text(RULE)
    out = generate_completions(_config(run, prompts, tmp_path / "c.jsonl", label_with=f"{rules}:label"))
    rows = _rows(out)
    assert [row["label"] for row in rows] == [rule(row) for row in rows]
    assert {row["label"] for row in rows} == {True, False}
    assert [{**row, "label": None} for row in rows] == _rows(unlabeled)  # the same rows, labelled

    dataset = load_source(str(out))
    assert check_source(dataset) == "unpaired" and len(dataset) == 9
    cache = precompute(
        PrecomputeConfig(model=str(tiny_model_dir), dataset=str(out), output=str(tmp_path / "cache"), max_length=64)
    )
    counts = json.loads((cache / "manifest.json").read_text())["counts"]
    assert counts["rows"] == 9 and counts["desirable"] == sum(row["label"] for row in rows)


def test_unlabeled_rows_are_refused_by_precompute(unlabeled, tmp_path, tiny_model_dir):
    message = r"row 0: label is null: the rows have no label; label them first: `kto-pipeline label"
    with pytest.raises(KTOPipelineError, match=message):
        check_source(load_source(str(unlabeled)))
    with pytest.raises(KTOPipelineError, match=message):
        precompute(PrecomputeConfig(model=str(tiny_model_dir), dataset=str(unlabeled), output=str(tmp_path / "cache")))
    # a hand-labelled row among them: the first row still unlabeled is named
    rows = _rows(unlabeled)
    rows[0]["label"] = True
    with pytest.raises(KTOPipelineError, match="row 1: label is null"):
        check_source(load_source(str(write_jsonl(tmp_path / "half.jsonl", rows))))


def test_label_command_and_a_dotted_module(unlabeled, tmp_path, monkeypatch, capsys):
    (tmp_path / "my_rules_dotted.py").write_text(RULE)
    monkeypatch.chdir(tmp_path)  # a dotted module is imported from the current directory
    code, out, err = run_cli(
        monkeypatch, capsys, "label", str(unlabeled), "--label-with", "my_rules_dotted:label", "--output", "l.jsonl"
    )
    assert code == 0, err
    rows = _rows(tmp_path / "l.jsonl")
    assert [row["label"] for row in rows] == [rule(row) for row in rows]
    trues = sum(row["label"] for row in rows)
    assert f"labels: {trues} true (desirable), {9 - trues} false (undesirable), 0 unlabeled" in out
    # the same labels as labelling while generating; relabelling replaces labels, in place with --overwrite
    (tmp_path / "flip.py").write_text("def label(row):\n    return not row['label']\n")
    label_file(tmp_path / "l.jsonl", "flip.py:label", tmp_path / "l.jsonl", overwrite=True)
    assert [row["label"] for row in _rows(tmp_path / "l.jsonl")] == [not rule(row) for row in rows]


# ------------------------------------------------------------------------------------------ bad input


ROWS = [{"prompt": "p", "completion": "a"}, {"prompt": "p", "completion": "bb"}, {"prompt": "p", "completion": "c"}]


@pytest.mark.parametrize(
    "source,spec,fragment",
    [
        (None, "no_such_module_xyz:label", "no module named 'no_such_module_xyz' in the current directory"),
        (None, "missing.py:label", "missing.py: no such file"),
        ("def label(row)\n", "rules.py:label", r"importing .*rules.py failed: SyntaxError: .*\(at rules.py:1\)"),
        ("import no_such_dep_xyz\n", "rules.py:label", "importing .*rules.py failed: ModuleNotFoundError"),
        ("def rule(row):\n    return True\n", "rules.py:label", "rules.py has no 'label'; it defines rule"),
        ("label = 3\n", "rules.py:label", "label in .*rules.py is a int, not a function"),
        (
            "def label(row):\n    return {'a': True, 'c': False}[row['completion']]\n",
            "rules.py:label",
            r"the labeller raised on .*l.jsonl line 2: KeyError: 'bb' \(at rules.py:2\)",
        ),
        (
            "def label(row):\n    return 1\n",
            "rules.py:label",
            r"line 1 the labeller returned 1 \(int\); it must return",
        ),
        ("def label(row):\n    return None\n", "rules.py:label", r"returned None \(NoneType\)"),
        (
            "def label(row):\n    return row['completion'] * 80\n",
            "rules.py:label",
            r"returned 'aaaa.*\.\.\. \(str\)",
        ),
        ("", "rules.py:", "expected MODULE:FUNCTION"),
    ],
)
def test_labeller_problems_are_named_and_nothing_is_written(tmp_path, monkeypatch, capsys, source, spec, fragment):
    monkeypatch.chdir(tmp_path)
    if source is not None:
        (tmp_path / "rules.py").write_text(source)
    rows = write_jsonl(tmp_path / "l.jsonl", ROWS)
    with pytest.raises(KTOPipelineError, match=fragment):
        label_file(rows, spec, tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()
    code, _, err = run_cli(monkeypatch, capsys, "label", str(rows), "--label-with", spec, "--output", "out.jsonl")
    assert code == 1 and err.startswith("error: --label-with ") and err.strip().count("\n") == 0, err
    assert not (tmp_path / "out.jsonl").exists()


def test_numpy_bools_are_labels_and_the_input_file_is_checked(tmp_path):
    (tmp_path / "np_rules.py").write_text(
        "import numpy as np\ndef label(row):\n    return np.bool_(len(row['completion']) > 1)\n"
    )
    rows = write_jsonl(tmp_path / "l.jsonl", ROWS)
    out = label_file(rows, f"{tmp_path / 'np_rules.py'}:label", tmp_path / "out.jsonl")
    assert [r["label"] for r in _rows(out)] == [False, True, False]
    with pytest.raises(KTOPipelineError, match="out.jsonl exists. Pass --overwrite"):
        label_file(rows, f"{tmp_path / 'np_rules.py'}:label", out)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "p", "completion": "a"}\n{"prompt": "p"}\n')
    with pytest.raises(
        KTOPipelineError, match='bad.jsonl line 2: each line must be an object with "prompt" and "completion"'
    ):
        label_file(tmp_path / "bad.jsonl", f"{tmp_path / 'np_rules.py'}:label", tmp_path / "o.jsonl")


def test_generate_labeller_problems_name_the_row_and_write_nothing(run, prompts, tmp_path):
    out = tmp_path / "c.jsonl"
    (tmp_path / "rules.py").write_text(
        "def label(row):\n    if row['gold'] == 'water':\n        raise ValueError('no')\n    return True\n"
    )
    with pytest.raises(
        KTOPipelineError, match=r"raised on row 3 \(--prompts line 2, sample 0\): ValueError: no \(at rules.py:3\)"
    ):
        generate_completions(_config(run, prompts, out, label_with=f"{tmp_path / 'rules.py'}:label"))
    assert not out.exists() and not list(tmp_path.glob(".c.jsonl*"))
    # a labeller that cannot be loaded is refused before any model loads
    with pytest.raises(KTOPipelineError, match="has no 'lable'; it defines label"):
        generate_completions(_config(run, prompts, out, label_with=f"{tmp_path / 'rules.py'}:lable"))


# ------------------------------------------------------------------------------------------ command line


def test_cli_default_output_under_the_run_and_overwrite(run, prompts, tmp_path, monkeypatch, capsys):
    copy = shutil.copytree(run, tmp_path / "run")
    args = ["generate", "--run", str(copy), "--prompts", str(prompts), "--num-return-sequences", "2"]
    code, out, err = run_cli(monkeypatch, capsys, *args, "--max-new-tokens", "4")
    assert code == 0, err
    path = copy / "rounds" / "completions.jsonl"
    assert f"completions: {path}" in out
    assert "6 rows: completions of 2 prompts; labels: 0 true (desirable), 0 false (undesirable), 6 unlabeled" in out
    assert "label them before `precompute --append`: kto-pipeline label" in out
    code, _, err = run_cli(monkeypatch, capsys, *args)
    assert code == 1 and f"--output {path} exists. Pass --overwrite" in err, err
    code, _, err = run_cli(monkeypatch, capsys, *args, "--max-new-tokens", "4", "--overwrite", "--num-prompts", "1")
    assert code == 0, err
    assert len(_rows(path)) == 2


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--num-return-sequences", "0"], "--num-return-sequences: must be at least 1, got 0"),
        (["--num-return-sequences", "4", "--no-do-sample"], "4 greedy completions of a prompt are one completion"),
        (
            ["--num-return-sequences", "2", "--reference", "x"],
            "--reference: does not apply with --num-return-sequences",
        ),
        (["--label-with", "rules.py:label"], "--label-with: only applies with --num-return-sequences"),
        (["--overwrite"], "--overwrite: only applies with --num-return-sequences"),
        (["--num-return-sequences", "2", "--label-with", "rules"], "--label-with: expected MODULE:FUNCTION"),
    ],
)
def test_cli_setting_errors_are_one_line(run, prompts, monkeypatch, capsys, args, fragment):
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--run", str(run), "--prompts", str(prompts), *args)
    assert code == 1 and err.startswith("error: ") and fragment in err, err
    assert err.strip().count("\n") == 0


def test_rounds_need_a_prompts_file(run, small_cache):
    with pytest.raises(
        KTOPipelineError, match="--num-return-sequences: .* pass --prompts FILE.jsonl instead of --cache"
    ):
        GenerateConfig(run=str(run), cache=str(small_cache), num_return_sequences=2)
    config = GenerateConfig(run=str(run), prompts="p.jsonl", num_return_sequences=1, do_sample=False)
    assert not config.sampling  # one greedy completion per prompt is allowed


def test_several_processes_are_refused(run, prompts, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "c.jsonl"
    with pytest.raises(KTOPipelineError, match=r"generate runs in one process \(this launch started 2\)"):
        generate_samples(_config(run, prompts, out))  # the Python API's one entry point runs rounds too
    assert not out.exists()
