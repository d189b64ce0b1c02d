"""A child's own error line out of its log, never torchrun's ``ChildFailedError`` banner (issue 43).

The two logs under ``tests/unit/data`` are real torchrun output (torch 2.13, CPU, gloo): a script whose rank 0
raises while loading and whose rank 1 waits at a barrier, run on one rank and on two. On two, rank 1 dies
second with an error of its own ("Connection closed by peer"), printed after rank 0's; the banner names
rank 0 as the root cause, and that rank's error is the one to show.
"""

from __future__ import annotations

from pathlib import Path

from tether.commands.child_errors import last_error, normalised, read_life, same_error, without_banner

DATA = Path(__file__).parent / "data"
CAUSE = "RuntimeError: model.attn_implementation: flash_attention_2 needs a GPU; use sdpa on CPU"


def test_the_failing_ranks_error_not_torchruns_banner() -> None:
    for name in ("torchrun_one_rank_fails.log", "torchrun_rank0_fails.log"):
        text = (DATA / name).read_text()
        assert "ChildFailedError" in text and "Root Cause" in text  # the banner is there to be skipped
        assert last_error(text) == CAUSE, name


def test_the_root_cause_rank_wins_over_a_later_rank() -> None:
    text = (DATA / "torchrun_rank0_fails.log").read_text()
    assert "[rank1]: RuntimeError:" in text and text.index("[rank1]: RuntimeError:") > text.index(CAUSE)
    assert last_error(text) == CAUSE
    # Without the banner (torchrun killed before it printed it) the last traceback is all there is.
    cut = text[: text.index("W1128")]
    assert "Connection closed by peer" in last_error(cut)


def test_a_line_the_child_printed_on_purpose_comes_first() -> None:
    text = (DATA / "torchrun_one_rank_fails.log").read_text()
    own = "learner: error: the run cannot train: none trained — check rollout.reward.address\n"
    i = text.index("E1128")
    assert last_error(text[:i] + own + text[i:]) == "the run cannot train: none trained — check rollout.reward.address"
    assert last_error("learner: learner.val_data_path: x.parquet does not exist\n").startswith("learner.val_data_path")


def test_a_chained_exception_gives_its_last_error_and_a_process_without_torchrun_works_too() -> None:
    text = (
        "2026-01-01 10:00:00 [info     ] rollout_server_starting\n"
        "Traceback (most recent call last):\n"
        '  File "a.py", line 1, in <module>\n'
        "KeyError: 'weight'\n"
        "\n"
        "During handling of the above exception, another exception occurred:\n"
        "\n"
        "Traceback (most recent call last):\n"
        '  File "a.py", line 3, in <module>\n'
        "    load()\n"
        "    ^^^^^^\n"
        "OSError: model.safetensors is truncated\n"
    )
    assert last_error(text) == "OSError: model.safetensors is truncated"
    assert last_error("killed\n") is None and last_error("") is None


def test_the_tail_shown_without_an_error_line_leaves_the_banner_out() -> None:
    text = (DATA / "torchrun_rank0_fails.log").read_text()
    kept = "\n".join(without_banner(text))
    assert CAUSE in kept and "ChildFailedError" not in kept and "Root Cause" not in kept
    assert "torch/distributed/elastic" not in kept and "=====" not in kept


def test_two_lives_of_one_failure_are_the_same_error() -> None:
    a = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:32142 (pid 7150) at 0x7f3a2c"
    b = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:40511 (pid 9021) at 0x7f11e0"
    assert same_error(a, b) and normalised(a) == normalised(b)
    assert not same_error(a, "OSError: model.safetensors is truncated")
    assert not same_error(None, None)  # no error line (a SIGKILL): nothing says it would fail again


def test_a_life_is_read_from_its_offset(tmp_path: Path) -> None:
    log = tmp_path / "learner.out"
    log.write_text("Traceback (most recent call last):\n  x\nValueError: first life\n")
    offset = log.stat().st_size
    with log.open("a") as f:
        f.write("second life started\n")
    assert last_error(read_life(log)) == "ValueError: first life"
    assert last_error(read_life(log, offset)) is None
    assert read_life(tmp_path / "missing.out") == ""
