"""A running request's output text, at a cost per token that does not grow with the output, and each token's own
text as logprobs show it."""

import os
import re

from tokenizers.decoders import DecodeStream

# Tokens decoded before the new ones, so that what a decoder does at the start of a text (SentencePiece strips
# the first space) and bytes of a character split across tokens come out as in the whole text.
CONTEXT_TOKENS = 4
# Tokens that may wait for their text to settle; past this the whole text is decoded again.
MAX_PENDING_TOKENS = 16
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a SentencePiece byte-fallback token
# A prompt's last tokens that an output's text is decoded after (enough that they decode to some text)
PROMPT_CONTEXT_TOKENS = 32


class IncrementalText:
    """The text a growing list of output token ids adds to their prompt's: `tokenizer.decode(prompt + ids)` past
    the prompt's text, as vLLM's detokenizer gives it (a SentencePiece output keeps the space its first token
    starts with; bytes of a character split across tokens wait for the rest; no clean-up of spaces before
    punctuation, which transformers' decode makes for some tokenizers). A fast tokenizer's text comes from
    the tokenizers library's DecodeStream primed with the prompt, one token at a time (as vLLM's incremental
    detokenizer); otherwise, or if the stream fails, each update decodes only the new tokens after a few earlier
    ones (the prompt's last ones first) and keeps what they add to those tokens' text. New tokens that end in an
    incomplete character, or would change the text before them, wait for the next update (at most
    `MAX_PENDING_TOKENS` of them); `final` gives them all."""

    def __init__(self, tokenizer, skip_special_tokens: bool, stream: bool = True, prompt_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prompt_ids = list(prompt_ids or [])[-PROMPT_CONTEXT_TOKENS:]
        self.text = ""  # the backend's text of ids[:done] (a stream's: but its pending bytes)
        self.done = 0
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = self._primed_stream() if stream and self._backend is not None else None

    def _primed_stream(self) -> DecodeStream:
        """A DecodeStream primed with the prompt's last tokens. A prompt that ends inside a character is primed up
        to it and steps its bytes, which the output may complete (primed with them, the stream would take the
        whole window's text for the output's)."""
        whole = len(self.prompt_ids)
        while whole > len(self.prompt_ids) - 4 and whole and self._decode(self.prompt_ids[:whole]).endswith("\ufffd"):
            whole -= 1
        if whole <= len(self.prompt_ids) - 4:  # no character of up to 4 bytes explains it: a U+FFFD of its own
            whole = len(self.prompt_ids)
        stream = DecodeStream(self.prompt_ids[:whole], skip_special_tokens=self.skip_special_tokens)
        for token in self.prompt_ids[whole:]:
            stream.step(self._backend, token)
        return stream

    def update(self, ids: list[int]) -> str:
        """The text of `ids` (the ids of the last update and more), without its not yet settled last tokens."""
        if self._stream is not None:
            try:
                self.text += "".join(self._stream.step(self._backend, t) or "" for t in ids[self.done :])
            except Exception:  # tokenizers' "invalid prefix" (vLLM meets it too): decode whole, then windows
                self._stream, self.text = None, self._after(self.prompt_ids[-CONTEXT_TOKENS:], ids)
            self.done = len(ids)
        elif len(ids) > self.done:
            lead = CONTEXT_TOKENS
            before = self._before(ids, lead)
            # more context where it decodes to nothing (skipped specials) or starts inside a run of byte tokens,
            # which SentencePiece decodes as one (a run cut short is no UTF-8: every byte a U+FFFD)
            while (not self._decode(before) or _BYTE_PIECE.fullmatch(self._vocab_piece(before[0]))) \
                    and lead < self.done + len(self.prompt_ids):
                lead += CONTEXT_TOKENS
                before = self._before(ids, lead)
            added = self._after(before, ids[self.done :], partial=True)
            if added is not None:
                self.text += added
                self.done = len(ids)
            elif len(ids) - self.done > MAX_PENDING_TOKENS:  # e.g. a model that writes U+FFFD itself
                self.text, self.done = self._after(self.prompt_ids[-CONTEXT_TOKENS:], ids), len(ids)
        return self.text

    def final(self, ids: list[int]) -> str:
        """The whole text of `ids`: the settled text and the tokens still waiting (from a stream, but the bytes of
        a character they leave unfinished, which vLLM drops too)."""
        text = self.update(ids)
        if self.done == len(ids) and (self._stream is not None or not self.text.endswith("\ufffd")):
            return text
        self.text, self.done = self._after(self.prompt_ids[-CONTEXT_TOKENS:], ids), len(ids)
        return self.text

    def _before(self, ids: list[int], n: int) -> list[int]:
        """The `n` tokens before ids[done]: the prompt's last ones where the output has fewer."""
        own = ids[max(0, self.done - n) : self.done]
        return self.prompt_ids[max(0, len(self.prompt_ids) - (n - len(own))) :] + own if len(own) < n else own

    def _after(self, before: list[int], new: list[int], partial: bool = False) -> str | None:
        """What `new` adds to the text of the tokens `before` it; with `partial`, None where new ends in an
        incomplete character or changes the text before it (else the characters it completes and its text, or
        the text of new alone)."""
        head, whole = self._decode(before), self._decode(before + new)
        if whole.startswith(head) and not (partial and whole.endswith("\ufffd")):
            return whole[len(head) :]
        if partial:
            return None
        complete = head.rstrip("\ufffd")
        return whole[len(complete) :] if whole.startswith(complete) else self._decode(new)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _vocab_piece(self, token_id: int) -> str:
        """The token as the vocabulary spells it ("<0xE6>", "▁the"), not decoded."""
        return self.tokenizer.convert_ids_to_tokens(token_id) or ""


# preceding tokens a token's text may need to complete a character split across tokens (as vLLM looks back)
PIECE_CONTEXT_TOKENS = 4


class TokenPieces:
    """Each token's own text, as vLLM's decoded_token: `tokenizer.decode([id])`, with the leading space a
    SentencePiece decoder strips from a lone token ('▁The' is ' The') put back; a token whose text holds U+FFFD
    (bytes of a character split across tokens) takes its text from the preceding tokens it completes, "" while
    the character is unfinished. Texts without U+FFFD are decoded once per id."""

    context_tokens = PIECE_CONTEXT_TOKENS

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}
        self.marker = _stripped_space_marker(tokenizer)
        self.vocab_bytes: list[bytes] | None = None  # every token's bytes, decoded by xgrammar when first needed

    def __call__(self, token_id: int, context: list[int] = ()) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self._piece(token_id)
        return self._completed(token_id, list(context[-PIECE_CONTEXT_TOKENS:])) if "\ufffd" in text else text

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes, a piece of a character included (its text cannot hold those)."""
        text = self(token_id)
        if "\ufffd" not in self.cache[token_id]:
            return text.encode()
        if self.vocab_bytes is None:
            import xgrammar

            self.vocab_bytes = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer).decoded_vocab
        return self.vocab_bytes[token_id] if token_id < len(self.vocab_bytes) else text.encode()

    def _piece(self, token_id: int) -> str:
        text = self.tokenizer.decode([token_id])
        if self.marker is None:
            return text
        raw = self.tokenizer.convert_ids_to_tokens(token_id) or ""
        markers = len(raw) - len(raw.lstrip(self.marker))
        missing = markers - (len(text) - len(text.lstrip(" ")))
        return " " * missing + text if missing > 0 else text

    def _completed(self, token_id: int, context: list[int]) -> str:
        """The text a partial-character token ends (vLLM's correction): after the fewest preceding tokens that
        complete the character, the text the token adds to those of them that are whole."""
        for n in range(1, len(context) + 1):
            ctx = context[-n:]
            whole = self.tokenizer.decode(ctx + [token_id])
            if whole.endswith("\ufffd"):
                continue
            clean = len(ctx)
            while clean > 0 and self.tokenizer.decode([ctx[clean - 1]]).endswith("\ufffd"):
                clean -= 1
            head = self.tokenizer.decode(ctx[:clean]) if clean else ""
            return whole[len(os.path.commonprefix([head, whole])) :]
        return ""


def _stripped_space_marker(tokenizer) -> str | None:
    """"▁" where decoding a lone SentencePiece token drops the space its piece starts with, else None."""
    vocab = getattr(tokenizer, "get_vocab", dict)()
    piece = next((p for p in vocab if len(p) > 1 and p[0] == "\u2581" and p[1:].isalpha()), None)
    if piece is None:
        return None
    return "\u2581" if tokenizer.decode([vocab[piece]]) == piece[1:] else None
