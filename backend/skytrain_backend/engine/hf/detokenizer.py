"""Text of a growing sequence of token ids, released only once it is final.

A byte-level BPE token can end in the middle of a UTF-8 character, so each step decodes a
short window of recent tokens and releases new text only when it no longer ends in a partial
character. Stop strings are searched in the text as it grows; while a sequence runs, the
last ``len(longest stop) - 1`` characters are held back, since they may be the start of a stop
string that must not reach the client.
"""

from __future__ import annotations

from typing import Any

from skytrain_backend.engine.hf.sampling import SamplingParams

_PARTIAL_CHARACTER = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stop = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._longest_stop = max((len(s) for s in params.stop), default=0)
        self._hold_back = 0 if self._include_stop else max(self._longest_stop - 1, 0)
        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._released = 0
        self.text = ""

    def _decode(self, token_ids: list[int]) -> str:
        return str(
            self._tokenizer.decode(
                token_ids,
                skip_special_tokens=self._skip_special_tokens,
                clean_up_tokenization_spaces=False,
            )
        )

    def add(self, token_id: int) -> str | None:
        """Append a token; returns the stop string it completed, if any."""
        self._token_ids.append(token_id)
        prefix = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._token_ids[self._prefix_offset :])
        if len(window) <= len(prefix) or window.endswith(_PARTIAL_CHARACTER):
            return None
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        return self._extend(window[len(prefix) :])

    def flush(self) -> None:
        """At the end of a sequence, take the text still waiting for more bytes as it is."""
        prefix = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._token_ids[self._prefix_offset :])
        if len(window) > len(prefix):
            self._extend(window[len(prefix) :])
        self._prefix_offset = self._read_offset = len(self._token_ids)

    def _extend(self, new_text: str) -> str | None:
        search_from = max(len(self.text) - self._longest_stop + 1, 0)
        self.text += new_text
        matches = [
            (at, stop) for stop in self._stop if (at := self.text.find(stop, search_from)) >= 0
        ]
        if not matches:
            return None
        at, stop = min(matches)
        self.text = self.text[: at + (len(stop) if self._include_stop else 0)]
        return stop

    def release(self, *, final: bool) -> str:
        """The text not yet released that can be released now."""
        end = len(self.text) if final else max(len(self.text) - self._hold_back, self._released)
        released = self.text[self._released : end]
        self._released = end
        return released
