"""EvalForge's training core: policies and language models on megatron-core, the `trainer` CLI."""
