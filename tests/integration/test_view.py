"""``tether view`` on a real run, in a real browser: Debian's Chromium, headless.

A short ``tether up`` trains on a dataset of two data sources, one of whose rows have no reference answer,
so its groups fail their reward and are dead-lettered for real. The page written from the run folder is
opened at ``#step=3`` and must show exactly step 3's sampled groups — their prompts and rewards as the
learner recorded them — and, on the whole run, the dead letters with their reason; a screenshot of it is
taken. The same page served by ``tether view --port 0`` is loaded from its URL. Without Chromium the test
skips, except under CI (``.ci/run`` installs it), where it fails.
"""

from __future__ import annotations

import html
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from tests.helpers import interruptible
from tether.records import DEAD_LETTERS, GENERATIONS, read_records

REPO = Path(__file__).resolve().parents[2]
STEPS = 5
CLASSES = ("digits", "lower", "upper")


@pytest.fixture
def chromium() -> str:
    """Decided before the test starts work: a skip (or, under CI, a failure) raised mid-test would leave the
    work half done and be reported as a failure."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        reason = "needs Debian's chromium (apt-get install chromium; .ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return exe


def browse(chromium: str, url: str, profile: Path, *, screenshot: Path | None = None) -> str:
    """The DOM after the page's script ran (or a screenshot of it): headless Chromium, as root."""
    args = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            f"--user-data-dir={profile}", "--window-size=1280,1000"]  # fmt: skip
    args += [f"--screenshot={screenshot}", "--hide-scrollbars"] if screenshot else ["--dump-dom"]
    out = subprocess.run([*args, url], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


class Cards(HTMLParser):
    """The page's group and dead-letter cards: data attributes, prompt text, reward cells, reason."""

    FIELDS = (("pre", "prompt"), ("td", "reward"), ("span", "reason"))  # (tag, class): the class is the field

    def __init__(self, dom: str) -> None:
        super().__init__()
        self.cards: list[dict] = []
        self._field: str | None = None
        self._open: list[str] = []  # tags opened inside the field's element, itself first
        self.feed(dom)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if self._field:
            self._open.append(tag)
        elif tag == "section" and classes and classes[0] in ("group", "dead"):
            self.cards.append({"kind": classes[0], "step": a.get("data-step"), "group": a.get("data-group"),
                               "prompt": "", "rewards": [], "reason": ""})  # fmt: skip
        elif self.cards and (field := next((c for t, c in self.FIELDS if t == tag and c in classes), None)):
            self._field, self._open = field, [tag]
            if field == "reward":
                self.cards[-1]["rewards"].append("")

    def handle_endtag(self, tag: str) -> None:
        if self._field and self._open and self._open[-1] == tag:
            self._open.pop()
            if not self._open:
                self._field = None

    def handle_data(self, data: str) -> None:
        if self._field == "reward":
            self.cards[-1]["rewards"][-1] += data
        elif self._field:
            self.cards[-1][self._field] += data


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    tmp = tmp_path_factory.mktemp("view")
    rows = []
    for i in range(24):
        if i % 4 == 3:  # no answer: exact_match cannot score it, so the group is dead-lettered
            rows.append({"prompt": "lower:", "data_source": "noanswer"})
        else:
            name = CLASSES[i % 3]
            rows.append({"prompt": f"{name}:", "answer": name, "data_source": "charclass"})
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "run": {"run_id": "view", "output_dir": str(tmp / "runs"), "loggers": ["console"]},
        "model": {"path": str(tiny_model_dir)},
        "rollout": {
            "engine": {"type": "transformers", "max_num_seqs": 32},
            "reward": {"type": "data_source", "scorers": {"noanswer": "exact_match"}},
            "n": 4,
            "max_tokens": 8,
            "num_servers": 1,
            "prompt_workers": 2,
            "drain_timeout_s": 5,
        },
        "learner": {
            "total_steps": STEPS,
            "train_batch_size": 4,
            "lr": 3e-3,
            "data_path": str(data),
            "checkpoint_every": 0,
            "export_hf": False,
            "read_timeout_s": 240,
        },
        "algorithm": {"max_staleness": 1},
        "weight_sync": {"transport": {"type": "filesystem"}},
    }
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = subprocess.run([sys.executable, "-m", "tether", "up", "--config", str(path)], cwd=REPO,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return tmp / "runs" / "view"


def _groups(run: Path) -> list[dict]:
    records, bad = read_records(run / GENERATIONS)
    assert bad == 0
    return records


def _prompt_text(run: Path, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    model = yaml.safe_load((run / "config.yaml").read_text())["model"]["path"]
    return AutoTokenizer.from_pretrained(model).decode(ids)


@pytest.mark.slow
def test_the_learner_keeps_a_sample_of_each_step_and_the_dead_letters(run_dir: Path) -> None:
    groups = _groups(run_dir)
    by_step: dict[int, list[dict]] = {}
    for g in groups:
        by_step.setdefault(g["step"], []).append(g)
    assert sorted(by_step) == list(range(1, STEPS + 1)) and all(len(v) == 2 for v in by_step.values())
    for g in groups:
        assert g["data_source"] == "charclass" and g["server"] == "rollout-0" and g["context"]["answer"] in CLASSES
        assert len(g["samples"]) == 4
        assert all(s["adv"] is not None and len(s["lp"]) == len(s["ids"]) for s in g["samples"])
    dead, _ = read_records(run_dir / DEAD_LETTERS)
    assert dead and all("reward failed" in d["reason"] and d["data_source"] == "noanswer" for d in dead)
    assert all(d["origin"].endswith("rollout-0") and len(d["samples"]) == 4 for d in dead)


@pytest.mark.slow
def test_the_page_shows_a_chosen_step_in_headless_chromium(run_dir: Path, tmp_path: Path, chromium: str) -> None:
    page = tmp_path / "page.html"
    out = subprocess.run([sys.executable, "-m", "tether", "view", str(run_dir), "--out", str(page)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    step3 = [g for g in _groups(run_dir) if g["step"] == 3]
    dom = browse(chromium, page.as_uri() + "#step=3", tmp_path / "profile")
    cards = [c for c in Cards(dom).cards if c["kind"] == "group"]
    assert [c["group"] for c in cards] == [g["group_id"] for g in step3] and {c["step"] for c in cards} == {"3"}
    for card, g in zip(cards, step3, strict=True):
        assert card["prompt"] == _prompt_text(run_dir, g["prompt"])
        assert [float(r) for r in card["rewards"]] == pytest.approx([s["reward"] for s in g["samples"]], abs=5e-4)
    assert html.escape(_prompt_text(run_dir, step3[0]["prompt"]), quote=False) in dom
    whole = Cards(browse(chromium, page.as_uri() + "#color=logprob", tmp_path / "profile")).cards
    assert sum(c["kind"] == "group" for c in whole) == 2 * STEPS
    dead = [c for c in whole if c["kind"] == "dead"]
    assert dead and all("reward failed" in c["reason"] for c in dead)
    shot = tmp_path / "viewer.png"
    browse(chromium, page.as_uri() + "#step=3", tmp_path / "profile", screenshot=shot)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 1000


@pytest.mark.slow
def test_the_served_page_loads_from_its_url(run_dir: Path, tmp_path: Path, chromium: str) -> None:
    server = subprocess.Popen([sys.executable, "-m", "tether", "view", str(run_dir), "--port", "0"], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=interruptible)  # fmt: skip
    try:
        line = server.stdout.readline()  # printed once the page is built and the port is open
        assert "http://127.0.0.1:" in line, line + server.stderr.read()
        url = line.split(" at ", 1)[1].split()[0]
        with urllib.request.urlopen(url, timeout=30) as reply:
            assert reply.status == 200 and b"tether view" in reply.read()
        cards = Cards(browse(chromium, url + "#step=2", tmp_path / "profile")).cards
        cards = [c for c in cards if c["kind"] == "group"]
        assert [c["group"] for c in cards] == [g["group_id"] for g in _groups(run_dir) if g["step"] == 2]
    finally:
        server.send_signal(signal.SIGINT)
        try:
            code = server.wait(timeout=30)
        finally:  # a server that outlives its SIGINT fails the test without being left running
            if server.poll() is None:
                server.kill()
                server.wait()
        assert code == 0
