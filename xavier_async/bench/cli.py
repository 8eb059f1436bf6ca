"""The ``xavier-async`` command line: ``xavier-async bench [options]`` and ``xavier-async demo [options]``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._checks import cli_int
from ..slabs import KiB, MiB


def _size(text: str) -> int:
    """``12MiB``, ``256KiB``, ``4096`` -> bytes."""
    t = text.strip()
    for suffix, mult in (("MiB", MiB), ("KiB", KiB), ("M", MiB), ("K", KiB), ("B", 1)):
        if t.endswith(suffix):
            t, m = t[: -len(suffix)], mult
            break
    else:
        m = 1
    try:
        value = int(t) * m
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 12MiB, 256KiB, 4096)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0: {text!r}")
    return value


_positive = cli_int(1)


def _size_or_zero(text: str) -> int:
    """A size as :func:`_size`, or ``0``."""
    return 0 if text.strip() == "0" else _size(text)


#: the bench's experiment flags (sizes, counts, the serving section's knobs): parsed
#: always, listed only by ``xavier-async bench --help-all``
EXPERT_FLAGS = ("--full", "--small", "--copies", "--loads", "--trace-batches", "--trace-large",
                "--alloc-copies", "--alloc-loads", "--no-descriptors", "--no-protocol-floor",
                "--no-load-timeline", "--seed", "--pin", "--no-pin", "--serving-topology",
                "--serving-slabs", "--serving-merge-small", "--serving-small-trips",
                "--serving-trimmed", "--serving-piece-bytes", "--serving-bulk-bytes", "--serving-copy-threads", "--serving-split-copies", "--serving-direct-write-regions", "--reply-spin", "--serving-rounds", "--serving-host-profile")


class _HelpAll(argparse.Action):
    """``--help-all``: the bench's help with its experiment flags, then exit."""

    def __init__(self, option_strings: list[str], dest: str, **kw: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="also list the experiment flags (sizes, counts, the serving "
                              "section's knobs) and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        full = build_parser(expert=True)
        bench = next(a for a in full._actions if isinstance(a, argparse._SubParsersAction))
        bench.choices["bench"].print_help()
        parser.exit()


def build_parser(expert: bool = False) -> argparse.ArgumentParser:
    """The command line; ``expert``: list the bench's experiment flags in its help too
    (they are parsed either way)."""
    p = argparse.ArgumentParser(prog="xavier-async", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show NIXL's and UCX's own INFO logs (quiet by default)")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="benchmark two endpoints against a floor measured in the same run",
                       description="Run the floor, four channel-copy cases (always full, alternating "
                                   "under size-only selection and under the streak machine, sustained "
                                   "small), end-to-end loads, "
                                   "a serving-trace replay, the decision cost, memory growth over "
                                   "copies and over loads, the packed path vs the descriptor path "
                                   "per batch shape, the snapshot store (its tiers against live "
                                   "slots, hit rate per tier, staging and demotion, direct write vs "
                                   "gather on pool memory), and serving load (16 loads in flight, a "
                                   "loader and two sources, or two endpoints that both load and serve).")
    b.add_argument("--help-all", action=_HelpAll)
    b.add_argument("--transport", choices=("nixl", "local"), default="nixl",
                   help="nixl: peer in a child process over real NIXL (default); local: in-process")
    b.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA when two GPUs are visible (one process per GPU), else DRAM; "
                        "cuda on one GPU runs both processes on it (time-sliced: the output "
                        "says its figures are not the two-GPU ones)")
    b.add_argument("--full", type=_size, default=12 * MiB, help="full slab size (default 12MiB)")
    b.add_argument("--small", type=_size, default=256 * KiB, help="small view size (default 256KiB)")
    b.add_argument("--copies", type=_positive, default=400, help="copies per channel case")
    b.add_argument("--loads", type=_positive, default=300, help="end-to-end small loads")
    b.add_argument("--trace-batches", type=_positive, default=628)
    b.add_argument("--trace-large", type=int, default=25)
    b.add_argument("--alloc-copies", type=_positive, default=10_000,
                   help="copies for the memory-growth check over copies")
    b.add_argument("--alloc-loads", type=_positive, default=10_000,
                   help="real loads for the memory-growth check over loads (default 10000)")
    b.add_argument("--no-descriptors", dest="descriptors", action="store_false",
                   help="skip the packed-vs-descriptor-path section (raw NIXL, two processes)")
    b.add_argument("--no-protocol-floor", dest="protocol_floor", action="store_false",
                   help="skip the plain-Python protocol floor (two bare NIXL processes: request, "
                        "WRITE with its notification, one-copy gather and scatter) that the load "
                        "rows are compared with")
    b.add_argument("--no-load-timeline", dest="load_timeline", action="store_false",
                   help="skip the load timeline (one-hash loads with every stage marked in both "
                        "processes: each side's Python host time per load, NIXL's calls and "
                        "copies apart)")
    snapshot = b.add_mutually_exclusive_group()
    snapshot.add_argument("--no-snapshot", dest="snapshot", action="store_false",
                          help="skip the snapshot-store section (a loader and three sources over "
                               "NIXL: the store's tiers against live slots, then direct write vs "
                               "gather on pool memory)")
    snapshot.add_argument("--only-snapshot", action="store_true",
                          help="run only the snapshot-store section (its own floors included)")
    b.add_argument("--seed", type=int, default=0)
    pin = b.add_mutually_exclusive_group()
    pin.add_argument("--pin", dest="pin", action="store_const", const=True, default=None,
                     help="pin the two processes to separate physical cores (default: on the "
                          "CPU only; >= 4 cores)")
    pin.add_argument("--no-pin", dest="pin", action="store_const", const=False,
                     help="do not pin (the default on CUDA machines)")
    b.add_argument("--quick", action="store_true", help="small counts (CI); same sections")
    b.add_argument("--vllm", action="store_true",
                   help="only the vLLM section: B's TTFT inside real vLLM on the CPU, recompute vs "
                        "XavierConnector vs vLLM's NixlConnector (needs the vllm extra)")
    serving = b.add_mutually_exclusive_group()
    serving.add_argument("--no-serving", dest="serving", action="store_false",
                         help="skip the serving-load section (two or three processes, 16 loads in flight)")
    serving.add_argument("--only-serving", action="store_true",
                         help="run only the serving-load section (its own floor included)")
    b.add_argument("--serving-topology", choices=("auto", "three", "duplex"), default="auto",
                   help="serving load between a loader and two sources (three processes) or two "
                        "endpoints that both load and serve (duplex); default: duplex on CUDA "
                        "(one process per GPU), three on the CPU")
    b.add_argument("--serving-slabs", type=_positive, metavar="K", default=None,
                   help="the receive/send slab count of the serving section's default run, "
                        "compared with K=1 (the seed's design, and K=1 merging waiting batches); "
                        "default: the engine's default")
    b.add_argument("--serving-merge-small", type=_size, metavar="SIZE", default=None,
                   help="EndpointConfig.merge_small_bytes of the serving section's merged runs "
                        "(how large a group of waiting small batches may grow); default: the "
                        "engine's default (the small view)")
    b.add_argument("--serving-small-trips", type=_positive, metavar="N", default=None,
                   help="EndpointConfig.small_round_trips of the serving section's merged runs "
                        "(at most N round trips of small batches in flight per source; the "
                        "others wait and merge); default: no cap")
    b.add_argument("--serving-trimmed", action="store_true",
                   help="the serving section's endpoints (every run) copy only the payload "
                        "(EndpointConfig.trimmed) instead of the whole view")
    b.add_argument("--serving-piece-bytes", type=_size_or_zero, metavar="SIZE", default=None,
                   help="NixlTransport(piece_bytes=...) of the serving section's endpoints (a "
                        "larger host copy is posted in pieces of this size; 0: whole); "
                        "default: the transport's default (0)")
    b.add_argument("--serving-bulk-bytes", type=_size_or_zero, metavar="SIZE", default=None,
                   help="NixlTransport(bulk_bytes=...) of the serving section's endpoints (a "
                        "host WRITE of at least SIZE goes through a second NIXL agent on a "
                        "thread of its own; 0: never); default: the transport's default (1 MiB "
                        "on 8 CPUs or more, else 0)")
    b.add_argument("--serving-copy-threads", type=int, metavar="N", default=None,
                   help="EndpointConfig.copy_threads of the serving section's endpoints (0: "
                        "every host pack and unpack on the event loop); default: the engine's "
                        "default (2)")
    b.add_argument("--serving-split-copies", action="store_true",
                   help="the serving section's endpoints cut each large host pack and unpack "
                        "across all their copy threads (EndpointConfig.split_copies) instead "
                        "of one copy thread a copy")
    b.add_argument("--serving-direct-write-regions", type=int, metavar="N", default=None,
                   help="EndpointConfig.direct_write_regions of the serving section's endpoints "
                        "(a serve from the store in at most N regions is written straight from "
                        "it, no gather; 0: always gather); default: the engine's default for "
                        "the device (0 on the CPU)")
    b.add_argument("--reply-spin", type=float, metavar="SECONDS", default=None,
                   help="EndpointConfig.reply_spin of the load rows' endpoints (how long a lone "
                        "small load polls for its reply itself; 0: never); default: the "
                        "engine's default")
    b.add_argument("--serving-rounds", type=_positive, metavar="N", default=1,
                   help="run the serving section's runs N times, alternating them (each round "
                        "starts one run later), and report each figure as the median over the "
                        "rounds, with the targets' spread (for hosts whose runs differ)")
    b.add_argument("--serving-host-profile", action="store_true",
                   help="in the serving section, count each process's host time per event-loop "
                        "callback and per engine function, per phase (\"host_time\" in the JSON; "
                        "adds about a microsecond per call)")
    b.add_argument("--soak", type=_positive, metavar="N",
                   help="instead of the sections: N loads over NIXL between processes with "
                        "injected faults, cancellations and a peer restart, every byte checked")
    b.add_argument("--json", type=Path, metavar="PATH", help="write every figure and the environment")
    b.add_argument("--plot", type=Path, metavar="PATH", help="write a PNG (needs matplotlib)")
    b.add_argument("--compare", choices=("xoscar",),
                   help="also run the four channel cases through xoscar's copy_to over NIXL (two "
                        "processes, same sizes and counts), side by side; needs "
                        "pip install 'xavier-async[xoscar]'")
    if not expert:
        for action in b._actions:
            if any(o in EXPERT_FLAGS for o in action.option_strings):
                action.help = argparse.SUPPRESS
        b.usage = "xavier-async bench [options]"   # argparse cannot draw hidden group members
        b.epilog = (f"{len(EXPERT_FLAGS)} experiment flags (sizes, counts, the serving section's "
                    "knobs) are listed by --help-all; docs/benchmarks.md explains each.")
    from ..demo import add_arguments as demo_arguments
    d = sub.add_parser("demo", help="prefix sharing between replicas of a real model, each a "
                                    "batched serving engine (needs the demo extra: transformers)",
                       description="Qwen2 replicas (random weights, same seed) in three processes, "
                                   "each running batched engine steps: warm requests recompute "
                                   "their prefix, load it from a peer, load it with trimmed "
                                   "copies; every answer checked against recomputing. Prints the "
                                   "TTFT table and the break-even sweep of prefix length.")
    demo_arguments(d)
    return p


