import random

import pytest

from flock.engine.detokenizer import MAX_PENDING_TOKENS, IncrementalText
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
@pytest.mark.parametrize("with_prompt", [False, True])
def test_incremental_text_is_the_decoded_text(tmp_path, skip_special_tokens, stream, with_prompt):
    """After every update the text is what the output's ids add to their prompt's decoded text (all of their
    decoded text without a prompt) but for a few last unsettled ones (a prefix of it), and at the end, `final`,
    all of it, for each kind of decoder, where the ids are characters; as vLLM's, without transformers' clean-up
    of spaces before punctuation (which the WordPiece tokenizer asks for)."""
    rng = random.Random(0)
    for name, tok in tokenizers(tmp_path).items():
        decode = lambda ids: tok.decode(ids, skip_special_tokens=skip_special_tokens,  # noqa: E731
                                        clean_up_tokenization_spaces=False)
        for ids in sequences(tok, rng):
            prompt = tok.encode(rng.choice(TEXTS[:2]), add_special_tokens=False)[-5:] if with_prompt else []
            head, whole = decode(prompt), decode(prompt + ids)
            expected = whole[len(head) :] if whole.startswith(head) else decode(ids)
            inc, k, text = IncrementalText(tok, skip_special_tokens, stream, prompt), 0, ""
            while k < len(ids):
                k = min(len(ids), k + rng.choice([1, 1, 1, 2, 3]))
                text = inc.update(ids[:k])
                assert k - inc.done <= MAX_PENDING_TOKENS
                assert expected.startswith(text) or "\ufffd" in expected, (name, ids[:k], text)
            final = inc.final(ids)
            # bytes that are no UTF-8 decode whole as U+FFFD each, but one by one as far as they are characters
            assert final == expected or "\ufffd" in expected, (name, prompt, ids, final, expected)


def test_an_output_keeps_the_space_its_first_token_starts_with(tmp_path):
    """As vLLM: a SentencePiece output after its prompt keeps its first token's space ('▁the' is ' the'), which
    decoding the output alone strips; stop strings see that text too."""
    from flock import LLM, SamplingParams

    tok = load_tokenizer(write_spm_gguf(tmp_path / "s.gguf"))
    pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
    word = next(i for i, t in enumerate(pieces) if t.startswith("\u2581") and t[1:].isalpha())
    text = " " + pieces[word][1:]
    assert tok.decode([word, word]) == text[1:] + text
    for stream in (True, False):
        assert IncrementalText(tok, True, stream, tok.encode("Say:")).final([word, word]) == text * 2
    llm = LLM("flock/tiny", load_format="dummy", dtype="float32", tokenizer=str(tmp_path / "s.gguf"))
    params = SamplingParams(temperature=0, max_tokens=3, logit_bias={word: 100}, ignore_eos=True)
    assert llm.generate(["Say:"], params, use_tqdm=False)[0].outputs[0].text == text * 3
    params.stop = [text]
    out = llm.generate(["Say:"], params, use_tqdm=False)[0].outputs[0]
    assert (out.text, len(out.token_ids), out.stop_reason) == ("", 1, text)


@pytest.mark.parametrize("stream", [True, False], ids=["DecodeStream", "windows"])
def test_a_prompt_ending_inside_a_character_gives_none_of_its_text(tmp_path, stream):
    """Token-id prompts may end in the middle of a character that the output completes: the output is that
    character, never the prompt's text before it."""
    write_tokenizer(tmp_path, VOCAB)
    tok = load_tokenizer(tmp_path)
    ids = tok.encode("Paragraph one. " * 12 + "The dog \U0001f389", add_special_tokens=False)
    cut = next(k for k in range(len(ids) - 1, 0, -1) if tok.decode(ids[:k]).endswith("\ufffd"))
    inc = IncrementalText(tok, True, stream, ids[:cut])
    text = inc.final(ids[cut:])
    assert text.endswith("\U0001f389") and "Paragraph" not in text and "dog" not in text


