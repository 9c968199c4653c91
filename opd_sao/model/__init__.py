"""The model adapter: what a transformers decoder is (`decoders`), how to run it (`modeling`: hidden states, the
lm head one vocabulary chunk at a time; `llama_forward`: opd-sao's own forward for the Llama family, which
`modeling` picks where it serves the model, transformers' elsewhere), its caches and its heads."""