def quiet_nixl(verbose: bool) -> None:
    """NIXL's own logs for this process and the peer processes it starts (through the
    environment). ``-v``: NIXL's INFO lines, as NIXL prints them (``NIXL_LOG_LEVEL=INFO``;
    without it the library hands NIXL's logger to the application's logging, which the
    command line does not configure). Otherwise warnings only, NIXL's and UCX's. A level
    the user set in the environment wins either way."""
    if verbose:
        os.environ.setdefault("NIXL_LOG_LEVEL", "INFO")
        return
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    logging.getLogger("nixl").setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_nixl(args.verbose)
    if args.command == "bench":
        return _bench(args)
    if args.command == "demo":
        from ..demo import run as run_demo
        return run_demo(args)
    return 2  # pragma: no cover


def _bench(args: argparse.Namespace) -> int:
    import anyio

    if args.vllm:
        from . import vllm_ttft
        prefixes = (128, 1024) if args.quick else vllm_ttft.PREFIXES
        res = vllm_ttft.run(prefixes=prefixes, reps=2 if args.quick else 3)
        print(vllm_ttft.table(res))
        if args.plot is not None:
            vllm_ttft.plot(res, args.plot)
            print(f"wrote {args.plot}")
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(res, indent=2, default=str))
            print(f"wrote {args.json}")
        return 0

    if args.soak is not None:
        from .soak import print_soak, soak
        result = anyio.run(lambda: soak(args.soak, seed=args.seed,
                                        report=lambda i, n: print(f"... {i}/{n}", file=sys.stderr)))
        print_soak(result)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=2, default=str))
            print(f"wrote {args.json}")
        return 0

    from .suite import BenchOptions, run

    if args.compare == "xoscar":
        from .xoscar_anchor import available
        if not available():
            print("--compare xoscar needs xoscar (with its NIXL channel): "
                  "pip install 'xavier-async[xoscar]'", file=sys.stderr)
            return 2
    try:
        opts = BenchOptions(transport=args.transport, device=args.device, full_bytes=args.full,
                            small_bytes=args.small, copies=args.copies, loads=args.loads,
                            trace_batches=args.trace_batches, trace_large=args.trace_large,
                            alloc_copies=args.alloc_copies, alloc_loads=args.alloc_loads,
                            descriptors=args.descriptors, snapshot=args.snapshot,
                            protocol_floor=args.protocol_floor,
                            load_timeline=args.load_timeline,
                            seed=args.seed, quick=args.quick,
                            pin_cpus=args.pin, compare=args.compare, serving=args.serving,
                            serving_topology=args.serving_topology,
                            serving_slabs=args.serving_slabs,
                            serving_merge_small=args.serving_merge_small,
                            serving_trimmed=args.serving_trimmed,
                            serving_piece_bytes=args.serving_piece_bytes,
                            serving_bulk_bytes=args.serving_bulk_bytes,
                            serving_copy_threads=args.serving_copy_threads,
                            serving_split_copies=args.serving_split_copies,
                            serving_direct_write_regions=args.serving_direct_write_regions,
                            reply_spin=args.reply_spin,
                            serving_host_profile=args.serving_host_profile,
                            serving_rounds=args.serving_rounds,
                            serving_small_trips=args.serving_small_trips)
    except ValueError as exc:
        print(f"xavier-async bench: {exc}", file=sys.stderr)
        return 2
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("--plot needs matplotlib: pip install 'xavier-async[bench]'", file=sys.stderr)
            return 2

    console = _console()
    if args.only_serving and args.only_snapshot:
        print("--only-serving and --only-snapshot: pick one", file=sys.stderr)
        return 2
    if args.only_serving:
        return _only_serving(args, opts, console)
    if args.only_snapshot:
        return _only_snapshot(args, opts, console)
    sections = ["floor", "seed cases", "end-to-end loads", "trace replay", "trace as loads",
                "decision cost", "memory growth", "memory over loads"]
    if opts.protocol_floor and opts.transport == "nixl":
        sections.append("protocol floor")
    if opts.load_timeline and opts.transport == "nixl":
        sections.append("load timeline")
    if opts.descriptors and opts.transport == "nixl":
        sections.append("descriptor path")
    if opts.snapshot and opts.transport == "nixl":
        sections.append("snapshot store")
    if opts.serving:
        sections.append("serving load")
    if opts.compare:
        sections.append("xoscar compare")
    if console is not None:
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                      TimeElapsedColumn(), console=console, transient=True) as progress:
            task = progress.add_task("starting", total=len(sections))

            def report(name: str) -> None:
                progress.update(task, description=name, completed=sections.index(name))

            result = anyio.run(run, opts, report)
    else:
        result = anyio.run(run, opts, lambda s: print(f"... {s}", file=sys.stderr))
    print_report(result, console)
    _write(args, result)
    xo = result.get("compare", {}).get("xoscar")
    if xo is not None and "error" in xo:
        print(f"--compare xoscar failed: {xo['error']}", file=sys.stderr)
        return 1
    if "error" in result.get("serving", {}):
        print(f"the serving-load section failed: {result['serving']['error']}", file=sys.stderr)
        return 1
    if "error" in result.get("snapshot", {}):
        print(f"the snapshot-store section failed: {result['snapshot']['error']}", file=sys.stderr)
        return 1
    return 0


