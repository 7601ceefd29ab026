"""Score on several hosts with jax.distributed: start this on every host (or process).

    python examples/multihost.py --coordinator 10.0.0.1:8476 --num-processes 2 --process-id 0
    python examples/multihost.py --coordinator 10.0.0.1:8476 --num-processes 2 --process-id 1

Try it on one machine with CPU devices standing in for chips (gloo collectives on loopback):

    python examples/multihost.py --cpu-devices 2 --num-processes 2 --process-id 0 &
    python examples/multihost.py --cpu-devices 2 --num-processes 2 --process-id 1

Every process joins JAX's runtime, builds the same mesh over all processes' devices, loads the
same model, and makes the same calls. Process 0 stands for a service's front end: it holds the
requests and broadcasts each batch, and the others follow it until it broadcasts the end. Each
process feeds its own devices' rows and gets every score back (docs/sharding.md).
"""

import argparse
import faulthandler
import json
import os

REQUESTS = [
    {
        "query": "I loved Dune and The Left Hand of Darkness. Would I enjoy this book?",
        "items": [" Foundation", " A cookbook of soups", " Hyperion", " Tax law, 3rd edition"],
    },
    {
        "query": "Is this review positive?",
        "items": [" Wonderful, I would go again.", " Cold food and a rude waiter."],
    },
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--coordinator", default="127.0.0.1:8476", help="process 0's host:port")
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--model-axis", type=int, default=1, help="devices per weight shard")
    parser.add_argument("--backend", action="append", help="repeat to run several (default auto)")
    parser.add_argument("--labels", nargs="+", default=[" yes", " no"])
    parser.add_argument("--cpu-devices", type=int, default=None, help="simulate on CPU devices")
    parser.add_argument("--out", default=None, help="write this process's scores as JSON here")
    parser.add_argument("--timeout", type=float, default=300, help="exit after this many seconds")
    args = parser.parse_args()
    # A process whose peer died would wait in a collective for ever: stop by itself instead.
    faulthandler.dump_traceback_later(args.timeout, exit=True)

    if args.cpu_devices:  # must be set before JAX starts
        os.environ |= {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(args.cpu_devices)}
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from tpuscore import Scorer
    from tpuscore.parallel.sharding import broadcast_from_leader

    if args.cpu_devices:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=60,
    )
    # The same mesh on every process, over every process's devices (jax.devices() is global).
    devices = np.array(jax.devices()).reshape(-1, args.model_axis)
    scorer = Scorer.from_pretrained(args.model, mesh=Mesh(devices, ("data", "model")))
    leader = jax.process_index() == 0

    scores = []
    requests = [request | {"labels": args.labels} for request in REQUESTS]
    backends = args.backend or ["auto"]
    batches = [[backend, requests] for backend in backends] if leader else []
    while True:
        # Process 0 decides what runs; None ends the loop on every process at once.
        work = broadcast_from_leader(batches.pop(0) if batches else None)
        if work is None:
            break
        backend, batch = work
        results = scorer.score_batch(batch, backend=backend)
        scores.append([r.logprobs.tolist() for r in results])

    if leader:
        for request, result in zip(REQUESTS, scores[0], strict=True):
            for item, logprobs in zip(request["items"], result, strict=True):
                print(f"{item!r:32} log P{tuple(args.labels)} = {np.round(logprobs, 3).tolist()}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"process": jax.process_index(), "scores": scores}, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
