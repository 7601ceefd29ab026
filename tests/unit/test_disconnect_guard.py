"""`guards.unless_disconnected`: when a client leaves, the work it waited on has dropped itself
(a batcher request gives up its place) before the server answers that the client left. Answering
first would let the batcher's worker, freed meanwhile, still score a request whose 499 was sent."""

import asyncio

import pytest

from tpuscore.serving import guards
from tpuscore.serving.guards import ClientDisconnected


async def _disconnect_after(started: asyncio.Event):
    """An ASGI receive whose client leaves once the work has started."""
    await started.wait()
    return {"type": "http.disconnect"}


def test_the_work_is_cancelled_before_the_client_is_answered():
    events = []

    async def main():
        started = asyncio.Event()

        async def work():
            started.set()
            try:
                await asyncio.Event().wait()  # queued behind a long batch
            except asyncio.CancelledError:
                await asyncio.sleep(0)  # cancellation that takes a loop turn, as wrap_future's does
                events.append("work dropped")
                raise

        with pytest.raises(ClientDisconnected):
            await guards.unless_disconnected(lambda: _disconnect_after(started), work())
        events.append("client answered")

    asyncio.run(main())
    assert events == ["work dropped", "client answered"]


def test_work_that_finishes_first_returns_its_result():
    async def main():
        never = asyncio.Event()

        async def receive():
            await never.wait()
            return {"type": "http.disconnect"}

        async def work():
            return 42

        return await guards.unless_disconnected(receive, work())

    assert asyncio.run(main()) == 42
