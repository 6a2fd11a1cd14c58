"""vLLM's flags that `vllm serve` and `vllm run-batch` command lines share (its engine's and its frontend's), for
`flock serve` and `flock run`: taken where Flock has them under other names, accepted where they change nothing
here, refused by name where Flock cannot run what they ask."""

import argparse
import json
from pathlib import Path

from flock.api.reasoning import read_structured_outputs_config
from flock.chat_content import CONTENT_FORMATS
from flock.tokenizer import ChatOptions


CONFIG_EPILOG = ("vLLM's command lines run as they are: --config FILE.yaml (its keys as flags; the command line wins), "
                 "--max_model_len as --max-model-len, --no-X for a switch's false, --speculative-config.method ngram")


def add_vllm_arguments(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    v = p.add_argument_group("vLLM's flags (a `vllm serve` or `vllm run-batch` command line runs as it is)")
    v.add_argument("--scheduling-policy", choices=["fcfs", "priority"],
                   help="priority: --scheduler priority; fcfs: --scheduler stands")
    v.add_argument("--enable-prefix-caching", action="store_true", help="on by default")
    v.add_argument("--no-enable-prefix-caching", action="store_true", help="as --no-prefix-caching")
    v.add_argument("--trust-remote-code", action="store_true", help="accepted: Flock runs its own model code only")
    v.add_argument("--disable-log-stats", action="store_true", help="accepted: Flock logs no engine stats")
    what = ("accepted: the model's architecture decides what it serves (generation and embeddings; a "
            "*ForSequenceClassification, or --hf-overrides classifier_from_token: classification, score, rerank)")
    v.add_argument("--runner", choices=["auto", "draft", "generate", "pooling"], help=what)
    v.add_argument("--convert", choices=["auto", "classify", "embed", "none"], help=what)
    v.add_argument("--task", help=what)
    v.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="1 (one engine per process)")
    v.add_argument("--enforce-eager", "--enable-chunked-prefill", action="store_true",
                   help="accepted: Flock runs eagerly, and chunks long prefills always")
    v.add_argument("--gpu-memory-utilization", type=float, help="accepted: a CPU's KV budget is "
                   "--kv-cache-memory-bytes (or --num-kv-blocks)")
    v.add_argument("--download-dir", "--revision", help="accepted: Flock never downloads")
    v.add_argument("--tokenizer-mode", default="auto", help="auto (or hf): the model's Hugging Face tokenizer")
    v.add_argument("--structured-outputs-config", type=json.loads, default={},
                   help="vLLM's JSON: backend auto or xgrammar, disable_any_whitespace (= not "
                        "--structured-outputs-any-whitespace), reasoning_parser (= --reasoning-parser), "
                        "enable_in_reasoning false")
    v.add_argument("--max-loras", "--max-cpu-loras", type=int,
                   help="accepted: Flock keeps every loaded LoRA adapter in memory and runs any number in one step")
    v.add_argument("--chat-template-content-format", choices=CONTENT_FORMATS, default="auto",
                   help="how messages' contents reach the chat template: auto (as the template reads them), string "
                        "(text parts joined) or openai (a list of parts)")
    v.add_argument("--default-chat-template-kwargs", type=json.loads, default={},
                   help="JSON: chat template variables for every request (a request's chat_template_kwargs win)")
    v.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a request's own chat_template (else such requests are refused)")
    v.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="tool_choice none: the tools are not shown to the template either")
    v.add_argument("--response-role", default="assistant",
                   help="the role of chat answers to requests with add_generation_prompt (the default)")
    v.add_argument("--enable-force-include-usage", action="store_true",
                   help="every stream ends with its usage, whatever its stream_options say")
    v.add_argument("--max-log-len", type=int, help="accepted: Flock logs no prompts")
    v.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="accepted: usage always has prompt_tokens_details.cached_tokens")
    return v


