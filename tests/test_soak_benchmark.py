"""benchmarks/soak.py's own parts: its raw HTTP clients and its memory slope (issue 25)."""

import asyncio
import importlib.util
import pathlib

import numpy as np

SOAK = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"
spec = importlib.util.spec_from_file_location("soak_benchmark", SOAK)
soak = importlib.util.module_from_spec(spec)
spec.loader.exec_module(soak)


def test_raw_clients_read_each_answer_and_reconnect_when_told_to_close():
    """A server that answers 200 on a kept-alive connection, then 503 with Connection: close:
    every answer's status is recorded and the client reconnects after the close."""
    seen = {"per_connection": [], "bodies": []}

    async def handle(reader, writer):
        seen["per_connection"].append(0)
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = int(next(
                line.split(b":")[1] for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            ))  # fmt: skip
            seen["bodies"].append(await reader.readexactly(length))
            seen["per_connection"][-1] += 1
            if len(seen["bodies"]) % 3:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
            else:
                writer.write(
                    b"HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\n"
                    b"content-length: 5\r\n\r\nbusy!"
                )
                await writer.drain()
                break
            await writer.drain()
        writer.close()

    async def run():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            requests = [("/v1/score", {"query": [1, 2], "items": [[3]]})]
            return await soak.raw_clients(f"http://127.0.0.1:{port}", requests, 1, 0.3)

    answers = asyncio.run(run())
    statuses = [status for _, _, status in answers]
    assert len(statuses) >= 3
    assert statuses == [503 if (i + 1) % 3 == 0 else 200 for i in range(len(statuses))]
    served = [n for n in seen["per_connection"] if n]
    assert served[:-1] == [3] * (len(served) - 1)  # a new connection after each close
    assert len(served) == 1 + (len(statuses) - 1) // 3
    assert seen["bodies"][0] == b'{"query":[1,2],"items":[[3]]}'


def test_rss_slope_is_the_second_halfs_trend_not_its_swing():
    t = np.arange(0, 120, 0.5)
    swing = 1450 + 110 * np.where(np.arange(len(t)) % 2, 1, -1)  # +-110 MiB each sample
    flat = np.stack([t, swing], axis=1)
    assert abs(soak.rss_slope(flat)) < 10  # 5.5: the swing's phase at the ends
    rising = np.stack([t, swing + 2 * t], axis=1)  # +2 MiB/s: +120 MiB/min
    assert abs(soak.rss_slope(rising) - 120) < 10
    assert soak.rss_slope(flat[:1]) is None
