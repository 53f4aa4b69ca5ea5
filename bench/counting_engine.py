"""The CPU engine as ``skytrain engine serve`` runs it, counting the TCP connections it accepts.

Each accepted connection appends one byte to ``--connections-file``, so the file's size is how
many connections the engine has accepted so far: counted where they arrive. The kernel's socket
tables cannot count them: a closed connection's entry is gone once its TIME_WAIT ends, and on
loopback (net.ipv4.tcp_tw_reuse=2, the default) a new connection may take the client port of
one still in TIME_WAIT, so it looks like no new connection at all.

Usage (by the benches):
    python bench/counting_engine.py --connections-file F --model DIR --port N [options]
"""

from __future__ import annotations

import argparse
import asyncio
import os

import torch
import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from skytrain_backend.engine.hf.engine import HFEngine
from skytrain_backend.engine.hf.server import create_app, default_threads


def _counting_protocol(connections_fd: int) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (one instance per connection), writing a byte as each starts."""

    class CountingProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            os.write(connections_fd, b".")
            super().connection_made(transport)

    return CountingProtocol


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections-file", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    args = parser.parse_args()

    connections_fd = os.open(args.connections_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    torch.set_num_threads(default_threads())
    engine = HFEngine(
        args.model, served_model_name=args.served_model_name, max_num_seqs=args.max_num_seqs
    )
    uvicorn.run(
        create_app(engine, api_key=args.api_key),
        host="127.0.0.1",
        port=args.port,
        http=_counting_protocol(connections_fd),
        log_level="warning",
    )


if __name__ == "__main__":
    main()