def _only_serving(args: argparse.Namespace, opts: Any, console: Any) -> int:
    """``--only-serving``: the serving-load section alone (JSON: options and serving)."""
    import platform
    from dataclasses import asdict

    import anyio

    from .. import __version__
    from .serving import serving, serving_tables
    from .common import use_device
    if opts.transport != "nixl":
        print("--only-serving runs processes over NIXL: drop --transport local", file=sys.stderr)
        return 2
    use_device(opts)
    result = {"options": asdict(opts), "serving": anyio.run(serving, opts)}
    print_tables(f"xavier-async {__version__} | serving load only | {platform.platform()} | "
                 f"{os.cpu_count()} cpus", serving_tables(result["serving"]), console)
    _write(args, result)
    return 0


def _only_snapshot(args: argparse.Namespace, opts: Any, console: Any) -> int:
    """``--only-snapshot``: the snapshot-store section alone (JSON: options, environment
    facts and snapshot); a wrong byte or any failure: status 1."""
    import platform
    from dataclasses import asdict

    import anyio

    from .. import __version__
    from .common import use_device
    from .snapshots import snapshot_section, snapshot_tables
    if opts.transport != "nixl":
        print("--only-snapshot runs processes over NIXL: drop --transport local", file=sys.stderr)
        return 2
    device = use_device(opts)

    def report(step: str) -> None:
        print(f"... {step}", file=sys.stderr)

    try:
        section = anyio.run(snapshot_section, opts, report)
    except Exception as exc:  # reported like the full bench does, in the JSON too
        section = {"error": f"{type(exc).__name__}: {exc}"}
    result = {"options": asdict(opts), "snapshot": section}
    head = (f"xavier-async {__version__} | snapshot store only | device {device} | "
            f"{platform.platform()} | {os.cpu_count()} cpus")
    if section.get("note"):
        head += f"\nnote: {section['note']}"
    print_tables(head, snapshot_tables(section), console)
    _write(args, result)
    if "error" in section:
        print(f"the snapshot-store section failed: {section['error']}", file=sys.stderr)
        return 1
    return 0


