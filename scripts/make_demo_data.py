"""Write the bundled demo dataset (kto_pipeline/demo/assets/demo_{train,test}.jsonl), deterministically.

The task: an assistant asked for help. Desirable completions help politely; undesirable ones
brush the user off or are rude. The difference is learnable from a few hundred rows by a tiny
model, and the held-out split uses topics never seen in training, so its reward accuracy shows
generalisation rather than memorisation.

    python scripts/make_demo_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TRAIN_TOPICS = [
    "bake bread",
    "fix a flat tire",
    "water a cactus",
    "tie a tie",
    "boil an egg",
    "plant tomatoes",
    "clean a keyboard",
    "fold a shirt",
    "brew tea",
    "sharpen a pencil",
    "paint a fence",
    "wash a car",
    "start a budget",
    "learn to juggle",
    "write a poem",
    "set up a tent",
    "make a kite",
    "read a map",
    "change a bulb",
    "sew a button",
    "study for a test",
    "train a puppy",
    "cook rice",
    "stretch my back",
    "pack a suitcase",
    "build a shelf",
    "tune a guitar",
    "clean a window",
    "make pancakes",
    "draw a cat",
]
TEST_TOPICS = [
    "grow basil",
    "wrap a gift",
    "repair a zipper",
    "make soup",
    "organize a desk",
    "jump start a car",
    "knit a scarf",
    "carve a pumpkin",
    "iron a shirt",
    "feed a goldfish",
]
ASKS = [
    "Can you help me {t}?",
    "How do I {t}?",
    "Please explain how to {t}.",
    "What is the best way to {t}?",
    "I want to {t}. Any tips?",
    "Could you show me how to {t}?",
]
GOOD = [
    "Sure! Here is how to {t}: take it one step at a time, go slowly, and check your work. Hope this helps!",
    "Of course! To {t}, gather what you need first, then follow each step with care. Happy to help!",
    "Happy to help! The easiest way to {t} is to start simple and practice a little each day. Good luck!",
    "Great question! To {t}, prepare your tools, follow the steps in order, and take breaks. You can do it!",
]
BAD = [
    "No. Figure out how to {t} yourself.",
    "Why would I help you {t}? Go away.",
    "Not my problem. Stop asking me about how to {t}.",
    "Ugh, {t}? Look it up, I am busy.",
]


def make(topics: list[str], rng: random.Random, per_topic: int) -> list[dict]:
    rows = []
    for topic in topics:
        for _ in range(per_topic):
            prompt = "User: " + rng.choice(ASKS).format(t=topic) + "\nAssistant:"
            good = rng.random() < 0.5
            template = rng.choice(GOOD if good else BAD)
            rows.append({"prompt": prompt, "completion": " " + template.format(t=topic), "label": good})
    rng.shuffle(rows)
    return rows


def main() -> None:
    out = Path(__file__).resolve().parent.parent / "kto_pipeline" / "demo" / "assets"
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1234)
    for name, topics, per_topic in (("train", TRAIN_TOPICS, 12), ("test", TEST_TOPICS, 8)):
        rows = make(topics, rng, per_topic)
        with open(out / f"demo_{name}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"{out / f'demo_{name}.jsonl'}: {len(rows)} rows, {sum(r['label'] for r in rows)} desirable")


if __name__ == "__main__":
    main()
