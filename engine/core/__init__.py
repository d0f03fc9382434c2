"""One rank's engine: `EngineCore` (scheduler over executor), the rank loop's real
driver (`rank_runner`), the model thread, and the in-process core client."""
