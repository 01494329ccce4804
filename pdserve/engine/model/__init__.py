"""The model: what it is (config, path), how it is read (GGUF, safetensors, tokenizer) and the
Llama-family layer slice that runs on a PP rank."""