def apply_vllm_arguments(args: argparse.Namespace) -> None:
    """vLLM's flags as Flock's; ValueError for what Flock cannot run."""
    if args.tensor_parallel_size != 1:
        raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size}: Flock runs one engine per process "
                         "(scale out with flock run --workers)")
    if args.scheduling_policy == "priority":
        args.scheduler = "priority"
    if args.no_enable_prefix_caching:
        args.enable_prefix_caching = False
    if args.tokenizer_mode not in ("auto", "hf"):
        raise ValueError(f"--tokenizer-mode {args.tokenizer_mode}: Flock runs the model's Hugging Face tokenizer "
                         "(auto)")
    if not isinstance(args.default_chat_template_kwargs, dict):
        raise ValueError("--default-chat-template-kwargs must be a JSON object")
    _apply_structured_outputs_config(args)


def chat_options(args: argparse.Namespace) -> ChatOptions:
    return ChatOptions(args.chat_template_content_format, args.default_chat_template_kwargs,
                       args.trust_request_chat_template, args.exclude_tools_when_tool_choice_none, args.response_role)


def _apply_structured_outputs_config(args: argparse.Namespace) -> None:
    try:
        any_whitespace, parser, in_reasoning = read_structured_outputs_config(args.structured_outputs_config)
    except ValueError as e:
        raise ValueError(f"--structured-outputs-config: {e}") from None
    if in_reasoning:
        raise ValueError("--structured-outputs-config: the engine's grammars follow the thinking "
                         "(enable_in_reasoning false)")
    if any_whitespace is not None:
        args.structured_outputs_any_whitespace = any_whitespace
    args.reasoning_parser = args.reasoning_parser or parser


def vllm_argv(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """A command line as vLLM's parser reads it, in the spellings `parser` (a subcommand's) takes: `--config
    FILE.yaml` (its keys as flags, before the command line's own, which win), `--max_model_len` (underscores),
    `--no-X` of a switch `--X`, `--speculative-config.method ngram` (a JSON flag's field)."""
    argv = _with_config(argv)
    options = {o: a for a in parser._actions for o in a.option_strings}
    out: list[str] = []
    dotted: dict[str, dict] = {}
    i = 0
    while i < len(argv):
        token, i = argv[i], i + 1
        if not token.startswith("--") or token == "--":
            out.append(token)
            continue
        flag, eq, value = token.partition("=")
        flag = flag.replace("_", "-")
        base, dot, field = flag.partition(".")
        if dot and base in options:
            if not eq:
                if i == len(argv):
                    raise ValueError(f"{flag} needs a value")
                value, i = argv[i], i + 1
            _nest(dotted.setdefault(base, {}), field.replace("-", "_").split("."), value)
            continue
        switch = "--" + flag.removeprefix("--no-")
        if flag.startswith("--no-") and flag not in options and \
                isinstance(options.get(switch), argparse._StoreTrueAction):
            out = [t for t in out if t != switch]  # vLLM's --no-X: the switch off (it is off unless given)
            continue
        out.append(flag + eq + value)
    for base, fields in dotted.items():
        out += [base, json.dumps(fields)]
    return out


def _with_config(argv: list[str]) -> list[str]:
    """`--config FILE` (vLLM's YAML: `key: value` per flag; true a switch given, a list its values, a mapping
    JSON) read into the command line, right after the subcommand."""
    at = next((i for i, t in enumerate(argv) if t == "--config" or t.startswith("--config=")), None)
    if at is None:
        return argv
    import yaml

    if "=" in argv[at]:
        path, rest = argv[at].split("=", 1)[1], argv[at + 1 :]
    elif at + 1 < len(argv):
        path, rest = argv[at + 1], argv[at + 2 :]
    else:
        raise ValueError("--config needs a YAML file")
    try:
        config = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--config {path}: not a mapping of flags to values")
    flags = []
    for key, value in config.items():
        flag = f"--{str(key).replace('_', '-')}"
        if isinstance(value, bool):
            flags += [flag] if value else []
        elif isinstance(value, list):
            flags += [flag, *map(str, value)] if value else []
        else:
            flags += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return argv[:1] + flags + argv[1:at] + rest


def _nest(into: dict, keys: list[str], value: str) -> None:
    for key in keys[:-1]:
        into = into.setdefault(key, {})
    try:
        into[keys[-1]] = json.loads(value)
    except json.JSONDecodeError:
        into[keys[-1]] = value
