"""What the CLI's subcommands share: the default models, the engine and sampling flags, the batch
jobs' flags (caption, embed), and building the LLM and SamplingParams from them."""
import argparse

from vlinfer.cli.options import FLAGS, add_engine_args, advanced_group, engine_options

TEXT_MODEL = "smollm2"  # real SmolLM2-135M-Instruct, shipped inside a PyPI package: works offline
# real Qwen3-VL-2B when in the HF cache, else the embedded toy model (warned)
VISION_MODEL = "qwen3-vl"
# real Qwen3-VL-Embedding-2B when in the HF cache, else the toy (warned)
EMBED_MODEL = "qwen3-vl-embedding"
MODEL_HELP = (
    "alias ({aliases}), local folder, .gguf file or Hugging Face repo id; default: {default}")


# Settings named in engine messages -> this CLI's flags (the engine names its keyword arguments).
CLI_FLAGS = {
    **FLAGS, "batch_size": "--batch-size", "max_pixels": "--max-pixels",
    "dimensions": "--dimensions"
}


def add_model_args(p: argparse.ArgumentParser, default: str) -> None:
    from vlinfer.loading import known_aliases
    p.add_argument("--model", default=None,
                   help=MODEL_HELP.format(aliases=", ".join(known_aliases()), default=default))
    add_engine_args(advanced_group(p))


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int, temperature: float = 0.0,
                       top_p: float = 1.0) -> None:
    """Defaults per subcommand: README.md's defaults table says why they differ."""
    p.add_argument("--temperature", type=float, default=temperature,
                   help=f"0 is greedy (default: {temperature:g})")
    p.add_argument("--top-p", type=float, default=top_p, help=f"default: {top_p:g}")
    p.add_argument("--max-tokens", type=int, default=max_tokens, help=f"default: {max_tokens}")


def add_batch_job_args(p: argparse.ArgumentParser, batch_size: int, unit: str) -> None:
    """The flags of a resumable batch job over files or tables (caption, embed), here or on a Ray
    cluster."""
    p.add_argument("--batch-size", type=int, default=batch_size,
                   help=f"{unit} per engine run (default: {batch_size})")
    p.add_argument("--resume", action="store_true",
                   help="continue an existing --out, skipping what it records")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--ray", nargs="?", const="", default=None, metavar="ADDRESS",
        help="run on a Ray cluster: ADDRESS of its head (e.g. 10.0.0.1:6379, or 'auto' for the one "
        "this machine is in), or none to start one here; tables are then read by Ray Data (any "
        "filesystem it reads) (needs pip install 'vlinfer[ray]')")
    p.add_argument("--replicas", type=int, default=1,
                   help="with --ray: engines, one per Ray actor (default: 1)")


def add_max_pixels(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-pixels", type=int, default=None, metavar="N",
        help="resize each image to at most N pixels before encoding (fewer image tokens, faster; "
        "the model's min_pixels is lowered to N if it is larger); default: the model's own limits")


def add_lora_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lora", default=None, metavar="PATH",
        help="a PEFT LoRA adapter folder every request runs with, named after the folder (turns "
        "--enable-lora on; its rank must be at most --max-lora-rank)")


def lora_request(args):
    """--lora's LoRARequest (LoRARequest.from_path), or None."""
    from vlinfer import LoRARequest
    return LoRARequest.from_path(args.lora) if args.lora is not None else None


def build_llm(args, model: str):
    """The LLM of the engine flags; with --lora, its adapter read and checked here, before any input
    is."""
    from vlinfer import LLM
    llm = LLM(model, **engine_options(args))
    if args.lora is not None:
        llm.engine.input_processor.check_lora(lora_request(args))
    return llm


def sampling_params(args):
    from vlinfer import SamplingParams
    return SamplingParams(temperature=args.temperature, top_p=args.top_p,
                          max_tokens=args.max_tokens, seed=args.seed)


def mm_kwargs(args, llm) -> dict | None:
    from vlinfer.captioning import image_limits
    return image_limits(llm, args.max_pixels) if llm.engine.is_multimodal else None
