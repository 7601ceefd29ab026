"""Zero-shot classification: one instruction as the query, each text an item, classes as labels.

Each class name must be a single token (with its leading space); the scores are the softmax over
the classes, so each row sums to 1. The instruction is the shared query: prefill_extend runs it
once for all texts.

    python examples/classify.py [--model PATH_OR_HUB_ID]
"""

import argparse

from tpuscore import Scorer

QUERY = "Classify the topic of each news headline as sports, politics, technology or business.\n"
CLASSES = [" sports", " politics", " technology", " business"]
HEADLINES = [
    "The striker scored twice in the final minutes of the match.",
    "Parliament passed the new budget after a long debate.",
    "The new phone ships with a faster chip and a better camera.",
    "Shares of the bank fell after its quarterly earnings report.",
    "The senator announced a run for president.",
    "The tennis champion retired at 35.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    args = parser.parse_args()

    scorer = Scorer.from_pretrained(args.model)
    items = [f"Headline: {headline}\nTopic:" for headline in HEADLINES]
    result = scorer.score(QUERY, items, labels=CLASSES, apply_softmax=True)
    print(" " * 46 + "".join(f"{c.strip():>11}" for c in CLASSES))
    for headline, row in zip(HEADLINES, result.scores, strict=True):
        best = CLASSES[row.argmax()].strip()
        print(f"{headline[:44]:<44}  " + "".join(f"{p:11.2f}" for p in row) + f"  -> {best}")


if __name__ == "__main__":
    main()
