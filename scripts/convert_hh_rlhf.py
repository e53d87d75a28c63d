"""Convert HH-RLHF (Anthropic's plain-text dialogues) to conversational paired rows for a chat model.

    python scripts/convert_hh_rlhf.py OUT.jsonl                      # the 1,200 bundled pairs
    python scripts/convert_hh_rlhf.py OUT.jsonl --source harmless-base/train.jsonl.gz --max-turns 1
    python scripts/convert_hh_rlhf.py heldout.jsonl --start 240 --stop 296 --max-turns 1

Each output line is {"prompt": [messages], "chosen": [answer], "rejected": [answer]}, which
`kto-pipeline precompute --dataset OUT.jsonl` reads as paired conversational data (a desirable and an
undesirable row per pair). `make demo` runs the same conversion (kto_pipeline/demo/hh_rlhf.py).
"""

from __future__ import annotations

import argparse
import sys

from kto_pipeline.demo.hh_rlhf import bundled_path, convert_file
from kto_pipeline.errors import KTOPipelineError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", help="the .jsonl file to write")
    parser.add_argument("--source", default=str(bundled_path()), help="HH-RLHF .jsonl or .jsonl.gz (default: bundled)")
    parser.add_argument("--start", type=int, default=0, help="first pair to write (after the --max-turns filter)")
    parser.add_argument("--stop", type=int, default=None, help="pair to stop before (default: all)")
    parser.add_argument("--max-turns", type=int, default=None, help="keep pairs whose prompt has at most N turns")
    args = parser.parse_args()
    try:
        written = convert_file(args.source, {args.output: (args.start, args.stop)}, max_turns=args.max_turns)
    except KTOPipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {written[args.output]} pairs to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
