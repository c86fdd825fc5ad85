"""Structured outputs: constraints (JSON schema, regex, choice, grammar) compiled by llguidance into
per-sequence matchers whose token bitmasks the sampler applies. grammar_spec.py is tokenizer-free
(SamplingParams checks with it); matchers.py is what an engine owns (its tokenizer's vocabulary, a
compile cache, a matcher per sequence)."""
