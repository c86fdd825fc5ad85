"""Incremental detokenization: text grows as tokens arrive, never splitting a multi-byte character.

Decoding a few tokens before the new ones and taking the difference keeps tokenizers that strip or
merge leading spaces (SentencePiece) correct; a trailing U+FFFD means an unfinished UTF-8 sequence,
so the text waits for the next token."""


class IncrementalDetokenizer:
    CONTEXT = 5

    def __init__(self, tokenizer, num_prompt_tokens: int, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # vLLM's rule: only when special tokens are kept does False change anything, and then it
        # removes the space a tokenizer's decoder (WordPiece, some SentencePiece ones) puts between
        # two adjacent added tokens. Byte-level BPE decoders (Qwen, SmolLM2) put none, so for them
        # both settings give the same text.
        self.added_ids = None
        if not skip_special_tokens and not spaces_between_special_tokens:
            self.added_ids = set(tokenizer.added_tokens_decoder)
        self.prefix_offset = max(num_prompt_tokens - self.CONTEXT, 0)
        self.read_offset = num_prompt_tokens

    def decode(self, ids: list[int]) -> str:
        if not self.added_ids:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        # Decode in pieces split between adjacent added tokens: the decoder cannot put a space where
        # it never sees both tokens.
        pieces, start = [], 0
        for i in range(1, len(ids)):
            if ids[i] in self.added_ids and ids[i - 1] in self.added_ids:
                pieces.append(ids[start:i])
                start = i
        pieces.append(ids[start:])
        return "".join(self.tokenizer.decode(p, skip_special_tokens=False) for p in pieces)

    def step(self, token_ids: list[int]) -> str:
        """New text after token_ids[-1] was appended."""
        prefix_text = self.decode(token_ids[self.prefix_offset:self.read_offset])
        new_text = self.decode(token_ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(token_ids)
            return new_text[len(prefix_text):]
        return ""
