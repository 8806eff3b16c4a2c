"""``pretune serve``: a model behind the OpenAI HTTP API, every request decoded by one continuous-batching loop.

    from pretune.serve import Limits, Server, build_app, run
    run("runs/sft", host="127.0.0.1", port=8000)                      # what `pretune serve runs/sft` does

See docs/serve.md. Needs the ``serve`` extra (fastapi, uvicorn).
"""

from __future__ import annotations

import ipaddress
import logging
import socket

from ..config import ConfigError

__all__ = ["Limits", "Server", "build_app", "run", "check_exposure", "load_server"]


def __getattr__(name):  # fastapi is imported only when the server is wanted
    if name in ("Limits", "Server"):
        from . import app

        return getattr(app, name)
    if name == "build_app":
        from .handlers import build_app

        return build_app
    raise AttributeError(name)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: str | None, insecure: bool) -> None:
    """A server reachable beyond this machine needs an API key, or the user's explicit ``--insecure``."""
    if not is_loopback(host) and api_key is None and not insecure:
        raise ConfigError(f"--host {host} makes the server reachable from other machines: give --api-key KEY "
                          "(clients then send 'Authorization: Bearer KEY'), or --insecure to serve without one")


def load_server(model: str, *, adapters: dict[str, str] | None = None, name: str | None = None, limits=None,
                api_key: str | None = None, base: str | None = None, dtype=None, quantize: str | None = None):
    """Load ``model`` (any folder ``pretune.load_pretrained`` reads) and its adapters into a :class:`Server`;
    ``quantize`` (``int8``, ``int4``): its linear weights quantised for CPU decoding once the adapters are on
    (``pretune.quantize``; from the weights as loaded, so fp32)."""
    from ..loading import folder_kind, load_pretrained
    from .app import Server

    # an adapter folder served beside other adapters: folded into its base, so that routing per row is well defined
    merge = bool(adapters) and folder_kind(model) == "adapter"
    loaded = load_pretrained(model, base=base, merge=merge, dtype=dtype)
    return Server(loaded, name=name, adapters=adapters, limits=limits, api_key=api_key, quantize=quantize)


def run(model: str, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
        insecure: bool = False, adapters: dict[str, str] | None = None, name: str | None = None, limits=None,
        base: str | None = None, dtype=None, quantize: str | None = None) -> None:
    """Load ``model`` and serve it until interrupted (uvicorn)."""
    import uvicorn

    from .handlers import build_app

    check_exposure(host, api_key, insecure)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)  # bound before loading: a busy
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)               # port fails at once
    try:
        sock.bind((host, port))
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    server = load_server(model, adapters=adapters, name=name, limits=limits, api_key=api_key, base=base, dtype=dtype,
                         quantize=quantize)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("pretune.serve").setLevel(logging.INFO)
    app = build_app(server)
    config = uvicorn.Config(app, log_level="info", access_log=False, timeout_graceful_shutdown=3)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        if server.engine is not None:
            server.engine.close()
