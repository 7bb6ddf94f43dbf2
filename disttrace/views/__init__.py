"""Views: render what the readers and the analysis return, as terminal text, markdown, HTML or a
Perfetto trace. No analysis lives here; no torch either."""
