"""The console every human output goes through: rich's, with every string it prints made visible.

A run store's writer chooses tensor, host, fault and file names, event texts and INDEX keys. Printed raw, an
ESC sequence among them clears the screen, writes the clipboard (OSC 52) or repaints a FAIL as a PASS, and
U+202E reverses what follows. `SafeConsole.render` passes every text segment through `fmt.visible` (rich's
own styling travels in segment styles and control segments, which are left alone), so no view has to
remember to escape, and a view added later is covered too. --json output does not go through it: it stays
exact.
"""

from __future__ import annotations

from rich.console import Console
from rich.segment import Segment

from disttrace.fmt import visible


class SafeConsole(Console):
    def render(self, renderable, options=None):
        for seg in super().render(renderable, options):
            if seg.control is None and seg.text:
                text = visible(seg.text, keep_newlines=True)
                if text is not seg.text and text != seg.text:
                    seg = Segment(text, seg.style, seg.control)
            yield seg
