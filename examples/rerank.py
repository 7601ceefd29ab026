"""Rerank passages for a search query with a reranker prompt template.

    python examples/rerank.py                        # the "plain" template, embedded SmolLM2
    python examples/rerank.py --model Qwen/Qwen3-Reranker-0.6B --template qwen3-reranker

"plain" is an instruction prompt any instruction-tuned model can answer; "qwen3-reranker" is
Qwen3-Reranker's own format (its system line, <Instruct>/<Query>/<Document>, the empty <think>
block and "yes"/"no" labels) and needs a Qwen3 reranker checkpoint, such as
Qwen/Qwen3-Reranker-0.6B from the Hugging Face hub. The score is P(yes) / (P(yes) + P(no)).
"""

import argparse

from tpuscore import Scorer
from tpuscore.api import templates

QUERY = "What is the capital of France?"
PASSAGES = [
    "Berlin is the capital and largest city of Germany.",
    "Paris is the capital and most populous city of France.",
    "The Eiffel Tower was completed in 1889 for the World's Fair.",
    "Bananas are a good source of potassium.",
    "France is a country in Western Europe; its capital is Paris.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--template", default="plain", choices=sorted(templates.TEMPLATES))
    parser.add_argument("--instruction", default=None, help="default: the template's own")
    args = parser.parse_args()

    scorer = Scorer.from_pretrained(args.model)
    ranked = scorer.rank(QUERY, PASSAGES, template=args.template, instruction=args.instruction)
    print(f"Query: {QUERY}  (template {args.template!r})\n")
    for item in ranked:
        print(f"  {item.score:.3f}  [{item.index}] {item.item}")


if __name__ == "__main__":
    main()
