"""`vlinfer bench`: the throughput benchmarks of a source checkout's bench/ folder."""
import importlib.util
import os
import sys


BENCH_SCRIPTS = {False: "throughput.py", True: "vlm_throughput.py"}


def cmd_bench(args, passthrough: list[str]) -> int:
    """The benchmarks live in bench/ of a source checkout (not in the installed package): load the
    script by path and run its main() with the remaining arguments."""
    name = BENCH_SCRIPTS[args.vlm]
    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench", name)
    wants_help = any(a in ("-h", "--help") for a in passthrough)
    if wants_help:
        print(
            "usage: vlinfer bench [--vlm] [ARGS ...]\n\nRuns bench/throughput.py (text-model "
            "throughput) or, "
            "with --vlm, bench/vlm_throughput.py (image + text throughput) with ARGS, both against "
            "transformers.\n"
        )
    if not os.path.exists(path):
        print(
            f"{'' if wants_help else 'error: '}the benchmarks are in the bench/ folder of a source "
            "checkout of "
            f"vlinfer, which this installation does not have ({path} not found). From a checkout "
            "run: "
            f"python bench/{name} --help", file=sys.stdout if wants_help else sys.stderr)
        return 0 if wants_help else 2
    spec = importlib.util.spec_from_file_location(f"vlinfer_bench_{name[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if wants_help:
        print(f"{path} options:\n")
    else:
        print(f"running {path} {' '.join(passthrough)}", file=sys.stderr)
    # the script's argparse names itself from argv[0]
    sys.argv = [f"vlinfer bench{' --vlm' if args.vlm else ''}"]
    return module.main(passthrough) or 0



def add_parser(sub):
    b = sub.add_parser(
        "bench", add_help=False, help="throughput benchmark (bench/throughput.py from a source "
        "checkout; --vlm: bench/vlm_throughput.py); try bench --help")
    b.add_argument("--vlm", action="store_true")
    b.set_defaults(func=cmd_bench)
    return b
