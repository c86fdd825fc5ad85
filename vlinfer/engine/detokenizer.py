"""Incremental detokenization: text grows as tokens arrive, never splitting a multi-byte character.

Decoding a few tokens before the new ones and taking the difference keeps tokenizers that strip or merge
leading spaces (SentencePiece) correct; a trailing U+FFFD means an unfinished UTF-8 sequence, so the text
waits for the next token."""


class IncrementalDetokenizer:
    CONTEXT = 5

    def __init__(self, tokenizer, num_prompt_tokens: int, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = max(num_prompt_tokens - self.CONTEXT, 0)
        self.read_offset = num_prompt_tokens

    def step(self, token_ids: list[int]) -> str:
        """New text after token_ids[-1] was appended."""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        prefix_text = decode(token_ids[self.prefix_offset:self.read_offset])
        new_text = decode(token_ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(token_ids)
            return new_text[len(prefix_text):]
        return ""
