"""Reasoning output, in vLLM's shape (--reasoning-parser): a model that thinks writes
`<think> ... </think>` before its answer; a reasoning parser splits its text into the reasoning and
the content, per request, and exactly in a stream (a tag split across tokens or deltas waits until
it is whole or cannot be one).

- Where the output starts (prompt_state): a prompt whose last tag is `<think>` opened the thinking
  (Qwen3.5's and Qwen3-Thinking's templates open it in the generation prompt): the output starts in
  the reasoning. A prompt that ends with `</think>` and whitespace closed it (enable_thinking=False
  writes an empty thinking): the output is all content. Otherwise the output is reasoning only when
  it starts with `<think>` (Qwen3's templates), and content from its first character when not.
- The text split (ReasoningText) is on characters: the joined reasoning and content with the tags
  put back equal the raw text, whatever the deltas.
- The token rules (ReasoningState: the thinking budget, structured outputs after `</think>`) are on
  the tags' token ids, so the parser needs a tokenizer where each tag is one token (Qwen's are).

One definition of when the parser is on by default: template_thinks."""
import logging

logger = logging.getLogger("vlinfer")

# Engine option values: a parser's name, "auto" (the template decides: template_thinks), "none".
REASONING_PARSERS = ("qwen3",)
REASONING_PARSER_CHOICES = ("auto", "none") + REASONING_PARSERS
# chat_template_kwargs that would change what the template is given by the engine, not the template
RESERVED_TEMPLATE_KWARGS = ("messages", "conversation", "tools", "documents", "chat_template",
                            "add_generation_prompt", "tokenize", "continue_final_message")


def template_thinks(chat_template: str | None) -> bool:
    """Whether a chat template writes thinking tags: the rule that turns the qwen3 parser on by
    default (reasoning_parser="auto")."""
    return bool(chat_template) and "<think>" in chat_template and "</think>" in chat_template


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (held back: the next
    delta may complete the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


STATES = ("start", "reasoning", "content")


class ReasoningText:
    """One output's text split into reasoning and content as it streams (feed), the whole text
    being one feed with final=True. States (STATES): "start" (the output may still open with the
    start tag), "reasoning", "content"; the first is the prompt's (prompt_state)."""

    def __init__(self, start_tag: str, end_tag: str, state: str = "start"):
        if state not in STATES:
            raise ValueError(f"reasoning state {state!r} is not one of {STATES}")
        self.start_tag, self.end_tag = start_tag, end_tag
        self.state = state
        self.opened = state == "reasoning"  # thinking began (in the prompt, or the output's tag)
        self.wrote_start_tag = False  # the output itself opened with the start tag
        self.closed = False  # the end tag came
        self.pending = ""  # text held back: maybe the start of a tag
        self.reasoning, self.content = "", ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) this delta adds; final=True hands out what was held back."""
        text, reasoning, content = self.pending + delta, "", ""
        self.pending = ""
        while True:
            if self.state == "start":
                if text.startswith(self.start_tag):
                    text = text[len(self.start_tag):]
                    self.state, self.opened, self.wrote_start_tag = "reasoning", True, True
                    continue
                if self.start_tag.startswith(text) and not final:
                    self.pending = text
                    break
                self.state = "content"
            elif self.state == "reasoning":
                end = text.find(self.end_tag)
                if end >= 0:
                    reasoning += text[:end]
                    text = text[end + len(self.end_tag):]
                    self.state, self.closed = "content", True
                    continue
                keep = 0 if final else _partial_suffix(text, self.end_tag)
                reasoning += text[:len(text) - keep]
                self.pending = text[len(text) - keep:]
                break
            else:
                content += text
                break
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def raw(self) -> str:
        """The text fed so far, tags put back (pending text excluded)."""
        return (self.start_tag if self.wrote_start_tag else "") + self.reasoning + \
            (self.end_tag if self.closed else "") + self.content


class Qwen3ReasoningParser:
    """vLLM's qwen3 parser: `<think>` and `</think>`, each one token of the tokenizer."""
    name = "qwen3"
    start_token, end_token = "<think>", "</think>"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        missing = [t for t in (self.start_token, self.end_token) if t not in vocab]
        if missing:
            raise ValueError(f"reasoning_parser={self.name!r} needs {' and '.join(missing)} as "
                             "single tokens of the tokenizer; this tokenizer has no such token")
        self.start_token_id, self.end_token_id = vocab[self.start_token], vocab[self.end_token]

    def prompt_state(self, prompt_token_ids: list[int]) -> str:
        """Where the output starts (the module docstring): "reasoning" when the prompt's last tag
        is the start tag, "content" when the prompt ends with the end tag and whitespace, else
        "start"."""
        for i in range(len(prompt_token_ids) - 1, -1, -1):
            token = prompt_token_ids[i]
            if token == self.start_token_id:
                return "reasoning"
            if token == self.end_token_id:
                rest = self.tokenizer.decode(prompt_token_ids[i + 1:])
                return "content" if not rest.strip() else "start"
        return "start"

    def text_splitter(self, state: str = "start") -> ReasoningText:
        return ReasoningText(self.start_token, self.end_token, state)

    def extract_reasoning(self, model_output: str, state: str = "start"
                          ) -> tuple[str | None, str]:
        """(reasoning, content) of a whole output, which starts in `state` (prompt_state);
        reasoning None when the output did not think."""
        split = self.text_splitter(state)
        split.feed(model_output, final=True)
        return (split.reasoning if split.opened else None), split.content


