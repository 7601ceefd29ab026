"""One peer of benchmarks/vs_peers.py in its own process: vLLM's CPU build (in its own
virtualenv, which pins its own torch) or llama.cpp (llama-cpp-python).

It loads the model, writes one JSON line {"ready": true, "describe": "..."} and then answers
each request line {"query": [ids], "items": [[ids]], "labels": [ids]} with
{"logprobs": [[log P(label | query + item)]]} (or {"error": "..."}), until stdin closes. The
protocol has the process's real stdout to itself: everything the peer prints or logs goes to
stderr, which the driver keeps in a log file.

    python benchmarks/vs_peers_worker.py vllm --model HF_DIR --dtype bfloat16 --max-len 2100
    python benchmarks/vs_peers_worker.py llama.cpp --gguf FILE --n-ctx 4096 --n-seq 64
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys


def protocol_stream():
    """The real stdout for the protocol; fd 1 (C libraries' and Python's prints) goes to stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


class VllmPeer:
    """vLLM's offline LLM on token ids, prefix caching on. Each item is its own prompt (query +
    item; vLLM's prefix cache shares the query's blocks) generating one token; the labels'
    logprobs come from `logprob_token_ids` where this vLLM has it, as its /generative_scoring
    does, else from `prompt_logprobs` on query + item + label, one prompt per label."""

    def __init__(self, args):
        from vllm import LLM, SamplingParams

        self.SamplingParams = SamplingParams
        self.llm = LLM(
            model=args.model, dtype=args.dtype, max_model_len=args.max_len,
            enable_prefix_caching=True, skip_tokenizer_init=True, seed=0,
        )  # fmt: skip
        try:
            SamplingParams(max_tokens=1, logprob_token_ids=[0])
            self.method = "logprob_token_ids"
        except TypeError:
            self.method = "prompt_logprobs"
        import vllm

        threads = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "vLLM's default")
        self.description = (
            f"vllm {vllm.__version__} ({args.dtype}), scoring with {self.method}, prefix "
            f"caching on, VLLM_CPU_OMP_THREADS_BIND={threads}, "
            f"VLLM_CPU_KVCACHE_SPACE={os.environ.get('VLLM_CPU_KVCACHE_SPACE', 'default')} GiB"
        )

    def score(self, query, items, labels):
        from vllm.inputs import TokensPrompt

        if self.method == "logprob_token_ids":
            params = self.SamplingParams(
                max_tokens=1, temperature=0.0, detokenize=False, logprob_token_ids=labels
            )
            prompts = [TokensPrompt(prompt_token_ids=query + item) for item in items]
            outs = self.llm.generate(prompts, params, use_tqdm=False)
            return [[out.outputs[0].logprobs[0][label].logprob for label in labels] for out in outs]
        params = self.SamplingParams(
            max_tokens=1, temperature=0.0, detokenize=False, prompt_logprobs=0
        )
        prompts = [
            TokensPrompt(prompt_token_ids=query + item + [label])
            for item in items
            for label in labels
        ]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        flat = [
            out.prompt_logprobs[-1][label].logprob
            for out, label in zip(outs, labels * len(items), strict=True)
        ]
        return [flat[i : i + len(labels)] for i in range(0, len(flat), len(labels))]


class LlamaCppPeer:
    """vs_llama_cpp.py's LlamaCpp: the query's cells shared by batched item sequences."""

    def __init__(self, args):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from vs_llama_cpp import LlamaCpp

        self.llama = LlamaCpp(
            args.gguf, args.n_ctx, args.n_seq, args.threads, args.flash_attn, args.extra_bufts
        )
        self.description = f"{self.llama.describe()}; {args.threads} threads"

    def score(self, query, items, labels):
        return self.llama.score(query, items, labels).tolist()


def terminate_with_parent() -> None:
    """SIGTERM this process when its parent dies (Linux's PR_SET_PDEATHSIG); at once if the
    parent died before the request."""
    import ctypes

    parent = os.getppid()
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent or parent == 1:
        os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("system", choices=["vllm", "llama.cpp"])
    parser.add_argument("--model", help="vLLM: a Hugging Face directory")
    parser.add_argument("--dtype", default="float32", help="vLLM's dtype")
    parser.add_argument("--max-len", type=int, default=4096, help="vLLM's max_model_len")
    parser.add_argument("--gguf", help="llama.cpp: the GGUF file")
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--n-seq", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--flash-attn", action="store_true")
    parser.add_argument("--no-extra-bufts", dest="extra_bufts", action="store_false")
    args = parser.parse_args()
    # The driver starts this worker as the leader of its own process group; asked here (not in
    # a preexec_fn, unsafe in the driver's threaded process), the kernel sends it SIGTERM when
    # the driver dies, and it then takes its group down with it (vLLM's engine process among
    # them), which would otherwise spin on for minutes, taking the CPU from runs that follow.
    signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
    terminate_with_parent()
    out = protocol_stream()
    peer = VllmPeer(args) if args.system == "vllm" else LlamaCppPeer(args)
    out.write(json.dumps({"ready": True, "describe": peer.description}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"logprobs": peer.score(request["query"], request["items"], request["labels"])}
        except Exception as error:  # reported to the driver, which prints it and stops the peer
            reply = {"error": f"{type(error).__name__}: {error}"}
        out.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
