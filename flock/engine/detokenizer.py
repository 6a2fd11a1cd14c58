"""A running request's output text, at a cost per token that does not grow with the output."""

from tokenizers.decoders import DecodeStream

# Tokens decoded before the new ones, so that what a decoder does at the start of a text (SentencePiece strips
# the first space) and bytes of a character split across tokens come out as in the whole text.
CONTEXT_TOKENS = 4
# Tokens that may wait for their text to settle; past this the whole text is decoded again.
MAX_PENDING_TOKENS = 16


def cleans_up_spaces(tokenizer) -> bool:
    """Whether `tokenizer.decode` removes spaces before punctuation after the backend's decode (transformers
    does for some tokenizers), a step that `IncrementalText` then repeats on its whole text."""
    ids = tokenizer.encode("a .", add_special_tokens=False)
    return tokenizer.decode(ids) != tokenizer.decode(ids, clean_up_tokenization_spaces=False)


class IncrementalText:
    """The text of a growing list of token ids, equal to `tokenizer.decode(ids)`. A fast tokenizer's text comes
    from the tokenizers library's DecodeStream, one token at a time (as vLLM's incremental detokenizer);
    otherwise, or if the stream fails, each update decodes only the new tokens after a few earlier ones and keeps
    what they add to those tokens' text. New tokens that end in an incomplete character, or would change the text
    before them, wait for the next update (at most `MAX_PENDING_TOKENS` of them)."""

    def __init__(self, tokenizer, skip_special_tokens: bool, clean_up_spaces: bool, stream: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.clean_up_spaces = clean_up_spaces
        self.raw = ""  # the backend's text of ids[:done] (a stream's: but its pending bytes), before any clean-up
        self.done = 0
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) \
            if stream and self._backend is not None else None

    @property
    def text(self) -> str:
        return self.tokenizer.clean_up_tokenization(self.raw) if self.clean_up_spaces else self.raw

    def update(self, ids: list[int]) -> str:
        """The text of `ids` (the ids of the last update and more), without its not yet settled last tokens."""
        if self._stream is not None:
            try:
                self.raw += "".join(self._stream.step(self._backend, t) or "" for t in ids[self.done :])
            except Exception:  # tokenizers' "invalid prefix" (vLLM meets it too): decode whole, then windows
                self._stream, self.raw = None, self._decode(ids)
            self.done = len(ids)
        elif len(ids) > self.done:
            start = max(0, self.done - CONTEXT_TOKENS)
            before = self._decode(ids[start : self.done])
            while not before and start > 0:  # context that decodes to nothing (skipped special tokens)
                start = max(0, start - CONTEXT_TOKENS)
                before = self._decode(ids[start : self.done])
            after = self._decode(ids[start:])
            if after.startswith(before) and not after.endswith("\ufffd"):
                self.raw += after[len(before) :]
                self.done = len(ids)
            elif len(ids) - self.done > MAX_PENDING_TOKENS:  # e.g. a model that writes U+FFFD itself
                self.raw, self.done = self._decode(ids), len(ids)
        return self.text

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)
