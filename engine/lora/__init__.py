"""LoRA adapters: `LoRARequest` (what callers name), reading PEFT's format
(`peft_files`), the fused form and the store of loaded adapters (`adapters`), and
their deltas in the forward pass (`compute`)."""
