"""How far the reduced precisions ("mixed", "bfloat16", "int8") move scores from float32, on the
default model: realistic text requests and random-token queries.

    python benchmarks/precision_gap.py [--backend serial] [--random 5]
    python benchmarks/precision_gap.py --dtypes mixed,int8

The gap of a request is max |logprob - float32 logprob| over its items and labels (absolute), and
the same divided by |float32 logprob| (relative); float32 is the same backend in float32 (every
float32 backend equals the reference within 1e-5). The seeds' 0.02 gate compared SGLang /v1/score
outputs, which are probabilities: the tables also give the worst gap in both of its score
spaces, P(label) (`probs`, apply_softmax false) and the softmax over the labels (`label_probs`,
apply_softmax true).
"""

from __future__ import annotations

import argparse

import numpy as np

from tpuscore import Scorer

REVIEWS = [
    " I loved every minute.",
    " A waste of money.",
    " The plot dragged but the acting was superb.",
    " Easily the best film I have seen this year.",
    " I fell asleep halfway through.",
    " The soundtrack alone is worth the ticket.",
    " Predictable, loud and far too long.",
    " A charming little story with a big heart.",
]
MOVIES = ["Arrival", "The Notebook", "Blade Runner 2049", "Frozen", "Interstellar", "Mamma Mia!"]
FACTS = [
    "Paris is the capital of France.",
    "The sun rises in the west.",
    "Water boils at 100 degrees Celsius at sea level.",
    "Spiders have six legs.",
    "The Pacific is the largest ocean on Earth.",
    "Shakespeare wrote Don Quixote.",
    "Mount Everest is the highest mountain in the world.",
    "Bananas are a kind of fish.",
]
QUESTIONS = [
    ("Q: Which planet is closest to the Sun?\nA:", [" Venus", " Mercury", " Mars", " Earth"]),
    ("Q: What colour is the sky on a clear day?\nA:", [" blue", " green", " red", " yellow"]),
    ("Q: How many legs does a cat have?\nA:", [" four", " two", " six", " eight"]),
    ("Q: What do bees make?\nA:", [" honey", " milk", " silk", " wax"]),
]
EMAILS = [
    "Congratulations, you won a free cruise! Click here.",
    "Hi Sam, the meeting moved to 3pm tomorrow.",
    "URGENT: your account is locked, send your password now.",
    "Thanks for dinner last night, it was lovely.",
]


def text_requests() -> list[tuple[str, list[str], list[str]]]:
    """(query, items, labels): the README's kinds of request, 39 scored items in all."""
    liking = "A viewer's favourite movies are {}.\n"
    chat = "<|im_start|>user\nIs the following email spam? Answer yes or no.\n"
    turn = "<|im_end|>\n<|im_start|>assistant\n"
    out = [
        (
            "Classify the sentiment of each movie review.\nReview:",
            [r + "\nSentiment:" for r in REVIEWS],
            [" positive", " negative"],
        ),
        *[
            (
                liking.format(likes),
                [f"Next movie: {m}\nWould they like it?" for m in MOVIES],
                [" yes", " no"],
            )
            for likes in ("The Matrix, Alien and Dune", "Notting Hill, Amélie and Love Actually")
        ],
        (
            "Answer each statement with yes or no.\nStatement:",
            [f" {fact}\nTrue? Answer:" for fact in FACTS],
            [" yes", " no"],
        ),
        *[(question, [""], answers) for question, answers in QUESTIONS],
        (
            "What is the capital of France?",
            [FACTS[0], "Berlin is the capital of Germany.", "The Eiffel Tower is in Paris."],
            [" yes", " no"],
        ),
        (chat, [e + turn for e in EMAILS], ["yes", "no", "Yes", "No"]),
    ]
    return out


def gaps(exact, got) -> tuple[float, float, float, float]:
    """Worst gaps of one request's `ScoreResult`s: logprob (absolute, relative), probs,
    label_probs."""
    diff = np.abs(got.logprobs - exact.logprobs)
    relative = diff / np.maximum(np.abs(exact.logprobs), 1e-6)
    probs = np.abs(got.probs - exact.probs)
    label_probs = np.abs(got.label_probs - exact.label_probs)
    return float(diff.max()), float(relative.max()), float(probs.max()), float(label_probs.max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="serial")
    parser.add_argument("--random", type=int, default=5, help="random-token queries")
    parser.add_argument("--dtypes", default="mixed,bfloat16")
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")
    scorers = {d: Scorer.from_pretrained(dtype=d) for d in ["float32", *dtypes]}
    vocab = scorers["float32"].config.vocab_size
    rng = np.random.default_rng(0)
    suites = {
        "text": [(q, items, {"labels": labels}) for q, items, labels in text_requests()],
        "random tokens (300 + 8 x 10)": [
            (
                rng.integers(0, vocab, 300).tolist(),
                [rng.integers(0, vocab, 10).tolist() for _ in range(8)],
                {"label_token_ids": rng.choice(vocab, 3, replace=False).tolist()},
            )
            for _ in range(args.random)
        ],
    }
    for suite, requests in suites.items():
        rows = {d: [] for d in dtypes}
        for query, items, labels in requests:
            exact = scorers["float32"].score(query, items, backend=args.backend, **labels)
            for d in dtypes:
                got = scorers[d].score(query, items, backend=args.backend, **labels)
                rows[d].append(gaps(exact, got))
        print(f"{suite}: {len(requests)} requests, backend {args.backend}")
        print(
            "| precision | logprob worst abs | mean abs | worst rel | probs worst (mean) |"
            " label_probs worst (mean) | requests closer than bfloat16 |"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for d in dtypes:
            absolute, relative, probs, label_probs = np.array(rows[d]).T
            closer = ""
            if d != "bfloat16" and "bfloat16" in rows:
                pairs = zip(rows[d], rows["bfloat16"], strict=True)
                closer = f"{sum(a[0] <= b[0] for a, b in pairs)} of {len(requests)}"
            print(f"| {d} | {absolute.max():.4f} | {absolute.mean():.4f} | {relative.max():.2%} |"
                  f" {probs.max():.4f} ({probs.mean():.4f}) |"
                  f" {label_probs.max():.4f} ({label_probs.mean():.4f}) | {closer} |")  # fmt: skip
        print("per request:", {d: [[round(g, 4) for g in r] for r in rows[d]] for d in dtypes})


if __name__ == "__main__":
    main()
