"""Command line: `python -m vlinfer generate|chat|caption|embed|bench ...` (also installed as
`vlinfer`).

Exit codes: 0 done; 1 caption or embed finished but some items could not be read (their errors are
in the output); 2 bad usage, a model that cannot be found, or a rejected request; 3 caption or embed
could not write its output (disk full, ...): the batches written before are whole, --resume
continues; 130 interrupted.

Building the parsers imports no torch and no engine (they load in the command that runs), so
--help answers at once."""
import argparse
import logging
import sys

from vlinfer.cli import answer, bench, caption, embed
from vlinfer.cli.options import compact_usage, flags_in_logs, name_flags, set_threads
from vlinfer.cli.shared import CLI_FLAGS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlinfer",
                                     description="vlinfer: small VLM / LLM inference engine",
                                     epilog=__doc__.split("\n", 1)[1].strip())
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{generate,chat,caption,embed,bench,serve}")
    commands = [
        *answer.add_parsers(sub),
        caption.add_parser(sub),
        embed.add_parser(sub),
        bench.add_parser(sub)
    ]
    s = sub.add_parser("serve", add_help=False,
                       help="OpenAI-compatible HTTP server; try serve --help")
    s.set_defaults(func=None)  # its own parser takes -v too
    for command in commands:
        command.usage = compact_usage(command)
        # -v after the subcommand as well as before it; SUPPRESS: absent there, the top-level value
        # stands.
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="log engine details")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "serve":  # the server parses its own flags, --help included
        try:
            from vlinfer.cli.serve import main as serve_main
        except ImportError as e:
            print(
                f"error: the server needs FastAPI, uvicorn, httpx and prometheus_client ({e.name} "
                "is missing): "
                "pip install 'vlinfer[serve]'", file=sys.stderr)
            return 2
        return serve_main((["--verbose"] if args.verbose else []) + extra)
    if args.command != "bench" and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(message)s")
    from vlinfer.captioning.output import OutputWriteError
    # the benchmark scripts name their own flags
    flags = {} if args.command == "bench" else CLI_FLAGS
    try:
        with flags_in_logs(flags):
            # the process is the CLI's: its thread count is set here, once
            if hasattr(args, "num_threads"):
                set_threads(args)
            return bench.cmd_bench(args, extra) if args.command == "bench" else args.func(args)
    # bad request, bad input, ModelNotFoundError, mistyped --device
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {name_flags(str(e), flags)}", file=sys.stderr)
        return 2
    except OutputWriteError as e:
        print(f"error: {e.strerror}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
