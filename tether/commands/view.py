"""``tether view``: the trajectory viewer of a run folder — the groups the learner trained on, step by step.

    tether view runs/<id>                      serve the page on http://127.0.0.1:8765/ (Ctrl-C stops it)
    tether view runs/<id> --port 0             ... on a free port (the URL is printed)
    tether view runs/<id> --out page.html      write the page as one self-contained file instead

The page shows what the learner keeps of the run (``learner.log_train_generations`` groups of each logged
step, and the newest dead letters: :mod:`learner.generation_log`): each prompt and completion with its tokens
coloured by policy version or log-prob, reward, advantage, staleness, server, and the dead-lettered groups
with their reason; filters by step, reward and data source (:mod:`tether.commands.viewer.page`). Token ids are
decoded with the run's tokenizer (``model.path`` of its ``config.yaml``; ``--tokenizer DIR`` otherwise). The
server only listens on 127.0.0.1 and builds the page again when the run's files change, so a page
reloaded during a run shows its newest steps. Nothing is fetched from the network, by the server or the
page.
"""

from __future__ import annotations

import argparse
import http.server
import sys
import threading
from pathlib import Path

from tether.config import ConfigError
from tether.records import DEAD_LETTERS, GENERATIONS

HOST = "127.0.0.1"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("view", help="see the sampled groups of a run: prompts, completions, rewards, versions")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (runs/<id>)")
    p.add_argument("--out", metavar="FILE", default=None, help="write the page to FILE instead of serving it")
    p.add_argument("--port", type=int, default=8765, help="port to serve on at 127.0.0.1 (default 8765; 0: a free one)")
    p.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="tokenizer folder to decode with (default: model.path of the run's config.yaml)")  # fmt: skip


def run_folder(text: str) -> Path:
    folder = Path(text)
    if not folder.is_dir():
        raise ConfigError(f"view: {folder}: no such folder (give a run folder, runs/<id>)")
    if not any((folder / name).exists() for name in ("config.yaml", GENERATIONS, DEAD_LETTERS)):
        raise ConfigError(f"view: {folder}: not a run folder (no config.yaml, {GENERATIONS} or {DEAD_LETTERS} in it)")
    return folder


def cmd_view(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"view: unexpected arguments {' '.join(overrides)}")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"view: --port {args.port}: not a port (0 to 65535; 0 picks a free one)")
    folder = run_folder(args.run_dir)
    page = Page(folder, tokenizer=args.tokenizer)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(page.html(), encoding="utf-8")
        print(f"tether view: wrote {out} ({out.stat().st_size} bytes) from {folder}")
        return 0
    return serve(page, port=args.port)


class Page:
    """The page of one run folder, built again when its files change (size or modification time)."""

    def __init__(self, folder: Path, *, tokenizer: str | None) -> None:
        self.folder, self.tokenizer = folder, tokenizer
        self._lock = threading.Lock()
        self._key: tuple | None = None
        self._html = ""

    def _files_key(self) -> tuple:
        out = []
        for name in (GENERATIONS, DEAD_LETTERS, "buffer_stats.json"):
            try:
                st = (self.folder / name).stat()
                out.append((st.st_size, st.st_mtime_ns))
            except OSError:
                out.append(None)
        return tuple(out)

    def html(self) -> str:
        from tether.commands.viewer.page import build_page

        with self._lock:
            key = self._files_key()
            if key != self._key:
                self._html, self._key = build_page(self.folder, tokenizer=self.tokenizer), key
            return self._html


def serve(page: Page, *, port: int) -> int:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] not in ("/", "/index.html"):
                self.send_error(404, "the viewer serves one page: /")
                return
            body = page.html().encode("utf-8")
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # quiet: the URL line is all it says
            pass

    try:
        server = http.server.ThreadingHTTPServer((HOST, port), Handler)
    except OSError as e:
        raise ConfigError(f"view: --port {port}: cannot listen on {HOST}:{port} ({e.strerror or e}) — pick another "
                          "port, or --port 0 for a free one") from None  # fmt: skip
    page.html()  # built once before the URL is printed: the first load is not the slow one
    url = f"http://{HOST}:{server.server_address[1]}/"
    print(f"tether view: serving {page.folder} at {url} (Ctrl-C stops it)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    print("tether view: stopped", file=sys.stderr)
    return 0