PARSERS = {Qwen3ReasoningParser.name: Qwen3ReasoningParser}


def resolve_reasoning_parser(choice: str | None, chat_template: str | None, tokenizer,
                             vocab_size: int):
    """The parser an engine runs with (None: off) from its reasoning_parser option: "auto" picks
    qwen3 when the template thinks (template_thinks) and the tokenizer has both tags within the
    model's vocabulary; the choice is logged."""
    if choice in (None, "", "none"):
        return None
    if choice == "auto":
        if not template_thinks(chat_template):
            return None
        try:
            parser = Qwen3ReasoningParser(tokenizer)
        except ValueError as e:
            logger.info("reasoning parser: none (the chat template thinks, but %s)", e)
            return None
        if max(parser.start_token_id, parser.end_token_id) >= vocab_size:
            logger.info("reasoning parser: none (the chat template thinks, but the model's %d-token"
                        " vocabulary has no %s)", vocab_size, parser.end_token)
            return None
        logger.info("reasoning parser: qwen3 (the chat template writes <think> tags; "
                    "reasoning_parser='none' turns it off)")
        return parser
    if choice not in PARSERS:
        raise ValueError(f"reasoning_parser={choice!r} is not supported: expected one of "
                         f"{', '.join(REASONING_PARSER_CHOICES)}")
    parser = PARSERS[choice](tokenizer)
    logger.info("reasoning parser: %s (asked for)", choice)
    return parser


class ReasoningState:
    """One sequence's reasoning: its text split, and the token rules. The thinking budget ends the
    thinking after `budget` tokens by forcing the end tag; a structured-output matcher is parked
    while the output thinks, so the constraint covers only the answer after the end tag."""

    def __init__(self, parser: Qwen3ReasoningParser, prompt_token_ids: list[int],
                 budget: int | None):
        self.parser = parser
        self.token_state = parser.prompt_state(prompt_token_ids)  # then advanced by on_token
        self.opened_in_prompt = self.token_state == "reasoning"
        self.text = parser.text_splitter(self.token_state)
        self.budget = budget
        self.parked_matcher = None  # the grammar matcher, while the output thinks

    @property
    def may_open(self) -> bool:
        """The next token may be the start tag that opens the thinking (the output's first)."""
        return self.token_state == "start"

    def thinking_tokens(self, output_token_ids: list[int]) -> int | None:
        """Thinking tokens in an output (this sequence's, or a verification row's with proposals);
        None when the thinking has ended or never began."""
        if self.token_state == "content":
            return None
        start = 0
        if not self.opened_in_prompt:
            if not output_token_ids or output_token_ids[0] != self.parser.start_token_id:
                return None
            start = 1
        if self.parser.end_token_id in output_token_ids:
            return None
        return len(output_token_ids) - start

    def must_end(self, output_token_ids: list[int]) -> bool:
        """The budget is spent: the next token is the end tag."""
        used = self.thinking_tokens(output_token_ids) if self.budget is not None else None
        return used is not None and used >= self.budget

    def on_token(self, token_id: int, matcher):
        """Advance over an appended token; returns the matcher that applies from the next token on
        (parked while thinking, handed back after the end tag)."""
        if self.token_state == "start":
            if token_id == self.parser.start_token_id:
                self.token_state, self.parked_matcher = "reasoning", matcher
                return None
            self.token_state = "content"
        elif self.token_state == "reasoning" and token_id == self.parser.end_token_id:
            self.token_state = "content"
            matcher, self.parked_matcher = self.parked_matcher, None
        return matcher

    def park(self, matcher):
        """A new sequence's matcher: parked when its prompt opened the thinking."""
        if self.opened_in_prompt:
            self.parked_matcher = matcher
            return None
        return matcher


def allow_token(bitmask_row, token_id: int) -> None:
    """Set one token's bit in a row of an int32 token bitmask (bit t of word t // 32)."""
    bit = 1 << (token_id % 32)
    bitmask_row[token_id // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit
