import random

import pytest

from flock.engine.detokenizer import MAX_PENDING_TOKENS, IncrementalText, cleans_up_spaces
from flock.model.builtin import write_tokenizer
from flock.tokenizer import load_tokenizer
from tests.conftest import VOCAB
from tests.model.gguf_files import write_spm_gguf
from tests.model.test_gguf import SMOLLM2

TEXTS = ["Hello, world! It's 3.5 km — naïve café, 東京 and 🙂🙂.\n\n  indented\tand done .",
         "the cat sat on a mat . the  dog !\nüx ½ do n't , ok ?", "   ", "\u00e9\u0301\U0001f600"]


def wordpiece_tokenizer(folder):
    """A WordPiece tokenizer that transformers cleans up after decoding (spaces before punctuation go)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[CLS]", "[SEP]", "the", "cat", "do", "n", "'", "t", "s", ".", ",", "!", "?", "a", "##t", "##s"]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                   clean_up_tokenization_spaces=True)


def tokenizers(tmp_path):
    write_tokenizer(tmp_path, VOCAB)
    out = {"byte-level BPE": load_tokenizer(tmp_path), "SentencePiece": load_tokenizer(write_spm_gguf(tmp_path / "s.gguf")),
           "WordPiece": wordpiece_tokenizer(tmp_path)}
    if SMOLLM2 is not None:
        out["SmolLM2"] = load_tokenizer(SMOLLM2)
    return out


def sequences(tok, rng: random.Random) -> list[list[int]]:
    """Encoded texts, and random ids: special tokens, lone bytes and halves of characters among them."""
    encoded = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    return encoded + [[rng.randrange(len(tok)) for _ in range(rng.randrange(1, 60))] for _ in range(30)]


@pytest.mark.parametrize("stream", [True, False], ids=["DecodeStream", "windows"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_text_is_the_decoded_text(tmp_path, skip_special_tokens, stream):
    """After every update the text is the decoded text of all ids but a few last unsettled ones (a prefix of
    it), and at the end all of it, for each kind of decoder; only transformers' clean-up may change text
    already given (a space before a later '.'), so there only the end is compared."""
    rng = random.Random(0)
    for name, tok in tokenizers(tmp_path).items():
        cleans = cleans_up_spaces(tok)
        assert cleans == (name == "WordPiece")
        decode = lambda ids: tok.decode(ids, skip_special_tokens=skip_special_tokens)  # noqa: E731
        for ids in sequences(tok, rng):
            inc, k, text = IncrementalText(tok, skip_special_tokens, cleans, stream), 0, ""
            while k < len(ids):
                k = min(len(ids), k + rng.choice([1, 1, 1, 2, 3]))
                text = inc.update(ids[:k])
                assert k - inc.done <= MAX_PENDING_TOKENS
                assert cleans or decode(ids[:k]).startswith(text), (name, ids[:k], text)
            full = decode(ids)
            assert text == full or (full.endswith("\ufffd") and full.startswith(text)), (name, ids, text, full)


def test_a_stop_string_split_over_tokens_stops_the_request():
    """Found in the incremental text: across token boundaries, and before tokens that settle later."""
    from flock import LLM, SamplingParams

    llm = LLM("flock/tiny", load_format="dummy", dtype="float32")
    free = llm.generate(["a b c"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    at = next(i for i in range(5, len(free.text)) if free.text.find(free.text[i : i + 3]) == i)
    stop = free.text[at : at + 3]
    out = llm.generate(["a b c"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    assert (out[0].outputs[0].text, out[0].outputs[0].stop_reason) == (free.text[:at], stop)
