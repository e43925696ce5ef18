"""The KV plane against its floor: one handoff's bytes over raw TCP, over bare AES-GCM TCP,
and through the product per strategy and codec, on loopback, veth and shaped links.

Issue 40's benchmark. The KV source is ``--engine synthetic-kv``
(``engines/synthetic_kv.py``): prefill fills MLX KV of the asked shape (default
8B-shaped: 32 layers, 8 KV heads, head_dim 128, bf16: 128 KiB a token, 1 GiB at
8k) without computing it, so the transfer is what is measured; the decode node
(the same engine, same fingerprint) adopts it into its MLX cache and decodes the
first token over it. Real node processes, the product's real link, driven by
``LinkDriver`` (the router's part).

Links: ``loopback`` (both nodes on 127.0.0.1), ``veth`` (two network namespaces
joined by veth pairs through a bridge, unshaped), ``tbf10``/``tbf25``/``tbf1``
(that veth shaped with ``tc tbf`` at 10/25/1 Gbit/s both ways). A shaped link is
first proved: raw TCP must reach >= 0.9x its rate (the tbf burst is widened once
if it does not); otherwise what raw TCP reached is reported as the harness's limit
and used as the link's rate.

For each link and size, in one run: raw TCP, bare AES-256-GCM TCP
(``loadtests/tcp_baselines.py``: the product's record size and lane count, read
from its ``LinkConfig``) and the product per ``--configs``, in ``--repeats`` rounds
of one run of each (after each config's unmeasured handoffs, below), so a slow spell
of the machine falls on every path alike. Columns: GiB/s
(raw KV bytes / time: the baselines' sender from first byte to ack; Full from the
end of prefill to the decode node's ack, ``mlxcel:handoff_time_seconds``; a
streaming strategy from the submit, since its rows leave while prefill fills),
x link, x bare AES-GCM, CPU-s per GiB of raw KV on each side over that window
(baselines: their own rusage; nodes: their CPU clocks, ``harness.proc_cpu_s``, sampled
every 5 ms; the decode node's from the submit, when its begin comes and the buffers of the
layers it implies are allocated (kv_serde/expected_layers.py), on to its first token,
less its idle background over the prefill (measured for 2 s after the warm-up with nothing
to do: "decode_idle_ms_per_s" in the JSON) and less the median CPU of its next
three decode steps over the same cache, shown as "step CPU s": the model's own
attention, not the handoff's, and at 2k tokens more than twice the handoff's whole
receive here, so one step's noise swung the ratio by a fifth), and
the time from the ack to the decode node's first token (adoption into MLX and that
token's step), and "readers busy": the median share of their reading time the decode
node's bulk readers were running or waiting for a CPU (its acks' ``reader_busy_share``;
at 0.8 or more the prefill node takes the handoff as receiver-paced, not as the link's
speed: docs/bulk-lanes.md#who-set-the-pace). A second table splits the decode node's CPU per
handoff by thread (each thread's ``schedstat`` over the same window, less the steps' median:
bulk readers, event loop, engine (its thread and the MLX threads it started, which
inherit its OS name), the rest), beside the bare AES-GCM receiver's whole
process for the same bytes. Each config first takes unmeasured handoffs of
each size: the first lands
in fresh pages (its receiver CPU prints as "recv cold s/GiB"), the rest until one lands
warm (the decode node's minor faults per GiB low: its receive pool and prefix cache have
turned over to this size, the prefix cache filled first, which small handoffs take many
of; "warm-up" counts them), so the measured ones land in the
receive pool's warm pages as on a node in service (docs/bulk-lanes.md#receive-pool).
ITL: ``--itl-streams`` streams decode on the decode node (short prompts, restarted as
they end) while ``--itl-handoffs`` handoffs of ``--itl-tokens`` arrive (full, none), against quiet
windows of the same streams in between; gaps ending inside each window count
(ingest: end of prefill to the decode node's ack, as the transfer; the steps with the
long sequence in the batch, from the one that takes it in, fall in neither window: they
are the model's attention over the whole prompt, which a stream pays beside any long
prompt, handed over or not, not ingestion).

With ``--pin`` (default on >= 2 cores) the sending side (prefill nodes, baseline
senders) runs on one core and the receiving side (decode node, sinks, this driver)
on another: two one-core machines. Figures from a machine shared with other work
are noisy: compare ratios within one run. Targets (issue 40) print beside them.

    sudo .venv/bin/python loadtests/bench_kv_plane.py [--quick] [--json PATH]
        [--sizes 2k,8k] [--links loopback,veth,tbf10] [--configs full-none,...]
        [--repeats 1] [--no-itl] [--itl-tokens 8192] [--pin | --no-pin]

Without root (or iproute2) the namespace links are skipped with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import add_common_args, bench_result, format_table, write_json  # noqa: E402
from harness import Placement, kv_plane_defaults, pin_all, source_revision  # noqa: E402
from kv_plane_links import LINK_RATES, LinkRun, netns_links, run_loopback  # noqa: E402
from kv_plane_nodes import CONFIGS  # noqa: E402
from kv_plane_report import report  # noqa: E402

QUICK_SHAPE = {"layers": 4, "kv_heads": 2, "head_dim": 64}  # 2 KiB a token
SIZE_SAFETY = 6  # free memory a size needs, in multiples of its KV (copies on both nodes)


def parse_tokens(text: str) -> int:
    text = text.strip().lower()
    return int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def fitting_sizes(sizes: list[int], bytes_per_token: int) -> list[int]:
    """The sizes this machine's free memory allows; says which it leaves out and why."""
    free, kept = mem_available(), []
    for tokens in sizes:
        need = SIZE_SAFETY * tokens * bytes_per_token
        if free and need > free:
            print(f"skipping {tokens} tokens: needs ~{need / 2**30:.1f} GiB free, "
                  f"{free / 2**30:.1f} GiB available", flush=True)
        else:
            kept.append(tokens)
    return kept