def _write(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The ``--json`` and ``--plot`` outputs."""
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {args.json}")
    if args.plot is not None:
        plot(result, args.plot)
        print(f"wrote {args.plot}")


def _console() -> Any:
    try:
        from rich.console import Console
    except ImportError:
        return None
    import shutil
    width = shutil.get_terminal_size((160, 40)).columns if sys.stdout.isatty() else 160
    return Console(width=max(width, 120))


def _rows(r: dict[str, Any]) -> list[tuple[str, list[list[str]], list[str]]]:
    """(title, rows, header) for each table of the report."""
    fl, sc, e2e, tr = r["floor"], r["seed_cases"], r["e2e_loads"], r["trace"]
    o = r["options"]
    floor_rows = [[name, f"{fl[name]['median_us']:.1f}", f"{fl[name]['p95_us']:.1f}",
                   f"{r['floor_after'][name]['median_us']:.1f}"] for name in ("full", "small")]
    seed_rows = []
    for c in ("always_full", "alternating_size_only", "alternating_streak", "sustained_small"):
        x = sc[c]
        ratio = x.get("ratio_median_to_floor", x["ratio_mean_to_floor"])
        seed_rows.append([c, str(x["streak"]), f"{x['median_us']:.1f}", f"{x['p95_us']:.1f}",
                          f"{x['mean_us']:.1f}", f"{ratio:.2f}x",
                          str(x["registrations_after_warmup"] + x["peer_registrations_after_warmup"]),
                          f"{x['wire_bytes'] / max(1, x['useful_bytes']):.3f}", str(x["copies_small"]),
                          "yes" if x["bytes_verified"] else "NO"])
    e2e_rows = [[k, f"{v['payload_bytes'] / KiB:.0f} KiB", f"{v['median_us']:.1f}", f"{v['p95_us']:.1f}",
                 f"{v['ratio_to_channel_copy']:.2f}x", "yes" if v["bytes_verified"] else "NO"]
                for k, v in e2e.items()]
    trace_rows = [[k, f"{v['wire_over_useful']:.3f}", str(v["registrations_after_warmup"]),
                   f"{v['median_us']:.1f}", f"{v['p95_us']:.1f}", f"{v['total_ms']:.1f}",
                   f"{v['ratio_total_to_floor']:.2f}x", "yes" if v["bytes_verified"] else "NO"]
                  for k, v in tr.items() if isinstance(v, dict)]
    tl = r.get("trace_loads")
    if tl is not None:
        trace_rows.append(["as loads", f"{tl['wire_over_useful']:.3f}", str(tl["registrations_after_warmup"]),
                           f"{tl['median_us']:.1f}", f"{tl['p95_us']:.1f}", f"{tl['total_ms']:.1f}",
                           f"{tl['ratio_total_to_floor']:.2f}x (floor {tl['floor_ms']:.1f} ms)",
                           f"yes ({tl['slots_checked']} slots)" if tl["bytes_verified"] else "NO"])
    target_rows = [[k, f"{v['value']:.3g}", f"<= {v['limit']:.3g}", "met" if v["met"] else "MISSED"]
                   for k, v in r["targets"].items()]
    ml = r.get("memory_loads")
    loads_note = "" if ml is None else (
        f"; over {ml['loads']} loads: Python objects retained {ml['python_retained_bytes']} B, "
        f"RSS {ml['rss_growth_bytes']} B (peer {ml['peer_rss_growth_bytes']}; the window "
        f"before, the process's one-time growth: {ml.get('first_window_rss_growth_bytes')} B, "
        f"peer {ml.get('first_window_peer_rss_growth_bytes')}), device "
        f"{ml['device_growth_bytes']} B, bytes {'checked' if ml['bytes_verified'] else 'WRONG'}")
    tables = [
        (f"Floor ({fl['kind']}, per copy, us; full={o['full_bytes']} B, small={o['small_bytes']} B)",
         floor_rows, ["size", "median", "p95", "median at end"]),
        ("Seed cases: channel copies (ratio: median/floor, or mean/floor when sizes alternate)",
         seed_rows, ["case", "streak", "median us", "p95 us", "mean us", "vs floor", "regs after warm-up",
                     "wire/useful", "small copies", "bytes ok"]),
        ("End-to-end loads (request, pack, write, unpack, acknowledge)", e2e_rows,
         ["load", "payload", "median us", "p95 us", "vs channel copy", "bytes ok"]),
        (f"Trace replay: {tr['batches']} batches ({tr['large_batches']} large), "
         f"{tr['useful_bytes'] / 1e6:.1f} MB useful, floor {tr['floor_ms']:.1f} ms", trace_rows,
         ["mode", "wire/useful", "regs after warm-up", "p50 us", "p95 us", "total ms", "vs floor",
          "bytes ok"]),
        (f"Targets; decision {r['decision']['median_us']:.2f} us; memory growth "
         f"over {r['memory']['copies']} copies: host {r['memory']['rss_growth_bytes']} B, device "
         f"{r['memory']['device_growth_bytes']} B{loads_note}", target_rows,
         ["target", "value", "limit", ""]),
    ]
    pf = r.get("protocol_floor")
    if pf is not None:
        tables.insert(3, _protocol_floor_rows(e2e, pf, fl))
    lt = r.get("load_timeline")
    if lt is not None:
        tables.insert(4, _timeline_rows(lt))
    d = r.get("descriptors")
    if d is not None:
        from .descriptors import HEADER, print_descriptors
        tables.append((f"Packed path vs descriptor path ({d['memory']}, raw NIXL, two processes; "
                       f"median us per transfer to DONE; packed/prepped/runs land in the peer's "
                       f"slab, direct in its cache slots, unpack is the engine's, measured at the "
                       f"source; cache registrations {d['cache_registrations']} "
                       f"({d['cache_regions_registered']} regions) at start, "
                       f"{d['registrations_after_warmup']} after warm-up). Rule, into the slab: "
                       f"{d['rule']['text']}. Rule, into the slots: {d['rule_to_slots']['text']}",
                       print_descriptors(d), HEADER))
    small_floor = fl["small"]["median_us"]
    stage_table = _stage_rows(e2e, tl, small_floor)
    if stage_table is not None:
        tables.insert(3, stage_table)
    else:
        tables.insert(3, ("Per-stage breakdown", [["not recorded: this engine's snapshot_metrics() "
                                                   "has no stage timings yet"]], ["stages"]))
    plan = r.get("plan")
    if plan is not None:
        tables.insert(4, ("Planning one block hash x all layers (validate + batches), median",
                          [[f"one hash x {plan['layers']} layers", f"{plan['cached_us']:.2f}",
                            f"{plan['reference_us']:.2f}",
                            f"{plan['reference_us'] / max(plan['cached_us'], 1e-9):.1f}x"]],
                          ["request", "cached planner us", "normalize + plan_batches us", "speedup"]))
    xo = r.get("compare", {}).get("xoscar")
    if xo is not None:
        tables.append(_compare_rows(sc, xo))
    if "snapshot" in r:
        from .snapshots import snapshot_tables
        tables.extend(snapshot_tables(r["snapshot"]))
    if "serving" in r:
        from .serving import serving_tables
        tables.extend(serving_tables(r["serving"]))
    return tables


def _protocol_floor_rows(e2e: dict[str, Any], pf: dict[str, Any], fl: dict[str, Any],
                         ) -> tuple[str, list[list[str]], list[str]]:
    """Each load row beside the plain-Python protocol floor of its shape (issue 24)."""
    if "error" in pf:
        return ("Loads vs the plain-Python protocol floor (did not run)", [[pf["error"]]], ["error"])
    rows = []
    for name, f in pf.items():
        raw = fl["full" if name == "large" else "small"]["median_us"]
        floor = f["gather"]["median_us"]
        row = [name, f"{f['bytes'] / KiB:.0f} KiB", f"{raw:.1f}", f"{f['notify']['median_us']:.1f}",
               f"{f['asyncio']['median_us']:.1f}", f"{floor:.1f}"]
        for case in (name, f"{name}_blocks"):  # load(), then load_blocks() where measured
            lp = e2e.get(case, {}).get("median_us")
            row += (["-", "-", "-"] if lp is None else
                    [f"{lp:.1f}", f"{lp / floor:.2f}x", f"{lp / raw:.2f}x"])
        rows.append([*row, "yes" if f["bytes_ok"] else "NO"])
    return ("Loads vs the plain-Python protocol floor (p50 us; two bare NIXL processes, no library: "
            "request notification, pre-made WRITE carrying the done notification, checked to DONE, "
            "polled; +gather/scatter: one strided copy each side; raw: the WRITE floor above; "
            "load_blocks: the same load through Endpoint.load_blocks)",
            rows, ["load", "payload", "raw WRITE", "request+WRITE+notify", "same on asyncio",
                   "+gather/scatter (floor)", "Endpoint.load", "load/floor", "load/raw",
                   "load_blocks", "blocks/floor", "blocks/raw", "bytes ok"])


def _timeline_rows(lt: dict[str, Any]) -> tuple[str, list[list[str]], list[str]]:
    """Each side's time per one-hash load, from the load timeline (issue 24's host time)."""
    if "error" in lt:
        return ("Load timeline (did not run)", [[lt["error"]]], ["error"])
    apis = list(lt)
    names: list[str] = []
    for api in apis:
        names.extend(k for k, v in lt[api].items()
                     if isinstance(v, float) and k not in names and k != "loads")
    head = ["load", "receiver.busy", "receiver.python", "receiver.nixl", "receiver.copy",
            "receiver.marking", "source.busy", "source.python", "source.nixl", "source.copy",
            "source.marking"]
    order = head + sorted(n for n in names if n not in head and n != "mark_ns")
    rows = [[n, *(f"{lt[api][n]:.1f}" if n in lt[api] else "-" for api in apis)] for n in order]
    n, mark = lt[apis[0]].get("loads", 0), lt[apis[0]].get("mark_ns", 0.0)
    return (f"Load timeline: one-hash loads one at a time, every stage marked in both processes "
            f"(medians over {n} loads, us). busy: the receiver's load less its wait for the "
            f"reply, the source's handling; python: busy less NIXL's calls (nixl), byte copies "
            f"(copy: memmoves on the CPU, waits for the copy kernels on CUDA) and the marks' own cost (marking: {mark / 1e3:.2f} us a marked call, "
            f"measured)", rows, ["span", *apis])


def _stage_rows(e2e: dict[str, Any], tl: dict[str, Any] | None, small_floor: float,
                ) -> tuple[str, list[list[str]], list[str]] | None:
    """Per-stage p50 (and p99) per load kind, and as a ratio to the small-copy floor."""
    cases = {k: v["stages"] for k, v in e2e.items() if v.get("stages")}
    if tl is not None and tl.get("stages"):
        cases["trace as loads"] = tl["stages"]
    if not cases:
        return None
    names: list[str] = []
    for st in cases.values():
        names.extend(n for n in st if n not in names)
    rows = []
    for n in names:
        row = [n]
        for st in cases.values():
            x = st.get(n)
            row.append("-" if x is None else
                       f"{x['p50_us']:.1f} / {x['p99_us']:.1f} ({x['p50_us'] / small_floor:.2f}x)")
        rows.append(row)
    return (f"Per-stage breakdown per load kind: p50 / p99 us (p50 / raw small-copy floor, "
            f"{small_floor:.1f} us)", rows, ["stage", *cases])


def _compare_rows(sc: dict[str, Any], xo: dict[str, Any]) -> tuple[str, list[list[str]], list[str]]:
    """Side by side: our channel copies vs xoscar's copy_to, per seed case."""
    if "error" in xo:
        return ("Anchor: xoscar copy_to (did not run)", [[xo["error"]]], ["error"])
    rows = []
    for c in ("always_full", "alternating_size_only", "alternating_streak", "sustained_small"):
        for who, x in (("xavier", sc[c]), ("xoscar", xo["cases"][c])):
            ratio = x.get("ratio_median_to_floor", x["ratio_mean_to_floor"])
            speedup = x["median_us"] / sc[c]["median_us"]
            rows.append([c if who == "xavier" else "", who, f"{x['median_us']:.1f}", f"{x['p95_us']:.1f}",
                         f"{x['mean_us']:.1f}", f"{ratio:.2f}x",
                         str(x["registrations_after_warmup"] + x["peer_registrations_after_warmup"]),
                         f"{x['wire_bytes'] / max(1, x['useful_bytes']):.3f}",
                         f"{speedup:.1f}x" if who == "xoscar" else "",
                         "yes" if x["bytes_verified"] else "NO"])
    title = (f"Anchor, side by side ({xo['cases']['always_full']['copies']} copies per case, two "
             f"processes): xavier channel copy vs {xo['transport']}. vs floor: median/floor (mean/floor "
             "when sizes alternate); regs: both ends after warm-up (xoscar's: NixlChannel._register "
             "calls that re-registered, wrapped in both processes); xoscar/xavier: median over median")
    return (title, rows, ["case", "path", "median us", "p95 us", "mean us", "vs floor", "regs after warm-up",
                          "wire/useful", "xoscar/xavier", "bytes ok"])

