"""Score real examples with the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF).

pip install nox && nox -s demo
"""

import time

import jax

from tpuscore import Scorer


def show(title: str, rows: list[str], cols: list[str], values, fmt: str = "{:8.3f}") -> None:
    print(f"\n{title}")
    print(" " * 28 + "".join(f"{c!r:>12}" for c in cols))
    for row, vals in zip(rows, values, strict=True):
        print(f"  {row[:25]:26}" + "".join(f"{fmt.format(v):>12}" for v in vals))


def main() -> None:
    start = time.perf_counter()
    scorer = Scorer.from_pretrained()
    print(
        f"SmolLM2-135M-Instruct loaded in {time.perf_counter() - start:.1f}s "
        f"({scorer.dtype}, JAX on {jax.default_backend()})"
    )

    # Candidate scoring: one empty item, the candidates are the labels.
    labels = [" Paris", " London", " Berlin", " Rome"]
    result = scorer.score("The capital of France is", [""], labels=labels)
    show("log P(label | 'The capital of France is')", ["(empty item)"], labels, result.logprobs)

    # Context comparison: which continuation of the query leads to which label.
    items = [" France is", " Germany is", " Italy is", " Japan is"]
    labels = [" Paris", " Berlin", " Rome", " Tokyo"]
    result = scorer.score("The capital of", items, labels=labels)
    show("log P(label | 'The capital of' + item)", items, labels, result.logprobs)

    # Classification of many items against one instruction, softmax over the two labels.
    reviews = [
        " An absolute delight from start to finish, I loved every minute.",
        " Boring, far too long, and the acting was wooden.",
        " The best film I have seen this year.",
        " A waste of money. I walked out halfway through.",
    ]
    query = "Classify the sentiment of each movie review.\nReview:"
    items = [f"{review}\nSentiment:" for review in reviews]
    print()
    for call in ("first call, compiles", "second call"):
        start = time.perf_counter()
        result = scorer.score(query, items, labels=[" positive", " negative"], apply_softmax=True)
        elapsed_ms = (time.perf_counter() - start) * 1000
        print(f"{call}: {len(items)} items in {elapsed_ms:.0f} ms ({result.backend} backend)")
    show("P(label) within {positive, negative}", reviews, [" positive", " negative"], result.scores)


if __name__ == "__main__":
    main()
