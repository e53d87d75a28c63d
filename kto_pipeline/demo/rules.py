"""The tiny demo's labelling rule for its second round (`kto-pipeline generate --label-with
kto_pipeline.demo.rules:helpful`): a rule a reader can check against the toy data, whose desirable answers
offer help ("Happy to help!", "Hope this helps!") and whose undesirable ones refuse ("No. Figure it out ...")."""


def helpful(row: dict) -> bool:
    """Desirable: the answer mentions help and does not open with a refusal."""
    text = row["completion"]
    return "help" in text.lower() and not text.lstrip().startswith("No")
