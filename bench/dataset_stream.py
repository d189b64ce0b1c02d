"""Peak memory of the learner's prompt source on a 1M-row parquet file against a 10K-row one.

    python bench/dataset_stream.py [--rows 1000000] [--small 10000] [--repeats 3] [--row-group 0] [--quick]

Both files are verl's row layout (chat-message ``prompt``, ``reward_model.ground_truth``, …) written
with pyarrow; ``--row-group 0`` writes each file as one row group, as ``datasets``' ``to_parquet`` and
pandas do for files of this size — the hard case for streaming. Each measurement is a fresh process
that does what learner rank 0 does at start and over a run: open the file, collect its data sources
(the scorer check), pull 5,000 prompts (chat template applied), then resume near the end of the file and
pull across the epoch boundary. It prints its peak RSS — reset (``/proc/self/clear_refs``) once torch and
transformers are loaded, so their import peak does not hide the data's — and the growth above that. The
figure is peak(large) / peak(small), the order alternating per repeat; the baseline is the same source
on the small file, which any loader holds whole.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import figure, ordered, report

CHILD = """
import itertools, json, sys
from pathlib import Path
from transformers import AutoTokenizer
from learner.data import PromptSource
from tether.config import TetherConfig

def status(field):
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field))
    return int(line.split()[1]) / 1024

path, model, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
AutoTokenizer.from_pretrained(model)  # libraries warm before the peak is reset: it measures the data
Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM (the peak RSS) to the current RSS
before = status("VmRSS")
cfg = TetherConfig.model_validate({"model": {"path": model}, "learner": {"data_path": path},
                                   "rollout": {"reward": {"type": "data_source"}}})
first = list(itertools.islice(PromptSource(cfg), 5000))
resumed = PromptSource(cfg, start=rows - 100)
tail = list(itertools.islice(resumed, 300))
assert tail[100].text == first[0].text and resumed.position == rows + 200
print(json.dumps({"peak_rss_mb": status("VmHWM"), "growth_mb": status("VmHWM") - before}))
"""


def write_verl_parquet(path: Path, rows: int, *, row_group: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    chunk = 100_000
    writer = None
    for lo in range(0, rows, chunk):
        idx = range(lo, min(rows, lo + chunk))
        table = pa.table({
            "data_source": ["openai/gsm8k"] * len(idx),
            "prompt": [[{"role": "user", "content": f"Natalia sold {i} clips in April and half as many in May. "
                         "How many clips did she sell altogether? Let's think step by step."}] for i in idx],
            "ability": ["math"] * len(idx),
            "reward_model": [{"style": "rule", "ground_truth": str(i + i // 2)} for i in idx],
            "extra_info": [{"split": "train", "index": i} for i in idx],
        })  # fmt: skip
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema)
        writer.write_table(table, row_group_size=row_group or rows)
    writer.close()


def peak_mb(path: Path, model: Path, rows: int) -> dict[str, float]:
    """``peak_rss_mb`` of a fresh process doing the learner's reads, and ``growth_mb`` of it over its RSS
    once the libraries were loaded."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(model), str(rows)], capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--small", type=int, default=10_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--row-group", type=int, default=0, help="rows per row group; 0: one row group per file")
    p.add_argument("--quick", action="store_true", help="a smoke run: 100K rows, 1 repeat (not a measurement)")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.repeats = 100_000, 1
    from tether.commands.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", hidden=64, layers=1, heads=2)
        files = {}
        for n in (args.small, args.rows):
            files[n] = Path(tmp) / f"{n}.parquet"
            write_verl_parquet(files[n], n, row_group=args.row_group)
            print(f"{n} rows: {files[n].stat().st_size / 2**20:.1f} MiB on disk", flush=True)
        ratios = []
        for k in range(args.repeats):
            peaks = {n: peak_mb(files[n], model, n) for n in ordered([args.rows, args.small], k)}
            big, small = peaks[args.rows], peaks[args.small]
            ratios.append(big["peak_rss_mb"] / small["peak_rss_mb"])
            print(f"repeat {k}: peak RSS {args.rows} rows {big['peak_rss_mb']:.1f} MB (+{big['growth_mb']:.1f} MB "
                  f"over the loaded libraries), {args.small} rows {small['peak_rss_mb']:.1f} MB "
                  f"(+{small['growth_mb']:.1f} MB)", flush=True)  # fmt: skip
    groups = f"row groups of {args.row_group}" if args.row_group else "one row group per file"
    baseline = f"the same prompt source on a {args.small}-row file ({groups})"
    name = f"dataset_stream/peak_rss_{args.rows}_vs_{args.small}_rows"
    report(figure(name, ratios, goal=1.1, direction="max", baseline=baseline), quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
