"""How a chat template reads a message's content, and each message made that shape (vLLM's content formats):
"string" templates write `message['content']` as text, so text parts reach them joined by newlines; "openai"
templates loop over it, so every content reaches them as a list of parts, a string as one text part."""

import functools

from jinja2 import nodes

CONTENT_FORMATS = ("auto", "string", "openai")
# the content parts read as text, and the key of their text
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}
# the line Claude Code puts first in its system prompt: its `cch` value changes with every request
CLAUDE_CODE_BILLING_HEADER = "x-anthropic-billing-header"


@functools.lru_cache(maxsize=64)
def detect_content_format(template: str) -> str:
    """"openai" where the template loops over a message's content (or a macro's parameter given it), else
    "string" (a template that does not parse too)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        tree = _compile_jinja_template(template).environment.parse(template)
    except Exception:
        return "string"
    return "string" if next(_content_loops(tree), None) is None else "openai"


def template_message(message: dict, content_format: str, image_text: str | None = None) -> dict:
    """The message as a template of `content_format` ("string" or "openai") reads it: text parts (TEXT_PARTS)
    joined by newlines, or a list of {"type": "text"} parts (other parts, an image's, as they are); a null content
    as no text; a tool's result as a string either way (as vLLM passes it: most templates print it); a system
    message without Claude Code's billing header line. With `image_text` (the model's placeholder), a "string"
    message's {"type": "image"} parts are that text, before its text (as vLLM writes them)."""
    if message.get("role") == "assistant":  # vLLM's: `reasoning` first, given to the template under both names
        reasoning = message.get("reasoning")
        reasoning = message.get("reasoning_content") if reasoning is None else reasoning
        if reasoning is not None:
            message = message | {"reasoning": reasoning, "reasoning_content": reasoning}
    content = message.get("content")
    if content is None:
        content = []
    elif isinstance(content, str):
        content = [{"type": "text", "text": content}]
    elif not isinstance(content, list):
        return message
    if message.get("role") == "system":
        content = _without_billing_header(content)
    parts = [{"type": "text", "text": part[TEXT_PARTS[part["type"]]]} if _is_text(part) else part
             for part in content]
    if content_format == "string" and image_text is not None:
        images = [p for p in parts if isinstance(p, dict) and p.get("type") == "image"]
        parts = [{"type": "text", "text": image_text} for _ in images] + [p for p in parts if p not in images]
    if not all(_is_text(part) for part in parts) or (content_format == "openai" and message.get("role") != "tool"):
        return message | {"content": parts}
    return message | {"content": "\n".join(part["text"] for part in parts)}


def joined_text(content) -> str:
    """A content's text: a string as it is, text parts joined by newlines (others left out)."""
    if isinstance(content, str):
        return content
    return "\n".join(p[TEXT_PARTS[p["type"]]] for p in content or [] if _is_text(p))


def _is_text(part) -> bool:
    return isinstance(part, dict) and isinstance(part.get(TEXT_PARTS.get(part.get("type"), "")), str)


def _without_billing_header(parts: list) -> list:
    out = []
    for part in parts:
        text = part.get("text") if _is_text(part) and part["type"] == "text" else None
        if text is None or not text.startswith(CLAUDE_CODE_BILLING_HEADER):
            out.append(part)
        elif rest := text.partition("\n")[2]:
            out.append(part | {"text": rest})
    return out


def _content_loops(tree: nodes.Template):
    """The for-loops that iterate over a message's content: `message.content` of a loop over the messages (or
    a name set from them), a name set from it, a plain `content` outside macros, or a macro's parameter that a
    call passes it to."""
    messages = _aliases(tree, {"messages"})
    message_names = {loop.target.name for loop in tree.find_all(nodes.For)
                     if isinstance(loop.target, nodes.Name) and _names(loop.iter, messages)}
    contents = {a.target.name for a in tree.find_all(nodes.Assign)
                if isinstance(a.target, nodes.Name) and _is_content(a.node, message_names)}
    in_macros = set()
    for macro in tree.find_all(nodes.Macro):
        fed = _params_given_content(tree, macro, message_names)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if _names(loop.iter, fed):
                yield loop
    for loop in tree.find_all(nodes.For):
        plain = {"content"} if id(loop) not in in_macros else set()
        if _is_content(loop.iter, message_names) or _names(loop.iter, contents | plain):
            yield loop


def _params_given_content(tree: nodes.Template, macro: nodes.Macro, message_names: set[str]) -> set[str]:
    params = [arg.name for arg in macro.args]
    fed = set()
    for call in tree.find_all(nodes.Call):
        if isinstance(call.node, nodes.Name) and call.node.name == macro.name:
            fed |= {name for name, arg in zip(params, call.args) if _is_content(arg, message_names)}
            fed |= {kw.key for kw in call.kwargs if kw.key in params and _is_content(kw.value, message_names)}
    return fed


def _aliases(tree: nodes.Template, names: set[str]) -> set[str]:
    """`names` and every name set from one of them (a slice, a filter of it), transitively."""
    names, grown = set(names), True
    while grown:
        new = {a.target.name for a in tree.find_all(nodes.Assign)
               if isinstance(a.target, nodes.Name) and _names(a.node, names)} - names
        names, grown = names | new, bool(new)
    return names


def _unwrapped(node: nodes.Node) -> nodes.Node:
    """The expression under filters, tests and slices."""
    while True:
        if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            return node


def _names(node: nodes.Node, names: set[str]) -> bool:
    node = _unwrapped(node)
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names


def _is_content(node: nodes.Node, message_names: set[str]) -> bool:
    """Whether the expression reads `m.content` or `m['content']` of a message name (under filters, tests, slices)."""
    node = _unwrapped(node)
    if isinstance(node, nodes.Getattr):
        return node.attr == "content" and _names(node.node, message_names)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        return node.arg.value == "content" and _names(node.node, message_names)
    return False