def report_head(env: dict[str, Any]) -> str:
    """The report's first line (what ran where), and its note when there is one (one GPU
    time-slicing both processes)."""
    head = (f"xavier-async {env['xavier_async']} | transport {env['transport']} | device {env['device']}"
            f" | torch {env['torch']} | nixl {env.get('nixl', '-')} | {env['cpus']} cpus")
    return head + (f"\nnote: {env['note']}" if env.get("note") else "")


def print_report(r: dict[str, Any], console: Any = None) -> None:
    print_tables(report_head(r["environment"]), _rows(r), console)


def print_tables(head: str, tables: list[tuple[str, list[list[str]], list[str]]], console: Any = None,
                 ) -> None:
    """A header line, then each (title, rows, header) table (rich when available)."""
    if console is None:
        print(head)
        for title, rows, header in tables:
            print(f"\n{title}")
            widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
            for row in [header, *rows]:
                print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))
        return
    from rich.table import Table
    console.print(head)
    for title, rows, header in tables:
        table = Table(title=title, title_justify="left")
        for h in header:
            table.add_column(h, justify="right")
        for row in rows:
            table.add_row(*row)
        console.print(table)


def plot(r: dict[str, Any], path: Path) -> None:
    """Per-copy latency of the four cases and the floor; trace wire vs useful bytes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "seed_cases" not in r and "snapshot" in r:  # --only-snapshot
        from .snapshots import plot_snapshot
        fig, ax = plt.subplots(figsize=(8, 5))
        plot_snapshot(ax, r["snapshot"])
        _save(fig, path)
        return
    if "seed_cases" not in r:  # --only-serving
        from .serving import plot_serving
        fig, ax = plt.subplots(figsize=(7.5, 5))
        plot_serving(ax, r["serving"])
        _save(fig, path)
        return
    sc, fl, tr = r["seed_cases"], r["floor"], r["trace"]
    staged = {k: v["stages"] for k, v in r["e2e_loads"].items() if v.get("stages")}
    serving = r.get("serving") if "runs" in r.get("serving", {}) else None
    n = 2 + bool(staged) + bool(serving)
    fig, axes = plt.subplots(1, n, figsize=((19 if staged else 13) + (6.5 if serving else 0), 5))
    ax1, ax2 = axes[0], axes[1]
    names = ["floor full", "floor small", "always full", "alt. size-only", "alt. streak",
             "sustained small"]
    med = [fl["full"]["median_us"], fl["small"]["median_us"]] + [
        sc[c]["median_us"] for c in ("always_full", "alternating_size_only", "alternating_streak",
                                     "sustained_small")]
    p95 = [fl["full"]["p95_us"], fl["small"]["p95_us"]] + [
        sc[c]["p95_us"] for c in ("always_full", "alternating_size_only", "alternating_streak",
                                  "sustained_small")]
    colors = ["#999999", "#bbbbbb", "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"]
    ax1.bar(names, med, color=colors, label="median")
    ax1.scatter(names, p95, color="black", marker="_", s=300, label="p95", zorder=3)
    xo = r.get("compare", {}).get("xoscar")
    if xo is not None and "cases" in xo:
        cases = ("always_full", "alternating_size_only", "alternating_streak", "sustained_small")
        ax1.scatter(names[2:], [xo["cases"][c]["median_us"] for c in cases], color="#d62728",
                    marker="D", s=60, label="xoscar copy_to median", zorder=4)
    ax1.set_yscale("log")
    ax1.set_ylabel("per copy (us, log)")
    ax1.set_title(f"Channel copies vs floor ({r['environment']['transport']}, {r['environment']['device']})"
                  + (" and xoscar" if xo is not None and "cases" in xo else ""))
    ax1.tick_params(axis="x", rotation=25)
    ax1.legend()
    modes = [k for k, v in tr.items() if isinstance(v, dict)]
    useful = tr["useful_bytes"] / 1e6
    wire = [tr[m]["wire_bytes"] / 1e6 for m in modes]
    x = range(len(modes))
    ax2.bar([i - 0.2 for i in x], [useful] * len(modes), width=0.4, label="useful", color="#2ca02c")
    ax2.bar([i + 0.2 for i in x], wire, width=0.4, label="on the wire", color="#d62728")
    for i, m in enumerate(modes):
        ax2.text(i + 0.2, wire[i], f"{tr[m]['wire_over_useful']:.2f}x", ha="center", va="bottom")
    ax2.set_xticks(list(x), modes, rotation=15)
    ax2.set_ylabel("MB")
    ax2.set_title(f"Trace replay: {tr['batches']} batches, wire vs useful bytes")
    ax2.legend()
    if staged:
        _stacked_stages(axes[2], staged, fl["small"]["median_us"])
    if serving:
        from .serving import plot_serving
        plot_serving(axes[-1], serving)
    _save(fig, path)


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)



def _stacked_stages(ax: Any, staged: dict[str, dict[str, Any]], small_floor: float) -> None:
    """One stacked bar per load kind: receiver stages (plan, post, wait, unpack) by p50,
    the source's stages drawn inside 'wait' as a second bar next to it."""
    kinds = list(staged)
    x = list(range(len(kinds)))
    bottoms = [0.0] * len(kinds)
    colors = {"plan": "#1f77b4", "post": "#ff7f0e", "wait": "#bbbbbb", "unpack": "#2ca02c",
              "queue": "#9467bd", "lookup": "#8c564b", "pack": "#e377c2", "post_to_done": "#7f7f7f"}
    for side, stages, dx in (("receiver", ("plan", "post", "wait", "unpack"), -0.2),
                             ("source", ("queue", "lookup", "pack", "post_to_done"), 0.2)):
        bottoms = [0.0] * len(kinds)
        for st in stages:
            vals = [staged[k].get(f"{side}.{st}", {}).get("p50_us", 0.0) for k in kinds]
            if not any(vals):
                continue
            ax.bar([i + dx for i in x], vals, width=0.38, bottom=bottoms, color=colors[st],
                   label=f"{side} {st}")
            bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax.axhline(small_floor, color="black", linestyle="--", linewidth=1, label="raw small-copy floor")
    ax.set_xticks(x, kinds)
    ax.set_ylabel("p50 per stage (us)")
    ax.set_title("Where a load's time goes (left: receiver, right: source)")
    ax.legend(fontsize=7)


if __name__ == "__main__":
    sys.exit(main())