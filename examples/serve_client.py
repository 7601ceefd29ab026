"""Call a running `tpuscore serve` over HTTP with httpx: one score and one rerank.

    tpuscore serve &                      # the embedded default model on 127.0.0.1:8000
    python examples/serve_client.py       # or --url http://host:port

With no server answering at --url, the example starts one itself (`tpuscore serve` on a free
port, the embedded default model) and stops it at the end.
"""

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import time

import httpx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    args = parser.parse_args()
    with server_at(args.url) as url, httpx.Client(base_url=url, timeout=120) as client:
        score(client)
        rerank(client)


def score(client: httpx.Client) -> None:
    """SGLang's /v1/score: P(label | query + item) per item and label. `labels` takes label
    strings (each a single token); SGLang clients send `label_token_ids` instead."""
    response = client.post(
        "/v1/score",
        json={
            "query": "Classify the sentiment of each movie review.\nReview:",
            "items": [" I loved every minute.\nSentiment:", " A waste of money.\nSentiment:"],
            "labels": [" positive", " negative"],
            "apply_softmax": True,
        },
    )
    response.raise_for_status()
    body = response.json()
    print("POST /v1/score")
    for review, (positive, negative) in zip(["loved", "waste"], body["scores"], strict=True):
        print(f"  {review:6}  P(positive) {positive:.3f}  P(negative) {negative:.3f}")
    print(f"  usage: {body['usage']}")


def rerank(client: httpx.Client) -> None:
    """The Cohere/Jina rerank API: documents sorted by relevance, best first."""
    response = client.post(
        "/v1/rerank",
        json={
            "query": "What is the capital of France?",
            "documents": [
                "Berlin is the capital of Germany.",
                "Paris is the capital and largest city of France.",
                "The Eiffel Tower was finished in 1889.",
            ],
            "top_n": 2,
        },
    )
    response.raise_for_status()
    print("POST /v1/rerank (top_n 2)")
    for result in response.json()["results"]:
        print(
            f"  {result['relevance_score']:.3f}  [{result['index']}] {result['document']['text']}"
        )


@contextlib.contextmanager
def server_at(url: str):
    """url if a server answers there; else a `tpuscore serve` of our own, stopped on exit."""
    with contextlib.suppress(httpx.HTTPError):
        if httpx.get(f"{url}/health", timeout=5).status_code == 200:
            yield url
            return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "tpuscore.cli", "serve", "--port", str(port)]
    print(f"no server at {url}; starting one: {' '.join(command[1:])}", file=sys.stderr)
    process = subprocess.Popen(command, env=os.environ.copy())
    own = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise SystemExit(f"tpuscore serve exited with status {process.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{own}/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit("tpuscore serve did not answer within 120 s")
            time.sleep(0.5)
        yield own
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


if __name__ == "__main__":
    main()
