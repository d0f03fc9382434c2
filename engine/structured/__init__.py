"""Structured output: a request's grammar, compiled off the event loop, and the token
bitmask it allows at each step (`grammars`, `compiler`, `bitmask`). The spec a request
carries is `engine.structured_outputs.StructuredOutputs`."""
