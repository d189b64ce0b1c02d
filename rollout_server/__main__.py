"""``python -m rollout_server --config FILE [--section.key VALUE ...]``: validate, then serve.

The config is parsed and validated here, before torch or vLLM is imported, so a typo fails in a
second. This module must stay importable without side effects: vLLM spawns worker processes that
re-import ``__main__``.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from tether.config import ConfigError, load_config
    from tether.model_path import with_model_folder

    parser = argparse.ArgumentParser(prog="python -m rollout_server", description="Start one tether rollout server.")
    parser.add_argument("--config", "-c", metavar="FILE", help="YAML config file")
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = with_model_folder(load_config(args.config, overrides))  # a .gguf or pypi: model -> its folder
    except ConfigError as e:
        print(f"config error:\n{e}", file=sys.stderr)
        return 2
    from rollout_server.main import run

    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
