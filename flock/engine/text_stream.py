"""Incremental output text for streaming."""


class TextStream:
    """Turns the growing output text into deltas that are safe to send: an incomplete UTF-8 character
    (decoded as U+FFFD) and a possible start of a stop string are held back until the request finishes."""

    def __init__(self, stop: list[str]):
        self.sent = 0
        self.hold = max((len(s) for s in stop), default=1) - 1

    def delta(self, text: str, finished: bool) -> str:
        end = len(text)
        if not finished:
            end -= self.hold
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        out, self.sent = text[self.sent : end], end
        return out
