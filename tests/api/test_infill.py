"""llama-server's /infill: the FIM prompt as llama-server builds it (tokens found by name, the repo-level
pattern, each part cut to its share), refusals naming the field, and a live server answering as the engine;
OpenAI's `suffix` on /v1/completions through the same tokens."""

import httpx
import pytest

from flock import LLM, SamplingParams
from flock.api.infill import N_BATCH, infill_prompt, parse_infill
from flock.api.protocol import APIError, parse_request
from flock.tokenizer import fim_tokens

FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>"]


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    """flock/tiny as a Hugging Face folder whose tokenizer has Qwen2.5-Coder's FIM tokens (embeddings grown for them)."""
    import json

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from flock.model import save_model

    folder = save_model("flock/tiny", tmp_path_factory.mktemp("coder") / "tiny", dtype="float32", seed=0)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"additional_special_tokens": FIM})
    tok.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            tensors[name] = torch.cat([tensors[name], torch.randn(len(tok) - config["vocab_size"], tensors[name].shape[1],
                                                                  generator=torch.Generator().manual_seed(0)) * 0.02])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config | {"vocab_size": len(tok)}))
    return folder, AutoTokenizer.from_pretrained(folder)


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_prompt_is_llama_servers_repo_level_pattern(coder):
    _, tok = coder
    f = fim_tokens(tok)
    assert [f[r] for r in ("pre", "suf", "mid", "rep", "sep")] == tok.convert_tokens_to_ids(FIM)
    body = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n", "prompt": "return",
            "input_extra": [{"filename": "util.py", "text": "X = 1\n"}, {"text": "Y = 2\n"}], "n_predict": 8}
    req = parse_infill(body, tok, 4096)
    ids, params = req.requests[0]
    want = [f["rep"], *encode(tok, "myproject\n"), f["sep"], *encode(tok, "util.py\n"), *encode(tok, "X = 1\n"),
            f["sep"], *encode(tok, "tmp\n"), *encode(tok, "Y = 2\n"), f["sep"], *encode(tok, "filename\n")]
    bos = [tok.bos_token_id] if tok.encode("a")[:1] == [tok.bos_token_id] else []
    want += bos + [f["pre"], *encode(tok, body["input_prefix"]), *encode(tok, "return"), f["suf"],
                   *encode(tok, body["input_suffix"]), f["mid"]]
    assert ids == want and params.max_tokens == 8 and req.single


def test_openai_suffix_is_the_fim_prompt(coder):
    _, tok = coder
    f = fim_tokens(tok)
    bos = [tok.bos_token_id] if tok.encode("a")[:1] == [tok.bos_token_id] else []
    tail = [f["suf"], *encode(tok, "\n\nf(1)\n"), f["mid"]]
    r = parse_request("completion", {"prompt": ["def f(x):\n    ", "g"], "suffix": "\n\nf(1)\n"}, tok)
    assert r.prompts == [bos + [f["pre"], *encode(tok, p), *tail] for p in ("def f(x):\n    ", "g")]
    r = parse_request("completion", {"prompt": [5, 6], "suffix": "\n\nf(1)\n"}, tok)
    assert r.prompts == [bos + [f["pre"], 5, 6, *tail]]
    with pytest.raises(APIError, match="suffix and echo") as e:
        parse_request("completion", {"prompt": "a", "suffix": "b", "echo": True}, tok)
    assert e.value.param == "suffix"
    with pytest.raises(APIError, match="fill-in-the-middle tokens"):
        parse_request("completion", {"prompt": "a", "suffix": "b"}, LLM("flock/tiny").get_tokenizer())


def test_parts_cut_to_their_shares():
    fim = {"pre": 1, "suf": 2, "mid": 3}
    prefix, suffix, extra, prompt = list(range(10, 2010)), list(range(3000, 4000)), list(range(5000, 5100)), [7, 8]
    ids = infill_prompt(fim, prefix, suffix, extra, prompt, [], N_BATCH + 50)
    kept_extra, rest = ids[:52], ids[52:]  # the context beside the batch (+ 2, as llama-server's n_predict -1)
    assert kept_extra == extra[-52:]
    assert rest[0] == 1 and rest[1 : 1 + 1536] == prefix[-1536:] and rest[1537:1539] == prompt
    assert rest[1539] == 2 and rest[1540:-1] == suffix[: 512 - 2 - 2] and rest[-1] == 3


def test_refusals(coder):
    _, tok = coder
    for body, param in (({"input_suffix": ""}, "input_prefix"), ({"input_prefix": ""}, "input_suffix"),
                        ({"input_prefix": "", "input_suffix": "", "prompt": 3}, "prompt"),
                        ({"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "a"}]}, "input_extra"),
                        ({"input_prefix": [1.5], "input_suffix": ""}, "input_prefix")):
        with pytest.raises(APIError) as e:
            parse_infill(body, tok, 4096)
        assert e.value.param == param
    plain = LLM("flock/tiny").get_tokenizer()  # no FIM tokens: not supported, as llama-server says
    with pytest.raises(APIError, match="Infill is not supported by this model: prefix token is missing") as e:
        parse_infill({"input_prefix": "", "input_suffix": ""}, plain, 4096)
    assert e.value.status == 501


def test_server_answers_as_the_engine(coder):
    from bench.harness.server_process import ServerProcess

    folder, tok = coder
    body = {"input_prefix": "def f(x):\n    ", "input_suffix": "\n", "n_predict": 12, "temperature": 0,
            "input_extra": [{"filename": "a.py", "text": "import os\n"}]}
    ids = parse_infill(body, tok, 2048).requests[0][0]
    want = LLM(str(folder)).generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=12))
    with ServerProcess("--model", str(folder), "--max-model-len", "2048", env={"OMP_NUM_THREADS": "1"}) as s:
        got = httpx.post(f"{s.url}/infill", json=body, timeout=60).json()
        plain = httpx.post(f"{s.url}/infill", json={"input_prefix": "x"}, timeout=60)
        insert = httpx.post(f"{s.url}/v1/completions", json={"model": str(folder), "prompt": "def f(x):\n    ",
                                                             "suffix": "\n", "max_tokens": 12, "temperature": 0},
                            timeout=60).json()
    assert got["content"] == want[0].outputs[0].text and got["tokens_evaluated"] == len(ids)
    fim_ids = parse_request("completion", {"prompt": "def f(x):\n    ", "suffix": "\n"}, tok).prompts[0]
    inserted = LLM(str(folder)).generate([{"prompt_token_ids": fim_ids}], SamplingParams(temperature=0, max_tokens=12))
    assert insert["choices"][0]["text"] == inserted[0].outputs[0].text
    assert plain.status_code == 400 and "input_suffix" in plain.text
