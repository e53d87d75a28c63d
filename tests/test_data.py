"""Normalization, tokenization semantics and KL pairing (trl parity itself: test_trl_parity.py)."""

import numpy as np
import pytest
from datasets import Dataset
from helpers import conversational_rows

from kto_pipeline.demo.tiny import build_char_tokenizer
from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.stages.precompute.data import assign_kl_partners, extract_prompt, normalize, tokenize, tokenize_row


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_unpaired_rows_pass_through_with_int_labels():
    ds = Dataset.from_dict({"prompt": ["a", "b"], "completion": [" x", " y"], "label": [1, 0]})
    assert normalize(ds) == [
        {"prompt": "a", "completion": " x", "label": True},
        {"prompt": "b", "completion": " y", "label": False},
    ]


def test_paired_rows_become_desirable_then_undesirable():
    ds = Dataset.from_dict({"prompt": ["p0", "p1"], "chosen": [" c0", " c1"], "rejected": [" r0", " r1"]})
    rows = normalize(ds)
    assert [(r["prompt"], r["completion"], r["label"]) for r in rows] == [
        ("p0", " c0", True),
        ("p0", " r0", False),
        ("p1", " c1", True),
        ("p1", " r1", False),
    ]


def test_implicit_prompt_is_the_shared_prefix():
    ds = Dataset.from_dict({"chosen": ["The sky is blue."], "rejected": ["The sky is green."]})
    rows = normalize(ds)
    assert rows[0]["prompt"] == "The sky is" and rows[0]["completion"] == " blue."
    assert rows[1]["completion"] == " green." and rows[1]["label"] is False


def test_implicit_prompt_conversational():
    user = {"role": "user", "content": "Hi?"}
    chosen = [user, {"role": "assistant", "content": "Hello!"}]
    rejected = [user, {"role": "assistant", "content": "Go away."}]
    prompt, c, r = extract_prompt(chosen, rejected)
    assert prompt == [user] and c == chosen[1:] and r == rejected[1:]


@pytest.mark.parametrize(
    "columns,match",
    [
        ({"prompt": ["a"], "response": ["b"], "label": [True]}, "no 'completion' column"),
        ({"prompt": ["a"], "completion": ["b"]}, "no 'label' column"),
        ({"text": ["a"]}, "expected one of"),
        ({"completion": ["b"], "label": [True]}, "no 'prompt' column"),
    ],
)
def test_missing_or_misnamed_columns_are_explained(columns, match):
    with pytest.raises(KTOPipelineError, match=match):
        normalize(Dataset.from_dict(columns))


@pytest.mark.parametrize("labels,row", [([1, 2], 1), (["yes", "no"], 0), ([0.5, 1.0], 0), ([True, None], 1)])
def test_non_boolean_labels_name_the_row(labels, row):
    ds = Dataset.from_dict({"prompt": ["a", "b"], "completion": ["x", "y"], "label": labels})
    with pytest.raises(KTOPipelineError, match=f"row {row}: label"):
        normalize(ds)


def test_empty_dataset():
    with pytest.raises(KTOPipelineError, match="empty"):
        normalize(Dataset.from_dict({"prompt": [], "completion": [], "label": []}))


def test_standard_rows_get_eos_once(tok):
    p, c, is_prefix = tokenize_row(tok, {"prompt": "Q:", "completion": " A"})
    assert is_prefix and p == tok("Q:")["input_ids"]
    assert c == tok(" A")["input_ids"] + [tok.eos_token_id]
    _, c2, _ = tokenize_row(tok, {"prompt": "Q:", "completion": " A" + tok.eos_token})
    assert c2 == c  # not appended twice


def test_conversational_rows_use_the_chat_template(tok):
    row = conversational_rows(1)[0]
    p, c, _ = tokenize_row(tok, row)
    text = tok.decode(p + c)
    assert text == tok.apply_chat_template(row["prompt"] + row["completion"], tokenize=False)
    assert tok.decode(p).endswith("<|im_start|>assistant\n")  # add_generation_prompt
    assert tok.eos_token not in tok.decode(c)[: -len(tok.eos_token) - 2] and c[-2] == tok.eos_token_id


def test_tokenize_drops_and_counts(tok):
    rows = [
        {"prompt": "short", "completion": " ok", "label": True},
        {"prompt": "x" * 30, "completion": " ok", "label": False},  # prompt reaches max_length
        {"prompt": "", "completion": " ok", "label": False},  # empty prompt
    ]
    out = tokenize(tok, rows, max_length=20)
    assert out.example_ids.tolist() == [0] and out.labels.tolist() == [True]
    assert out.dropped == {"prompt >= max_length (20)": 1, "empty prompt": 1}


def test_kl_partners_are_a_seeded_cycle_never_self():
    for n in (2, 3, 17, 1000):
        partner = assign_kl_partners(n, seed=5)
        assert (partner != np.arange(n)).all()
        assert sorted(partner.tolist()) == list(range(n))  # every completion used once
        assert (assign_kl_partners(n, seed=5) == partner).all()
    assert (assign_kl_partners(50, 1) != assign_kl_partners(50, 2)).any()
    with pytest.raises(KTOPipelineError, match="at least 2 rows"):
        assign_kl_partners(1, 0)


def test_mixed_standard_and_conversational_rows_are_explained():
    conv = [{"role": "user", "content": "hi"}]
    with pytest.raises(KTOPipelineError, match="row 0: the prompt is a messages but the completion is a string"):
        normalize(Dataset.from_list([{"prompt": conv, "completion": " hello", "label": True}]))
    with pytest.raises(KTOPipelineError, match="row 0: 'completion' must be a string or a non-empty list"):
        normalize(Dataset.from_list([{"prompt": "hi", "completion": [], "label": True}]))


def test_messages_without_content_are_refused_naming_their_keys():
    """`{"role", "text"}` messages (a misspelt key) would render as empty turns: refused, as a column and row by row."""
    user, answer = [{"role": "user", "text": "hi"}], [{"role": "assistant", "text": "hello"}]
    with pytest.raises(KTOPipelineError, match=r"row 0: 'prompt' must be .* messages with the keys \['role', 'text'\]"):
        normalize(Dataset.from_list([{"prompt": user, "completion": answer, "label": True}]))
    # among rows with content (one Arrow struct of role, content, text): the row that has none
    good = {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}
    rows = [{**good, "label": True}, {"prompt": user, "completion": answer, "label": False}]
    with pytest.raises(KTOPipelineError, match=r"row 1: 'prompt' must be .* messages with the keys \['role', 'text'\]"):
        normalize(Dataset.from_list(rows))
