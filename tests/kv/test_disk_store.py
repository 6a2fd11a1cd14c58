"""The prefix cache's disk tier: blocks kept whole and checked against their tokens on every read, the least
recently used deleted beyond the size, torn or vanished files misses; an engine reads evicted prefixes, and those
an earlier run wrote, back instead of computing them, and its tokens still equal transformers'."""

import numpy as np
import pytest

from flock.kv.disk_store import HEADER_BYTES, STALE_TMP_SECONDS, DiskKVStore
from flock.kv.manager import KVCacheManager
from flock.lora import LoRARequest
from flock.request import Request
from flock.sampling_params import SamplingParams
from tests.engine.test_parity import assert_no_leak, flock_greedy, hf_greedy

BS = 4
BYTES = 32
TOKENS = (1, 2, 3, 4)


def store(folder, capacity_blocks: int = 8) -> DiskKVStore:
    return DiskKVStore(folder, capacity_blocks * (HEADER_BYTES + 8 * BS + BYTES), BS, BYTES)


def kept(s: DiskKVStore, block_hash: int, value: int) -> None:
    s.write(block_hash, TOKENS, np.full(BYTES, value, dtype=np.uint8))
    s.flush()


def test_blocks_come_back_whole_and_only_for_their_tokens(tmp_path):
    s = store(tmp_path)
    kept(s, 7, 5)
    assert 7 in s and (s.read(7, TOKENS) == 5).all() and s.blocks_read == 1
    assert s.read(7, (1, 2, 3, 5)) is None and 7 not in s  # another prefix of the same hash: forgotten


def test_another_store_of_the_folder_finds_them_and_torn_files_are_misses(tmp_path):
    import os

    kept(store(tmp_path), 1, 9)
    kept(store(tmp_path), 4, 8)
    (tmp_path / f"{2:016x}.kv").write_bytes(b"FLOCKKV2torn")
    stale, fresh = tmp_path / f"{3:016x}.tmp42", tmp_path / f"{5:016x}.tmp43"
    for path in (stale, fresh, tmp_path / "notahash.kv", tmp_path / "._0123456789abcdef.kv"):
        path.write_bytes(b"a write cut short")
    old = stale.stat().st_mtime - STALE_TMP_SECONDS - 1
    os.utime(stale, (old, old))
    block = tmp_path / f"{4:016x}.kv"
    data = bytearray(block.read_bytes())
    data[-1] ^= 0x40  # a bit of its KV flipped on disk: its checksum no longer holds
    block.write_bytes(bytes(data))
    again = store(tmp_path)  # stray names are no blocks; a stale temporary file is deleted, a fresh one kept
    assert (again.read(1, TOKENS) == 9).all() and again.read(4, TOKENS) is None
    assert not stale.exists() and fresh.exists()
    assert 2 in again and again.read(2, TOKENS) is None and 2 not in again and 3 not in again
    (tmp_path / f"{1:016x}.kv").unlink()  # another process's store deleted it
    assert again.read(1, TOKENS) is None


def test_the_least_recently_used_go_beyond_the_size(tmp_path):
    s = store(tmp_path, capacity_blocks=3)
    for h in (1, 2, 3):
        kept(s, h, h)
    s.read(1, TOKENS)
    kept(s, 4, 4)
    assert list(s.index) == [3, 1, 4] and not (tmp_path / f"{2:016x}.kv").exists()
    assert list(store(tmp_path, capacity_blocks=2).index) == [1, 4]  # a smaller store trims at start


def test_blocks_of_lora_requests_stay_off_disk(tmp_path):
    kv = KVCacheManager(16, BS, True, store(tmp_path))
    plain = Request(0, list(range(9)), SamplingParams(temperature=0))
    adapted = Request(1, list(range(9)), SamplingParams(temperature=0, lora_request=LoRARequest("a", 1, "x")))
    for req in (plain, adapted):
        assert kv.allocate(req, req.num_tokens, kv.cached_prefix(req))
    assert len(kv.take_saves(plain)) == 2 and kv.take_saves(adapted) == []


def prompts_of_groups() -> list[list[int]]:
    """Three 40-token prefixes, each with two questions, one group after another and then around again: with room
    for one request, a prefix is evicted before its group comes back."""
    prefixes = [[(97 * g + 13 * i) % 8000 + 5 for i in range(40)] for g in range(3)]
    return [p + [7000 + 10 * g + q, 7100 + q] for q in range(2) for g, p in enumerate(prefixes)]


@pytest.fixture(scope="module")
def reference(hf_folders):
    prompts = prompts_of_groups()
    return prompts, hf_greedy(hf_folders["llama"], prompts)


