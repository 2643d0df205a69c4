"""DeepSeek reasoning parser: splits `<think> ... </think>` reasoning from the answer, whole or streamed.

The server runs it before the tool-call parser, which then sees only the content.
"""
from __future__ import annotations

from mlaserve.server.tool_parser import hold_back_from

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

_OPEN, _THINK, _ANSWER = "open", "think", "answer"


class ReasoningParser:
    """Routes text before `</think>` to `reasoning_content`, the rest to `content`.

    Args:
        starts_in_think: the prompt already opened the think block (R1 templates end with
            `<think>\\n`), so text is reasoning from the start even without an opening tag.
            When False, text is reasoning only if it starts with `<think>`; otherwise all of it
            is content, verbatim (any `</think>` in it included).

    Rules (same for `parse` and `stream`/`finish`, however the text is split):
      * one leading `<think>` (after optional whitespace) is dropped; later ones are plain text;
      * reasoning is the text up to the first `</think>`, stripped of surrounding whitespace;
        without `</think>` all the text is reasoning (e.g. cut by max_tokens);
      * content is the text after `</think>` with leading whitespace dropped, otherwise verbatim;
      * `parse` gives None for an empty part; `stream` and `finish` give "" for "nothing new".
    Streaming holds back only a possible partial tag and whitespace that may turn out to be
    trailing reasoning whitespace; `finish()` flushes it and resets the parser for reuse.
    """

    def __init__(self, starts_in_think: bool = True) -> None:
        self.starts_in_think = starts_in_think
        self._reset()

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """Non-streaming: returns (reasoning or None, content or None)."""
        stripped = text.lstrip()
        if stripped.startswith(THINK_OPEN):
            text = stripped[len(THINK_OPEN):]
        elif not self.starts_in_think:
            return None, text or None
        reasoning, close, content = text.partition(THINK_CLOSE)
        return reasoning.strip() or None, (content.lstrip() or None) if close else None

    # --- streaming -------------------------------------------------------------------------------

    def _reset(self) -> None:
        self._buf = ""
        self._state = _OPEN
        self._lstrip = False

    def stream(self, delta: str) -> tuple[str, str]:
        """Feed the next piece of generated text. Returns (reasoning delta, content delta)."""
        self._buf += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """Flush what was held back at the end of generation."""
        out = self._advance(final=True)
        self._reset()
        return out

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._state == _OPEN:
                moved = self._step_open(final)
            elif self._state == _THINK:
                moved = self._step_think(final, reasoning)
            else:
                moved = self._step_answer(content)
            if not moved:
                return "".join(reasoning), "".join(content)

    def _drop_leading_ws(self) -> bool:
        """Apply a pending lstrip; False while only whitespace has arrived."""
        if self._lstrip:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._lstrip = False
        return True

    def _step_open(self, final: bool) -> bool:
        s = self._buf.lstrip()
        if s.startswith(THINK_OPEN):
            self._buf, self._state, self._lstrip = s[len(THINK_OPEN):], _THINK, True
            return True
        if not final and THINK_OPEN.startswith(s):
            return False
        self._state = _THINK if self.starts_in_think else _ANSWER
        self._lstrip = self.starts_in_think
        return True

    def _step_think(self, final: bool, reasoning: list[str]) -> bool:
        if not self._drop_leading_ws():
            return False
        end = self._buf.find(THINK_CLOSE)
        if end >= 0:
            reasoning.append(self._buf[:end].rstrip())
            self._buf, self._state, self._lstrip = self._buf[end + len(THINK_CLOSE):], _ANSWER, True
            return True
        cut = len(self._buf.rstrip()) if final else hold_back_from(self._buf, THINK_CLOSE)
        reasoning.append(self._buf[:cut])
        self._buf = "" if final else self._buf[cut:]
        return False

    def _step_answer(self, content: list[str]) -> bool:
        if self._drop_leading_ws():
            content.append(self._buf)
            self._buf = ""
        return False


REASONING_PARSERS: dict[str, bool] = {"deepseek-r1": True, "deepseek-v3": False}


def create_reasoning_parser(name: str) -> ReasoningParser:
    """A fresh parser for `--reasoning-parser NAME` (one per request: streaming is stateful).

    "deepseek-r1": the prompt opened `<think>`, so output is reasoning until `</think>`.
    "deepseek-v3": split only when the output itself starts with `<think>`.
    """
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choices: {', '.join(sorted(REASONING_PARSERS))}")
    return ReasoningParser(starts_in_think=REASONING_PARSERS[name])
