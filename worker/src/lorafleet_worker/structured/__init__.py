"""Structured output and tool calls: grammars (llguidance), their per-step token masks, tool-call parsers."""