def parse_args() -> argparse.Namespace:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--sizes", default="2k,8k", help="prompt tokens (2k, 8k, 32k ...)")
    parser.add_argument("--links", default="loopback,veth,tbf10",
                        help=f"of {', '.join(LINK_RATES)}")
    parser.add_argument("--configs", default="full-none,streamed-none,layer-parallel-none,"
                        "full-int8", help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--itl", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--itl-tokens", default="8k", help="each ingested handoff's tokens")
    parser.add_argument("--itl-streams", type=int, default=8)
    parser.add_argument("--itl-handoffs", type=int, default=2)
    parser.add_argument("--quiet-s", type=float, default=3.0,
                        help="each quiet ITL window, at least (else as long as the last ingest)")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--shape", default="32,8,128", help="layers,kv_heads,head_dim (bf16)")
    parser.add_argument("--receive-pool-bytes", type=int, default=None,
                        help="the decode node's [engine] receive_pool_bytes (default: its own "
                        "auto; 536870912 = the 512 MiB MLX cache it had before the pool)")
    parser.add_argument("--ingest-nice", type=int, default=None,
                        help="the decode node's [server] ingest_nice (default: its own, 15)")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.links, args.configs = "256", "loopback", "full-none,full-int8"
        args.itl_tokens, args.itl_streams, args.itl_handoffs, args.quiet_s = "256", 2, 1, 1.0
        args.repeats = 1
    return args


def shape_of(args: argparse.Namespace) -> dict[str, int]:
    if args.quick:
        return dict(QUICK_SHAPE)
    layers, kv_heads, head_dim = (int(v) for v in args.shape.split(","))
    return {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim}


def main() -> None:
    args = parse_args()
    # SIGTERM unwinds like Ctrl-C: nodes stop, namespaces and links go.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from engines.synthetic_kv import (
        kv_bytes_per_token,
        synthetic_config,
        write_synthetic_checkpoint,
    )

    workdir = Path(tempfile.mkdtemp(prefix="bench-kv-plane-"))
    shape = shape_of(args)
    model = str(write_synthetic_checkpoint(workdir / "synthetic-kv", **shape))
    per_token = kv_bytes_per_token(synthetic_config(**shape))
    sizes = fitting_sizes([parse_tokens(s) for s in args.sizes.split(",")], per_token)
    placement = Placement.split(args.pin if args.pin is not None else True)
    pin_all(os.getpid(), placement.receiver)  # the driver sits with the decode node
    plane = kv_plane_defaults()
    run = LinkRun(model=model, workdir=workdir, sizes=sizes, bytes_per_token=per_token,
                  configs=args.configs.split(","), repeats=args.repeats, placement=placement,
                  plane=plane, itl=_itl_settings(args), rng=random.Random(0),
                  decode_sections=_decode_sections(args))
    links = args.links.split(",")
    revision = source_revision()
    print(f"KV plane at {revision}: shape {shape} ({per_token} B/token), sizes {sizes}, "
          f"links {links}, "
          f"{plane.lanes} lane(s) x {plane.record_bytes} B records ({plane.source}), "
          f"{placement.describe()}, workdir {workdir}", flush=True)
    results: list[dict[str, Any]] = []
    if "loopback" in links:
        results.append(asyncio.run(run_loopback(run)))
    results += netns_links(run, [link for link in links if link != "loopback"])
    result = report(results, run, shape)
    for item in result["tables"]:
        print("\n" + format_table(item))
    if args.json:
        write_json(Path(args.json), bench_result("kv_plane", result["tables"], result["series"])
                   | {"run": {**result["run"], "revision": revision}})


def _decode_sections(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The decode node's TOML tables beyond [transfer]: what the flags set, said aloud."""
    sections: dict[str, dict[str, Any]] = {}
    if args.receive_pool_bytes is not None:
        sections["engine"] = {"receive_pool_bytes": args.receive_pool_bytes}
    if args.ingest_nice is not None:
        sections["server"] = {"ingest_nice": args.ingest_nice}
    for name, keys in sections.items():
        print(f"decode node: [{name}] {keys}", flush=True)
    return sections


def _itl_settings(args: argparse.Namespace) -> dict[str, Any] | None:
    if not args.itl:
        return None
    return {"tokens": parse_tokens(args.itl_tokens), "streams": args.itl_streams,
            "handoffs": args.itl_handoffs, "quiet_s": args.quiet_s}


if __name__ == "__main__":
    main()
