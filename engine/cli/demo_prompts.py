"""The built-in prompts of `wavecore generate --demo`: short and long, varied tasks."""

from __future__ import annotations

DEMO_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "What is 17 multiplied by 3?",
    "Translate 'good morning' into Spanish and German.",
    "Give me a short tip for learning to cook.",
    "What does a CPU do?",
    "Write one sentence that a pirate might say.",
    "Name the planets of the solar system in order.",
    "Summarise the plot of Little Red Riding Hood in three sentences.",
    "What is the difference between weather and climate?",
    "Suggest a name for a friendly robot and explain it briefly.",
    "How do plants make their food?",
    "Write a Python function that returns the square of a number.",
    "Why is sleep important? Answer briefly.",
)
