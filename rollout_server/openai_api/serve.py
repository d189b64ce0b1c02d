"""Run the OpenAI-compatible app on the rollout server's own event loop (uvicorn, embedded).

The server process owns SIGTERM / Ctrl-C (they start its drain), so uvicorn's own signal capture is switched off;
the door stops when the server does, after the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import uvicorn

from rollout_server.episodes import EpisodeStore
from rollout_server.openai_api.app import build_app
from rollout_server.state import ServerState


class _Embedded(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class OpenAIDoor:
    def __init__(self, state: ServerState, store: EpisodeStore, *, host: str, port: int) -> None:
        # Idle keep-alive connections live 75 s (uvicorn's default is 5): an agent pauses between calls for its
        # tools, and a server that closes an idle connection at the moment a client (httpx: 5 s expiry too)
        # reuses it makes that call fail with a connection error — retried by the openai client's default,
        # lost with max_retries=0 (it failed the door bench's 64-client level once).
        config = uvicorn.Config(
            build_app(state, store), host=host, port=port, log_level="warning", access_log=False, lifespan="off",
            timeout_keep_alive=75,
        )  # fmt: skip
        self.server = _Embedded(config)
        self.task: asyncio.Task | None = None

    async def start(self) -> int:
        """Serve in the background; the bound port once it listens (raises if it could not bind)."""
        self.task = asyncio.create_task(self.server.serve(), name="openai-door")
        while not self.server.started:
            if self.task.done():  # uvicorn logs why (e.g. the port is taken) and exits the task
                with contextlib.suppress(SystemExit):
                    self.task.result()
                port = self.server.config.port
                raise OSError(f"rollout.openai.port: cannot serve HTTP on {self.server.config.host}:{port}")
            await asyncio.sleep(0.02)
        (sock,) = [s for server in self.server.servers for s in server.sockets][:1]
        return sock.getsockname()[1]

    async def stop(self) -> None:
        if self.task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(self.task, timeout=5)
