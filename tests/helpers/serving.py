"""A pretune.serve server on a free loopback port in a thread, for the server tests."""

from __future__ import annotations

import socket
import threading
import time


class Running:
    """A uvicorn server on 127.0.0.1:<free port> in a thread, serving ``server`` (a pretune.serve.Server)."""

    def __init__(self, server):
        import uvicorn

        from pretune.serve import build_app

        self.server = server
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.uv = uvicorn.Server(uvicorn.Config(build_app(server), log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.uv.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def stop(self):
        self.uv.should_exit = True
        self.thread.join(timeout=10)
        if self.server.engine is not None:
            self.server.engine.close()