def test_a_stop_string_split_over_tokens_stops_the_request():
    """Found in the incremental text: across token boundaries, and before tokens that settle later."""
    from flock import LLM, SamplingParams

    llm = LLM("flock/tiny", load_format="dummy", dtype="float32")
    free = llm.generate(["a b c"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    at = next(i for i in range(5, len(free.text)) if free.text.find(free.text[i : i + 3]) == i)
    stop = free.text[at : at + 3]
    out = llm.generate(["a b c"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    assert (out[0].outputs[0].text, out[0].outputs[0].stop_reason) == (free.text[:at], stop)


def test_token_pieces_are_vllms_decoded_tokens(tmp_path):
    """A lone SentencePiece token keeps its space; the bytes of a character split over tokens are "" until the
    token that ends it, which takes the whole character: the pieces of a text join into the text."""
    from flock.engine.detokenizer import TokenPieces

    for name, tok in tokenizers(tmp_path).items():
        if name == "WordPiece":
            continue
        pieces = TokenPieces(tok)
        for text in ("The café 日本 😀", " x 🙂🙂 ½"):
            ids = tok.encode(text, add_special_tokens=False)
            got = [pieces(t, ids[:i]) for i, t in enumerate(ids)]
            assert "".join(got) == (" " + text if pieces.marker else text), (name, got)
            assert all("\ufffd" not in g for g in got)
    spm = TokenPieces(load_tokenizer(write_spm_gguf(tmp_path / "s.gguf")))
    byte = spm.tokenizer.convert_tokens_to_ids("<0xE6>")
    assert spm.marker == "\u2581" and spm(byte) == "" and spm(byte, [1]) == ""  # unfinished, whatever came before


def test_chat_logprobs_bytes_are_each_tokens_own(tmp_path):
    """OpenAI's `bytes`: a token's own bytes, a piece of a character too, so that they join into the text (and
    alternatives that are pieces of different characters differ)."""
    from flock.api.logprobs import TokenText, chat_logprobs
    from flock.sample.logprobs import TokenLogprobs

    for name, tok in tokenizers(tmp_path).items():
        if name == "WordPiece":
            continue
        text = TokenText(tok)
        for sample in ("The café 日本 😀", " x 🙂🙂 ½"):
            ids = tok.encode(sample, add_special_tokens=False)
            entries = [TokenLogprobs(t, -1.0, 1, [(t, -1.0)]) for t in ids]
            items = chat_logprobs(text, entries)["content"]
            joined = bytes(b for item in items for b in item["bytes"]).decode()
            assert joined == (" " + sample if text.pieces.marker else sample), name
            assert all(item["bytes"] and item["top_logprobs"][0]["bytes"] == item["bytes"] for item in items)


def test_of_stop_strings_met_in_one_token_the_one_ending_first_stops():
    """As vLLM: several stop strings completed by the same token stop at the one that ends first in the text
    (the first listed of those that end together), whatever the list's order."""
    from flock import LLM, SamplingParams

    llm = LLM("flock/tiny", load_format="dummy", dtype="float32")
    free = llm.generate(["a b c"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    tok = llm.get_tokenizer()
    for k in range(1, len(free.token_ids)):
        start = len(tok.decode(free.token_ids[:k]))
        piece = free.text[start : len(tok.decode(free.token_ids[: k + 1]))]
        late, early = piece[-2:], piece[:2]
        if len(piece) >= 4 and free.text.find(early) == start and free.text.find(late) == start + len(piece) - 2:
            break
    else:
        pytest.skip("no token of four characters whose ends first appear in it")
    out = llm.generate(["a b c"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[late, early]))
    assert (out[0].outputs[0].text, out[0].outputs[0].stop_reason) == (free.text[:start], early)


def test_the_generation_configs_other_eos_ids_are_named_as_the_stop_reason():
    """As vLLM: an EOS id of the model's config other than the tokenizer's ends the output with it as stop_reason
    (vLLM makes them stop tokens); the tokenizer's own EOS gives none."""
    from flock import LLM, SamplingParams

    tiny = LLM("flock/tiny", load_format="dummy", dtype="float32")
    eos = tiny.get_tokenizer().eos_token_id
    llm = LLM("flock/tiny", load_format="dummy", dtype="float32", hf_overrides={"eos_token_id": [eos, 42]})
    for token, reason in ((42, 42), (eos, None)):
        out = llm.generate(["a b"], SamplingParams(temperature=0, max_tokens=5, logit_bias={token: 100}))[0].outputs[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason) == ([token], "stop", reason)


def test_a_stop_string_after_min_tokens_that_end_inside_its_character_is_found():
    """As vLLM: min_tokens' text ends before a character they leave unfinished, so a stop string starting there
    is still searched (the character's bytes read as U+FFFD had moved the search past it)."""
    from flock import LLM, SamplingParams
    from flock.request import Request

    engine = LLM("flock/tiny", load_format="dummy", dtype="float32").engine
    tok = engine.tokenizer
    output = tok.encode(" 😀 world", add_special_tokens=False)
    assert tok.decode(output[:2]).endswith("\ufffd")  # the second token is the emoji's first byte
    req = Request(0, tok.encode("Say", add_special_tokens=False), SamplingParams(min_tokens=2, stop=["😀"]))
    req.token_ids += output
    assert engine._find_stop_string(req) and req.stop_text == "😀"
    req.finish_reason = "stop"
    assert engine.decode(req) == " "
