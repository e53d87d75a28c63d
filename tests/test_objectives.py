"""The loss families' registry: every --loss-type name belongs to one family, whose loss function computes it, and
the rest of the package asks the family instead of naming it."""

import re
from pathlib import Path

import pytest
import torch

from kto_pipeline.objectives import OBJECTIVES, foreign_options, objective_for
from kto_pipeline.objectives.loss import kto_loss, pair_loss

PACKAGE = Path(__file__).resolve().parent.parent / "kto_pipeline"
# what only the families (and config, which checks a --loss-type) may name
FAMILY_NAMES = r"\b(is_pair_loss|pair_loss|CachePairs|CacheRows|PairCollator|Collator|kto_forward|pair_forward)\b"


def test_each_name_has_one_family_and_its_loss_computes_it():
    names = [name for objective in OBJECTIVES for name in objective.loss_types]
    assert len(names) == len(set(names))
    logps = torch.tensor([-3.0, -4.0])
    for objective in OBJECTIVES:
        for name in objective.loss_types:
            assert objective_for(name) is objective
            if objective.unit == "rows":
                loss = kto_loss(logps, logps, torch.tensor([True, False]), 0.0, beta=0.1, loss_type=name)[0]
            else:
                lengths = torch.tensor([2.0, 3.0])
                loss = pair_loss(
                    logps,
                    logps - 1,
                    logps,
                    logps - 1,
                    0.1,
                    [name],
                    label_smoothing=0.1 if name == "exo_pair" else 0.0,
                    chosen_lengths=lengths,
                    rejected_lengths=lengths,
                    chosen_token_logps=torch.tensor([-1.0, -2.0]),
                )[0]
            assert torch.isfinite(loss), name


def test_a_combination_is_its_first_terms_family_and_options_belong_to_one_family():
    assert objective_for("sigmoid+bco_pair+sft").unit == "pairs"
    with pytest.raises(ValueError, match="unknown loss type"):
        objective_for("dpo")
    kto, pairs = objective_for("kto"), objective_for("sigmoid")
    assert not set(kto.options) & set(pairs.options)
    assert foreign_options("kto") == pairs.options and foreign_options("ipo") == kto.options
    assert foreign_options("no-such-loss") == {}  # the config refuses the name, naming the flag


def test_only_the_families_and_config_name_a_family():
    """The stages, memory/, sweep.py, model_card.py and the scorer ask the run's objective: none names a family's
    dataset, collator or forward, or tests whether a loss is a pair loss."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(("objectives/", "config/")):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(FAMILY_NAMES, line):
                found.append(f"{relative}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
