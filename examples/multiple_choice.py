"""Multiple choice with loglikelihood: each answer's log P(answer | question), the highest wins.

This is how lm-evaluation-harness scores multiple-choice tasks: the question is the context,
each choice a continuation, and the prediction is the choice with the largest summed token
log-probability (acc); dividing by the answer's length in bytes gives acc_norm's choice. The
question's K/V is computed once for its four choices.

    python examples/multiple_choice.py [--model PATH_OR_HUB_ID]
"""

import argparse

from tpuscore import Scorer

CONTEXT = "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\nThe answer is"
QUESTIONS = [
    ("What is the capital of France?", [" Paris", " London", " Berlin", " Madrid"], 0),
    ("How many legs does a spider have?", [" six", " eight", " ten", " four"], 1),
    ("Which planet is closest to the Sun?", [" Venus", " Mars", " Mercury", " Jupiter"], 2),
    ("What do bees make?", [" milk", " silk", " honey", " wax paper"], 2),
    (
        "Which ocean is the largest?",
        [" the Atlantic", " the Indian", " the Pacific", " the Arctic"],
        2,
    ),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    args = parser.parse_args()

    scorer = Scorer.from_pretrained(args.model)
    correct = correct_norm = 0
    for question, choices, answer in QUESTIONS:
        results = scorer.loglikelihood(CONTEXT.format(question=question), choices)
        logprobs = [r.logprob for r in results]
        normalized = [lp / len(c.encode()) for lp, c in zip(logprobs, choices, strict=True)]
        best = max(range(len(choices)), key=logprobs.__getitem__)
        best_norm = max(range(len(choices)), key=normalized.__getitem__)
        correct += best == answer
        correct_norm += best_norm == answer
        print(f"\n{question}")
        for i, (choice, r) in enumerate(zip(choices, results, strict=True)):
            notes = [f"{r.num_tokens} token(s)"] + ["greedy"] * r.is_greedy
            notes += ["predicted"] * (i == best) + ["correct"] * (i == answer)
            print(f"  {choice.strip():<14} {r.logprob:8.2f}  {', '.join(notes)}")
    n = len(QUESTIONS)
    print(f"\nacc {correct}/{n}, acc_norm {correct_norm}/{n}")


if __name__ == "__main__":
    main()
