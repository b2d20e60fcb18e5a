"""The OpenAI-compatible HTTP server on quantkit's engine (`quantkit serve`), its chat page and clients.

    quantkit serve MODEL --port 23333
    curl http://127.0.0.1:23333/v1/chat/completions -H 'Content-Type: application/json' \
        -d '{"model": "MODEL", "messages": [...]}'

`serve(ServeConfig(...))` runs it from Python; `create_app` builds the ASGI app over an engine already
made (tests, embedding in another server). Importing this package imports nothing heavy: FastAPI,
uvicorn and torch load when a server is built.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServeConfig", "create_app", "serve"]


def __getattr__(name: str) -> Any:
    if name in ("ServeConfig", "serve"):
        from quantkit.server import launch

        return getattr(launch, name)
    if name == "create_app":
        from quantkit.server.app import create_app

        return create_app
    raise AttributeError(name)
