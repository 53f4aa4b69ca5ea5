"""What the control plane reads of a base model's config.json from the Hub is bounded: any
tenant may name any repository, and a hostile one's "config.json" can be gigabytes."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from skytrain_backend.errors import ModelConfigUnavailable
from skytrain_backend.planning.configs import MAX_CONFIG_BYTES, fetch_hub_config

HUGE = 64 * MAX_CONFIG_BYTES
CHUNK = 64 * 1024


@contextlib.contextmanager
def _hub_with_a_huge_config(sent: list[int]) -> Iterator[str]:
    """A Hub whose every config.json is ``HUGE`` bytes, streamed; ``sent`` counts the bytes
    a client took before it hung up."""

    class Handler(BaseHTTPRequestHandler):
        def _head(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(HUGE))
            self.send_header("X-Repo-Commit", "0" * 40)
            self.send_header("ETag", '"huge"')
            self.end_headers()

        def do_HEAD(self) -> None:
            self._head()

        def do_GET(self) -> None:
            self._head()
            chunk = b"{" + b" " * (CHUNK - 1)
            with contextlib.suppress(OSError):
                for _ in range(HUGE // CHUNK):
                    self.wfile.write(chunk)
                    sent[0] += len(chunk)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_a_huge_config_json_on_the_hub_is_refused_without_reading_it_whole() -> None:
    sent = [0]
    with _hub_with_a_huge_config(sent) as hub, pytest.raises(ModelConfigUnavailable) as refused:
        fetch_hub_config("attacker/huge-config", endpoint=hub, token=None, timeout_s=30)
    assert "is not a JSON object of at most 1 MiB" in refused.value.message
    assert hub.split("//")[1] not in refused.value.message
    # What socket buffers hold beside the cap, not the whole file.
    assert sent[0] < 16 * MAX_CONFIG_BYTES, sent[0]
