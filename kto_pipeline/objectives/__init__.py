"""The loss families and the registry that picks one from --loss-type.

A family is one module here with one `Objective` (`base.py` says what it answers); adding one is that module and a
line in `OBJECTIVES`. The stages, `memory/`, `sweep.py` and `model_card.py` take `objective_for(loss_type)` and ask
it; config checks a --loss-type here. The losses themselves, pure functions of tensors, are `loss.py`; the items a
family trains on and their order, `items.py`.
"""

from __future__ import annotations

from typing import Any

from kto_pipeline.errors import check_option
from kto_pipeline.objectives.base import Objective, StepOut
from kto_pipeline.objectives.kto import KTO
from kto_pipeline.objectives.pairs import Pairs

OBJECTIVES: tuple[Objective, ...] = (KTO(), Pairs())


def objective_for(loss_type: str) -> Objective:
    """The family of a --loss-type (one term, or several joined with +), named by its first term."""
    first = loss_type.split("+")[0].strip()
    for objective in OBJECTIVES:
        if first in objective.loss_types:
            return objective
    raise ValueError(f"unknown loss type {first!r}")


def check_loss_names(loss_type: str) -> None:
    """A --loss-type names known losses: one of a family's, or terms of a family that combines them joined with +
    (each once)."""
    known = [name for objective in OBJECTIVES for name in objective.loss_types]
    names = ", or of ".join(f"{', '.join(o.loss_types)} ({o.describes})" for o in OBJECTIVES)
    check_option(
        "," not in loss_type,
        "loss_type",
        f"{loss_type!r}: join the terms of a combination with + (sigmoid+bco_pair+sft); commas separate "
        "a sweep's values",
    )
    types = [t.strip() for t in loss_type.split("+")]
    unknown = [t for t in types if t not in known]
    check_option(not unknown, "loss_type", f"unknown {', '.join(map(repr, unknown))}: each term must be one of {names}")
    family = objective_for(loss_type)
    combining = " and ".join(o.describes for o in OBJECTIVES if o.combines)
    alone = "; ".join(f"{o.describes}: {', '.join(o.loss_types)}" for o in OBJECTIVES if not o.combines)
    check_option(
        len(types) == 1 or (family.combines and all(t in family.loss_types for t in types)),
        "loss_type",
        f"{loss_type!r}: only {combining} combine ({alone}: train alone)",
    )
    check_option(len(set(types)) == len(types), "loss_type", f"{loss_type!r} names a term twice")


def foreign_options(loss_type: str) -> dict[str, Any]:
    """The options of every other family than `loss_type`'s, with their defaults (none for an unknown name, which
    the config then refuses)."""
    try:
        family = objective_for(loss_type)
    except ValueError:
        return {}
    return {k: v for o in OBJECTIVES if o is not family for k, v in o.options.items()}


def check_options(config) -> None:
    """The options of another family than the run's keep their defaults; then the run's family checks its own."""
    family = objective_for(config.loss_type)
    if config.loss_weights is not None:
        combining = [o.loss_noun for o in OBJECTIVES if o.combines]
        check_option(
            family.combines, "loss_weights", f"weights the terms of a {' or '.join(combining)} (--loss-type a+b)"
        )
    for objective in OBJECTIVES:
        if objective is family:
            continue
        for name, default in objective.options.items():
            check_option(
                getattr(config, name) == default,
                name,
                f"applies to {objective.describes} only, not to --loss-type {config.loss_type}",
            )
    family.check(config)


__all__ = ["OBJECTIVES", "Objective", "StepOut", "check_loss_names", "check_options", "foreign_options"]
__all__ += ["objective_for"]