SMALL = dict(block_size=BS, num_kv_blocks=16, max_num_seqs=1, max_model_len=64)


@pytest.mark.parametrize("scheduler", ["fcfs", "feather"])
def test_evicted_prefixes_are_read_back(hf_folders, reference, tmp_path, scheduler):
    prompts, expected = reference
    got, llm = flock_greedy(hf_folders["llama"], prompts, kv_cache_disk_dir=str(tmp_path), scheduler=scheduler,
                            **SMALL)
    assert got == expected and llm.engine.kv.disk.blocks_read >= 10  # the second question of each group
    assert_no_leak(llm)


@pytest.mark.parametrize("scheduler, kv_cache_dtype", [("fcfs", "auto"), ("batchllm", "auto"), ("feather", "auto"),
                                                      ("fcfs", "fp8")])
def test_a_later_run_reads_what_an_earlier_one_wrote(hf_folders, reference, tmp_path, scheduler, kv_cache_dtype):
    prompts, expected = reference
    config = dict(kv_cache_disk_dir=str(tmp_path), scheduler=scheduler, kv_cache_dtype=kv_cache_dtype, block_size=BS)
    first, llm = flock_greedy(hf_folders["llama"], prompts, **config)
    llm.engine.kv.disk.flush()
    second, again = flock_greedy(hf_folders["llama"], prompts, **config)
    stats = again.engine.stats.as_dict()
    assert second == first and again.engine.kv.disk.blocks_read >= 27  # (nearly) every prefix block, from disk
    assert stats["computed_prefill_tokens"] < stats["logical_prefill_tokens"] / 3
    if kv_cache_dtype == "auto":
        assert first == expected
    assert_no_leak(again)
    flock_greedy(hf_folders["llama"], prompts[:1], dtype="float32", kv_cache_disk_dir=str(tmp_path), block_size=BS)
    assert len(list(tmp_path.iterdir())) == 2  # another dtype: a folder of its own


def test_longrope_keys_of_another_max_model_len_are_not_read(hf_folders, tmp_path):
    """LongRoPE's factors follow max_model_len (short within the original 64 positions, long past them): a run
    of another length computes other keys, so it has a folder of its own."""
    prompts = [[(13 * i) % 900 + 5 for i in range(40)]]
    for max_model_len in (64, 256):
        flock_greedy(hf_folders["phi3_longrope"], prompts, kv_cache_disk_dir=str(tmp_path), block_size=BS,
                     max_model_len=max_model_len)[1].engine.kv.disk.flush()
    assert len(list(tmp_path.iterdir())) == 2


def test_a_block_gone_before_it_is_read_ends_the_prefix_there(hf_folders, reference, tmp_path, monkeypatch):
    prompts, expected = reference
    _, llm = flock_greedy(hf_folders["llama"], prompts, kv_cache_disk_dir=str(tmp_path), block_size=BS)
    llm.engine.kv.disk.flush()
    read, calls = DiskKVStore.read, []

    def vanishing(self, block_hash, tokens):  # every third block read was deleted since the lookup
        calls.append(block_hash)
        return None if len(calls) % 3 == 0 else read(self, block_hash, tokens)

    monkeypatch.setattr(DiskKVStore, "read", vanishing)
    got, again = flock_greedy(hf_folders["llama"], prompts, kv_cache_disk_dir=str(tmp_path), block_size=BS)
    assert got == expected and calls and again.engine.kv.disk.blocks_read < len(calls)
    assert_no_leak(again)


def test_a_server_reads_what_an_offline_run_wrote(tmp_path):
    """flock serve on the folder an offline LLM of the same model wrote: the prompt is read back from disk (its
    usage counts the tokens as cached, /metrics the blocks) and answers as offline."""
    import httpx

    from bench.harness.server_process import ServerProcess
    from flock import LLM, SamplingParams

    prompt = "The pool hands out blocks; " * 12
    llm = LLM("flock/tiny", kv_cache_disk_dir=str(tmp_path))
    offline = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    llm.engine.kv.disk.flush()
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with ServerProcess("--model", "flock/tiny", "--kv-cache-disk-dir", str(tmp_path),
                       env={"OMP_NUM_THREADS": "1"}) as server:
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert reply["choices"][0]["text"] == offline.outputs[0].text
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(offline.prompt_token_ids) - 16
    read = [line for line in metrics.splitlines() if line.startswith("flock_kv_disk_read_blocks_total")]
    assert read and float(read[0].split()[-1]) > 0
