"""HH-RLHF -> conversational paired rows: the bundled data converts, malformed dialogues are refused by line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from helpers import run_script

from kto_pipeline.demo.hh_rlhf import bundled_path, convert_file, convert_pair, read_pairs, split_dialogue
from kto_pipeline.errors import KTOPipelineError

ROOT = Path(__file__).resolve().parents[1]


def test_split_dialogue_roles_and_content():
    text = "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: How are you?\n\nAssistant: Fine, thanks."
    assert split_dialogue(text, "x") == [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "How are you?"},
        {"role": "assistant", "content": "Fine, thanks."},
    ]


def test_consecutive_turns_of_one_speaker_are_joined():
    text = "\n\nHuman: a\n\nAssistant: b\n\nAssistant: c\n\nHuman: d\n\nAssistant: e"
    messages = split_dialogue(text, "x")
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[1]["content"] == "b\n\nc"


def test_convert_pair_splits_off_the_last_answer():
    shared = "\n\nHuman: Can you help me?\n\nAssistant: Sure.\n\nHuman: Do something bad."
    pair = convert_pair({"chosen": shared + "\n\nAssistant: No.", "rejected": shared + "\n\nAssistant: Ok!"}, 7)
    assert [m["role"] for m in pair["prompt"]] == ["user", "assistant", "user"]
    assert pair["chosen"] == [{"role": "assistant", "content": "No."}]
    assert pair["rejected"] == [{"role": "assistant", "content": "Ok!"}]


def test_the_bundled_file_converts_whole():
    lines = list(read_pairs(bundled_path()))
    assert len(lines) == 1200
    pairs = [convert_pair(row, line) for line, row in lines]
    assert all(p["prompt"][0]["role"] == "user" and p["prompt"][-1]["role"] == "user" for p in pairs)
    assert sum(len(p["prompt"]) == 1 for p in pairs) > 300  # the demo's single-turn rows


@pytest.mark.parametrize(
    "row,fragments",
    [
        ({"chosen": "just text", "rejected": "just text"}, ["line 3, 'chosen'", "starts with a Human turn"]),
        (
            {"chosen": "\n\nAssistant: hi\n\nHuman: x", "rejected": "\n\nAssistant: hi\n\nHuman: y"},
            ["line 3, 'chosen'", "it starts with an Assistant turn"],
        ),
        (
            {"chosen": "\n\nHuman: a\n\nAssistant: b\n\nHuman: c", "rejected": "\n\nHuman: a\n\nAssistant: d"},
            ["line 3, 'chosen'", "ends with a Human turn"],
        ),
        (
            {"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: z\n\nAssistant: d"},
            ["line 3:", "share every turn but the last answer"],
        ),
        ({"chosen": "\n\nHuman: a\n\nAssistant: b"}, ["line 3:", "no 'rejected' field"]),
    ],
)
def test_malformed_rows_are_refused_and_nothing_is_written(tmp_path, row, fragments):
    good = {"chosen": "\n\nHuman: q\n\nAssistant: yes", "rejected": "\n\nHuman: q\n\nAssistant: no"}
    source = tmp_path / "src.jsonl.gz"
    with gzip.open(source, "wt") as f:
        for r in (good, good, row, good):
            f.write(json.dumps(r) + "\n")
    out = tmp_path / "out.jsonl"
    with pytest.raises(KTOPipelineError) as info:
        convert_file(source, {str(out): (0, 2)})
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert not out.exists()


def test_script_reports_a_bad_line_in_one_line(tmp_path):
    source = tmp_path / "src.jsonl"
    source.write_text(
        json.dumps({"chosen": "\n\nHuman: q\n\nAssistant: a", "rejected": "\n\nHuman: q\n\nAssistant: b"})
    )
    source.write_text(source.read_text() + "\n{not json\n")
    result = run_script(ROOT / "scripts" / "convert_hh_rlhf.py", str(tmp_path / "o.jsonl"), "--source", str(source))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ") and "line 2: not valid JSON" in result.stderr


def test_script_writes_the_single_turn_pairs(tmp_path):
    out = tmp_path / "single.jsonl"
    result = run_script(ROOT / "scripts" / "convert_hh_rlhf.py", str(out), "--max-turns", "1", "--stop", "10")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 10 and all(len(r["prompt"]) == 1 for r in rows)
